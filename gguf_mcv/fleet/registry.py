"""What the fleet's ``/health`` lists: each replica reports itself to one small named actor.

Serve restarts a dead replica under a new name; a replica whose reports have stopped is counted
as lost (a restart, once Serve has started its successor).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

REGISTRY_NAME = "gguf_mcv_fleet_registry"
REGISTRY_NAMESPACE = "gguf_mcv"
REPORT_PERIOD_S = 1.0
LOST_AFTER_S = 5 * REPORT_PERIOD_S


class _Registry:
    """The latest report of every replica, and which ones stopped reporting."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}
        self.seen: dict[str, float] = {}

    def report(self, info: dict[str, Any]) -> None:
        self.reports[info["replica"]] = info
        self.seen[info["replica"]] = time.monotonic()

    def listing(self) -> dict[str, Any]:
        now = time.monotonic()
        live = [r for name, r in self.reports.items() if now - self.seen[name] <= LOST_AFTER_S]
        lost = [r for name, r in self.reports.items() if now - self.seen[name] > LOST_AFTER_S]
        return {"replicas": sorted(live, key=lambda r: r["replica"]), "lost": lost, "restarts": len(lost)}


Registry = ray.remote(num_cpus=0, max_restarts=-1)(_Registry)


def registry() -> Any:
    """The fleet's registry actor, started by whoever asks first (it outlives the replicas)."""
    return Registry.options(name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE, get_if_exists=True,
                            lifetime="detached").remote()


def keep_reporting(info: Any) -> Any:
    """Report ``info()`` every second, on a daemon thread, as long as the process lives; the registry."""
    handle = registry()

    def loop() -> None:
        while True:
            try:
                handle.report.remote(info())
            except Exception:  # noqa: BLE001 - the registry restarting: the next report reaches it
                pass
            time.sleep(REPORT_PERIOD_S)

    thread = threading.Thread(target=loop, name="gguf-mcv-fleet-report", daemon=True)
    thread.start()
    return handle
