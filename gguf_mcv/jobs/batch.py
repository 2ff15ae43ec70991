"""Batch jobs: many questions about a folder, glob or CSV/JSONL of images and videos, resumable, into JSONL.

    import gguf_mcv
    from gguf_mcv.jobs import batch
    model = gguf_mcv.load("minicpm-v")
    batch.run(model, "photos/", "results.jsonl", prompts=["What is in it?", "Any people?"])

One line per item (:func:`answer`): the item, its answer, usage and timings, or the
error that stopped it — a bad file is a recorded error, never the end of the job.
Rerunning with the same model files skips the keys already in the file (see
:mod:`gguf_mcv.jobs.batch_input` for the key, :mod:`gguf_mcv.jobs.batch_output` for how lines reach the disk).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from .. import progress
from ..errors import ConfigError, ModelClosedError, OutputError
from ..options import DETAILS, check_int, check_max_tokens, check_sampling, check_text, stop_list
from ..prompt.turns import VideoOptions
from ..reply import parsed_as_json
from ..vision.slicing import MAX_SLICES
from .batch_input import Item, answer_identity, collect, for_model, load_schema
from .batch_output import ResultsFile

if TYPE_CHECKING:
    from ..model import Model

__all__ = ["Item", "Summary", "answer", "check_options", "check_out", "collect", "load_schema", "pending",
           "progress_bar", "run", "run_items", "error_row"]


@dataclass(frozen=True)
class Summary:
    """What a job did: ``answered`` (with ``failed`` of them errors) of ``total`` items,
    ``skipped`` already in the results file, in ``elapsed_s``."""

    total: int
    skipped: int
    answered: int
    failed: int
    elapsed_s: float
    repaired_bytes: int = 0

    @property
    def items_per_s(self) -> float:
        return self.answered / self.elapsed_s if self.elapsed_s > 0 else 0.0


def run(model: "Model", source: str | os.PathLike, out: str | os.PathLike, *, prompts: Sequence[str] = (),
        schema: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
        progress: bool | None = None) -> Summary:
    """Answer every item of ``source`` (see :func:`~gguf_mcv.jobs.batch_input.collect`) with ``model``
    into the JSONL file ``out``, skipping items already there. ``options`` (``max_tokens``,
    ``detail``, ``temperature``, ``max_frames``, …) apply to every item; rows may override
    them. ``progress`` shows a tqdm bar (None: when stderr is a terminal). A bad value in
    ``options`` or ``out`` raises (:func:`check_options`, :func:`check_out`) before any item is read."""
    options = check_options(options)
    check_out(out)
    items = collect(source, prompts=prompts, schema=schema, options=options)
    return run_items(model, items, out, progress=progress)


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """A job's ``options`` (what every item is asked with; None keeps a default) checked as each
    answer checks them, so that a bad value stops the job before a model is loaded instead of
    becoming every row's error: :class:`~gguf_mcv.errors.ConfigError` naming it. Unknown names are
    :func:`collect`'s to refuse. Returned unchanged (None: ``{}``)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(f"options must be a dict of answer options, not {type(options).__name__}.")
    given = {k: v for k, v in options.items() if v is not None}
    if "max_tokens" in given:
        check_max_tokens(given["max_tokens"])
    check_sampling(**{k: v for k, v in given.items() if k in _SAMPLING})
    if "stop" in given:
        stop_list(given["stop"])
    if "system" in given:
        check_text("system", given["system"])
    if "detail" in given and (not isinstance(given["detail"], str) or given["detail"] not in DETAILS):
        raise ConfigError(f"detail must be one of {', '.join(DETAILS)}, not {given['detail']!r}.")
    if "max_slices" in given:
        check_int("max_slices", given["max_slices"], low=0, high=MAX_SLICES)
    video = {k: v for k, v in given.items() if k in _VIDEO}
    for flag in ("dedupe", "timestamps"):
        if flag in video and not isinstance(video[flag], bool):
            raise ConfigError(f"{flag} must be True or False, not {video[flag]!r}.")
    VideoOptions(**video)
    return options


def check_out(out: str | os.PathLike) -> Path:
    """The results path checked without touching it: :class:`~gguf_mcv.errors.OutputError` for a
    folder or a file whose folder does not exist (what :class:`ResultsFile` would refuse later)."""
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise OutputError(f"out must be a file path (results are JSONL), not {out!r:.60}.")
    path = Path(os.fsdecode(os.fspath(out))).expanduser()
    if path.is_dir():
        raise OutputError(f"Results path {path} is a folder: give a file name such as {path / 'results.jsonl'}.")
    if not path.parent.is_dir():
        raise OutputError(f"Results path {path}: the folder {path.parent} does not exist; create it first.")
    return path


#: The job options :func:`check_options` checks as :class:`~gguf_mcv.options.Sampling` and
#: :class:`~gguf_mcv.prompt.turns.VideoOptions` do.
_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"})
_VIDEO = frozenset({"max_frames", "fps", "dedupe", "timestamps"})


def run_items(model: "Model", items: Sequence[Item], out: str | os.PathLike, *,
              progress: bool | None = None) -> Summary:
    """Answer keyed ``items`` into ``out`` one by one; each line is on disk before the next item.
    Row keys include what of ``model`` changes an answer (:func:`~gguf_mcv.jobs.batch_input.answer_identity`):
    another model file, vision encoder or precision answers every item again."""
    items = for_model(items, answer_identity(model))
    return write_rows(items, out, lambda todo: (answer(model, item) for item in todo), progress=progress)


def write_rows(items: Sequence[Item], out: str | os.PathLike,
               rows: Callable[[list[Item]], Iterable[dict[str, Any]]], *,
               progress: bool | None = None) -> Summary:
    """Write the rows ``rows(todo)`` yields for the items of ``items`` not yet in ``out``, each
    on disk (fsync'd) as it comes, under ``out``'s lock and a progress bar; a row whose key is
    already written (a retried task's) is skipped, a row that is not strict JSON (an infinite
    number in a parsed answer) is written as its error row."""
    started = time.monotonic()
    answered = failed = 0
    with ResultsFile(out) as results:
        todo = pending(items, results.done)
        with progress_bar(len(items), len(items) - len(todo), progress) as bar:
            for row in rows(todo):
                if row["key"] in results.done:
                    continue
                try:
                    results.write(row)
                except (ValueError, TypeError, RecursionError) as exc:  # from json.dumps, before writing
                    row = _unrecordable(row, exc)
                    results.write(row)
                answered += 1
                failed += row["error"] is not None
                bar.update(1)
    return Summary(len(items), len(items) - len(todo), answered, failed, time.monotonic() - started,
                   results.repaired_bytes)


def pending(items: Iterable[Item], done: set[str]) -> list[Item]:
    """The items whose keys are not in ``done``, each key once, in order."""
    seen = set(done)
    todo = []
    for item in items:
        if item.key not in seen:
            seen.add(item.key)
            todo.append(item)
    return todo


def answer(model: "Model", item: Item) -> dict[str, Any]:
    """One result row for ``item``: its answer, or its error (class and message).

    Errors of the item (a bad file, a prompt too long, a wrong option) become the row;
    only a closed model (the job cannot go on) raises.
    """
    if item.problem is not None:
        return error_row(item, item.problem)
    try:
        if item.kind == "video":
            reply = model.ask_video(item.prompt, str(item.path), schema=item.schema, **item.options)
        else:
            reply = model.ask(item.prompt, str(item.path), schema=item.schema, **item.options)
    except ModelClosedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of one item is that item's row
        return error_row(item, exc)
    row = base_row(item)
    row.update(answer=str(reply), finish_reason=reply.finish_reason, usage=dataclasses.asdict(reply.usage),
               timings=dataclasses.asdict(reply.timings),
               video=dataclasses.asdict(reply.video) if reply.video is not None else None)
    if item.schema is not None:
        row.update(parsed=parsed_as_json(reply.parsed), parse_error=reply.parse_error)
    return row


def base_row(item: Item) -> dict[str, Any]:
    """The fields every row has, with nothing answered yet."""
    return {"key": item.key, "input": item.input, "kind": item.kind, "prompt": item.prompt, "id": item.id,
            "answer": None, "parsed": None, "parse_error": None, "finish_reason": None, "usage": None,
            "timings": None, "video": None, "error": None}


def error_row(item: Item, exc: BaseException) -> dict[str, Any]:
    """The row of an item that failed: ``error`` = its class and message."""
    row = base_row(item)
    row["error"] = {"class": type(exc).__name__, "message": " ".join(str(exc).split())}
    return row


def _unrecordable(row: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    """The error row of ``row``, whose answer cannot be written as strict JSON."""
    item = Item(str(row.get("input", "")), str(row.get("kind", "")), str(row.get("prompt", "")),
                id=row.get("id"), key=row["key"])
    return error_row(item, ValueError(f"The answer cannot be recorded as JSON ({type(exc).__name__}: {exc}); "
                                      "ask again, or change the schema so that it gives finite numbers."))


def progress_bar(total: int, initial: int, show: bool | None) -> Any:
    """The job's bar on stderr (items/s, ETA) starting at ``initial`` of ``total``, drawn when
    ``show``, or when it is None and stderr is a terminal (:func:`gguf_mcv.progress.bar`)."""
    return progress.bar(total, initial=initial, desc="batch", unit="item", show=show)


def iter_rows(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a results file, in order (for reading results back)."""
    import json

    with open(Path(path), "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
