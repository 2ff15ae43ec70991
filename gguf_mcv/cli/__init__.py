"""The ``gguf-mcv`` command: a thin layer over the library.

Exit codes: 0 ok, 1 a user-facing error (one line on stderr, no traceback unless
``--debug``), 2 bad usage (argparse). Each command imports what it needs when it
runs, so ``gguf-mcv --help`` does not load llama.cpp, huggingface_hub or OpenCV.
One module per command (``run_<command>``); the parser is in :mod:`.arguments`.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..errors import GgufMcvError
from .arguments import build_parser
from .printing import one_line


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (GgufMcvError, OSError) as exc:
        if args.debug:
            raise
        print(f"gguf-mcv: error: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
