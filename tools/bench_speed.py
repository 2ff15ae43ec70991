#!/usr/bin/env python3
"""Predicted vs measured speed on this machine, for every quant of a generated ladder.

For each quant: the speed probe runs (:func:`gguf_mcv.runtime.speed_probe.measure`), then the
quant is loaded and timed the way the probe times its own models -- a text prompt's
prefill and greedy decoding -- and the speed model's predictions from that probe (with
the file's own weight types, read from its header) are printed beside the measurements.
Then one 448-pixel slice through the ladder's vision tower with each encoder (libmtmd,
ONNX fp32 and int8), against the last probe's predictions. Probe and measurement run
back to back and both count wall time (:func:`gguf_mcv.runtime.speed_probe.clock`), so run it on a
quiet machine: on a machine shared with other work both are slowed, unevenly. Then the model's
predictions for boards from their
published figures (labelled predictions: nothing was run on them).

    python tools/make_test_model.py --preset bench --out /tmp/bench-speed
    python tools/bench_speed.py --ladder /tmp/bench-speed --threads 1
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench import options, record

from gguf_mcv.models.headers import read_projector_header, read_tensors, read_text_header, tensor_list
from gguf_mcv.models.quants import classify_gguf, quality_rank
from gguf_mcv.planning import speed
from gguf_mcv.runtime import speed_probe

# Published figures (peak DRAM bandwidth, cores x clock x FP32 FLOPs per cycle per core):
# - Raspberry Pi 5: LPDDR4X-4267 on a 32-bit bus = 17.1 GB/s; 4x Cortex-A76 at 2.4 GHz,
#   two 128-bit NEON FMA pipes = 16 FP32 FLOP/cycle/core (Raspberry Pi 5 product brief;
#   Arm Cortex-A76 software optimization guide).
# - Raspberry Pi 4: LPDDR4-3200 on a 32-bit bus = 12.8 GB/s; 4x Cortex-A72 at 1.8 GHz
#   (1.5 GHz on early boards), 8 FP32 FLOP/cycle/core (one 128-bit FMA per cycle issue
#   in practice on A72; Raspberry Pi 4 product brief).
# - Jetson Orin Nano 8 GB (CPU only here): LPDDR5 128-bit = 68 GB/s; 6x Cortex-A78AE at
#   1.5 GHz, 16 FP32 FLOP/cycle/core (NVIDIA Jetson Orin Nano series data sheet).
BOARDS = {
    "Raspberry Pi 5 (4 threads)": dict(bandwidth=17.1e9, cores=4, ghz=2.4, flop_per_cycle=16),
    "Raspberry Pi 4 (4 threads)": dict(bandwidth=12.8e9, cores=4, ghz=1.8, flop_per_cycle=8),
    "Jetson Orin Nano 8GB, CPU (6 threads)": dict(bandwidth=68e9, cores=6, ghz=1.5, flop_per_cycle=16),
}
#: Share of the published peak bandwidth a streaming read reaches on these boards' LPDDR
#: (STREAM-style figures are typically 50-70 % of peak on such SoCs).
BOARD_BANDWIDTH_SHARE = 0.6


def measure_quant(path: Path, mmproj: Path, threads: int) -> dict[str, float]:
    """Seconds for a 280-token prompt and each of 32 greedy tokens on ``path`` (libmtmd
    holds a stand-in of ``mmproj``: the text timings need no vision tower)."""
    from gguf_mcv.vision.mmproj_standin import write_standin

    standin = write_standin(mmproj, Path(tempfile.mkdtemp(prefix="bench-speed-")) / "standin.gguf")
    try:
        with speed_probe.open_engine(path, standin, threads) as engine:
            return speed_probe._time_text(engine, threads)
    finally:
        shutil.rmtree(standin.parent, ignore_errors=True)


def measure_vision(model: Path, mmproj: Path, threads: int) -> dict[str, float]:
    """Seconds (the faster of two) per 448-pixel slice of ``mmproj``'s tower: libmtmd (F16), then each ONNX
    variant (converted once into the cache, as ``load`` does)."""
    import numpy as np

    from gguf_mcv.runtime.engine import file_identity
    from gguf_mcv.vision import onnx_vision
    from gguf_mcv.vision.mtmd_preprocess import slice_pixels

    with speed_probe.open_engine(model, mmproj, threads) as engine:
        out = {"llama.cpp": speed_probe._time_slice(engine, threads)}
    converted = onnx_vision.prepare(mmproj, file_identity(mmproj), progress=onnx_vision.progress_bar())
    rgb = np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    for variant in onnx_vision.VARIANTS:
        encoder = onnx_vision.OnnxEncoder(converted.path(variant), converted.projector, n_threads=threads)
        pixels = slice_pixels(rgb, encoder.params)[0]
        encoder.encode_pixels(pixels)
        runs = []
        for _ in range(2):
            start = speed_probe.clock()
            encoder.encode_pixels(pixels)
            runs.append(speed_probe.clock() - start)
        out[f"onnx-{variant}"] = min(runs)
        del encoder
    return out


def board_rates(here: speed.Rates, here_peak_flops: float, board: dict) -> speed.Rates:
    """A board's rates: its published bandwidth x BOARD_BANDWIDTH_SHARE; the arithmetic rates
    (every type and backend) scaled from this machine's measured ones by the ratio of peak
    FP32 FLOP/s, the fixed per-token costs by the ratio of one core's."""
    peak = board["cores"] * board["ghz"] * 1e9 * board["flop_per_cycle"]
    ratio = peak / here_peak_flops
    core_ratio = (here_peak_flops / here.threads) / (peak / board["cores"])
    scaled = speed.scaled(here, matvec=ratio, prefill_flops=ratio, vision_flops=ratio)
    return replace(scaled, bandwidth=board["bandwidth"] * BOARD_BANDWIDTH_SHARE, threads=board["cores"],
                   source="published figures", token_overhead_s=min(0.5, here.token_overhead_s * core_ratio),
                   layer_overhead_s=min(0.5, here.layer_overhead_s * core_ratio))


def main(argv: list[str] | None = None) -> int:
    ap = options.parser(__doc__, ladder=None, quant=options.OMIT, threads=1)
    ap.add_argument("--quants", help="comma-separated (default: every quant in the folder)")
    ap.add_argument("--no-vision", action="store_true", help="skip the per-slice encoder timings")
    ap.add_argument("--ghz", type=float, default=None,
                    help="this CPU's clock, for scaling to boards (default: from /proc/cpuinfo)")
    ap.add_argument("--flop-per-cycle", type=int, default=32, help="this CPU's FP32 FLOP/cycle/core (AVX-512: 32)")
    ap.add_argument("--boards-from", type=Path, metavar="JSON",
                    help="only the board predictions, from the last probe in a --json file of an earlier run")
    args = ap.parse_args(argv)
    if args.boards_from:
        data = json.loads(args.boards_from.read_text())
        data = data.get("results", data)  # a record, or the older layout
        rates = speed.Rates(**data["rows"][-1]["rates"])
        print_boards(rates, args.ghz or _cpu_ghz(), args.flop_per_cycle)
        return 0

    mmproj = next(args.ladder.glob("mmproj*.gguf"))
    files = {}
    for p in args.ladder.glob("*.gguf"):
        info = classify_gguf(p.name)
        if info is not None and not info.is_mmproj and info.quant and info.quant not in ("F16", "BF16", "F32"):
            files[info.quant] = p
    wanted = args.quants.split(",") if args.quants else sorted(files, key=quality_rank)
    vision = read_projector_header(mmproj).shape
    rows, last_rates = [], None
    for quant in wanted:
        path = files[quant]
        start = time.perf_counter()
        rates = speed_probe.measure(args.threads)
        probe_s = time.perf_counter() - start
        m = measure_quant(path, mmproj, args.threads)
        header = read_text_header(path)
        text, size = header.shape, header.size
        weights = speed.weight_profile(size, text, quant, tensor_list(read_tensors(path)))
        pred = {
            "decode_tok_s": 1 / speed.decode_seconds(size, text, quant, rates, n_past=int(m["n_past"]),
                                                     weights=weights),
            "prefill_tok_s": m["prefill_tokens"] / speed.prefill_seconds(int(m["prefill_tokens"]), text, rates,
                                                                         weights=weights),
        }
        meas = {"decode_tok_s": 1 / m["token_s"], "prefill_tok_s": m["prefill_tokens"] / m["prefill_s"]}
        row = {"quant": quant, "file_bytes": size, "probe_wall_s": probe_s, "predicted": pred, "measured": meas,
               "error": {k: pred[k] / meas[k] - 1 for k in pred}, "rates": rates.to_dict()}
        rows.append(row)
        last_rates = rates
        print(f"{quant:<7} decode {pred['decode_tok_s']:6.1f} / {meas['decode_tok_s']:6.1f} tok/s "
              f"({row['error']['decode_tok_s']:+.0%})  prefill {pred['prefill_tok_s']:6.0f} / "
              f"{meas['prefill_tok_s']:6.0f} tok/s ({row['error']['prefill_tok_s']:+.0%})  "
              f"[probe {probe_s:.1f} s wall]", flush=True)
    slices = {}
    if last_rates is not None and not args.no_vision:
        measured = measure_vision(files[wanted[0]], mmproj, args.threads)
        width = read_text_header(files[wanted[0]]).shape.n_embd
        for backend, seconds in measured.items():
            predicted = speed.encode_seconds(vision, width, last_rates, backend=backend)
            slices[backend] = {"predicted_s": predicted, "measured_s": seconds, "error": predicted / seconds - 1}
            print(f"slice {backend:<10} {predicted:6.2f} / {seconds:6.2f} s ({predicted / seconds - 1:+.0%})",
                  flush=True)
    boards = print_boards(last_rates, args.ghz or _cpu_ghz(), args.flop_per_cycle) if last_rates else {}
    record.write(args.json, "bench_speed", {"rows": rows, "slices": slices, "boards": boards}, args)
    return 0


def print_boards(rates: speed.Rates, ghz: float, flop_per_cycle: int) -> dict:
    """Print (and return) predictions for the catalog's MiniCPM-V 4.6 and 2.6 at Q4_K_M on each board."""
    from gguf_mcv.models.catalog import load_catalog

    here_peak = rates.threads * ghz * 1e9 * flop_per_cycle
    out: dict = {}
    for name, board in BOARDS.items():
        r = board_rates(rates, here_peak, board)
        for model in ("minicpm-v-4.6", "minicpm-v-2.6"):
            entry = load_catalog().get(model)
            q = entry.quants["Q4_K_M"]
            p = speed.predict(model_size=q.size, text=entry.arch, quant="Q4_K_M", vision=entry.vision, rates=r,
                              vision_backend="onnx-int8" if "onnx-int8" in r.vision_by_backend else None)
            out.setdefault(name, {})[model] = p.to_dict()
            print(f"PREDICTION {name:<38} {model} Q4_K_M: decode {p.decode_tokens_per_s:5.1f} tok/s, slice "
                  f"{p.encode_s_per_slice:5.1f} s, photo first answer {p.first_answer_s:5.0f} s "
                  f"({p.photo_slices} passes), 16-frame video {p.video_first_answer_s:5.0f} s")
    return out


def _cpu_ghz() -> float:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1000
    except (OSError, ValueError):
        pass
    return 3.0


if __name__ == "__main__":
    sys.exit(main())
