"""Progress on a terminal, one way: tqdm bars on stderr, shown only when stderr is a terminal.

Batch jobs (:func:`bar`), the ONNX conversion (:func:`steps`), ``gguf-mcv``'s image
encoding (:func:`encoding`) and ``gguf-mcv watch``'s status line (:func:`status_line`) all go
through here; downloads show huggingface_hub's own bar.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


def shown(show: bool | None = None) -> bool:
    """Whether to draw: ``show`` when given, else whether stderr is a terminal."""
    return bool(show) if show is not None else sys.stderr.isatty()


def bar(total: int, *, desc: str, unit: str, initial: int = 0, show: bool | None = None,
        leave: bool = True) -> Any:
    """A tqdm bar on stderr (rate, ETA) from ``initial`` of ``total``; drawn only when
    :func:`shown` (else a disabled bar: every call still works and draws nothing)."""
    from tqdm import tqdm  # lazy: only commands that show progress import it

    # a terminal that reports no size (a bare pty, a serial console) gets 80x24: tqdm would take
    # its 0 rows for "no room" and draw nothing
    sized = _stderr_width() > 0
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=sized,
                ncols=None if sized else 80, nrows=None if sized else 24, smoothing=0.1, leave=leave,
                disable=not shown(show))


def status_line(show: bool | None = None) -> Any:
    """A live line of text on stderr (a tqdm bar drawing only its description): set it with
    ``set_description_str``; print other output inside its ``external_write_mode()`` so the line
    is cleared first and drawn again after. Drawn only when :func:`shown`."""
    from tqdm import tqdm  # lazy: only commands that show progress import it

    sized = _stderr_width() > 0
    return tqdm(total=None, bar_format="{desc}", file=sys.stderr, dynamic_ncols=sized,
                ncols=None if sized else 80, nrows=None if sized else 24, leave=False,
                disable=not shown(show))


def _stderr_width() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def steps(desc: str) -> Callable[[str, int, int], None]:
    """A callback ``(what, done, total)`` with one bar per ``what``, closed when it is done."""
    bars: dict[str, Any] = {}

    def update(what: str, done: int, total: int) -> None:
        current = bars.get(what)
        if current is None:
            current = bars[what] = bar(total, desc=f"{desc}: {what}", unit="step", leave=False)
        current.n = done
        current.refresh()
        if done >= total:
            current.close()

    return update


def encoding(unit: str = "image slice", show: bool | None = None) -> Callable[[Any], None] | None:
    """An ``on_progress`` callback (:class:`gguf_mcv.Progress`: ``done``, ``total``, ``cached``)
    drawing the image slices being encoded; None when nothing would be drawn."""
    if not shown(show):
        return None
    state: dict[str, Any] = {}

    def update(p: Any) -> None:
        current = state.get("bar")
        if current is None or current.total != p.total:
            if current is not None:
                current.close()
            current = state["bar"] = bar(p.total, desc=f"encoding {unit}s", unit=unit, leave=False, show=show)
        current.n = p.done
        current.set_postfix_str(f"{p.cached} from the cache" if p.cached else "", refresh=False)
        current.refresh()
        if p.done >= p.total:
            current.close()
            state.pop("bar", None)

    return update
