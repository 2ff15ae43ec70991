"""``GET /metrics`` in Prometheus' text format, made by ``prometheus_client`` from the server's counters.

Each app has its own :class:`~prometheus_client.CollectorRegistry` (never the process-wide
default one, so two servers in one process, or tests, do not collide) holding one
collector that reads :class:`~gguf_mcv.server.metrics.Metrics`, the queue and the
model's embedding cache when scraped: nothing is counted twice and nothing is updated
on the answer's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import ModelClosedError
from ..runtime.memory_store import EVENTS

if TYPE_CHECKING:
    from .state import State

#: the media type of the text format (version 0.0.4), as prometheus_client writes it
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def registry_for(state: "State") -> CollectorRegistry:
    """A registry of its own whose one collector reads ``state`` at every scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(state))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry's metrics in the Prometheus text format."""
    return generate_latest(registry)


class ServerCollector(Collector):
    """Reads the server's counters, queue and embedding cache as Prometheus metric families."""

    def __init__(self, state: "State") -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        m, gate = self.state.metrics, self.state.gate
        requests = CounterMetricFamily("gguf_mcv_http_requests", "HTTP requests by method, route and status.",
                                       labels=["method", "route", "status"])
        for (label, status), n in sorted(m.requests.items()):
            method, _, route = label.partition(" ")
            requests.add_metric([method, route, str(status)], n)
        yield requests
        answers = CounterMetricFamily("gguf_mcv_answers", "Answers by outcome.", labels=["outcome"])
        for outcome, n in (("completed", m.answers), ("cancelled", m.cancelled), ("failed", m.failed)):
            answers.add_metric([outcome], n)
        yield answers
        tokens = CounterMetricFamily("gguf_mcv_tokens", "Tokens of completed answers: prompt (image tokens "
                                     "included), image, cached (reused from the KV cache) and completion.",
                                     labels=["kind"])
        for kind, n in (("prompt", m.prompt_tokens), ("image", m.image_tokens), ("cached", m.cached_tokens),
                        ("completion", m.completion_tokens)):
            tokens.add_metric([kind], n)
        yield tokens
        slices = CounterMetricFamily("gguf_mcv_vision_slices", "Image slices of completed answers: encoded by "
                                     "the vision encoder, or taken from the embedding cache.", labels=["source"])
        slices.add_metric(["encoded"], m.slices_encoded)
        slices.add_metric(["cache"], m.slices_from_cache)
        yield slices
        yield CounterMetricFamily("gguf_mcv_vision_encode_seconds", "Time spent in the vision encoder.",
                                  value=m.encode_ms / 1000.0)
        yield CounterMetricFamily("gguf_mcv_answer_seconds", "Time spent answering (completed answers).",
                                  value=m.answer_seconds)
        yield GaugeMetricFamily("gguf_mcv_queue_length", "Requests admitted and waiting for the model.",
                                value=gate.waiting)
        yield GaugeMetricFamily("gguf_mcv_active_slots", "Answers being generated now.", value=int(gate.busy))
        yield GaugeMetricFamily("gguf_mcv_max_queue", "Requests allowed to wait.", value=gate.max_waiting)
        yield GaugeMetricFamily("gguf_mcv_start_time_seconds", "When the server started (Unix time).",
                                value=m.started)
        yield CounterMetricFamily("gguf_mcv_worker_restarts", "Times the model's worker process died and was "
                                  "started again (gguf-mcv serve).", value=self.state.worker.restarts)
        yield from self._embedding_cache()
        yield from self._kept_chats()
        yield from self._kept_in_memory()

    def _kept_chats(self) -> Iterator[Metric]:
        store = self.state.kept
        if store is None:
            return
        events = CounterMetricFamily("gguf_mcv_kept_chats", "Idle conversations' KV states on disk: saved, "
                                     "restored, and entries ignored (foreign: another model's; damaged: deleted; "
                                     "refused by llama.cpp; dropped: writer behind; write_failed).",
                                     labels=["event"])
        for event in ("saved", "restored", "foreign", "damaged", "refused", "dropped", "write_failed"):
            events.add_metric([event], store.counts[event])
        yield events
        yield GaugeMetricFamily("gguf_mcv_kept_chats_disk_bytes", "Bytes the kept conversations take on disk.",
                                value=store.disk_usage())

    def _kept_in_memory(self) -> Iterator[Metric]:
        store = self.state.kept_in_memory
        if store is None:
            return
        events = CounterMetricFamily("gguf_mcv_kept_chats_memory", "Idle conversations' KV states in RAM: saved, "
                                     "restored, evicted (to make room), refused by llama.cpp, too_big for the cap.",
                                     labels=["event"])
        for event in EVENTS:
            events.add_metric([event], store.counts[event])
        yield events
        yield GaugeMetricFamily("gguf_mcv_kept_chats_memory_bytes", "Bytes the kept conversations take in RAM.",
                                value=store.usage())
        yield GaugeMetricFamily("gguf_mcv_kept_chats_memory_cap_bytes", "The cap of the kept conversations in RAM.",
                                value=store.max_bytes)

    def _embedding_cache(self) -> Iterator[Metric]:
        try:
            cache = self.state.model.engine.embed_cache
        except ModelClosedError:
            return
        lookups = CounterMetricFamily("gguf_mcv_embedding_cache_lookups", "Embedding-cache lookups by result "
                                      "(hit_disk counts the hits the disk tier served).", labels=["result"])
        lookups.add_metric(["hit"], cache.hits)
        lookups.add_metric(["miss"], cache.misses)
        lookups.add_metric(["hit_disk"], cache.disk_hits)
        yield lookups
        yield GaugeMetricFamily("gguf_mcv_embedding_cache_memory_bytes", "Bytes the embedding cache holds "
                                "in memory.", value=cache.nbytes)
