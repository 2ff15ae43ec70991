"""``gguf-mcv selftest``: check this install end to end on a generated model."""

from __future__ import annotations

import argparse


def run_selftest(args: argparse.Namespace) -> int:
    from .. import selftest  # lazy: per command

    print("gguf-mcv selftest")
    return 0 if selftest.run() else 1
