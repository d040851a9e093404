"""Pooling models against transformers (tests/golden/pooling.npz, from
tests/oracle/make_pooling_golden.py), through the engine core in this process (scheduler,
runner, pooler): a tiny BERT (CLS and MEAN pooling), a cross-encoder's classifier with token
types, and a Qwen3-shaped decoder with last-token pooling (`--convert embed`). Each model's
inputs run in one batch and one by one; outputs within 1e-4 of the oracle."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tiny_pooling import GOLDEN, ID_INPUTS, PAIRS, SINGLE_TEXTS, write_bert_dir, \
    write_bert_gguf, write_decoder_dir

from opencl_platform import require_opencl

from vllm_actors.config import EngineArgs
from vllm_actors.enginecore.core import EngineCore
from vllm_actors.errors import ValidationError
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.protocol.engine import EngineCoreRequest
from vllm_actors.sampling_params import RequestOutputKind, SamplingParams

TOL = 1e-4
SAMPLING = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def _core(path, device: str, **args) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device=device, multiprocessing=False,
                                 **args).create_engine_config())


def _run(core: EngineCore, inputs: list[tuple[list[int], PoolingParams]],
         batched: bool) -> list[np.ndarray]:
    """Each input's pooled output; all queued at once (one step) or one at a time."""
    results: dict[str, np.ndarray] = {}
    pending = list(enumerate(inputs))
    while pending or core.has_work():
        for i, (ids, params) in (pending if batched else pending[:1]):
            core.add_request(EngineCoreRequest(f"r{i}-{batched}", ids, SAMPLING, [],
                                               time.time(), pooling_params=params))
        pending = [] if batched else pending[1:]
        while core.has_work():
            for out in core.step().outputs:
                assert out.error is None, out.error
                results[out.request_id] = np.frombuffer(out.pooled.data, np.float32) \
                    .reshape(out.pooled.shape)
    return [results[f"r{i}-{batched}"] for i in range(len(inputs))]


@pytest.mark.parametrize("device", ["numpy", "cpu", "opencl"])
def test_bert_pooling_and_classifier(tmp_path, golden, device):
    """CLS and MEAN pooling of the encoder; the cross-encoder's logits with token types
    (pairs) and without (single texts); batched equals alone. OpenCL on PoCL (its
    encoder attention runs on the host)."""
    if device == "opencl":
        require_opencl()
    core = _core(write_bert_dir(tmp_path / "bert"), device, runner="pooling")
    assert core.ready.runner == "pooling" and core.ready.pooling_tasks == ["embed", "encode"]
    for kind in ("cls", "mean"):
        params = PoolingParams(normalize=False)
        core = core if kind == "cls" else _core(
            tmp_path / "bert", device, pooler_config='{"pooling_type": "MEAN"}')
        for batched in (True, False):
            outs = _run(core, [(ids, params) for ids in ID_INPUTS], batched)
            for i, out in enumerate(outs):
                np.testing.assert_allclose(out, golden[f"bert_{kind}_{i}"], atol=TOL)
    cross = _core(write_bert_dir(tmp_path / "cross", classifier=True), device)
    assert cross.ready.labels == ["neg", "neutral", "pos"]
    inputs = []
    for i in range(len(PAIRS) + len(SINGLE_TEXTS)):
        types = golden[f"cross_types_{i}"]
        start = int(np.argmax(types)) if types.any() else None
        inputs.append((golden[f"cross_ids_{i}"].tolist(),
                       PoolingParams(task="classify", activation=False, token_type_start=start)))
    for batched in (True, False):
        for i, out in enumerate(_run(cross, inputs, batched)):
            np.testing.assert_allclose(out, golden[f"cross_logits_{i}"], atol=TOL)


def test_matryoshka_dimensions(tmp_path, golden):
    """A Matryoshka model's `dimensions`: the first values, normalized after the cut."""
    core = _core(write_bert_dir(tmp_path / "m", matryoshka=True), "numpy")
    assert core.ready.matryoshka and core.ready.hidden_size == 64
    outs = _run(core, [(ids, PoolingParams(dimensions=16)) for ids in ID_INPUTS], True)
    for i, out in enumerate(outs):
        want = golden[f"bert_cls_{i}"][:16]
        np.testing.assert_allclose(out, want / np.linalg.norm(want), atol=TOL)


def test_bert_gguf_as_llama_cpp_writes_it(tmp_path, golden):
    """The tiny BERT as a llama.cpp GGUF: its WordPiece vocabulary gives the HF
    tokenizer's ids, and its CLS pooling (the GGUF's pooling type) the oracle's values."""
    from vllm_actors.loaders.tokenizer import get_tokenizer
    hf = write_bert_dir(tmp_path / "bert")
    path = write_bert_gguf(hf, tmp_path / "bert.gguf")
    ours, theirs = get_tokenizer(path), get_tokenizer(hf)
    for text in [*SINGLE_TEXTS, *(a + " " + b for a, b in PAIRS)]:
        assert ours.encode(text) == theirs.encode(text)
    core = _core(path, "cpu")
    assert core.ready.runner == "pooling" and core.ready.max_model_len == 64
    outs = _run(core, [(ids, PoolingParams(normalize=False)) for ids in ID_INPUTS], True)
    for i, out in enumerate(outs):
        np.testing.assert_allclose(out, golden[f"bert_cls_{i}"], atol=TOL)


def test_decoder_last_token_pooling(tmp_path, golden):
    """`--convert embed` on a decoder: the last token's final-normed state; normalized by
    default."""
    path = write_decoder_dir(tmp_path / "decoder")
    with pytest.raises(ValidationError, match="generate"):
        EngineArgs(model=str(path), convert="embed", runner="generate").create_engine_config()
    core = _core(path, "numpy", convert="embed")
    raw = _run(core, [(ids, PoolingParams(normalize=False)) for ids in ID_INPUTS], True)
    unit = _run(core, [(ids, PoolingParams()) for ids in ID_INPUTS], False)
    for i, (r, u) in enumerate(zip(raw, unit)):
        want = golden[f"decoder_last_{i}"]
        np.testing.assert_allclose(r, want, atol=TOL)
        np.testing.assert_allclose(u, want / np.linalg.norm(want), atol=TOL)
