#!/usr/bin/env python3
"""Decoding a photo no larger than its slices need (JPEG draft mode): what changes.

The bundled example photo stretched to ``--size`` and saved as a JPEG (quality 90) is decoded
two ways for each ``detail``: in full then resized (before), and with ``load_image(fit=...)``
(Pillow's draft mode, then resized). Reported: the decode's peak (``VmHWM`` growth, fresh
process each), the slices' pixels (libmtmd's preprocessing, ``mtmd_preprocess``) as max and
mean absolute difference in 0-255 levels, and with ``--mmproj`` the ONNX encoder's embeddings
of every slice (converted into a temporary cache) as the worst per-token cosine.

    python tools/bench_image_decode.py --size 4000x3000 --mmproj /tmp/bench/mmproj-model-f16.gguf
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from bench import fresh, images, memory, options, record


def decode_peak(path: str, detail: str, how: str) -> int:
    """Bytes of memory decoding ``path`` at ``detail`` took above this process's resident set before
    it, in this process (run in a fresh one): ``full`` decodes the whole picture then resizes it,
    ``draft`` decodes at the detail's size (JPEG draft mode)."""
    from gguf_mcv.vision.media import load_image
    from gguf_mcv.vision.slicing import apply_detail, detail_size

    data = Path(path).read_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    base = memory.status()["VmRSS"]
    if how == "draft":
        load_image(data, fit=lambda w, h: detail_size(w, h, detail=detail))
    else:
        apply_detail(load_image(data), detail=detail)
    return memory.status()["VmHWM"] - base


def main() -> None:
    ap = options.parser(__doc__, quant=options.OMIT)
    ap.add_argument("--size", default="4000x3000")
    ap.add_argument("--mmproj", help="an mmproj to compare embeddings with (its int8 ONNX encoder)")
    ap.add_argument("--details", default="low,auto")
    args = ap.parse_args()
    import PIL.Image

    from gguf_mcv.vision.media import load_image
    from gguf_mcv.vision.mtmd_preprocess import PreprocessParams, slice_pixels
    from gguf_mcv.vision.onnx_vision import EXAMPLE_IMAGE, token_cosines
    from gguf_mcv.vision.slicing import apply_detail, detail_size

    w, h = (int(x) for x in args.size.split("x"))
    data = images.encoded(PIL.Image.open(EXAMPLE_IMAGE).convert("RGB").resize((w, h), PIL.Image.Resampling.BICUBIC),
                          "JPEG", quality=90)
    encoder = None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "photo.jpg")
        with open(path, "wb") as f:
            f.write(data)
        if args.mmproj:
            os.environ["GGUF_MCV_CACHE"] = tmp
            from gguf_mcv.runtime.engine import file_identity
            from gguf_mcv.vision.onnx_vision import OnnxEncoder, prepare

            converted = prepare(args.mmproj, file_identity(args.mmproj))
            encoder = OnnxEncoder(converted.int8, converted.projector, n_threads=args.threads)
        params = encoder.params if encoder else PreprocessParams()
        rows = {}
        for detail in args.details.split(","):
            full = apply_detail(load_image(data), detail=detail)
            drafted = load_image(data, fit=lambda a, b, d=detail: detail_size(a, b, detail=d))
            peaks = {}
            for how in ("full", "draft"):
                run = fresh.call("bench_image_decode:decode_peak", {"path": path, "detail": detail, "how": how})
                peaks[how] = run.checked() / memory.MIB
            a, b = slice_pixels(full.rgb, params), slice_pixels(drafted.rgb, params)
            diffs = [np.abs(x - y) * 127.5 for x, y in zip(a, b, strict=True)]  # normalised by std 0.5: back to levels
            row = {"size": [full.width, full.height], "slices": len(a), "peak_full_MiB": peaks["full"],
                   "peak_draft_MiB": peaks["draft"], "max_abs": float(max(d.max() for d in diffs)),
                   "mean_abs": float(np.mean([d.mean() for d in diffs]))}
            if encoder is not None:
                row["min_token_cosine"] = float(min(
                    token_cosines(encoder.encode_pixels(x), encoder.encode_pixels(y)).min()
                    for x, y in zip(a, b, strict=True)))
            rows[detail] = row
            print(detail, json.dumps(row), flush=True)
    record.write(args.json, "bench_image_decode", rows, args)


if __name__ == "__main__":
    main()
