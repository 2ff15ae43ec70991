"""From command-line flags to a loaded model: load() keywords, local files, the embedding cache, sampling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def load_model(args: argparse.Namespace):
    from ..loader import load  # lazy: per command

    model = load(**load_kwargs(args), embed_cache=embed_cache(args))
    if args.verbose or (getattr(args, "vision_backend", "auto") == "auto" and model.info.vision_backend == "llama.cpp"):
        print(f"vision encoder: {model.info.vision_backend} ({model.info.vision_backend_reason})", file=sys.stderr)
    return model


def checked_load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`load_kwargs`, checked as ``load()`` checks them (:func:`gguf_mcv.loader.check_load`),
    for a command that does more before it loads (or loads in another process)."""
    from ..loader import check_load  # lazy: per command

    kwargs = load_kwargs(args)
    check_load(**kwargs)
    return kwargs


def load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``load()``'s keywords for MODEL and the model options (plain values: they travel to Ray workers)."""
    gpu = args.gpu_layers if args.gpu_layers == "auto" else int_arg(args.gpu_layers, "--gpu-layers")
    common: dict[str, Any] = dict(n_ctx=args.ctx, n_threads=args.threads, n_gpu_layers=gpu,
                                  vision_gpu=args.vision_gpu, kv_cache_type=args.kv,
                                  vision_backend=getattr(args, "vision_backend", "auto"), verbose=args.verbose,
                                  vision_weights=getattr(args, "vision_weights", None),
                                  min_tokens_per_s=getattr(args, "min_tokens_per_s", None),
                                  max_first_answer_s=getattr(args, "max_first_answer_s", None))
    parallel = getattr(args, "parallel", "1")
    common["parallel"] = parallel if parallel == "auto" else int_arg(parallel, "--parallel")
    local = local_files(args)
    if local is not None:
        return dict(model_path=str(local[0].resolve()), mmproj_path=str(local[1].resolve()),
                    ram_budget=args.ram, **common)
    return dict(model=args.model, quant=args.quant, ram_budget=args.ram, **common)


def local_files(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(model, mmproj) when MODEL names a local .gguf file (or --mmproj was given), else None."""
    local = Path(args.model)
    if not (args.model.endswith(".gguf") or args.mmproj):
        return None
    if not local.is_file():
        raise ConfigError(f"Model file {local} does not exist.")
    return local, Path(args.mmproj) if args.mmproj else find_mmproj(local)


def embed_cache(args: argparse.Namespace):
    """The embedding cache the command's options ask for: a disk tier unless --no-disk-cache
    (None for commands without those options: the model's own, in memory)."""
    from ..units import parse_size  # lazy: per command
    from ..vision.embed_cache import EmbeddingCache, default_disk_dir  # lazy: per command

    if not hasattr(args, "no_disk_cache"):
        return None
    if args.no_disk_cache:
        if args.cache_dir is not None:
            raise ConfigError("Give --cache-dir or --no-disk-cache, not both.")
        return EmbeddingCache()
    folder = Path(args.cache_dir).expanduser() if args.cache_dir else default_disk_dir()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--cache-dir {folder} is a file, not a folder: name a folder (it is created).")
    return EmbeddingCache(disk_dir=folder, max_disk_bytes=parse_size(args.cache_size))


def find_mmproj(model: Path) -> Path:
    found = sorted(p for p in model.parent.glob("*.gguf") if "mmproj" in p.name.lower())
    if len(found) != 1:
        raise ConfigError(f"Pass --mmproj: found {len(found)} mmproj files next to {model}.")
    return found[0]


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        out["temperature"] = args.temperature
    if args.seed is not None:
        out["seed"] = args.seed
    return out


def int_arg(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} takes an integer or 'auto', not {text!r}.") from None

