#!/usr/bin/env python3
"""Weight formats for the ONNX vision encoder: size, memory, speed and fidelity of each.

Converts an mmproj (``tools/make_test_model.py --preset bench`` / ``--preset 4.6-bench``) into
the fp32 graph (as the cache does: rounding as ggml does) and three quantized graphs, then for
each quantized graph, in a fresh process: the external data file's size, what its session adds
to the process (``RssAnon`` / ``RssFile`` from ``/proc/self/status``, with ONNX Runtime's
prepacking on and with ``session.disable_prepacking``), the median time of one 448-px slice
(``--runs`` after a warm-up, ``--threads`` threads; also as busy time, process CPU ms per thread, which a
loaded machine distorts less) and the mean per-token cosine of its
embeddings against the fp32 graph's (run stage by stage) on the validation images (worst image):

* ``int8-tower``: only the SigLIP blocks' MatMuls int8 (before this change; merger/resampler fp32);
* ``int8``: every MatMul int8 (DynamicQuantizeMatMul), what the cache now converts;
* ``int4``: the blocks' MatMuls 4-bit MatMulNBits (blocks of 32, accuracy_level 4: int8
  compute), the merger's and resampler's int8.

    python tools/bench_onnx_weights.py /tmp/bench/mmproj-model-f16.gguf --threads 2 --runs 3
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench import fresh, memory, options, record

VARIANTS = {"int8-tower": {"int8": True, "block_bits": 8}, "int8": {"int8": True, "block_bits": 8},
            "int4": {"int8": True, "block_bits": 4}}


def _status(key: str) -> int:
    return memory.status().get(key, 0)


def convert(mmproj: Path, folder: Path) -> None:
    import onnx

    from gguf_mcv.vision import onnx_graph
    from gguf_mcv.vision.onnx_graph import Weights, build_model

    weights = Weights(mmproj)
    jobs = {"fp32": {"ggml": True}, **{k: {"fold": True, **v} for k, v in VARIANTS.items()}}
    for name, kw in jobs.items():
        path = folder / f"{name}.onnx"
        if name == "int8-tower":  # the earlier rule: only the blocks' MatMuls quantized
            original = onnx_graph._Builder.matmul_in_out

            def tower_only(self, x, w, b, hint, rnd=None, _orig=original):
                if hint.startswith("v.blk."):
                    return _orig(self, x, w, b, hint, rnd)
                self.int8, out = False, None
                try:
                    out = _orig(self, x, w, b, hint, rnd)
                finally:
                    self.int8 = True
                return out

            onnx_graph._Builder.matmul_in_out = tower_only
            try:
                model, _ = build_model(weights, external=path.with_name(path.name + ".data"), **kw)
            finally:
                onnx_graph._Builder.matmul_in_out = original
        else:
            model, _ = build_model(weights, external=path.with_name(path.name + ".data"), **kw)
        onnx.save_model(model, str(path))


def measure(mmproj: str, folder: str, variant: str, threads: int, runs: int, no_prepack: bool) -> dict:
    """One variant's session memory, speed and cosine against fp32 (run in a fresh process)."""
    import onnxruntime as ort

    from gguf_mcv.vision.onnx_graph import Weights
    from gguf_mcv.vision.onnx_vision import OnnxEncoder, token_cosines, validation_images

    projector = Weights(mmproj).projector()
    images = validation_images()
    reference = np.load(Path(folder) / "reference.npy")
    if no_prepack:
        original = ort.SessionOptions.__init__

        def no_prepack(self, *a, **kw):
            original(self, *a, **kw)
            self.add_session_config_entry("session.disable_prepacking", "1")

        ort.SessionOptions.__init__ = no_prepack
    anon, file_ = _status("RssAnon"), _status("RssFile")
    encoder = OnnxEncoder(Path(folder) / f"{variant}.onnx", projector, n_threads=threads)
    session = {"anon": _status("RssAnon") - anon, "file": _status("RssFile") - file_}
    outs = [encoder.encode_rgb(rgb, 0) for rgb in images]
    cos = min(float(token_cosines(r, o).mean()) for r, o in zip(reference, outs, strict=True))
    times, busy = [], []
    rng = np.random.default_rng(0)
    for _ in range(runs):
        rgb = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
        start, cpu = time.perf_counter(), time.process_time()
        encoder.encode_rgb(rgb, 0)
        times.append((time.perf_counter() - start) * 1000)
        busy.append((time.process_time() - cpu) * 1000 / threads)  # CPU ms per thread: less load-bound
    return {"session": session, "cosine": cos, "ms": times, "median_ms": statistics.median(times),
            "busy_ms": statistics.median(busy), "peak": _status("VmHWM")}


def main() -> None:
    ap = options.parser(__doc__, quant=options.OMIT)
    ap.add_argument("mmproj")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from gguf_mcv.vision.mtmd_preprocess import slice_pixels
    from gguf_mcv.vision.onnx_graph import Weights, graph_inputs
    from gguf_mcv.vision.onnx_vision import _params, run_in_stages, validation_images

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        convert(Path(args.mmproj), folder)
        print(f"converted in {time.perf_counter() - start:.0f} s", flush=True)
        projector = Weights(args.mmproj).projector()
        feeds = []
        for rgb in validation_images():
            px = slice_pixels(rgb, _params(projector))[0]
            h, w = px.shape[1] // projector.patch_size, px.shape[2] // projector.patch_size
            feeds.append({"pixels": px[None], **graph_inputs(projector, h, w)})
        np.save(folder / "reference.npy", np.stack([o[0] for o in run_in_stages(folder / "fp32.onnx", feeds)]))
        rows = {}
        for name in VARIANTS:
            size = (folder / f"{name}.onnx.data").stat().st_size
            for prepack in (True, False):
                r = fresh.call("bench_onnx_weights:measure", {
                    "mmproj": args.mmproj, "folder": tmp, "variant": name, "threads": args.threads,
                    "runs": args.runs, "no_prepack": not prepack}, timeout=3600).checked()
                rows[(name, prepack)] = r
                print(f"{name} prepack={prepack}: data {size / 2**20:.1f} MiB, session anon "
                      f"{r['session']['anon'] / 2**20:.1f} MiB file {r['session']['file'] / 2**20:.1f} MiB, "
                      f"{r['median_ms']:.0f} ms/slice {[round(t) for t in r['ms']]} "
                      f"(busy {r.get('busy_ms', 0):.0f}), cosine vs fp32 {r['cosine']:.5f}",
                      flush=True)
        found = {f"{k[0]}:{'prepack' if k[1] else 'no-prepack'}": v for k, v in rows.items()}
        print(json.dumps(found))
        record.write(args.json, "bench_onnx_weights", found, args)


if __name__ == "__main__":
    main()
