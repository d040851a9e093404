"""Engine statistics as the frontend sees them: gauges from the latest step and counters
summed over steps, under vLLM's metric names."""

from __future__ import annotations

from vllm_actors.protocol.engine import SchedulerStats


class StatsAccumulator:
    def __init__(self) -> None:
        self.last = SchedulerStats()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def observe(self, stats: SchedulerStats | None) -> None:
        if stats is None:
            return
        self.last = stats
        self.num_preemptions += stats.num_preemptions
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits

    def snapshot(self) -> dict[str, float]:
        return {
            "vllm:num_requests_running": self.last.num_running_reqs,
            "vllm:num_requests_waiting": self.last.num_waiting_reqs,
            "vllm:kv_cache_usage_perc": self.last.kv_cache_usage,
            "vllm:num_preemptions": self.num_preemptions,
            "vllm:prefix_cache_queries": self.prefix_cache_queries,
            "vllm:prefix_cache_hits": self.prefix_cache_hits,
        }
