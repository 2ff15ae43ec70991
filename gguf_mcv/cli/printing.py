"""What the commands print: answers (streamed or as JSON), progress bars, errors on one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import GgufMcvError


def print_pieces(stream: Any) -> None:
    for piece in stream:
        print(piece, end="", flush=True)
    print()


def print_answer(reply_or_stream, as_json: bool) -> None:
    if not as_json:
        for piece in reply_or_stream:
            print(piece, end="", flush=True)
        print()
        return
    reply = reply_or_stream
    out: dict[str, Any] = {"answer": str(reply), "finish_reason": reply.finish_reason,
                           "usage": vars(reply.usage), "timings": vars(reply.timings)}
    if reply.reasoning:
        out["reasoning"] = reply.reasoning
    if reply.video is not None:
        out["video"] = vars(reply.video)
    print(json.dumps(out, indent=2))


def progress_line(args: argparse.Namespace, unit: str = "image slice"):
    """An ``on_progress`` callback drawing the slices being encoded on stderr (cleared before
    the answer); None when stderr is not a terminal or ``--quiet`` was given."""
    from ..progress import encoding  # lazy: per command

    return None if getattr(args, "quiet", False) else encoding(unit)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def native_lines(result: Any, local: tuple[Path, Path] | None, vision_backend: str) -> list[str]:
    """What the native check (gguf_mcv.runtime.native_check) changes for this plan's load, or refuses."""
    from ..planning.memory import QUANT_TYPE_MIX, output_type
    from ..runtime import native_check  # lazy: per command

    if local is not None:
        types = native_check.weight_types(local[0])
    else:
        types = {*QUANT_TYPE_MIX.get(result.quant.upper(), {result.quant.upper(): 1.0}), output_type(result.quant)}
    try:
        decision = native_check.decide(types, None if result.vision_on_gpu else result.vision_backend,
                                       vision_auto=vision_backend == "auto", what=result.quant)
    except GgufMcvError as exc:
        return [f"refused: {one_line(exc)}"]
    # the plan itself may have moved the vision backend (announced then, kept in native_check.notices())
    notices = dict.fromkeys([*native_check.notices(), *decision.notices])
    return list(notices) or ["every kernel this load uses ran in the check"]
