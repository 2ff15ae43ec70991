"""``gguf-mcv watch``: questions about a live source, as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from .. import progress
from ..errors import ConfigError
from ..options import (
    check_max_tokens,
    check_sampling,
    check_text,
)
from .loading import checked_load_kwargs, load_model
from .watch_status import describe_tick

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..watch.sink_queue import QueuedSink


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
    from ..watch.mqtt import MqttSink  # lazy: per command
    from ..watch.observe import check_every  # lazy: per command
    from ..watch.regions import check_zones, parse_region, parse_zone  # lazy: per command
    from ..watch.snapshots import SnapshotFolder  # lazy: per command
    from ..watch.sources import check_give_up  # lazy: per command
    from ..watch.webhook import WebhookSink  # lazy: per command

    check_source(args.source)  # a missing file, a bad URL or number, before minutes of loading
    check_events(args.event_on, args.hold, args.cooldown, structured=schema is not None, on_name="--event-on",
                 shaping={"--hold": args.hold != 1, "--cooldown": args.cooldown != 0.0,
                          "--snapshots": bool(args.snapshots), "--webhook": bool(args.webhook),
                          "--mqtt": bool(args.mqtt)})
    if args.mqtt_discovery is not None and not args.mqtt:
        raise ConfigError("--mqtt-discovery announces what --mqtt publishes: give --mqtt too.")
    if args.zone and args.region:
        raise ConfigError("give --region or --zone, not both: a zone is a named region with its own question.")
    snapshots = SnapshotFolder(args.snapshots) if args.snapshots else None
    region = parse_region(args.region) if args.region else None
    zones = None
    if args.zone:
        named = [parse_zone(text) for text in args.zone]
        if len({name for name, _ in named}) < len(named):
            raise ConfigError(f"--zone names must differ: {', '.join(name for name, _ in named)}.")
        zones = dict(named)
        check_zones(zones)
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
    sinks: list[WebhookSink | MqttSink] = []
    try:  # a bad URL, before loading
        if args.webhook:
            sinks.append(WebhookSink(args.webhook))
        if args.mqtt:
            sinks.append(MqttSink(args.mqtt, discovery=args.mqtt_discovery))
    except BaseException:
        _close_sinks(sinks)
        if out is not None:
            out.close()
        raise
    lines = 0
    try:
        with load_model(args) as model:
            watching = watch(model, args.source, args.prompt, every_s=args.every, schema=schema,
                             only_changes=args.only_changes, answer_unchanged=args.answer_unchanged,
                             threshold=DEFAULT_THRESHOLD if args.threshold is None else args.threshold,
                             detail=args.detail, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, give_up_s=args.give_up, event_on=args.event_on, hold=args.hold,
                             cooldown_s=args.cooldown, snapshots=snapshots, region=region, zones=zones)
            status = progress.status_line(False if args.quiet else None)  # after loading: its bars come first
            try:
                for seen in watching:
                    line = json.dumps(seen.to_dict(), ensure_ascii=False)
                    if out is not None:
                        out.write(line)  # first: every line printed is in the file
                    with status.external_write_mode():
                        print(line, flush=True)
                    if seen.event is not None:
                        event = seen.event.to_dict()
                        for sink in sinks:
                            sink.send(event)
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
        _close_sinks(sinks)
    return 0


def _close_sinks(sinks: "Sequence[QueuedSink]") -> None:
    """Deliver what each sink holds (10 s at most), then one stderr line for a sink that lost events."""
    for sink in sinks:
        counts = sink.close()
        if counts.dropped or counts.failed:
            print(f"{sink.name}: {counts.sent} event(s) sent, {counts.dropped} dropped (queue full or unsent at the "
                  f"end), {counts.failed} given up ({counts.last_error})", file=sys.stderr)
