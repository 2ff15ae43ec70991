#!/usr/bin/env python3
"""Watch: what a tick costs when one slice changed, when nothing did, and how far behind a stream it runs.

On the benchmark-size generated model (tools/make_test_model.py --preset bench: SigLIP-400M
vision shape, Qwen2-0.5B-size text model) and a 1280×720 synthetic scene at ``detail="high"``
(overview + 6 slices), each phase drives :func:`gguf_mcv.watch` and times its ticks:

* **full vs one slice**: a tick whose frame is new everywhere (7 encoder passes) against a
  tick where one object moved inside one slice (the overview and that slice: 2 passes);
  ``max_tokens=1``, so a tick is encoding plus prefill. Target: encoding ≤ 0.3× (2 of 7 passes);
  the whole tick's ratio is reported beside it (the prefill is the same in both). Wall time and this
  process's CPU time (all threads) are both reported: on a shared machine the CPU time is the
  steadier measure of the work a tick does.
* **zone**: a tick after a change everywhere with a quarter-frame ``region`` (the top left) against
  the whole frame, taking turns (``--rounds`` each);
* **events**: ``--event-ticks`` watches of one new scene each, following a count of at least 1
  (so each first tick starts an event whatever the random weights answer), the event sent to a
  webhook receiver and to a mosquitto broker on 127.0.0.1: the time from the frame's reading
  (the change in the picture) to the event's arrival at each, split into the tick (frame to
  observation) and the delivery (observation to arrival);
* **static**: noisy frames of an unchanged scene; the default (no model call) and
  ``answer_unchanged=True`` (prefill served by the KV cache, 4 tokens). Target: ≤ 50 ms a tick.
* **lag**: a 10 fps MJPEG-over-HTTP stream served on 127.0.0.1 (a static scene with an object
  crossing it), answered every 2 s: latency from the frame's reading to the answer, frames and
  ticks skipped.
* **agreement**: on noisy copies of static scenes (Gaussian sensor noise, σ 3 and 6), the greedy
  answer watch gives (it reuses the clean frame's embeddings: nothing passes the threshold)
  against a full re-encode of the noisy frame; and, for scale, two full re-encodes of two
  noise draws against each other.
* **soak**: ``--soak`` ticks on a synthetic stream (noisy static frames, one small object moved every
  ``--soak-change-every`` ticks: the no-model-call path with occasional two-slice re-encodes and
  2-token answers), resident memory sampled every 100 ticks.

    python tools/bench_watch.py --ladder /tmp/watch_bench --threads 2 --json /tmp/bench_watch.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import psutil
from bench import REPO, models, options, record, stats
from bench.images import noisy, scene

W, H = 1280, 720


def moved(rgb: np.ndarray, k: int) -> np.ndarray:
    """``rgb`` with one small square drawn inside slice 1 + k % 6 (well away from its borders)."""
    out = rgb.copy()
    col, row = k % 3, (k // 3) % 2
    x, y = col * 426 + 150 + (k * 7) % 60, row * 360 + 120 + (k * 5) % 60
    out[y:y + 60, x:x + 60] = ((k * 50) % 255, 255 - (k * 30) % 255, 128)
    return out


class Ticks:
    """Frames handed to watch one at a time, each tick timed from handing out the frame to the observation."""

    def __init__(self, model, **options) -> None:
        import gguf_mcv

        self.frame: np.ndarray | None = None
        options = {"detail": "high", **options}
        self.watching = gguf_mcv.watch(model, self._frames(), "Describe the scene.", every_s=1e-3, temperature=0,
                                       **options)

    def _frames(self):
        while self.frame is not None:
            yield self.frame

    def tick(self, frame: np.ndarray):
        """(observation, wall seconds); ``self.cpu_s``: this process's CPU seconds (all threads) for it."""
        self.frame = frame
        cpu = sum(psutil.Process().cpu_times()[:2])
        start = time.perf_counter()
        seen = next(self.watching)
        took = time.perf_counter() - start
        self.cpu_s = sum(psutil.Process().cpu_times()[:2]) - cpu
        return seen, took

    def close(self) -> None:
        self.watching.close()


def zone_vs_frame(model, rounds: int) -> dict:
    """The cost of a tick after a change everywhere: a quarter-frame region (the top left) against
    the whole frame, the two taking turns (A B A B)."""
    import itertools

    import gguf_mcv

    seeds = itertools.count(300)

    def tick(region) -> float:
        frames = [scene(next(seeds)), scene(next(seeds))]  # the second tick: every slice changed
        seen = list(gguf_mcv.watch(model, frames, "What is in the picture?", every_s=0.001, max_tokens=2,
                                   detail="high", region=region))
        return seen[1].latency_s

    samples = stats.alternate({"whole frame": lambda: tick(None),
                               "quarter-frame region": lambda: tick((0.0, 0.0, 0.5, 0.5))}, rounds,
                              on_sample=lambda i, name, t: print(f"  zone round {i}: {name} {t:.2f} s", flush=True))
    ratio = stats.ratio(samples["quarter-frame region"], samples["whole frame"])
    print(f"  quarter-frame region / whole frame, tick after a change: {ratio['median']:.3f}× "
          f"(range {ratio['min']:.3f}–{ratio['max']:.3f})", flush=True)
    return {"ticks_s": samples, "ratio": ratio}


def events(model, n: int) -> dict:
    """Change to arrival: ``n`` new scenes, each answer an event, sent to a webhook receiver and a
    mosquitto broker (the test suite's, tests/test_watch_webhook.py and tests/mqttbroker.py)."""
    import itertools
    import tempfile

    import gguf_mcv
    from gguf_mcv.watch import MqttSink, WebhookSink

    sys.path.insert(0, str(REPO / "tests"))
    from mqttbroker import Broker, Subscriber, mosquitto
    from test_watch_webhook import Receiver

    if mosquitto() is None:
        print("  events: no mosquitto (apt-get install mosquitto): the broker is left out", flush=True)
    seeds = itertools.count(500)  # every scene new: nothing comes from the embedding cache
    with tempfile.TemporaryDirectory() as folder:
        broker = Broker(Path(folder)).start() if mosquitto() else None
        receiver = Receiver()
        sub = Subscriber(broker.port, "bench") if broker else None
        hook = WebhookSink(receiver.url)
        mqtt = MqttSink(f"mqtt://127.0.0.1:{broker.port}/bench") if broker else None
        sinks = [s for s in (hook, mqtt) if s is not None]
        seen = []
        count = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
                 "required": ["n"]}
        try:
            for _ in range(n):  # a watch's first value, a count of at least 1, is a started event
                for o in gguf_mcv.watch(model, [scene(next(seeds))], "How many things are there?", every_s=0.001,
                                        max_tokens=16, detail="high", schema=count, event_on="n"):
                    if o.event is not None:
                        for sink in sinks:
                            sink.send(o.event.to_dict())
                        seen.append((o, time.time()))
                        print(f"  event {len(seen)}: tick {o.latency_s:.2f} s", flush=True)
            for sink in sinks:
                sink.close(timeout_s=60)
        finally:
            receiver.close()
            if sub is not None:
                sub.close()
            if broker is not None:
                broker.stop()
    at = {round(o.time, 3): (o, yielded) for o, yielded in seen}  # the event's "time" names its frame

    def arrivals(times_and_arrivals) -> dict:
        change, delivery = [], []
        for frame_time, arrived in times_and_arrivals:
            o, yielded = at[frame_time]
            change.append(arrived - o.time)
            delivery.append(arrived - yielded)
        return {"events": len(change), "change_to_arrival_s": stats.summary(change),
                "delivery_s": stats.summary(delivery)}

    out = {"events": len(seen), "tick_s": stats.summary([o.latency_s for o, _ in seen]),
           "webhook": arrivals((b["time"], t) for b, t in zip(receiver.bodies, receiver.arrived, strict=True))}
    if sub is not None:
        out["mqtt"] = arrivals((json.loads(payload)["time"], t)
                               for (topic, payload, _), t in zip(sub.messages, sub.arrived, strict=True)
                               if topic == "bench/event")
    for name in ("webhook", "mqtt"):
        if name in out:
            r = out[name]
            change, delivery = r["change_to_arrival_s"]["median"], r["delivery_s"]["median"]
            if change is not None:
                print(f"  {name}: {r['events']} events, change to arrival median {change:.3f} s, delivery median "
                      f"{delivery * 1000:.1f} ms", flush=True)
    return out


def full_vs_slice(model, rounds: int) -> dict:
    ticks = Ticks(model, max_tokens=1)
    full, part, full_cpu, part_cpu, encoded, split = [], [], [], [], [], []
    try:
        for r in range(rounds):
            base = scene(100 + r)
            first, took = ticks.tick(base)
            assert first.slices_encoded == 7, first
            full.append(took)
            full_cpu.append(ticks.cpu_s)
            seen, took = ticks.tick(moved(base, r))
            encoded.append(seen.slices_encoded)
            part.append(took)
            part_cpu.append(ticks.cpu_s)
            split.append([(o.answer.timings.encode_ms / 1000, o.answer.timings.prefill_ms / 1000)
                          for o in (first, seen)])
            print(f"  round {r}: full {full[-1]:.2f} s ({full_cpu[-1]:.1f} CPU s; encode/prefill "
                  f"{split[-1][0][0]:.1f}/{split[-1][0][1]:.1f} s), one slice {part[-1]:.2f} s "
                  f"({part_cpu[-1]:.1f} CPU s; encode/prefill {split[-1][1][0]:.1f}/{split[-1][1][1]:.1f} s; "
                  f"{seen.slices_encoded} encoded, {seen.slices_reused} reused)", flush=True)
    finally:
        ticks.close()
    return {"full_s": statistics.median(full), "one_slice_s": statistics.median(part),
            "ratio": statistics.median(part) / statistics.median(full), "full_cpu_s": statistics.median(full_cpu),
            "one_slice_cpu_s": statistics.median(part_cpu),
            "cpu_ratio": statistics.median(part_cpu) / statistics.median(full_cpu), "one_slice_encoded": encoded,
            "encode_prefill_s": split,
            # the target: encoding the overview and the changed slice against encoding the whole frame
            "encode_ratio": statistics.median(p[1][0] for p in split) / statistics.median(p[0][0] for p in split),
            "rounds": rounds}


def static(model, n: int) -> dict:
    out = {}
    for again in (False, True):
        ticks = Ticks(model, max_tokens=4, answer_unchanged=again)
        base = moved(scene(100), 0)  # the full phase's last frame: its slices are in the embedding cache
        calls = model.engine.encoder_calls
        try:
            ticks.tick(base)
            calls = model.engine.encoder_calls
            times = [ticks.tick(noisy(base, i))[1] for i in range(n)]
        finally:
            ticks.close()
        name = "answer_again" if again else "no_model_call"
        out[name] = {"median_ms": statistics.median(times) * 1000, "max_ms": max(times) * 1000,
                     "encoder_calls": model.engine.encoder_calls - calls}
        print(f"  static, {name}: median {out[name]['median_ms']:.1f} ms a tick, max {out[name]['max_ms']:.1f} ms, "
              f"{out[name]['encoder_calls']} encoder calls over {n} ticks", flush=True)
    return out


def lag(model, ticks_after_first: int) -> dict:
    """A 10 fps MJPEG-over-HTTP stream (tests/mjpegserver.py) of a static scene with an object crossing
    it, answered every 2 s: the first tick encodes the whole frame, the next ones what moved."""
    import gguf_mcv

    sys.path.insert(0, str(REPO / "tests"))  # the test suite's MJPEG server
    from mjpegserver import MjpegServer

    base = scene(3)
    frames = []
    for i in range(40):
        frame = base.copy()
        x = 50 + (W - 150) * i // 40
        cv2.rectangle(frame, (x, 500), (x + 80, 580), (255, 40, 40), -1)
        frames.append(noisy(frame, i))
    seen = []
    with MjpegServer(frames, fps=10) as server:
        watching = gguf_mcv.watch(model, server.url, "What moves?", every_s=2.0, detail="high", max_tokens=8)
        try:
            for o in watching:
                seen.append(o)
                print(f"  lag tick {len(seen)}: latency {o.latency_s:.2f} s, {o.slices_encoded} encoded, "
                      f"{o.frames_skipped} frames and {o.ticks_skipped} ticks skipped", flush=True)
                if len(seen) > ticks_after_first:
                    break
        finally:
            watching.close()
    rest = seen[1:]
    return {"ticks": len(seen), "first_latency_s": seen[0].latency_s,
            "latency_s_median": statistics.median(o.latency_s for o in rest),
            "latency_s_max": max(o.latency_s for o in rest),
            "frames_skipped_median": statistics.median(o.frames_skipped for o in rest),
            "ticks_skipped_median": statistics.median(o.ticks_skipped for o in rest),
            "slices_encoded_median": statistics.median(o.slices_encoded for o in rest)}


def agreement(model, scenes: int, sigmas: tuple[float, ...], detail: str) -> dict:
    same_watch = {s: 0 for s in sigmas}
    same_full = {s: 0 for s in sigmas}
    for k in range(scenes):
        base = scene(200 + k)
        ticks = Ticks(model, max_tokens=16, detail=detail)
        try:
            ticks.tick(base)  # the clean frame, encoded once
            for sigma in sigmas:
                seen, _ = ticks.tick(noisy(base, 1, sigma))
                assert seen.slices_encoded == 0, seen  # nothing passed the threshold: the clean embeddings
                full1 = model.ask("Describe the scene.", noisy(base, 1, sigma), detail=detail, max_tokens=16,
                                  temperature=0)
                full2 = model.ask("Describe the scene.", noisy(base, 2, sigma), detail=detail, max_tokens=16,
                                  temperature=0)
                same_watch[sigma] += str(seen.answer) == str(full1)
                same_full[sigma] += str(full1) == str(full2)
                marks = ["=" if a == b else "≠" for a, b in ((str(seen.answer), str(full1)), (str(full1), str(full2)))]
                print(f"  agreement, scene {k}, noise σ {sigma:g}: watch {marks[0]} full re-encode; "
                      f"two noise draws {marks[1]}", flush=True)
        finally:
            ticks.close()
    return {f"sigma_{s:g}": {"scenes": scenes, "watch_vs_full_reencode": same_watch[s] / scenes,
                             "full_vs_full_other_noise": same_full[s] / scenes} for s in sigmas}


def soak(model, n: int, change_every: int) -> dict:
    proc = psutil.Process()
    ticks = Ticks(model, max_tokens=2)
    base = moved(scene(100), 0)
    noise = [np.random.default_rng(i).normal(0, 3.0, base.shape).round().astype(np.int16) for i in range(4)]
    samples, encoded = [], 0
    start = time.perf_counter()
    try:
        current = base.astype(np.int16)
        for i in range(n):
            if i and i % change_every == 0:
                current = moved(base, i // change_every).astype(np.int16)
            seen, _ = ticks.tick(np.clip(current + noise[i % 4], 0, 255).astype(np.uint8))
            encoded += seen.slices_encoded
            if i % 100 == 0 or i == n - 1:
                samples.append((i, proc.memory_info().rss / 2**20))
    finally:
        ticks.close()
    warm = next(rss for i, rss in samples if i >= 200)
    out = {"ticks": n, "seconds": time.perf_counter() - start, "slices_encoded": encoded,
           "rss_mb_after_200": warm, "rss_mb_last": samples[-1][1], "peak_rss_mb": max(r for _, r in samples),
           "rss_drift_mb": samples[-1][1] - warm, "samples": samples}
    print(f"  soak: {n} ticks in {out['seconds']:.0f} s, {encoded} slices encoded, RSS {warm:.0f} -> "
          f"{samples[-1][1]:.0f} MB (drift {out['rss_drift_mb']:+.1f} MB), peak {out['peak_rss_mb']:.0f} MB",
          flush=True)
    return out


def main() -> int:
    parser = options.parser(__doc__, ladder=Path("/tmp/bench"))
    parser.add_argument("--vision-backend", default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="full / one-slice pairs timed")
    parser.add_argument("--static-ticks", type=int, default=50)
    parser.add_argument("--event-ticks", type=int, default=8, help="events: new scenes watched")
    parser.add_argument("--lag-ticks", type=int, default=5, help="lag: ticks timed after the first")
    parser.add_argument("--agreement-scenes", type=int, default=4)
    parser.add_argument("--agreement-detail", default="high", help="detail of the agreement phase")
    parser.add_argument("--soak", type=int, default=2000)
    parser.add_argument("--soak-change-every", type=int, default=200, help="soak: ticks between two moves")
    parser.add_argument("--skip", default="",
                        help="comma-separated phases to skip: full,zone,events,static,lag,agreement,soak")
    args = parser.parse_args()

    import gguf_mcv

    model_path, mmproj = models.pair(args.ladder, args.quant, "bench")
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {}
    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=4096,
                       n_threads=args.threads, vision_backend=args.vision_backend) as model:
        results["vision_backend"] = model.info.vision_backend
        print(f"bench model {args.quant}, {args.threads} threads, vision encoder {model.info.vision_backend}",
              flush=True)
        phases = [("full", lambda: full_vs_slice(model, args.rounds)),
                  ("zone", lambda: zone_vs_frame(model, args.rounds)),
                  ("events", lambda: events(model, args.event_ticks)),
                  ("static", lambda: static(model, args.static_ticks)),
                  ("soak", lambda: soak(model, args.soak, args.soak_change_every)),
                  ("lag", lambda: lag(model, args.lag_ticks)),
                  ("agreement", lambda: agreement(model, args.agreement_scenes, (3.0, 6.0), args.agreement_detail))]
        for name, phase in phases:
            if name not in skip:
                results[name] = phase()
                record.write(args.json, "bench_watch", results, args)  # after each: an interrupted run keeps it
    ok = True
    if "full" in results:
        ok &= results["full"]["encode_ratio"] <= 0.3
        print(f"one changed slice / full frame: encoding {results['full']['encode_ratio']:.3f}× (target ≤ 0.3×); "
              f"the whole tick {results['full']['ratio']:.3f}× wall, {results['full']['cpu_ratio']:.3f}× CPU time "
              "(the text model evaluates every image position after the overview again either way)")
    if "static" in results:
        ok &= results["static"]["no_model_call"]["median_ms"] <= 50
        print(f"static tick: {results['static']['no_model_call']['median_ms']:.1f} ms (target ≤ 50 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
