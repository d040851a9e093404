"""The engine core's batch queue for pipeline parallelism, against a fake executor whose steps
stay in flight until collected: two steps overlap, the stages receive exactly the tokens
sampled since a request's last step, outputs apply in order, and nothing is scheduled
twice while in flight."""

import time

from vllm_actors.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig)
from vllm_actors.enginecore import core as core_module
from vllm_actors.protocol.engine import EngineCoreRequest, EngineReady
from vllm_actors.protocol.step import StepInput, StepOutput
from vllm_actors.sampling_params import SamplingParams


class FakePipeline:
    """Tracks tokens as a stage worker does (from NewRequestData and new_token_ids, never its
    own samples) and samples 500 + position for a request whose tokens are all computed."""

    def __init__(self, config, ipc_dir=None):
        self.in_flight: list[tuple[StepInput, list[str]]] = []
        self.most_in_flight = 0
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.sampled: dict[str, list[int]] = {}
        self.scheduled_while_waiting: list[str] = []

    def start(self):
        return EngineReady(64, 4, 256, 1000)

    def submit(self, step: StepInput) -> None:
        waiting = {r for _, completing in self.in_flight for r in completing}
        self.scheduled_while_waiting += [r for r in step.num_scheduled_tokens if r in waiting]
        for new in step.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.sampled[new.req_id] = []
        cached = step.cached_requests
        assert len(cached.new_token_ids) == len(cached.req_ids)
        for req_id, computed, new_tokens in zip(cached.req_ids, cached.num_computed_tokens,
                                                cached.new_token_ids):
            known = len(self.tokens[req_id]) - 6          # sampled tokens already delivered
            assert new_tokens == self.sampled[req_id][known:]
            self.tokens[req_id] += new_tokens
            self.computed[req_id] = computed
        completing = []
        for req_id, n in step.num_scheduled_tokens.items():
            self.computed[req_id] += n
            if self.computed[req_id] >= len(self.tokens[req_id]):
                completing.append(req_id)
        self.in_flight.append((step, completing))
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def collect(self) -> StepOutput:
        step, completing = self.in_flight.pop(0)
        req_ids = list(step.num_scheduled_tokens)
        out = StepOutput(req_ids, [[] for _ in req_ids])
        for i, req_id in enumerate(req_ids):
            if req_id in completing:
                token = 506 + len(self.sampled[req_id])
                self.sampled[req_id].append(token)
                out.sampled_token_ids[i] = [token]
        return out

    def execute(self, step):
        self.submit(step)
        return self.collect()

    def collective_rpc(self, method, args=()):
        return []

    def check_health(self):
        pass

    def shutdown(self):
        pass


def test_two_steps_overlap_and_stages_get_the_sampled_tokens(monkeypatch):
    monkeypatch.setattr(core_module, "executor_for", FakePipeline)
    config = EngineConfig(cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),
                          parallel=ParallelConfig(pipeline_parallel_size=2,
                                                  executor_backend="mp"))
    core = core_module.EngineCore(config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for name, first in (("a", 1), ("b", 11)):      # no shared prefix: b needs two chunks
        core.add_request(EngineCoreRequest(name, list(range(first, first + 6)), params, [],
                                           time.time()))
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    finished = set()
    for _ in range(100):
        if not core.has_work():
            break
        for out in core.step().outputs:
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.add(out.request_id)
    fake = core.executor
    assert finished == {"a", "b"}
    assert fake.most_in_flight == 2
    assert not fake.scheduled_while_waiting
    # what each request was given is what the fake sampled for it, in order
    assert outputs == {name: fake.sampled[name] for name in ("a", "b")}
    assert outputs["a"] == [506, 507, 508, 509]
    # the stages saw every sampled token but the last (it finished the request)
    assert fake.tokens["a"] == [1, 2, 3, 4, 5, 6, 506, 507, 508]
    assert fake.tokens["b"] == [11, 12, 13, 14, 15, 16, 506, 507, 508]
    assert not core.scheduler.in_flight and not core.in_flight
