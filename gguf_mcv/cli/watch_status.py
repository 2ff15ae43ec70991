"""The status line ``gguf-mcv watch`` keeps on stderr."""

from __future__ import annotations

import sys
from typing import Any


def status_line(seen: Any, lines: int) -> None:
    """One live line on stderr (a terminal) saying what the last tick did."""
    what = "asked" if seen.asked else "unchanged"
    print(f"frame {seen.frame_index} · {seen.changed:.1%} changed · {seen.slices_encoded} encoded / "
          f"{seen.slices_reused} reused · {what} · {seen.latency_s:.2f} s · skipped {seen.frames_skipped} "
          f"frames, {seen.ticks_skipped} ticks · reconnects {seen.reconnects} · {lines} lines",
          end="", file=sys.stderr, flush=True)
