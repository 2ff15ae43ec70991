"""``gguf-mcv bench``: measure this machine and compare with the speed model's predictions.

``--json`` writes the benchmarks' record (:mod:`gguf_mcv.testing.bench_record`: command, date,
commit, machine, then the results), as every script under ``tools/`` does."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .loading import load_model


def run_bench(args: argparse.Namespace) -> int:
    from ..selftest import EXAMPLE_IMAGE  # lazy: per command

    image = args.image or str(EXAMPLE_IMAGE)
    with load_model(args) as model:
        chat = model.chat()
        first = chat.send("Describe this picture.", image, detail=args.detail,
                          max_tokens=args.max_tokens, temperature=0)
        follow = chat.send("What colours are in it?", max_tokens=args.max_tokens, temperature=0)
        result = {
            "model": model.info.name, "quant": model.info.quant, "vision_backend": model.info.vision_backend,
            "image_tokens": first.usage.image_tokens, "slices_encoded": first.timings.slices_encoded,
            "first_ttft_s": first.timings.ttft_ms / 1000, "encode_s": first.timings.encode_ms / 1000,
            "follow_up_ttft_s": follow.timings.ttft_ms / 1000,
            "decode_tokens_per_s": first.timings.decode_tokens_per_s,
        }
        result.update(bench_predictions(model.info, first, args))
    if args.json:
        from ..testing.bench_record import record  # lazy: per command

        settings = {"threads": args.threads, "detail": args.detail, "max_tokens": args.max_tokens,
                    "image": str(image)}
        print(json.dumps(record("gguf-mcv bench", result, settings=settings,
                                argv=["gguf-mcv", *sys.argv[1:]]), indent=2))
    else:
        for key, value in result.items():
            print(f"{key:<22} {value:.3f}" if isinstance(value, float) else f"{key:<22} {value}")
    return 0


def bench_predictions(info: Any, first: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The speed model's predictions for what ``run_bench`` just measured, keyed ``predicted_*``."""
    from ..hardware import probe as hardware_probe  # lazy: per command
    from ..models.headers import read_projector_header, read_tensors, read_text_header, tensor_list  # lazy
    from ..planning import speed  # lazy: per command
    from ..resolver import machine_rates  # lazy: per command

    text, projector = read_text_header(info.model_path), read_projector_header(info.mmproj_path)
    weights = speed.weight_profile(text.size, text.shape, info.quant, tensor_list(read_tensors(info.model_path)))
    threads = args.threads or hardware_probe().recommended_threads
    rates = machine_rates(hardware_probe(), False if args.no_probe else None)
    rates = speed.scaled(rates, **{k: threads / rates.threads for k in ("matvec", "prefill_flops", "vision_flops")})
    prompt = first.usage.prompt_tokens
    token = speed.decode_seconds(text.size, text.shape, info.quant, rates, n_past=prompt, weights=weights)
    encode = speed.encode_seconds(projector.shape, text.shape.n_embd, rates, backend=info.vision_backend)
    slices = first.timings.slices_encoded
    prefill = speed.prefill_seconds(prompt, text.shape, rates, weights=weights)
    return {
        "predicted_decode_tokens_per_s": 1 / token,
        "predicted_encode_s": encode * slices,
        "predicted_first_ttft_s": encode * slices + prefill + token,
        "rates_source": rates.source,
    }
