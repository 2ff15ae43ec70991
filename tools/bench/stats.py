"""Percentiles, summaries and alternating runs: a ratio between two setups is measured by running
them in turn (A B A B ...) in one process, so the machine's load falls on both alike."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, median, p10, p90, min and max of ``values`` (None for an empty list)."""
    return {"n": len(values), "median": statistics.median(values) if values else None,
            "p10": percentile(values, 10), "p90": percentile(values, 90),
            "min": min(values, default=None), "max": max(values, default=None)}


def alternate(runs: Mapping[str, Callable[[], Any]], rounds: int,
              on_sample: Callable[[int, str, Any], None] | None = None, *, swap: bool = False) -> dict[str, list[Any]]:
    """Each of ``runs`` once per round, in the order given, for ``rounds`` rounds (A B A B ...;
    with ``swap`` every other round in reverse, A B B A, so neither always goes first); every
    result by run name, in round order. ``on_sample(round, name, result)`` sees each as it comes
    (to print progress)."""
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    samples: dict[str, list[Any]] = {name: [] for name in runs}
    for i in range(rounds):
        order = list(runs.items())
        for name, run in order[::-1] if swap and i % 2 else order:
            result = run()
            samples[name].append(result)
            if on_sample is not None:
                on_sample(i, name, result)
    return samples


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float | int | None]:
    """The ratio ``numerator / denominator`` of paired rounds: the :func:`summary` of each round's
    ratio (pairs whose denominator is 0 left out), so a slow round slows both sides of its ratio."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired rounds differ in number: {len(numerator)} and {len(denominator)}")
    return summary([a / b for a, b in zip(numerator, denominator, strict=True) if b])
