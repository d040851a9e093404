"""Pipeline stages of tiny random-weight models, chained, give the whole model's logits:
bit for bit alone (the same operations in the same order), within the tensor-parallel
tolerance when each stage is also split over 2 ranks. Covered: separate and tied LM heads
(the last stage uploads the embedding table as its head), gemma3's sliding-window layers,
sandwich norms and embedding scale, stages of one layer, chunked prompts."""

import numpy as np
import pytest
from family_models import write_family_dir
from model_driver import prompt_logits
from tiny_models import TINY_PROMPT, write_hf_dir
from tp_ranks import TP_TOLERANCE, run_ranks

from vllm_actors.errors import ValidationError
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.base import PipelineStage
from vllm_actors.models.registry import load_model

CHUNKS = [17, 1, 1, 21]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-pp")
    write_hf_dir(root / "llama", "llama")
    write_hf_dir(root / "qwen2", "qwen2")
    write_family_dir(root / "gemma3", "gemma3")
    return {name: resolve_model(root / name) for name in ("llama", "qwen2", "gemma3")}


def pipeline_logits(source, backend, num_stages: int, group=None, block_size: int = 8):
    """Run TINY_PROMPT in CHUNKS through `num_stages` stage models, each with its own KV
    cache, the hidden states handed on through host memory as the stage channel does."""
    stages = [load_model(source, backend, group, stage=PipelineStage(s, num_stages))
              for s in range(num_stages)]
    args = getattr(stages[0], "local_args", stages[0].args)
    num_blocks = -(-len(TINY_PROMPT) // block_size)
    caches = [backend.allocate_kv_cache(len(m.layers), num_blocks + 1, block_size,
                                        args.num_kv_heads, args.head_dim) for m in stages]
    table = (np.arange(num_blocks, dtype=np.int32)[::-1] + 1)[None, :]
    rows, start = [], 0
    for n in CHUNKS:
        pos = np.arange(start, start + n)
        meta = AttentionMetadata(np.array([0, n], np.int32), np.array([start + n], np.int32),
                                 table, (table[0][pos // block_size].astype(np.int64)
                                         * block_size + pos % block_size), block_size)
        hidden = stages[0].forward(np.asarray(TINY_PROMPT[start:start + n]), pos, meta,
                                   caches[0])
        for model, kv in zip(stages[1:], caches[1:]):
            hidden = model.forward(None, pos, meta, kv, hidden_in=backend.from_host(
                backend.to_host(hidden).copy()))
        rows.append(stages[-1].compute_logits(hidden, np.arange(n)))
        start += n
    return None if rows[0] is None else np.concatenate(rows)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_stages_chained_equal_the_whole_model(sources, name):
    backend = NumpyBackend()
    expected = prompt_logits(load_model(sources[name], backend), backend, TINY_PROMPT, CHUNKS,
                             block_size=8)
    num_layers = load_model(sources[name], backend).args.num_layers
    for num_stages in range(2, num_layers + 1):
        logits = pipeline_logits(sources[name], backend, num_stages)
        assert np.array_equal(logits, expected), (name, num_stages)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_stages_split_over_tensor_parallel_ranks(sources, name):
    backend = NumpyBackend()
    expected = prompt_logits(load_model(sources[name], backend), backend, TINY_PROMPT, CHUNKS,
                             block_size=8)
    logits = run_ranks(2, lambda group, b: pipeline_logits(sources[name], b, 2, group))
    diff = float(np.abs(logits - expected).max())
    print(f"{name} TP=2 x PP=2: max |logits - single| = {diff:.2e}")
    assert diff <= TP_TOLERANCE
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_stage_layers_and_refusal():
    assert [list(PipelineStage(s, 3).layers(30)) for s in range(3)] == \
        [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    assert [len(PipelineStage(s, 4).layers(30)) for s in range(4)] == [7, 8, 7, 8]
    with pytest.raises(ValidationError, match="2 layers cannot be split into "
                                              "--pipeline-parallel-size 3"):
        PipelineStage(0, 3).layers(2)
