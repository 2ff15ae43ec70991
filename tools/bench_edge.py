#!/usr/bin/env python3
"""A model on a small board: a first and a second run inside a real memory limit.

For each ``--limit`` (a board's memory budget: ``1.4GB`` for a 2 GB board, ``3GB`` for 4 GB,
``7GB`` for 8 GB), two fresh processes run one after the other inside a memory cgroup of
that size (cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; root needed):

1. **first run**: an empty gguf_mcv cache (``GGUF_MCV_CACHE``), so the ONNX conversion of
   the mmproj and the native kernel check happen in it, as on a board's first question;
2. **second run** ("cached"): the cache the first one filled (when it got that far: a first
   run killed while converting leaves the second one converting too; ``--cache DIR`` runs
   both from a cache filled beforehand).

Each loads the preset's pair with ``gguf_mcv.load(model_path=..., mmproj_path=...,
ram_budget=LIMIT)`` (``--probe-budget``: the budget the hardware probe reads from the
cgroup, less its reserve, instead), asks about a 12 MP JPEG photo at ``detail="auto"``
and about a 16-frame video (``max_frames=16``, no dedupe), and reports: the plan's
prediction (``needed`` and the peak RSS it predicts, and its parts with ``--json``), the
process's peak RSS (``VmHWM``), the cgroup's peak usage (``memory.peak`` /
``memory.max_usage_in_bytes``: page cache included), OOM kills (exit 137,
``memory.events`` / ``memory.oom_control``), a refusal (``NoQuantFitsError``, exit 3)
and the times. The models are random-weight builds of ``tools/make_test_model.py``'s
presets (``4.6-bench``, ``bench`` = 2.6), made once under ``--models``::

    python tools/bench_edge.py 4.6-bench --limit 1.4GB
    python tools/bench_edge.py 4.6-bench --limit 1.4GB --probe-budget --same-cgroup
    python tools/bench_edge.py bench --limit 1.4GB 3GB 7GB --json /tmp/edge-26.json

``--same-cgroup`` runs both in one cgroup, as two runs in one container: the model files are
evicted from the page cache first, so the first run is charged for their pages, and those pages
are still charged when the second run probes (with ``--probe-budget``: the second must plan as the
first did). Its OOM kills and peaks are then counted over both runs. ``kernel peak`` is the
cgroup v1 kernel memory peak (page tables, stacks, slab): the container reserve's measure.

Where no memory cgroup can be made (not root, no writable controller) it says so and
exits 0 without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import images, memory, options, record
from bench.fresh import env_for_child

from gguf_mcv.testing.memory_cgroup import MemoryCgroup

PHOTO_SIZE = (4000, 3000)  # 12 MP
VIDEO_FRAMES = 16
MAX_TOKENS = 8
REFUSED = 3  # the child's exit status for NoQuantFitsError


# --- the measured process ---------------------------------------------------------------


def _say(**fields: Any) -> None:
    own = memory.status()
    print(json.dumps({**fields, "VmHWM": own.get("VmHWM"), "VmRSS": own.get("VmRSS")}), flush=True)


def child(args: argparse.Namespace) -> int:
    """Plan, load, ask about the photo and the video; one JSON line per stage on stdout."""
    import gguf_mcv
    from gguf_mcv.errors import NoQuantFitsError
    from gguf_mcv.resolver import plan_local

    budget = args.ram_budget or None
    _say(stage="start")
    start = time.perf_counter()
    try:
        from dataclasses import replace

        hardware = replace(gguf_mcv.probe(), gpu_offload=False)  # as load() plans a CPU load
        weights = args.vision_weights or None
        plan = plan_local(args.model, args.mmproj, hardware=hardware, ram_budget=budget, vision_weights=weights)
        _say(stage="plan", budget=plan.budget, needed=plan.predicted_bytes, peak_rss=plan.estimate.total,
             n_ctx=plan.n_ctx, kv_cache_type=plan.kv_cache_type, vision_backend=plan.vision_backend,
             shrunk=[str(s) for s in plan.shrunk], fits=plan.fits, estimate=plan.estimate.to_dict())
        model = gguf_mcv.load(model_path=args.model, mmproj_path=args.mmproj, ram_budget=budget,
                              n_threads=args.threads, vision_weights=weights)
    except NoQuantFitsError as exc:
        _say(stage="refused", error=str(exc), seconds=time.perf_counter() - start)
        return REFUSED
    _say(stage="loaded", seconds=time.perf_counter() - start, n_ctx=model.info.n_ctx,
         vision_backend=model.info.vision_backend)
    with model:
        t = time.perf_counter()
        reply = model.ask("What is in this photo?", args.photo, detail="auto", max_tokens=MAX_TOKENS,
                          temperature=0.0)
        _say(stage="photo", seconds=time.perf_counter() - t, image_tokens=reply.usage.image_tokens)
        t = time.perf_counter()
        reply = model.ask_video("What happens in this video?", args.video, max_frames=VIDEO_FRAMES, fps=None,
                                dedupe=False, max_tokens=MAX_TOKENS, temperature=0.0)
        _say(stage="video", seconds=time.perf_counter() - t, image_tokens=reply.usage.image_tokens)
    return 0


# --- inputs ----------------------------------------------------------------------------


# --- the parent ------------------------------------------------------------------------


def measure(files: dict[str, Path], limit: int, cache: Path, args: argparse.Namespace,
            group: MemoryCgroup | None = None) -> dict[str, Any]:
    """One run in ``group``, else in a fresh cgroup of ``limit`` bytes; what the child said and what
    the cgroup saw."""
    if group is not None:
        return _run_in(group, files, limit, cache, args)
    group = MemoryCgroup.make(limit, prefix="gguf_mcv_edge")
    try:
        return _run_in(group, files, limit, cache, args)
    finally:  # interrupted or not, the cgroup goes (the child is dead: run() kills it on any exception)
        group.remove()


def _evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache, so the next cgroup to read them is charged for
    them (as a fresh container is for the model it downloaded)."""
    for path in paths:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _drop_page_cache() -> None:
    """Empty the page cache (root): the run's cgroup is then charged for every file page it reads,
    the model files included, instead of finding them cached on another cgroup's account."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("1\n")
    except OSError as exc:
        print(f"could not drop the page cache ({exc}); file pages read before are not charged to the run",
              file=sys.stderr)


def _run_in(group: MemoryCgroup, files: dict[str, Path], limit: int, cache: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--model", str(files["model"]), "--mmproj", str(files["mmproj"]),
               "--photo", str(files["photo"]), "--video", str(files["video"]),
               "--ram-budget", "" if args.probe_budget else str(limit)]
    command += ["--threads", str(args.threads)] if args.threads else []
    command += ["--vision-weights", args.vision_weights] if args.vision_weights else []
    env = env_for_child({"GGUF_MCV_CACHE": str(cache), "GGUF_MCV_NO_PROBE": "1"})
    if args.drop_caches:
        _drop_page_cache()
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, preexec_fn=group.join,
                              timeout=args.timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", _text(exc.stdout), _text(exc.stderr)
    wall = time.perf_counter() - start
    stages = {}
    for line in out.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            stages[record["stage"]] = record
    return {"limit": limit, "exit": 137 if code == -signal.SIGKILL else code, "wall_s": wall, "stages": stages,
            "cgroup": f"v{group.version}", "cgroup_peak": group.peak(), "kernel_peak": group.kernel_peak(),
            "oom_kills": group.oom_kills(),
            "stderr_tail": err[-1500:] if code not in (0, REFUSED) else ""}


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:,.0f} MiB"


def _s(stage: dict[str, Any] | None) -> str:
    return "–" if not stage or "seconds" not in stage else f"{stage['seconds']:.1f}"


def row(preset: str, run: str, r: dict[str, Any]) -> str:
    """One Markdown table row."""
    st = r["stages"]
    plan, last = st.get("plan", {}), next((st[k] for k in ("video", "photo", "loaded", "refused", "plan", "start")
                                           if k in st), {})
    hwm = last.get("VmHWM")
    ratio = f" ({hwm / plan['peak_rss'] - 1:+.0%})" if hwm and plan.get("peak_rss") and "loaded" in st else ""
    verdict = ("refused (NoQuantFitsError)" if "refused" in st else "OOM-killed" if r["exit"] == 137
               else "answered" if r["exit"] == 0 else f"failed ({r['exit']})")
    shrunk = f"; shrunk {', '.join(plan['shrunk'])}" if plan.get("shrunk") else ""
    settings = f"n_ctx {plan['n_ctx']}, {plan['vision_backend']}{shrunk}" if plan else ""
    kills = "–" if r["oom_kills"] is None else r["oom_kills"]
    return (f"| {preset} | {_gb(r['limit'])} | {run} | {verdict} | {kills} | {_mb(plan.get('budget'))} "
            f"| {_mb(plan.get('needed'))} / {_mb(plan.get('peak_rss'))} | {_mb(hwm)}{ratio} | {_mb(r['cgroup_peak'])} "
            f"| {_mb(r.get('kernel_peak'))} "
            f"| {_s(st.get('loaded'))} | {_s(st.get('photo'))} | {_s(st.get('video'))} | {r['wall_s']:.0f} "
            f"| {settings} |")


def _gb(n: int) -> str:
    return f"{n / 1e9:g} GB"


HEADER = ("| preset | limit | run | outcome | OOM kills | budget | plan: needs / peak RSS | process peak RSS (vs plan) "
          "| cgroup peak | kernel peak | load s | photo s | video s | wall s | planned |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = options.parser(__doc__, quant="Q4_0", threads=None)
    ap.add_argument("preset", nargs="?", help="tools/make_test_model.py preset, e.g. 4.6-bench or bench (2.6)")
    ap.add_argument("--limit", nargs="+", default=["1.4GB"], help="memory limits (budgets), e.g. 1.4GB 3GB 7GB")
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gguf_mcv_edge",
                    help="folder for the preset's build, reused across calls")
    ap.add_argument("--probe-budget", action="store_true",
                    help="let load() take its budget from the probe (the cgroup limit less a reserve) "
                         "instead of ram_budget=LIMIT")
    ap.add_argument("--same-cgroup", action="store_true",
                    help="run the first and the second run in one cgroup, as two runs in one container: the "
                         "first run's page cache stays charged when the second probes (the model files are "
                         "evicted from the page cache before the first, so the cgroup is charged for them)")
    ap.add_argument("--cache", type=Path,
                    help="use (and keep) this gguf_mcv cache folder instead of a fresh empty one per limit; a run "
                         "is a 'first' run only while the folder is empty, else 'cached' (e.g. to measure the "
                         "steady state where a first run is killed)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    ap.add_argument("--drop-caches", action="store_true",
                    help="empty the page cache before each run (root), so the cgroup is charged for the model "
                         "files' pages too")
    ap.add_argument("--vision-weights", choices=("packed", "mapped"),
                    help="load()'s vision_weights (default: left to the plan)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("model", "mmproj", "photo", "video", "ram-budget"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    if not args.preset:
        ap.error("name a preset")
    from bench.models import build

    from gguf_mcv.testing.synthetic import PRESETS
    from gguf_mcv.units import parse_size

    if args.preset not in PRESETS:
        ap.error(f"unknown preset {args.preset!r}; one of {', '.join(sorted(PRESETS))}")
    limits = [parse_size(x) for x in args.limit]
    try:
        MemoryCgroup.make(limits[0], prefix="gguf_mcv_edge").remove()
    except OSError as exc:
        print(f"skipped: no memory cgroup can be made here ({exc}); this benchmark needs root and a "
              "cgroup v1 or v2 memory controller.", file=sys.stderr)
        return 0
    folder = args.models / args.preset
    built = build(folder, args.preset, quants=[args.quant])
    files = {"model": built.quants[args.quant], "mmproj": built.mmproj}
    inputs = args.models / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    files["photo"] = inputs / "photo-12mp.jpg" if (inputs / "photo-12mp.jpg").exists() else images.detailed_photo(
        inputs / "photo-12mp.jpg", PHOTO_SIZE)
    files["video"] = inputs / "clip-720p.avi" if (inputs / "clip-720p.avi").exists() else images.write_video(
        inputs / "clip-720p.avi", seconds=20, scene_cut=False, clock=False, sensor_noise=False)
    results = []
    print(HEADER, flush=True)
    for limit in limits:
        cache = args.cache or Path(tempfile.mkdtemp(prefix="gguf_mcv_edge_cache_"))
        cache.mkdir(parents=True, exist_ok=True)
        group = MemoryCgroup.make(limit, prefix="gguf_mcv_edge") if args.same_cgroup else None
        try:
            if group is not None:
                _evict([files["model"], files["mmproj"]])
            for _ in range(2):
                run = "cached" if any(cache.iterdir()) else "first"
                r = measure(files, limit, cache, args, group)
                results.append({"preset": args.preset, "run": run, "same_cgroup": group is not None, **r})
                print(row(args.preset, run, r), flush=True)
                if r["stderr_tail"]:
                    print(f"<!-- stderr: {r['stderr_tail'][-400:]!r} -->", flush=True)
                # after every run: an interrupted benchmark keeps what it measured
                record.write(args.json, "bench_edge", results, args)
        finally:
            if group is not None:
                group.remove()
            if args.cache is None:
                shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
