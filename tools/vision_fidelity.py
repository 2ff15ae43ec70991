#!/usr/bin/env python3
"""How close the onnx-fp32 vision encoder is to libmtmd, next to libmtmd's own variation.

For each tiny generation (``gguf_mcv.testing.synthetic`` presets, built into ``--out``), on a few
random images (every slice): the embeddings of libmtmd with flash attention off and with one
thread, of the plain fp32 ONNX graph and of the graph that rounds as ggml does (what
``vision_backend="onnx-fp32"`` converts), each against libmtmd's default (flash attention
auto, 2 threads): max and mean absolute difference, worst per-token cosine. Then greedy
answers (``--prompts`` images, 16 tokens, alternating ``detail``) of libmtmd without flash
attention and of onnx-fp32 with either graph, counted identical to libmtmd's default.

    python tools/vision_fidelity.py --out /tmp/fidelity --generations 2.5,2.6,o-2.6,4.0,4.5,4.6

``--time LADDER`` instead times the two fp32 graphs of a bench ladder's mmproj
(``tools/make_test_model.py --preset bench``) on one 448-px slice, 2 threads, alternating,
``--runs`` times each after a warm-up: what rounding as ggml does costs.

    python tools/vision_fidelity.py --out /tmp/fidelity --time /tmp/bench-onnx --runs 3

``--int8`` instead measures what int8 costs in answers: each generation's model (the
tiny presets, or ``--ladder FOLDER:GENERATION`` for a bench ladder's ``--quant`` and
``mmproj-model-f16.gguf``) loaded once with the onnx-fp32 backend (a fresh cache folder under
``--out``), then ``--images`` images (random noise, smooth colour fields, the example photo at
random sizes; ``detail`` alternating low/high) answered greedily (temperature 0, 16 tokens) with
the fp32 graph, the older int8 graph (``int8_scope="blocks"``: tower blocks only,
merger/resampler fp32) and the int8 graph the cache converts now (every MatMul): answers identical
to fp32's (exact text), and the worst per-token cosine against fp32 over every slice encoded.

    python tools/vision_fidelity.py --out /tmp/agree --int8 --generations 2.6,4.6 --images 12
    python tools/vision_fidelity.py --out /tmp/agree --int8 --ladder /tmp/ev/b26:2.6 --images 6
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from bench import options, record

import gguf_mcv
from gguf_mcv.generations import GENERATIONS
from gguf_mcv.models.identity import file_identity
from gguf_mcv.testing import synthetic
from gguf_mcv.vision import onnx_vision
from gguf_mcv.vision.embed_cache import EmbeddingCache
from gguf_mcv.vision.media import Image, load_image
from gguf_mcv.vision.onnx_graph import Weights, build_model
from gguf_mcv.vision.onnx_vision import OnnxEncoder, save_graph, token_cosines

#: generation key -> its catalog entry, for each generation the catalog lists (the registry's own list)
NAMES = {key: g.catalog_names[0] for key, g in GENERATIONS.items() if g.catalog_names and g.onnx_encoder}


def _load(gen: str, files, backend: str = "llama.cpp", **kw):
    return gguf_mcv.load(NAMES[gen], model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj, n_ctx=4096,
                         vision_backend=backend, embed_cache=EmbeddingCache(), **{"n_threads": 2, **kw})


def libmtmd_slices(gen: str, files, images: list[Image], **kw) -> list[np.ndarray]:
    with _load(gen, files, mmproj_precision="as-is", **kw) as model:
        engine, out = model.engine, []
        for image in images:
            with engine.tokenize(engine.marker, [image]) as prompt:
                out += [engine._encode(c, prompt.units[i]).reshape(-1, engine.n_embd)
                        for i, c in prompt.image_chunks()]
        return out


def onnx_slices(files, folder: Path, images: list[Image], ggml: bool, n_slices: list[int]) -> list[np.ndarray]:
    import onnx

    weights = Weights(files.mmproj)
    model, _ = build_model(weights, ggml=ggml)
    path = folder / f"fp32-{'ggml' if ggml else 'plain'}.onnx"
    save_graph(onnx, model, path)
    encoder = OnnxEncoder(path, weights.projector(), n_threads=2)
    return [encoder.encode_rgb(im.rgb, i, im.digest) for im, n in zip(images, n_slices, strict=True) for i in range(n)]


def answers(gen: str, files, jobs, backend: str, ggml: bool = True, **kw) -> list[str]:
    real = onnx_vision.build_model
    # the plain graph for the "plain" row: the backend converts with ggml=True
    onnx_vision.build_model = lambda w, **k: real(w, **{**k, "ggml": ggml and k.get("ggml", False)})
    onnx_vision.CONVERT_IN_CHILD = False  # a child would not see the patch
    try:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["GGUF_MCV_CACHE"] = cache
            with _load(gen, files, backend, **kw) as model:
                return [str(model.ask("Describe.", rgb, max_tokens=16, temperature=0, detail=d)) for rgb, d in jobs]
    finally:
        onnx_vision.build_model = real
        onnx_vision.CONVERT_IN_CHILD = True


def time_graphs(ladder: Path, folder: Path, runs: int) -> None:
    import time

    import onnx

    weights = Weights(ladder / "mmproj-model-f16.gguf")
    encoders = {}
    for ggml in (False, True):
        path = folder / f"bench-fp32-{'ggml' if ggml else 'plain'}.onnx"
        model, _ = build_model(weights, ggml=ggml, external=path.with_name(path.name + ".data"))
        onnx.save_model(model, str(path))
        del model
        encoders[ggml] = OnnxEncoder(path, weights.projector(), n_threads=2)
    rgb = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    times: dict[bool, list[float]] = {False: [], True: []}
    for encoder in encoders.values():
        encoder.encode_rgb(rgb, 0)
    for _ in range(runs):
        for ggml, encoder in encoders.items():
            start = time.perf_counter()
            encoder.encode_rgb(rgb, 0)
            times[ggml].append(time.perf_counter() - start)
    for ggml, t in times.items():
        print(f"fp32 graph, {'ggml roundings' if ggml else 'plain'}: median {np.median(t) * 1000:.0f} ms per slice "
              f"({', '.join(f'{x * 1000:.0f}' for x in t)})")


class _Recording:
    """An engine's vision encoder (:class:`onnx_vision.OnnxVision`) under a name of its own (so its
    embeddings never share a cache key with another graph's) that keeps what it encoded."""

    def __init__(self, inner, name: str, identity: str) -> None:
        self.inner, self.name, self.key_tag = inner, name, f"{identity}+{name}"
        self.seen: dict[tuple[str, int], np.ndarray] = {}

    def encode(self, image: Image, index: int) -> np.ndarray:
        out = self.inner.encode(image, index)
        self.seen[(image.digest, index)] = out
        return out


def agreement_images(n: int, seed: int = 5) -> list[tuple[np.ndarray, str]]:
    """``n`` (image, detail) jobs: random noise, smooth colour fields and the example photo in
    turn, at random sizes (one slice to a grid), detail alternating low/high."""
    rng = np.random.default_rng(seed)
    photo = load_image(onnx_vision.EXAMPLE_IMAGE)
    jobs = []
    for i in range(n):
        w, h = int(rng.integers(200, 1100)), int(rng.integers(200, 1100))
        kind = i % 3
        if kind == 0:
            rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        elif kind == 1:
            rgb = Image(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), "smooth").resized_to(w, h).rgb
        else:
            rgb = photo.resized_to(w, h).rgb
        jobs.append((rgb, "high" if (i // 3) % 2 == 0 else "low"))
    return jobs


def int8_agreement(name: str, text: Path, mmproj: Path, folder: Path, jobs, control: bool = False) -> dict:
    """Greedy answers and embeddings of the fp32 graph, the int8 graph of before (tower blocks
    only) and the int8 graph of now (every MatMul) on ``jobs``; what agrees with fp32. ``control``:
    the fp32 graph answers once more at the end (under a key of its own): identical answers
    show the comparison sees the encoder, not the order of the runs."""
    import dataclasses
    import time

    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix="int8-") as tmp:
        os.environ["GGUF_MCV_CACHE"] = str(Path(tmp) / "cache")
        identity = file_identity(mmproj)
        start = time.perf_counter()
        converted = onnx_vision.prepare(mmproj, identity)  # the library's fp32 and int8 graphs
        before = Path(tmp) / "int8-blocks.onnx"
        model, _ = build_model(Weights(mmproj), fold=True, int8=True, ggml=False, int8_scope="blocks",
                               external=before.with_name(before.name + ".data"))
        onnx.save_model(model, str(before))
        del model
        print(f"{name}: graphs converted in {time.perf_counter() - start:.0f} s", flush=True)
        answers: dict[str, list[str]] = {}
        seen: dict[str, dict] = {}
        with gguf_mcv.load(name, model_path=text, mmproj_path=mmproj, n_ctx=4096, vision_backend="onnx-fp32",
                           embed_cache=EmbeddingCache(), n_threads=2) as m:
            engine = m.engine
            fp32 = engine.encoder  # what the onnx-fp32 backend loaded
            variants = {"fp32": lambda: fp32,
                        "int8-blocks": lambda: onnx_vision.OnnxVision(dataclasses.replace(converted, int8=before),
                                                                      "int8", identity, n_threads=2),
                        "int8": lambda: onnx_vision.OnnxVision(converted, "int8", identity, n_threads=2)}
            if control:
                variants["fp32-again"] = variants["fp32"]
            for variant, make in variants.items():
                start = time.perf_counter()
                enc = _Recording(make(), f"onnx-{variant}", identity)
                # what keys the embedding cache (and kept states): each graph's embeddings its own
                engine.encoder, engine.mmproj_id, engine.vision_backend = enc, enc.key_tag, enc.name
                answers[variant] = [str(m.ask("Describe.", rgb, max_tokens=16, temperature=0, detail=d))
                                    for rgb, d in jobs]
                seen[variant] = enc.seen
                print(f"{name}: {variant} answered in {time.perf_counter() - start:.0f} s", flush=True)
                del enc
    ref = seen["fp32"]
    result = {"images": len(jobs), "slices": len(ref)}
    for variant in ("int8-blocks", "int8"):
        result[variant] = sum(a == b for a, b in zip(answers["fp32"], answers[variant], strict=True))
        result[variant + " cos"] = min(float(token_cosines(ref[k], v).min()) for k, v in seen[variant].items())
    if control:
        result["control"] = sum(a == b for a, b in zip(answers["fp32"], answers["fp32-again"], strict=True))
    result["before == now"] = sum(a == b for a, b in zip(answers["int8-blocks"], answers["int8"], strict=True))
    return result


def run_int8(args) -> list:
    runs = [(gen, None) for gen in args.generations.split(",")] if not args.ladder else \
        [(spec.rsplit(":", 1)[1], Path(spec.rsplit(":", 1)[0])) for spec in args.ladder]
    jobs = agreement_images(args.images)
    rows = []
    for gen, ladder in runs:
        if ladder is None:
            folder = Path(args.out) / gen
            files = synthetic.build(folder, synthetic.PRESETS[gen], ["Q4_K_M"])
            text, mmproj, label = files.quants["Q4_K_M"], files.mmproj, f"{gen} (tiny preset)"
        else:
            folder = Path(args.out) / ladder.name
            text, mmproj = ladder / f"ggml-model-{args.quant}.gguf", ladder / "mmproj-model-f16.gguf"
            label = f"{gen} ({ladder}, {args.quant})"
        r = int8_agreement(NAMES[gen], text, mmproj, folder, jobs, args.control)
        print(f"{label}: {r}", flush=True)
        rows.append((label, r))
    print("\n| preset | images (slices) | identical to fp32: int8 blocks only (before) | int8 every MatMul (now) "
          "| before = now | worst per-token cosine vs fp32: before | now |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, r in rows:
        print(f"| {label} | {r['images']} ({r['slices']}) | {r['int8-blocks']} | {r['int8']} | {r['before == now']} "
              f"| {r['int8-blocks cos']:.5f} | {r['int8 cos']:.5f} |"
              + (f" fp32 twice: {r['control']} identical" if "control" in r else ""))
    return [{"preset": label, **r} for label, r in rows]


def main() -> None:
    ap = options.parser(__doc__, quant="Q4_0", threads=options.OMIT)
    ap.add_argument("--out", required=True, help="folder for the tiny models and graphs")
    ap.add_argument("--generations", default=",".join(NAMES))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--time", help="a bench ladder folder: time the two fp32 graphs instead")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--int8", action="store_true", help="greedy agreement of the int8 graphs (before/now) with fp32")
    ap.add_argument("--images", type=int, default=12, help="--int8: images answered")
    ap.add_argument("--ladder", action="append", help="--int8: FOLDER:GENERATION of a bench ladder (repeatable)")
    ap.add_argument("--control", action="store_true", help="--int8: the fp32 graph answers twice (a control)")
    args = ap.parse_args()
    if args.int8:
        record.write(args.json, "vision_fidelity --int8", run_int8(args), args)
        return
    if args.time:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        time_graphs(Path(args.time), Path(args.out), args.runs)
        return
    print("| generation | vs libmtmd (flash attention auto) | max abs diff | mean abs diff | min cosine |")
    print("| --- | --- | ---: | ---: | ---: |")
    greedy = []
    for gen in args.generations.split(","):
        folder = Path(args.out) / gen
        folder.mkdir(parents=True, exist_ok=True)
        files = synthetic.build(folder, synthetic.PRESETS[gen], ["Q4_K_M"])
        rng = np.random.default_rng(7)
        images = [Image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "random")
                  for w, h in ((300, 200), (1000, 700))]
        ref = libmtmd_slices(gen, files, images)
        n_slices = [1, len(ref) - 1]
        rows = {"libmtmd, flash attention off": libmtmd_slices(gen, files, images, flash_attn=False),
                "libmtmd, 1 thread": libmtmd_slices(gen, files, images, n_threads=1),
                "ONNX fp32, plain": onnx_slices(files, folder, images, False, n_slices),
                "ONNX fp32, ggml's roundings": onnx_slices(files, folder, images, True, n_slices)}
        for name, got in rows.items():
            d = np.concatenate([np.abs(a - b).ravel() for a, b in zip(ref, got, strict=True)])
            cos = min(float(token_cosines(a, b).min()) for a, b in zip(ref, got, strict=True))
            print(f"| {gen} | {name} | {d.max():.1e} | {d.mean():.1e} | {cos:.8f} |", flush=True)
        rng = np.random.default_rng(11)
        sizes = [(int(rng.integers(200, 1100)), int(rng.integers(200, 1100))) for _ in range(args.prompts)]
        jobs = [(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "high" if i % 2 else "low")
                for i, (w, h) in enumerate(sizes)]
        want = answers(gen, files, jobs, "llama.cpp", mmproj_precision="as-is")
        counts = [sum(a == b for a, b in zip(want, got, strict=True)) for got in (
            answers(gen, files, jobs, "llama.cpp", flash_attn=False, mmproj_precision="as-is"),
            answers(gen, files, jobs, "onnx-fp32", ggml=False),
            answers(gen, files, jobs, "onnx-fp32"))]
        greedy.append((gen, counts))
    print(f"\n| generation | greedy answers identical to libmtmd's default, of {args.prompts}: libmtmd without "
          "flash attention | onnx-fp32, plain graph | onnx-fp32, ggml's roundings |")
    print("| --- | ---: | ---: | ---: |")
    for gen, (fa_off, plain, ggml) in greedy:
        print(f"| {gen} | {fa_off} | {plain} | {ggml} |")
    record.write(args.json, "vision_fidelity", {gen: dict(zip(("libmtmd_no_flash_attention", "onnx_fp32_plain",
                                                             "onnx_fp32_ggml_roundings"), counts, strict=True))
                                                for gen, counts in greedy}, args)


if __name__ == "__main__":
    main()
