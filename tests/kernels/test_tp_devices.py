"""Tensor parallelism through the engine core and real worker processes: a tiny random-weight
llama (4 heads, 2 KV heads) at TP=2 gives the greedy tokens of the numpy engine at TP=1.
CPU workers with ring slots too small for any StepInput (every step through the ZeroMQ
fallback); OpenCL (PoCL in CI): the host all-reduce path (download, shared-memory sum,
upload); CUDA: the NCCL all-reduce, on a machine with two GPUs (bench/gpu_check.sh runs it)."""

import pytest
from opencl_platform import require_opencl
from tiny_models import write_hf_dir

from vllm_actors import EngineArgs, SamplingParams
from vllm_actors.enginecore.core import EngineCore
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.workers import executor

GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(i * 37 + j * 11) % 256 for j in range(5 + 9 * i)] for i in range(3)]


def _skip_without(device: str) -> None:
    if device == "opencl":
        require_opencl()
    if device == "cuda":
        from vllm_actors.kernels.cuda.backend import cuda_available
        if not cuda_available():
            pytest.skip("no CUDA GPU visible to CuPy")
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 2:
            pytest.skip("tensor parallelism on CUDA needs two GPUs")


def greedy_tokens(model_dir, **engine_args) -> list[list[int]]:
    config = EngineArgs(model=str(model_dir), kv_cache_memory=16 << 20,
                        **engine_args).create_engine_config()
    core = EngineCore(config)
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(EngineCoreRequest(str(i), prompt, GREEDY_8, [2], 0.0))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
        return [tokens[str(i)] for i in range(len(PROMPTS))]
    finally:
        core.shutdown()


@pytest.mark.parametrize("device", ["opencl", "cuda"])
def test_tp2_on_device_equals_numpy_tp1(tmp_path, device):
    _skip_without(device)
    write_hf_dir(tmp_path / "llama", "llama")
    reference = greedy_tokens(tmp_path / "llama", device="cpu")
    tokens = greedy_tokens(tmp_path / "llama", device=device, tensor_parallel_size=2)
    assert all(len(t) == 8 for t in tokens)
    assert tokens == reference


def test_tp2_cpu_workers_with_every_message_over_the_fallback(tmp_path, monkeypatch):
    write_hf_dir(tmp_path / "llama", "llama")
    reference = greedy_tokens(tmp_path / "llama", device="cpu")
    monkeypatch.setattr(executor, "RING_SLOT_BYTES", 16)    # smaller than any StepInput
    assert greedy_tokens(tmp_path / "llama", device="cpu", tensor_parallel_size=2) == reference


@pytest.mark.parametrize("tp", [1, 2])
def test_collective_rpc_reaches_every_rank(tmp_path, tp):
    """Executor.collective_rpc: each rank answers from its own process (the in-process
    executor from this one); an unknown method is refused with the list of methods."""
    import os

    from vllm_actors.errors import ValidationError
    write_hf_dir(tmp_path / "llama", "llama")
    config = EngineArgs(model=str(tmp_path / "llama"), device="cpu", kv_cache_memory=16 << 20,
                        tensor_parallel_size=tp).create_engine_config()
    core = EngineCore(config)
    try:
        ranks = core.collective_rpc("describe", [])
        assert [r["rank"] for r in ranks] == list(range(tp))
        assert all(r["world_size"] == tp and r["backend"] == "cpu" for r in ranks)
        pids = {r["pid"] for r in ranks}
        if tp == 1:
            assert pids == {os.getpid()}
        else:
            assert len(pids) == tp and os.getpid() not in pids
        sizes = core.collective_rpc("kv_cache_bytes", [])
        assert len(set(sizes)) == 1 and sizes[0] > 0
        with pytest.raises(ValidationError, match="unknown method 'shutdown'.*describe"):
            core.collective_rpc("shutdown", [])
        core.add_request(EngineCoreRequest("after", PROMPTS[0], GREEDY_8, [2], 0.0))
        while core.has_unfinished_requests():   # the ranks still serve steps afterwards
            core.step()
    finally:
        core.shutdown()
