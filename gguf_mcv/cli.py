"""The ``gguf-mcv`` command: a thin layer over the library.

Exit codes: 0 ok, 1 a user-facing error (one line, no traceback unless
``--debug``), 2 bad usage (argparse).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import GgufMcvError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (GgufMcvError, OSError) as exc:
        if args.debug:
            raise
        print(f"gguf-mcv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gguf-mcv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("selftest", help="check the install offline with a tiny generated model")
    p.set_defaults(func=_selftest)

    p = sub.add_parser("ask", help="ask a question about images")
    p.add_argument("model", help="catalog name or Hub repo id (or a local .gguf with --mmproj)")
    p.add_argument("args", nargs="+", metavar="IMAGE... PROMPT", help="image files, then the question")
    p.add_argument("--example", action="store_true", help="ask about the bundled example image")
    p.add_argument("--mmproj", help="local vision projector, when MODEL is a local .gguf file")
    p.add_argument("--quant", help="quantization, e.g. Q4_K_M (default: planned from RAM)")
    p.add_argument("--ram", help="RAM budget for planning, e.g. 4GB")
    p.add_argument("--ctx", type=int, default=4096, help="context size (default 4096)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--detail", choices=("auto", "low", "high"), default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's logs")
    p.set_defaults(func=_ask)
    return parser


def _selftest(args: argparse.Namespace) -> int:
    from . import selftest

    print("gguf-mcv selftest")
    return 0 if selftest.run() else 1


def _load(args: argparse.Namespace):
    from .loader import load

    common = dict(n_ctx=args.ctx, n_threads=args.threads, verbose=args.verbose)
    if args.mmproj:
        return load(model_path=args.model, mmproj_path=args.mmproj, **common)
    return load(args.model, quant=args.quant, ram_budget=args.ram, **common)


def _ask(args: argparse.Namespace) -> int:
    from .selftest import EXAMPLE_IMAGE

    *images, prompt = args.args
    if args.example:
        images = [str(EXAMPLE_IMAGE), *images]
    with _load(args) as model:
        stream = model.ask(prompt, images, stream=True, max_tokens=args.max_tokens, detail=args.detail)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
