"""Frontend metrics under vLLM's names, in a private Prometheus registry: scheduler gauges and
counters from each step's SchedulerStats, request counters and latency histograms observed
as outputs arrive. Every series carries vLLM's labels `model_name` and `engine` (the data
parallel engine core's index; "0" with one core). `snapshot()` gives the same numbers summed
over the engine cores as a dict (LLM.get_metrics)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_actors.protocol.engine import SchedulerStats, SpecDecodingStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_COUNTED = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
SPEC_LOG_INTERVAL_S = 10.0   # vLLM's stat-log interval

logger = logging.getLogger("vllm_actors.metrics")


class FrontendMetrics:
    """Args: model_name; num_engines: the data parallel engine cores (labels "0".."N-1")."""

    def __init__(self, model_name: str, num_engines: int = 1, max_loras: int = 0) -> None:
        """max_loras: --max-loras when LoRA is on (0: off, no LoRA gauge)."""
        self.registry = reg = CollectorRegistry()
        self.max_loras = max_loras
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests: "
                               "the adapters of the running and waiting requests (the value "
                               "is when they were seen).", ["max_lora", "waiting_lora_adapters",
                                                            "running_lora_adapters"],
                               registry=reg) if max_loras else None
        self.model_name = model_name
        names = ["model_name", "engine"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=_LATENCY_BUCKETS, registry=reg)

        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.",
                             names, registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.",
                             names, registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.",
                              names, registry=reg)
        docs = {"vllm:num_preemptions": "Cumulative number of preemptions.",
                "vllm:prefix_cache_queries": "Prefix cache queries, in tokens.",
                "vllm:prefix_cache_hits": "Prefix cache hits, in tokens.",
                "vllm:prompt_tokens": "Number of prefill tokens processed.",
                "vllm:generation_tokens": "Number of generation tokens processed.",
                "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
                "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
                "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens."}
        self.counters = {name: Counter(name, docs[name], names, registry=reg)
                         for name in _COUNTED}
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
            "position.", names + ["position"], registry=reg)
        self.spec_log = SpecDecodingLog()
        self.success = Counter("vllm:request_success", "Count of finished requests.",
                               names + ["finished_reason"], registry=reg)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Time requests spent waiting for their first schedule.")
        self.engines_alive = Gauge("vllm_actors:engines_alive", "Data parallel engine cores "
                                   "serving (fewer than configured: degraded).", ["model_name"],
                                   registry=reg).labels(model_name)
        self.engine_deaths = Counter("vllm_actors:engine_deaths", "Engine cores that died.",
                                     ["model_name"], registry=reg).labels(model_name)
        self.engine_restarts = Counter("vllm_actors:engine_restarts", "Engine cores restarted "
                                       "after a death.", ["model_name"],
                                       registry=reg).labels(model_name)
        self.engines_alive.set(num_engines)
        self._last = [SchedulerStats() for _ in range(num_engines)]
        self._totals = dict.fromkeys(_COUNTED, 0)
        # every series exists from the start, at zero; each engine's children are looked up
        # once (a `labels()` lookup costs microseconds, and every step made a dozen)
        self._series = [self._children(engine) for engine in range(num_engines)]

    def _labels(self, engine: int) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": str(engine)}

    def _children(self, engine: int) -> dict:
        labels = self._labels(engine)
        families = {"running": self.running, "waiting": self.waiting,
                    "kv_usage": self.kv_usage, "ttft": self.ttft, "itl": self.itl,
                    "e2e": self.e2e, "queue": self.queue, **self.counters}
        return {key: family.labels(**labels) for key, family in families.items()}

    def _count(self, name: str, engine: int, value: int) -> None:
        if value:
            self._series[engine][name].inc(value)
            self._totals[name] += value

    def observe_step(self, stats: SchedulerStats | None, engine: int = 0) -> None:
        if stats is None:
            return
        self._last[engine] = stats
        series = self._series[engine]
        series["running"].set(stats.num_running_reqs)
        series["waiting"].set(stats.num_waiting_reqs)
        series["kv_usage"].set(stats.kv_cache_usage)
        self._count("vllm:num_preemptions", engine, stats.num_preemptions)
        self._count("vllm:prefix_cache_queries", engine, stats.prefix_cache_queries)
        self._count("vllm:prefix_cache_hits", engine, stats.prefix_cache_hits)
        spec = stats.spec_decoding
        if spec is not None:
            self._count("vllm:spec_decode_num_drafts", engine, spec.num_drafts)
            self._count("vllm:spec_decode_num_draft_tokens", engine, spec.num_draft_tokens)
            self._count("vllm:spec_decode_num_accepted_tokens", engine, spec.num_accepted_tokens)
            labels = self._labels(engine)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self.accepted_per_pos.labels(position=str(pos), **labels).inc(n)
            self.spec_log.observe(spec)
        if self.lora_info is not None:
            self._observe_loras()

    def _observe_loras(self) -> None:
        """One series, the adapters of every engine core's running and waiting requests
        now (vLLM's labels; older combinations are dropped)."""
        running = sorted({n for s in self._last for n in s.running_lora_adapters})
        waiting = sorted({n for s in self._last for n in s.waiting_lora_adapters})
        self.lora_info.clear()
        self.lora_info.labels(max_lora=str(self.max_loras), running_lora_adapters=",".join(running),
                              waiting_lora_adapters=",".join(waiting)).set_to_current_time()

    def observe_tokens(self, num_new: int, first_token_s: float | None,
                       since_last_s: float | None, engine: int = 0) -> None:
        """New output tokens of one request: time to its first token, or since its last."""
        self._count("vllm:generation_tokens", engine, num_new)
        if first_token_s is not None:
            self._series[engine]["ttft"].observe(first_token_s)
        elif since_last_s is not None and num_new:
            self._series[engine]["itl"].observe(since_last_s / num_new)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, e2e_s: float,
                         queue_s: float | None, engine: int = 0) -> None:
        self.success.labels(finished_reason=finish_reason, **self._labels(engine)).inc()
        self._count("vllm:prompt_tokens", engine, num_prompt_tokens)
        self._series[engine]["e2e"].observe(e2e_s)
        if queue_s is not None:
            self._series[engine]["queue"].observe(max(queue_s, 0.0))

    def observe_engine_death(self, engine: int, alive: int) -> None:
        """Engine `engine` died; `alive` cores are left. Its gauges drop to zero."""
        self.engine_deaths.inc()
        self.engines_alive.set(alive)
        self.observe_step(SchedulerStats(), engine)

    def observe_engine_restart(self, alive: int) -> None:
        self.engine_restarts.inc()
        self.engines_alive.set(alive)

    def snapshot(self) -> dict[str, float]:
        """The gauges and counters summed over the engine cores (KV usage: their mean)."""
        return {"vllm:num_requests_running": sum(s.num_running_reqs for s in self._last),
                "vllm:num_requests_waiting": sum(s.num_waiting_reqs for s in self._last),
                "vllm:kv_cache_usage_perc": sum(s.kv_cache_usage for s in self._last)
                / len(self._last), **self._totals}

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)


class SpecDecodingLog:
    """vLLM's periodic spec-decoding log line: acceptance since the last line, at most one
    line per `SPEC_LOG_INTERVAL_S`, only when drafts were verified."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.window = SpecDecodingStats()
        self.enabled = True      # --disable-log-stats: off

    def observe(self, stats: SpecDecodingStats) -> None:
        w = self.window
        w.num_drafts += stats.num_drafts
        w.num_draft_tokens += stats.num_draft_tokens
        w.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = w.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(stats.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[i] += n
        now = time.monotonic()
        if now - self.since >= SPEC_LOG_INTERVAL_S and w.num_drafts:
            if self.enabled:
                logger.info(self.line(now - self.since))
            self.since, self.window = now, SpecDecodingStats()

    def line(self, seconds: float) -> str:
        w = self.window
        rate = w.num_accepted_tokens / max(w.num_draft_tokens, 1)
        per_pos = ", ".join(f"{n / w.num_drafts:.3f}" for n in w.num_accepted_tokens_per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + w.num_accepted_tokens / w.num_drafts:.2f}, Accepted throughput: "
                f"{w.num_accepted_tokens / seconds:.2f} tokens/s, Drafted throughput: "
                f"{w.num_draft_tokens / seconds:.2f} tokens/s, Accepted: "
                f"{w.num_accepted_tokens} tokens, Drafted: {w.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: "
                f"{100 * rate:.1f}%")
