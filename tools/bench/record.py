"""The JSON record every benchmark run writes: command, date, commit and machine around the results
(:func:`gguf_mcv.testing.bench_record.record`, the layout ``gguf-mcv bench --json`` writes too)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gguf_mcv.testing.bench_record import machine, record

__all__ = ["machine", "record", "settings_of", "write"]


def settings_of(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """The run's settings as JSON values (paths as strings; the ``--json`` destination left out)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items() if k != "json"}


def write(path: Path | None, benchmark: str, results: Any, args: argparse.Namespace | dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    """The run's record; written (indented JSON) to ``path`` when one is given."""
    rec = record(benchmark, results, settings=settings_of(args) if args is not None else None)
    if path is not None:
        Path(path).write_text(json.dumps(rec, indent=2, default=str) + "\n")
    return rec
