"""``gguf-mcv watch``: questions about a live source, as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from .. import progress
from ..options import (
    check_max_tokens,
    check_sampling,
    check_text,
)
from .loading import checked_load_kwargs, load_model
from .watch_status import describe_tick

if TYPE_CHECKING:
    from ..watch.webhook import SinkCounts


def run_watch(args: argparse.Namespace) -> int:
    from ..watch import watch  # lazy: per command
    from ..watch.changes import DEFAULT_THRESHOLD  # lazy: per command
    from ..watch.jsonl import LinesFile  # lazy: per command
    from ..watch.sources import check_source  # lazy: per command

    schema = None
    if args.schema:
        from ..jobs.batch_input import load_schema  # lazy: per command

        schema = load_schema(args.schema)
    from ..watch.changes import check_threshold  # lazy: per command
    from ..watch.events import check_events  # lazy: per command
    from ..watch.observe import check_every  # lazy: per command
    from ..watch.regions import parse_region  # lazy: per command
    from ..watch.snapshots import SnapshotFolder  # lazy: per command
    from ..watch.sources import check_give_up  # lazy: per command
    from ..watch.webhook import WebhookSink  # lazy: per command

    check_source(args.source)  # a missing file, a bad URL or number, before minutes of loading
    check_events(args.event_on, args.hold, args.cooldown, structured=schema is not None, on_name="--event-on",
                 shaping={"--hold": args.hold != 1, "--cooldown": args.cooldown != 0.0,
                          "--snapshots": bool(args.snapshots), "--webhook": bool(args.webhook)})
    snapshots = SnapshotFolder(args.snapshots) if args.snapshots else None
    region = parse_region(args.region) if args.region else None
    check_every(args.every)
    check_give_up(args.give_up)
    if args.threshold is not None:
        check_threshold(args.threshold)
    check_text("--prompt", args.prompt)
    check_max_tokens(args.max_tokens)
    check_sampling(temperature=args.temperature, seed=args.seed)
    checked_load_kwargs(args)
    out = LinesFile(args.jsonl).open() if args.jsonl else None  # a FIFO or a JPEG refused before loading
    if out is not None and out.repaired_bytes:
        print(f"{args.jsonl}: cut a torn last line ({out.repaired_bytes} bytes)", file=sys.stderr)
    webhook = WebhookSink(args.webhook) if args.webhook else None  # a bad URL, before loading
    lines = 0
    try:
        with load_model(args) as model:
            watching = watch(model, args.source, args.prompt, every_s=args.every, schema=schema,
                             only_changes=args.only_changes, answer_unchanged=args.answer_unchanged,
                             threshold=DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
                             detail=args.detail, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, give_up_s=args.give_up, event_on=args.event_on, hold=args.hold,
                             cooldown_s=args.cooldown, snapshots=snapshots, region=region)
            status = progress.status_line(False if args.quiet else None)  # after loading: its bars come first
            try:
                for seen in watching:
                    line = json.dumps(seen.to_dict(), ensure_ascii=False)
                    if out is not None:
                        out.write(line)  # first: every line printed is in the file
                    with status.external_write_mode():
                        print(line, flush=True)
                    if webhook is not None and seen.event is not None:
                        webhook.send(seen.event.to_dict())
                    lines += 1
                    status.set_description_str(describe_tick(seen, lines))
            except KeyboardInterrupt:
                status.close()
                print(f"(stopped after {lines} observation(s))", file=sys.stderr)
                return 130
            finally:
                status.close()
                watching.close()  # releases the camera or stream
    finally:
        if out is not None:
            out.close()
        if webhook is not None:
            _report_sink("webhook", webhook.close())
    return 0


def _report_sink(name: str, counts: "SinkCounts") -> None:
    """One stderr line when a sink lost events (dropped from its full queue, or given up)."""
    if counts.dropped or counts.failed:
        print(f"{name}: {counts.sent} event(s) sent, {counts.dropped} dropped (queue full or unsent at the end), "
              f"{counts.failed} given up ({counts.last_error})", file=sys.stderr)
