#!/usr/bin/env python3
"""Soak test: one Model answers many image questions; watch memory, file descriptors, threads.

    python tools/soak.py                                  # 500 calls on the tiny synthetic model
    python tools/soak.py --calls 60 --model bench --detail low --report-every 10
    python tools/soak.py --model PATH.gguf --mmproj MMPROJ.gguf --json soak.json

The workload is what an unattended camera script does all day, plus the awkward parts:
questions about new images (fresh random pixels) and about images seen before (a small
pool, so the embedding cache and KV-cache reuse are exercised, sometimes twice in a row),
streamed and not, some streams closed after a piece or two, a chat with follow-ups now
and then, a short video now and then, and a broken image now and then (its ``MediaError``
is caught). Inputs arrive as numpy arrays, PNG bytes, JPEG files and PIL images.

Every ``--report-every`` calls it prints resident memory (RSS, and its anonymous part),
open file descriptors, threads and the embedding cache's size; at the end the drift from
call ``--baseline`` (default 50, after warm-up) to the last call. The embedding cache is
bounded (LRU by bytes): with ever-new images memory grows until it is full, so the soak
uses a small one (``--cache-mb``, default 4) that is full long before the baseline, and
reports the drift with the cache's own growth subtracted too. A leak is growth beyond
what the bounded caches explain. Target: under 50 MB from call 50 to call 500, no growth
in file descriptors or threads.

Exit status 1 when a call failed unexpectedly (anything but the planned MediaErrors).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from bench import images, memory, models, options, record

import gguf_mcv

MB = 2**20
BENCH_DIR = Path("/tmp/bench")
POOL_SIZE = 8


# --- measuring ----------------------------------------------------------------------------------------


@dataclass
class Sample:
    """The process's resources after ``call`` calls."""

    call: int
    rss_mb: float
    anon_mb: float | None
    fds: int
    threads: int
    cache_mb: float
    cache_items: int
    seconds: float


def _anon_mb() -> float | None:
    """RssAnon (Linux): RSS without file-backed pages such as the memory-mapped weights."""
    anon = memory.status().get("RssAnon")
    return None if anon is None else anon / MB


def sample(call: int, cache: gguf_mcv.EmbeddingCache, start: float) -> Sample:
    import psutil

    gc.collect()  # garbage not yet collected is not a leak
    proc = psutil.Process()
    return Sample(call=call, rss_mb=proc.memory_info().rss / MB, anon_mb=_anon_mb(),
                  fds=proc.num_fds() if hasattr(proc, "num_fds") else -1,
                  threads=proc.num_threads(), cache_mb=cache.nbytes / MB, cache_items=len(cache),
                  seconds=time.perf_counter() - start)


# --- inputs ---------------------------------------------------------------------------------------------


class Inputs:
    """Random images in the four input types the API takes, and a few broken ones."""

    def __init__(self, rng: np.random.Generator, folder: Path, max_side: int) -> None:
        self.rng = rng
        self.folder = folder
        self.max_side = max_side
        self.pool = [self.pixels() for _ in range(POOL_SIZE)]
        self.video = self._write_video()
        self._n = 0

    def pixels(self) -> np.ndarray:
        """Fresh random pixels: mostly one vision slice, one in ten larger (sliced)."""
        if self.rng.random() < 0.1:
            w, h = int(self.rng.integers(500, 900)), int(self.rng.integers(400, 700))
        else:
            w, h = int(self.rng.integers(32, 449)), int(self.rng.integers(32, 449))
        w, h = min(w, self.max_side), min(h, self.max_side)
        return self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)

    def as_input(self, rgb: np.ndarray) -> Any:
        """``rgb`` as a numpy array, PNG bytes, a JPEG file path or a PIL image."""
        import PIL.Image

        kind = int(self.rng.integers(0, 4))
        if kind == 0:
            return rgb
        pil = PIL.Image.fromarray(rgb)
        if kind == 1:
            return images.encoded(pil, "PNG", compress_level=1)
        if kind == 2:
            self._n += 1
            path = self.folder / f"frame{self._n % 16}.jpg"  # reused names: the folder stays small
            pil.save(path, "JPEG", quality=90)
            return str(path)
        return pil

    def broken(self) -> Any:
        """An input that must raise MediaError."""
        jpeg = images.encoded(self.pool[0], "JPEG")
        choices: list[Any] = [
            jpeg[: len(jpeg) // 2],  # truncated JPEG
            b"",  # empty
            b"not an image at all",
            str(self.folder / "missing.png"),
            np.zeros((4, 4), np.float32),  # wrong dtype
        ]
        return choices[int(self.rng.integers(0, len(choices)))]

    def _write_video(self) -> Path | None:
        """A 3-second, 4 fps MJPG AVI (None if this OpenCV cannot write one)."""
        import cv2

        path = self.folder / "clip.avi"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (96, 64))
        if not writer.isOpened():
            return None
        for i in range(12):
            frame = np.full((64, 96, 3), 40, np.uint8)
            frame[:, (i * 8) % 88:(i * 8) % 88 + 8] = 250
            writer.write(frame)
        writer.release()
        return path


# --- the workload -----------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the calls did."""

    kinds: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    cached_tokens: int = 0
    slices_encoded: int = 0
    slices_from_cache: int = 0
    unexpected: list[str] = field(default_factory=list)


def check_reply(reply: Any, max_tokens: int, tally: Tally) -> None:
    """A finished reply's counts make sense; add them to the tally."""
    u, t = reply.usage, reply.timings
    assert 0 <= u.completion_tokens <= max_tokens, u
    assert 0 <= u.cached_tokens < u.prompt_tokens and u.image_tokens < u.prompt_tokens, u
    tally.completion_tokens += u.completion_tokens
    tally.cached_tokens += u.cached_tokens
    tally.slices_encoded += t.slices_encoded
    tally.slices_from_cache += t.slices_from_cache


class Workload:
    """Chooses and runs the next call(s); every answer is checked."""

    QUESTIONS = ["What is in this picture?", "Describe the colours.", "Is there a person?",
                 "Count the objects.", "What changed?"]

    def __init__(self, model: gguf_mcv.Model, inputs: Inputs, rng: np.random.Generator,
                 max_tokens: int, detail: str) -> None:
        self.model, self.inputs, self.rng = model, inputs, rng
        self.max_tokens, self.detail = max_tokens, detail
        self.tally = Tally()
        self.previous: np.ndarray = inputs.pool[0]

    def question(self) -> str:
        return self.QUESTIONS[int(self.rng.integers(0, len(self.QUESTIONS)))]

    def step(self, call: int) -> int:
        """Run the call(s) due at ``call``; return how many were made."""
        if call % 50 == 17:
            return self._chat()
        if call % 25 == 7:
            return self._broken()
        if call % 40 == 11 and self.inputs.video is not None:
            return self._video()
        return self._image()

    def _image(self) -> int:
        r = self.rng.random()
        if r < 0.45:
            rgb, kind = self.inputs.pixels(), "new"
        elif r < 0.55:
            rgb, kind = self.previous, "same_again"  # a second question about the last frame
        else:
            rgb, kind = self.inputs.pool[int(self.rng.integers(0, POOL_SIZE))], "pool"
        self.previous = rgb
        mode = int(self.rng.integers(0, 3))
        ask = lambda stream: self.model.ask(self.question(), self.inputs.as_input(rgb),  # noqa: E731
                                            stream=stream, max_tokens=self.max_tokens,
                                            detail=self.detail)
        if mode == 0:
            check_reply(ask(False), self.max_tokens, self.tally)
            self.tally.kinds[f"image_{kind}"] += 1
        elif mode == 1:
            stream = ask(True)
            for _ in stream:
                pass
            check_reply(stream.reply, self.max_tokens, self.tally)
            self.tally.kinds[f"image_{kind}_stream"] += 1
        else:
            stream = ask(True)
            for _, _piece in zip(range(int(self.rng.integers(1, 3))), stream, strict=False):
                pass
            stream.close()  # cancelled mid-way: the model must be ready for the next call
            self.tally.kinds[f"image_{kind}_cancelled"] += 1
        return 1

    def _chat(self) -> int:
        chat = self.model.chat(system="Answer briefly.")
        rgb = self.inputs.pixels()
        check_reply(chat.send(self.question(), self.inputs.as_input(rgb), max_tokens=self.max_tokens,
                              detail=self.detail), self.max_tokens, self.tally)
        check_reply(chat.send("And what else?", max_tokens=self.max_tokens), self.max_tokens, self.tally)
        stream = chat.send("Say more.", stream=True, max_tokens=self.max_tokens)
        for _, _piece in zip(range(2), stream, strict=False):
            pass
        stream.close()
        self.tally.kinds["chat_turns"] += 3
        return 3

    def _broken(self) -> int:
        try:
            self.model.ask(self.question(), self.inputs.broken(), max_tokens=self.max_tokens)
        except gguf_mcv.MediaError:
            self.tally.kinds["broken_image_refused"] += 1
        else:
            raise AssertionError("a broken image was answered")
        return 1

    def _video(self) -> int:
        reply = self.model.ask_video(self.question(), str(self.inputs.video), max_frames=4,
                                     max_tokens=self.max_tokens)
        check_reply(reply, self.max_tokens, self.tally)
        assert reply.video is not None and reply.video.used >= 1, reply.video
        self.tally.kinds["video"] += 1
        return 1


# --- driver -------------------------------------------------------------------------------------------------


def model_files(name: str, mmproj: str | None) -> tuple[Path, Path]:
    """The (text model, mmproj) pair for ``--model``: tiny, bench or a path."""
    if name in ("tiny", "bench"):
        folder = (Path(tempfile.gettempdir()) / "gguf_mcv_soak_tiny") if name == "tiny" else BENCH_DIR
        return models.pair(folder, "Q4_K_M", name)
    if mmproj is None:
        raise SystemExit("--model PATH needs --mmproj PATH")
    return Path(name), Path(mmproj)


def summarize(samples: list[Sample], baseline_call: int, tally: Tally) -> dict[str, Any]:
    """Drift from the sample at ``baseline_call`` (or the nearest after it) to the last one."""
    base = next((s for s in samples if s.call >= baseline_call), samples[0])
    last = samples[-1]
    anon = (last.anon_mb - base.anon_mb) if last.anon_mb is not None and base.anon_mb is not None else None
    return {
        "baseline_call": base.call,
        "last_call": last.call,
        "rss_drift_mb": round(last.rss_mb - base.rss_mb, 2),
        "anon_drift_mb": None if anon is None else round(anon, 2),
        "cache_growth_mb": round(last.cache_mb - base.cache_mb, 2),
        "rss_drift_minus_cache_mb": round(last.rss_mb - base.rss_mb - (last.cache_mb - base.cache_mb), 2),
        "fd_growth": last.fds - base.fds,
        "thread_growth": last.threads - base.threads,
        "peak_rss_mb": round(max(s.rss_mb for s in samples), 2),
        "seconds": round(last.seconds, 1),
        "calls": dict(sorted(tally.kinds.items())),
        "completion_tokens": tally.completion_tokens,
        "cached_tokens": tally.cached_tokens,
        "slices_encoded": tally.slices_encoded,
        "slices_from_cache": tally.slices_from_cache,
        "unexpected_errors": tally.unexpected,
    }


def run(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    model_path, mmproj_path = model_files(args.model, args.mmproj)
    cache = gguf_mcv.EmbeddingCache(max_bytes=int(args.cache_mb * MB))
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    model = gguf_mcv.load(model_path=model_path, mmproj_path=mmproj_path, n_ctx=args.n_ctx,
                          n_threads=args.threads, embed_cache=cache)
    samples: list[Sample] = [sample(0, cache, start)]
    out(f"model {model_path.name} + {mmproj_path.name}, {args.calls} calls, cache {args.cache_mb} MiB, "
        f"detail={args.detail}, max_tokens={args.max_tokens}")
    out(f"{'call':>5} {'rss MB':>8} {'anon MB':>8} {'fds':>4} {'thr':>4} {'cache MB':>8} {'items':>5} "
        f"{'s':>7}")

    def report(s: Sample) -> None:
        anon = f"{s.anon_mb:8.1f}" if s.anon_mb is not None else f"{'-':>8}"
        out(f"{s.call:5d} {s.rss_mb:8.1f} {anon} {s.fds:4d} {s.threads:4d} {s.cache_mb:8.2f} "
            f"{s.cache_items:5d} {s.seconds:7.1f}")

    report(samples[0])
    with tempfile.TemporaryDirectory(prefix="gguf_mcv_soak_") as folder, model:
        inputs = Inputs(rng, Path(folder), args.max_side)
        work = Workload(model, inputs, rng, args.max_tokens, args.detail)
        call = 0
        next_report = args.report_every
        while call < args.calls:
            try:
                call += work.step(call + 1)
            except Exception as exc:  # noqa: BLE001 - a soak records failures and keeps going
                call += 1
                work.tally.unexpected.append(f"call {call}: {type(exc).__name__}: {exc}")
                out(f"! call {call}: unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
            if call >= next_report or call >= args.calls:
                samples.append(sample(call, cache, start))
                report(samples[-1])
                next_report = (call // args.report_every + 1) * args.report_every
        summary = summarize(samples, args.baseline, work.tally)
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model_path": str(model_path), "mmproj_path": str(mmproj_path),
              "samples": [asdict(s) for s in samples], "summary": summary}
    s = summary
    out(f"drift call {s['baseline_call']} -> {s['last_call']}: RSS {s['rss_drift_mb']:+.1f} MB "
        f"(anon {s['anon_drift_mb']:+.1f} MB, embedding cache {s['cache_growth_mb']:+.2f} MB), "
        f"fds {s['fd_growth']:+d}, threads {s['thread_growth']:+d}; peak RSS {s['peak_rss_mb']:.0f} MB; "
        f"{s['seconds']:.0f} s")
    out(f"calls: {s['calls']}; slices encoded {s['slices_encoded']}, from cache {s['slices_from_cache']}; "
        f"unexpected errors: {len(s['unexpected_errors'])}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = options.parser(__doc__, quant=options.OMIT, threads=None)
    ap.add_argument("--calls", type=int, default=500, help="calls to make (default: %(default)s)")
    ap.add_argument("--model", default="tiny", help="tiny, bench (/tmp/bench) or a text model path")
    ap.add_argument("--mmproj", default=None, help="the mmproj path, with --model PATH")
    ap.add_argument("--report-every", type=int, default=50,
                    help="calls between samples (default: %(default)s)")
    ap.add_argument("--baseline", type=int, default=50,
                    help="call from which drift is measured, after warm-up (default: %(default)s)")
    ap.add_argument("--cache-mb", type=float, default=4.0,
                    help="embedding cache bound in MiB (default: %(default)s; small so it fills early)")
    ap.add_argument("--detail", choices=("auto", "low", "high"), default="auto", help="image detail")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer length bound (default: %(default)s)")
    ap.add_argument("--max-side", type=int, default=900, help="largest image side (default: %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    record.write(args.json, "soak", result, args)
    return 1 if result["summary"]["unexpected_errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    sys.exit(main())
