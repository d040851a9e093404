"""A whole model on each device backend: the tiny random llama (GGUF, llama.cpp layout) in F32
and with Q8_0 / Q4_1 blocks dequantized inside the device matmul, prompt in chunks over a
scrambled paged cache, against the numpy backend on the same file; and a LoRA adapter on the
device against PEFT's golden logits."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from golden_files import GOLDEN
from model_driver import prompt_logits
from tiny_lora import LORA_PROMPT, attach, write_case
from tiny_models import TINY_PROMPT, write_llama_gguf

from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.models.registry import load_model


@pytest.mark.parametrize("qtype, semantics", [(None, "float32"), (QT.Q8_0, "float32"),
                                              (QT.Q4_1, "float32"), (QT.Q4_1, "quantized")],
                         ids=["f32", "q8_0", "q4_1", "q4_1-quantized"])
def test_tiny_llama_matches_numpy(dev, qtype, semantics, tmp_path):
    """Under --gguf-activations quantized the device quantizes x itself and runs the integer
    kernels (Q8_1 blocks and their sums for Q4_1); numpy simulates the same semantics."""
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, qtype=qtype)
    ref_backend = NumpyBackend()
    want = prompt_logits(load_model(resolve_model(path), ref_backend, gguf_activations=semantics),
                         ref_backend, TINY_PROMPT, [17, 1, 1, 21], block_size=8)
    model = load_model(resolve_model(path), dev, gguf_activations=semantics)
    if qtype is not None:
        assert model.layers[0].qkv.kernel == f"linear_{qtype.name.lower()}"
        assert model.layers[0].qkv.activations == ("q8_1" if semantics == "quantized" else None)
    got = prompt_logits(model, dev, TINY_PROMPT, [17, 1, 1, 21], block_size=8)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4     # logits of magnitude ~1-10
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from family_models import FAMILY_CONFIGS, write_family_dir
    root = tmp_path_factory.mktemp("device-families")
    for name in FAMILY_CONFIGS:
        write_family_dir(root / name, name)
    return root


def _family_names():
    from family_models import FAMILY_CONFIGS
    return list(FAMILY_CONFIGS)


@pytest.mark.parametrize("name", _family_names())
def test_model_families_match_numpy(dev, family_dirs, name):
    """Every family (GeGLU, LayerNorm, sliding windows, soft-caps, sandwich and post norms,
    routed experts) on the device against the numpy backend, prompt in chunks."""
    from family_models import FAMILY_PROMPT
    source = resolve_model(family_dirs / name)
    ref = NumpyBackend()
    want = prompt_logits(load_model(source, ref), ref, FAMILY_PROMPT[:60], [17, 1, 42],
                         block_size=8)
    got = prompt_logits(load_model(source, dev), dev, FAMILY_PROMPT[:60], [17, 1, 42],
                        block_size=8)
    assert np.abs(got - want).max() <= 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("name", ["llama", "phi3", "qwen2_moe"])
def test_lora_adapter_matches_peft(dev, name, tmp_path):
    """A PEFT adapter on the device (one launch for the stacked A, one per part of B; on
    qwen2_moe also each routed expert's rows and the shared expert) against PEFT's logits
    (tests/golden/lora.npz), within the LoRA oracle's 1e-4."""
    model_dir, adapter = write_case(tmp_path, name)
    model = attach(load_model(resolve_model(str(model_dir)), dev), adapter)
    logits = prompt_logits(model, dev, LORA_PROMPT, [17, 1, 30], block_size=8)
    golden = np.load(GOLDEN / "lora.npz")[f"{name}/logits"]
    assert np.abs(logits - golden).max() < 1e-4
