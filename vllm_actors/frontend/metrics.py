"""Frontend metrics under vLLM's names, in a private Prometheus registry: scheduler gauges and
counters from each step's SchedulerStats, request counters and latency histograms observed
as outputs arrive. `snapshot()` gives the same numbers as a dict (LLM.get_metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_actors.protocol.engine import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class FrontendMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**self.labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=_LATENCY_BUCKETS,
                             registry=reg).labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of finished requests.",
                               names + ["finished_reason"], registry=reg)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Time requests spent waiting for their first schedule.")
        self._last = SchedulerStats()
        self._totals = {"vllm:num_preemptions": 0, "vllm:prefix_cache_queries": 0,
                        "vllm:prefix_cache_hits": 0, "vllm:prompt_tokens": 0,
                        "vllm:generation_tokens": 0}

    def observe_step(self, stats: SchedulerStats | None) -> None:
        if stats is None:
            return
        self._last = stats
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        for name, counter, value in (
                ("vllm:num_preemptions", self.preemptions, stats.num_preemptions),
                ("vllm:prefix_cache_queries", self.prefix_queries, stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", self.prefix_hits, stats.prefix_cache_hits)):
            counter.inc(value)
            self._totals[name] += value

    def observe_tokens(self, num_new: int, first_token_s: float | None,
                       since_last_s: float | None) -> None:
        """New output tokens of one request: time to its first token, or since its last."""
        self.generation_tokens.inc(num_new)
        self._totals["vllm:generation_tokens"] += num_new
        if first_token_s is not None:
            self.ttft.observe(first_token_s)
        elif since_last_s is not None and num_new:
            self.itl.observe(since_last_s / num_new)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, e2e_s: float,
                         queue_s: float | None) -> None:
        self.success.labels(finished_reason=finish_reason, **self.labels).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self._totals["vllm:prompt_tokens"] += num_prompt_tokens
        self.e2e.observe(e2e_s)
        if queue_s is not None:
            self.queue.observe(max(queue_s, 0.0))

    def snapshot(self) -> dict[str, float]:
        return {"vllm:num_requests_running": self._last.num_running_reqs,
                "vllm:num_requests_waiting": self._last.num_waiting_reqs,
                "vllm:kv_cache_usage_perc": self._last.kv_cache_usage, **self._totals}

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
