"""The server's Prometheus metrics: queue depth, running sequences, KV blocks, tokens/s, latency.

Each server owns a registry (several servers can live in one process, as in tests). Engine gauges
are read at scrape time from the snapshot the engine loop publishes after every step, because
only the loop thread may call the engine. Latency histograms are observed as outputs arrive:
TTFT from admission to the first generated token, TPOT between later tokens. With speculative
decoding, its counters appear under vLLM's ``vllm:spec_decode_*`` names.
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
        if stats.spec is not None:
            yield from _speculative_metrics(stats.spec)


def _speculative_metrics(spec) -> Iterator:
    """Speculative decoding's counters under vLLM's names (its v1 counters, its v0 acceptance
    gauge); vLLM has no name for the mean accepted length or the draft and verify times."""
    counters = {
        "vllm:spec_decode_num_drafts": ("Verify steps of a sequence with proposals",
                                        spec.num_drafts),
        "vllm:spec_decode_num_draft_tokens": ("Proposed tokens", spec.num_draft_tokens),
        "vllm:spec_decode_num_accepted_tokens": ("Proposed tokens the target kept",
                                                 spec.num_accepted_tokens),
        "thresher_spec_decode_draft_seconds": ("Time spent proposing", spec.draft_seconds),
        "thresher_spec_decode_verify_seconds": ("Time spent in steps that verified proposals "
                                                "(forward and acceptance)", spec.verify_seconds),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value)
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Proposals kept, by position in the proposal", labels=["position"])
    for position, value in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(position)], value)
    yield per_pos
    yield GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate",
                            "Accepted over proposed tokens", spec.acceptance_rate)
    yield GaugeMetricFamily("thresher_spec_decode_mean_accepted_length",
                            "Tokens emitted per verify step (accepted proposals + 1)",
                            spec.mean_accepted_length)


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
