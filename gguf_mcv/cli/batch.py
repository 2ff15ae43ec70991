"""``gguf-mcv batch``: answer a file of questions."""

from __future__ import annotations

import argparse
import sys

from ..options import (
    check_int,
)
from .loading import checked_load_kwargs, load_model


def run_batch(args: argparse.Namespace) -> int:
    from ..jobs import batch  # lazy: per command

    # every argument before the model is loaded (or a cluster joined)
    load_kwargs = checked_load_kwargs(args)
    schema = batch.load_schema(args.schema) if args.schema else None
    options = batch.check_options({"max_tokens": args.max_tokens, "temperature": args.temperature,
                                   "seed": args.seed, "detail": args.detail, "max_frames": args.frames,
                                   "fps": args.fps})
    batch.check_out(args.out)
    if args.workers is not None:
        check_int("--workers", args.workers, low=1)
    items = batch.collect(args.input, prompts=args.prompt, schema=schema, options=options)
    show = False if args.no_progress else None
    if args.ray:
        from ..jobs import batch_ray  # lazy: per command, and an optional extra

        summary = batch_ray.run_items(args.ray, load_kwargs, items, args.out, workers=args.workers,
                                      progress=show)
    else:
        with load_model(args) as model:
            summary = batch.run_items(model, items, args.out, progress=show)
    repaired = f"; cut a torn last line ({summary.repaired_bytes} bytes)" if summary.repaired_bytes else ""
    print(f"{summary.answered} answered ({summary.failed} errors), {summary.skipped} already in {args.out}, "
          f"{summary.items_per_s:.2f} items/s{repaired}", file=sys.stderr)
    return 0
