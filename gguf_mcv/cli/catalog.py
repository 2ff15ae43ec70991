"""``gguf-mcv models``, ``plan`` and ``pull``: the catalog, the plan for this machine, downloads."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..units import format_size
from .loading import local_files
from .printing import native_lines


def run_models(args: argparse.Namespace) -> int:
    from ..models.catalog import load_catalog  # lazy: per command
    from ..models.hub import cached_models  # lazy: per command

    cached = {repo.lower(): (repo, files) for repo, files in cached_models().items()}
    rows: list[dict[str, Any]] = []
    for entry in load_catalog().entries():
        files = cached.pop(entry.repo.lower(), ("", []))[1]
        rows.append({"name": entry.name, "display_name": entry.display_name, "repo": entry.repo,
                     "rank": entry.rank, "thinking": entry.thinking,
                     "quants": {q: f.size for q, f in entry.quants.items()},
                     "cached": [{"file": f, "bytes": n} for f, n in files]})
    others: list[dict[str, Any]] = [{"repo": repo, "cached": [{"file": f, "bytes": n} for f, n in files]}
              for repo, files in cached.values()]
    if args.json:
        print(json.dumps({"catalog": rows, "other_cached": others}, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']:<26} {row['display_name']:<26} {row['repo']}")
        print(f"{'':<26} quants: {', '.join(row['quants'])}")
        for f in row["cached"]:
            print(f"{'':<26} cached: {f['file']} ({format_size(f['bytes'])})")
    for row in others:
        print(f"{'(not in catalog)':<26} {row['repo']}")
        for f in row["cached"]:
            print(f"{'':<26} cached: {f['file']} ({format_size(f['bytes'])})")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from ..planning.planner import check_request  # lazy: per command
    from ..resolver import check_plan, plan, plan_local  # lazy: per command

    limits: dict[str, Any] = dict(detail=args.detail, min_tokens_per_s=args.min_tokens_per_s,
                                  max_first_answer_s=args.max_first_answer_s)
    settings: dict[str, Any] = dict(ram_budget=args.ram, n_ctx=args.ctx, kv_cache_type=args.kv,
                                    vision_backend=args.vision_backend, vision_weights=args.vision_weights, **limits)
    local = local_files(args)
    # every argument before the machine is probed (the speed probe takes seconds to a minute)
    if local is not None:
        check_request(**settings)
    else:
        check_plan(args.model, quant=args.quant, **settings)
    from ..hardware import probe as hardware_probe  # lazy: per command
    from ..resolver import machine_rates  # lazy: per command

    hw = hardware_probe()
    rates = machine_rates(hw, False if args.no_probe else None, refresh=args.reprobe)
    if local is not None:
        result = plan_local(*local, hardware=hw, ram_budget=args.ram, n_ctx=args.ctx, kv_cache_type=args.kv,
                            rates=rates, vision_backend=args.vision_backend, vision_weights=args.vision_weights,
                            **limits)
    else:
        result = plan(args.model, ram_budget=args.ram, n_ctx=args.ctx, quant=args.quant,
                      kv_cache_type=args.kv, hardware=hw, rates=rates, vision_backend=args.vision_backend,
                      vision_weights=args.vision_weights, **limits)
    kernels = native_lines(result, local, args.vision_backend)
    if args.json:
        print(json.dumps({**result.to_dict(), "native_kernels": kernels}, indent=2))
    else:
        print(result.table())
        for line in kernels:
            print(f"Native kernels: {line}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from ..resolver import pull  # lazy: per command

    files = pull(args.model, quant=args.quant, ram_budget=args.ram, n_ctx=args.ctx,
                 revision=args.revision, progress=False if args.no_progress else None,
                 min_tokens_per_s=args.min_tokens_per_s, max_first_answer_s=args.max_first_answer_s)
    out = {"repo": files.repo, "revision": files.revision, "quant": files.quant,
           "model": str(files.model), "mmproj": str(files.mmproj)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{files.repo} {files.quant}\n  model:  {files.model}\n  mmproj: {files.mmproj}")
    return 0
