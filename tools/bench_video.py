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

import sys
import time
from pathlib import Path

from bench import images, models, options, record


def naive(model: Path, mmproj: Path, frames, args) -> float:
    from llama_cpp.llama_chat_format import MiniCPMv26ChatHandler

    from gguf_mcv import checked_llama

    llm = checked_llama(str(model), n_ctx=args.naive_ctx, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False,
                chat_handler=MiniCPMv26ChatHandler(clip_model_path=str(mmproj), verbose=False))
    parts = []
    for frame in frames:
        parts.append({"type": "image_url", "image_url": {"url": images.data_uri(images.encoded(frame.rgb))}})
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
    parser = options.parser(__doc__, ladder=Path("/tmp/bench"))
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--naive-ctx", type=int, default=8192, help="n_ctx for the naive path")
    parser.add_argument("--skip-naive", action="store_true")
    args = parser.parse_args()

    import gguf_mcv

    model_path, mmproj = models.pair(args.ladder, args.quant, "bench")
    folder = args.ladder / "videos"
    folder.mkdir(exist_ok=True)
    clip = images.write_video(folder / "moving.avi")
    static = images.write_video(folder / "static.avi", moving_for=4.0)

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
    record.write(args.json, "bench_video", results, args)
    ok = results.get("ratio", 0) <= 0.25 and results["static_encoded"] * 2 <= results["static_sampled"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
