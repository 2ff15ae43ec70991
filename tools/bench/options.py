"""The command-line options the benchmarks share, and the model pair they name."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gguf_mcv.environment import DEFAULT_QUANT

#: Leaves a shared option out of :func:`parser`.
OMIT: Any = object()


def parser(doc: str | None, *, ladder: Path | None | Any = OMIT, quant: str | Any = DEFAULT_QUANT,
           threads: int | None | Any = 2, json: bool = True, **kw: Any) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of ``doc`` (the rest shown as the epilog), with
    the shared options: ``--ladder`` (a folder of generated models: ``None`` makes it required,
    a path is its default), ``--quant``, ``--threads`` (``None``: the probe's recommendation) and
    ``--json`` (where to write the run's record). :data:`OMIT` leaves one out."""
    lines = (doc or "").strip().splitlines()
    p = argparse.ArgumentParser(description=lines[0] if lines else None,
                                epilog="\n".join(lines[1:]).strip() or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter, **kw)
    if ladder is not OMIT:
        p.add_argument("--ladder", type=Path, required=ladder is None, default=ladder,
                       help="folder of generated models (tools/make_test_model.py; built there if missing)"
                       + ("" if ladder is None else " (default %(default)s)"))
    if quant is not OMIT:
        p.add_argument("--quant", default=quant, help="text model quant (default %(default)s)")
    if threads is not OMIT:
        p.add_argument("--threads", type=int, default=threads,
                       help="llama.cpp threads (default %s)" % ("the probe's" if threads is None else threads))
    if json:
        p.add_argument("--json", type=Path, help="write the run's record (command, date, commit, machine, "
                       "results) here")
    return p
