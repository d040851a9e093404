"""The model runner's plain-greedy steps on the cpu backend, which take their ids from
`CpuBackend.argmax` (one kernel over the host logits) rather than the sampler: a request
whose logits hold a NaN fails with its reason and the others in the step are served, with
ties to the lowest id, as the sampler's path (a request with a logit bias) serves them."""

from __future__ import annotations

import numpy as np

from vllm_actors.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vllm_actors.enginecore.kv_cache_manager import KVCacheManager
from vllm_actors.enginecore.request import Request
from vllm_actors.enginecore.scheduler import Scheduler
from vllm_actors.models.base import ModelArgs
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import SamplingParams
from vllm_actors.workers.model_runner import ModelRunner

VOCAB = 100


class StubModel:
    """Logits by request: the first token of each prompt picks a row pattern."""

    args = ModelArgs("stub", hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8, intermediate_size=8, vocab_size=VOCAB, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=4096, rotary_dim=8)

    def forward(self, token_ids, positions, meta, kv_caches):  # type: ignore[no-untyped-def]
        ends = meta.query_start_loc[1:] - 1
        hidden = np.zeros((len(token_ids), 1), np.float32)
        hidden[ends, 0] = token_ids[meta.query_start_loc[:-1]]   # each prompt's first id
        return hidden

    def compute_logits(self, hidden, rows, on_device=False):  # type: ignore[no-untyped-def]
        logits = np.zeros((len(rows), VOCAB), np.float32)
        for i, kind in enumerate(hidden[rows, 0].astype(int).tolist()):
            logits[i, 40] = logits[i, 70] = 3.0 + kind       # a tie: 40 wins
            if kind == 2:
                logits[i, 11] = np.nan
        return logits


def _step(runner, config, requests):  # type: ignore[no-untyped-def]
    """The output of one scheduled step of `requests` (id, prompt, params), all new."""
    kv = KVCacheManager(runner.num_blocks, runner.block_size)
    scheduler = Scheduler(config.scheduler, kv, runner.max_model_len)
    for rid, prompt, params in requests:
        scheduler.add_request(Request(EngineCoreRequest(rid, prompt, params, [2], 0.0),
                                      runner.max_model_len, runner.block_size))
    return runner.execute(scheduler.schedule())


def test_a_nan_row_fails_its_request_and_the_rest_are_served(monkeypatch):
    config = EngineConfig(model=ModelConfig(max_model_len=256),
                          cache=CacheConfig(num_gpu_blocks_override=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    runner = ModelRunner(config, StubModel())
    assert runner.device_greedy and not runner.raw_greedy_logits
    calls = []
    argmax = runner.backend.argmax
    monkeypatch.setattr(runner.backend, "argmax", lambda x: calls.append(len(x)) or argmax(x))
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    biased = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={5: 0.0})
    for tag, params in (("argmax", greedy), ("sampler", biased)):
        a, b, c = (f"{tag}-{r}" for r in "abc")
        out = _step(runner, config, [(a, [1, 9, 9], params), (b, [2, 9], params),
                                     (c, [3, 9, 9, 9], params)])
        got = dict(zip(out.req_ids, out.sampled_token_ids))
        assert got[a] == [40] and got[c] == [40] and not got[b], tag
        assert out.failed == {b: "the model produced non-finite logits for this request"}, tag
        assert calls == [3], tag           # the greedy step's 3 rows; the biased step none
