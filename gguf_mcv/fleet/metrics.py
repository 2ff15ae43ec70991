"""The fleet's ``/metrics``: every replica's families in one exposition, each sample labelled ``replica``.

One scrape of the front covers the fleet; the replicas' expositions come from their latest
reports (:mod:`.registry`), so a figure is at most a second old.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


class _Labelled(Collector):
    def __init__(self, expositions: Mapping[str, str]) -> None:
        self.expositions = expositions

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.expositions.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                for sample in family.samples:
                    merged.samples.append(sample._replace(labels={**sample.labels, REPLICA_LABEL: replica}))
        yield from families.values()


def merged(expositions: Mapping[str, str]) -> bytes:
    """The replicas' expositions (by replica name) as one, in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Labelled(expositions))
    return generate_latest(registry)
