"""The server's Prometheus metrics: queue depth, running sequences, KV blocks, tokens/s, latency.

Each server owns a registry (several servers can live in one process, as in tests). Engine gauges
are read at scrape time from the snapshot the engine loop publishes after every step, because
only the loop thread may call the engine. Latency histograms are observed as outputs arrive:
TTFT from admission to the first generated token, TPOT between later tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Gauges and counters from the latest engine snapshot (None until the loop has run)."""

    def __init__(self, snapshot: Callable[[], tuple[object | None, float, int]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        stats, tokens_per_second, in_flight = self._snapshot()
        yield GaugeMetricFamily("thresher_requests_in_flight",
                                "Sequences admitted by the server and not finished", in_flight)
        yield GaugeMetricFamily("thresher_generation_tokens_per_second",
                                "Generated tokens per second over the last 10 s", tokens_per_second)
        if stats is None:
            return
        gauges = {
            "thresher_queue_depth": ("Sequences waiting for a running slot", stats.num_waiting),
            "thresher_running_sequences": ("Sequences in the running batch", stats.num_running),
            "thresher_kv_blocks_total": ("KV cache blocks", stats.kv_blocks_total),
            "thresher_kv_blocks_used": ("KV cache blocks held by sequences", stats.kv_blocks_used),
            "thresher_kv_blocks_cached_free": ("Free KV blocks still holding a cached prefix",
                                               stats.kv_blocks_cached_free),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value)
        counters = {
            "thresher_generation_tokens": ("Generated tokens", stats.generated_tokens_total),
            "thresher_prompt_tokens": ("Prompt tokens processed", stats.prompt_tokens_total),
            "thresher_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache",
                                                 stats.prefix_cache_hit_tokens),
            "thresher_preemptions": ("Sequences preempted for lack of KV blocks",
                                     stats.num_preempted_total),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value)


class ServerMetrics:
    """The metrics of one server instance, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("thresher_requests", "API requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.aborted = Counter("thresher_aborted_sequences",
                               "Sequences aborted because their client went away",
                               registry=self.registry)
        self.ttft = Histogram("thresher_time_to_first_token_seconds",
                              "Time from admission to the first generated token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("thresher_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per sequence",
                              buckets=TPOT_BUCKETS, registry=self.registry)

    def watch_engine(self, snapshot: Callable[[], tuple[object | None, float, int]]) -> None:
        """Expose the engine gauges; ``snapshot`` returns (EngineStats, tokens/s, in flight)."""
        self.registry.register(_EngineCollector(snapshot))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
