#!/usr/bin/env python3
"""Video: gguf_mcv's frame path vs passing the same frames as images to MiniCPMv26ChatHandler.

On the benchmark-size generated model (real SigLIP-400M vision shape, Qwen2-0.5B-size
text model; tools/make_test_model.py --preset bench) and a 30 s 1280×720 synthetic
video sampled to 16 frames:

* the naive path: the 16 frames as full-resolution images in one message to
  llama-cpp-python's own MiniCPMv26ChatHandler (each 1280×720 frame is sliced:
  overview + 6 slices), time to first token;
* gguf_mcv: ``Model.ask_video(max_frames=16, dedupe=False)`` (each frame one slice),
  time to first token;
* a mostly static video (a few seconds of motion, the rest still): how many of the
  sampled frames dedupe lets through to the encoder.

    python tools/bench_video.py --ladder /tmp/bench --quant Q4_K_M --threads 2
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import PIL.Image


def write_video(path: Path, *, seconds: int = 30, fps: int = 10, size=(1280, 720),
                moving_for: float | None = None) -> Path:
    """A synthetic clip: a drifting background, a moving ball, a scene cut at 2/3.

    ``moving_for`` seconds: after that the picture freezes (a static camera).
    """
    w, h = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    rng = np.random.default_rng(0)
    for i in range(seconds * fps):
        t = min(i / fps, moving_for) if moving_for is not None else i / fps
        frame = np.zeros((h, w, 3), dtype=np.uint8)
        frame[:] = (40 + int(t * 3) % 60, 90, 140) if t < seconds * 2 / 3 else (150, 60, 40)
        x = int(60 + (w - 120) * (t / seconds))
        cv2.circle(frame, (x, h // 2 + int(80 * np.sin(t))), 50, (0, 220, 255), -1)
        cv2.putText(frame, f"{t:5.1f}", (30, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (255, 255, 255), 3)
        noise = rng.integers(-2, 3, frame.shape, dtype=np.int16)  # sensor noise
        writer.write(np.clip(frame.astype(np.int16) + noise, 0, 255).astype(np.uint8))
    writer.release()
    return path


def naive(model: Path, mmproj: Path, frames, args) -> float:
    from llama_cpp.llama_chat_format import MiniCPMv26ChatHandler

    from gguf_mcv import checked_llama

    llm = checked_llama(str(model), n_ctx=args.naive_ctx, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False,
                chat_handler=MiniCPMv26ChatHandler(clip_model_path=str(mmproj), verbose=False))
    parts = []
    for frame in frames:
        buf = io.BytesIO()
        PIL.Image.fromarray(frame.rgb).save(buf, format="PNG")
        parts.append({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    parts.append({"type": "text", "text": "What happens in this video?"})
    start = time.perf_counter()
    for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": parts}],
                                            max_tokens=8, temperature=0.0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):
            break
    ttft = time.perf_counter() - start
    llm.close()
    return ttft


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladder", type=Path, default=Path("/tmp/bench"))
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--naive-ctx", type=int, default=8192, help="n_ctx for the naive path")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import gguf_mcv
    from gguf_mcv.testing import synthetic

    built = synthetic.build(args.ladder, synthetic.BENCH, quants=[args.quant])
    model_path, mmproj = built.quants[args.quant], built.mmproj
    folder = args.ladder / "videos"
    folder.mkdir(exist_ok=True)
    clip = write_video(folder / "moving.avi")
    static = write_video(folder / "static.avi", moving_for=4.0)

    frames = gguf_mcv.sample_frames(clip, max_frames=args.frames, dedupe=False)
    print(f"{len(frames)} frames of {clip.name} ({frames.duration:.0f} s), {args.threads} threads",
          flush=True)
    results: dict = {}
    if not args.skip_naive:
        results["naive_ttft_s"] = naive(model_path, mmproj, [f.image for f in frames], args)
        print(f"  naive (frames as full images, MiniCPMv26ChatHandler): "
              f"{results['naive_ttft_s']:.1f} s", flush=True)
    with gguf_mcv.load(model_path=model_path, mmproj_path=mmproj, n_ctx=4096,
                       n_threads=args.threads) as model:
        reply = model.ask_video("What happens in this video?", clip, max_frames=args.frames,
                                dedupe=False, max_tokens=8, temperature=0)
        results["gguf_mcv_ttft_s"] = reply.timings.ttft_ms / 1000
        results["gguf_mcv_image_tokens"] = reply.usage.image_tokens
        print(f"  gguf_mcv ask_video: {results['gguf_mcv_ttft_s']:.1f} s "
              f"({reply.video.used} frames, {reply.usage.image_tokens} image tokens)", flush=True)
        still = model.ask_video("What happens?", static, max_frames=args.frames, max_tokens=4)
        results["static_sampled"] = still.video.sampled
        results["static_encoded"] = still.video.encoded
        print(f"  mostly static video: {still.video.sampled} sampled, {still.video.dropped} dropped, "
              f"{still.video.encoded} encoded", flush=True)
    if "naive_ttft_s" in results:
        ratio = results["gguf_mcv_ttft_s"] / results["naive_ttft_s"]
        results["ratio"] = ratio
        print(f"\n| measure | value | target |\n| --- | ---: | --- |\n"
              f"| naive TTFT (16 full-resolution frames, MiniCPMv26ChatHandler) | {results['naive_ttft_s']:.1f} s | |\n"
              f"| gguf_mcv ask_video TTFT (16 frames, one slice each) | {results['gguf_mcv_ttft_s']:.1f} s | |\n"
              f"| ratio | {ratio:.3f}× | ≤ 0.25× |\n"
              f"| static video: encoded / sampled | {results['static_encoded']} / {results['static_sampled']} "
              "| ≤ 1/2 |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    ok = results.get("ratio", 0) <= 0.25 and results["static_encoded"] * 2 <= results["static_sampled"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
