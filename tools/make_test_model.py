#!/usr/bin/env python3
"""Write a random-weight MiniCPM-V GGUF pair (text quant ladder + mmproj) for tests and benchmarks.

Presets: "tiny" and "bench" are MiniCPM-V 2.6; every generation has its own, tiny as
"<generation>" and bench-sized as "<generation>-bench" (2.5, 2.6, o-2.6, 4.0, 4.5, 4.6,
4.6-thinking), with that generation's text architecture, tokenizer and projector.

Examples:
    python tools/make_test_model.py --out /tmp/tiny
    python tools/make_test_model.py --preset bench --out /tmp/bench --quants Q4_K_M,Q8_0
    python tools/make_test_model.py --preset 4.6 --out /tmp/v46 --quants Q4_K_M
    python tools/make_test_model.py --out /tmp/wide --n-embd 384 --minicpmv-version 2 --query-num 96

Every field of ``gguf_mcv.testing.synthetic.SyntheticSpec`` is a flag (``n_embd`` -> ``--n-embd``);
flags override the preset. A folder already holding a build of the same spec is reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import bench  # noqa: F401  (a checkout run without installing: gguf_mcv beside tools/)

from gguf_mcv.errors import GgufMcvError
from gguf_mcv.testing.synthetic import LADDER, MANIFEST_NAME, PRESETS, SyntheticSpec, build


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; one flag per spec field, all defaulting to the preset's value."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="starting shapes (default: tiny)")
    ap.add_argument("--out", type=Path, required=True, help="folder to write the files into")
    ap.add_argument("--quants", default=",".join(LADDER), help="comma-separated quants (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="rewrite every file even if a matching build exists")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's quantizer log and per-file timings")
    shapes = ap.add_argument_group("shapes (override the preset)")
    for field in dataclasses.fields(SyntheticSpec):
        kind = {float: float, "float": float, str: str, "str": str}.get(field.type, int)
        shapes.add_argument("--" + field.name.replace("_", "-"), type=kind, metavar=kind.__name__.upper())
    return ap.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> SyntheticSpec:
    """The preset with every flag that was given applied on top."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticSpec)}
    return dataclasses.replace(PRESETS[args.preset], **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    if args.force:
        (args.out / MANIFEST_NAME).unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        model = build(args.out, spec_from_args(args), quants, verbose=args.verbose)
    except GgufMcvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in [model.mmproj, model.f16, *model.quants.values()]:
        print(f"{path.stat().st_size:>14,}  {path}")
    print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
