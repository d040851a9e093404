"""bench/synth_gguf.py: the synthetic Q4_K_M llama file, at a tiny shape, read back by our
reader and gguf-py, loaded by llama.cpp, and run by our engine."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from vllm_actors import LLM, SamplingParams
from vllm_actors.kernels.quant import dequantize
from vllm_actors.loaders.gguf import GGUFFile

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import synth_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
SHAPE = synth_gguf.Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, context=512)
DEVICE = "cpu"   # the compiled backend, which keeps the Q4_K / Q6_K blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    cmd = [sys.executable, str(BENCH / "synth_gguf.py"), str(path), "--quick", "--seed", "3"]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"{path.stat().st_size:,} bytes" in result.stdout
    return path


def test_use_more_bits_matches_llama3_8b_q4_k_m():
    promoted = [i for i in range(32) if synth_gguf.use_more_bits(i, 32)]
    assert promoted == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    vocab = 49152
    types = [t for _, _, t in synth_gguf.tensor_layout(synth_gguf.LLAMA3_8B, vocab)]
    # a real Meta-Llama-3-8B Q4_K_M: 193 q4_K, 33 q6_K, 65 f32 tensors
    assert (types.count(T.Q4_K), types.count(T.Q6_K), types.count(T.F32)) == (193, 33, 65)
    data = synth_gguf.expected_data_bytes(synth_gguf.LLAMA3_8B, vocab)
    assert 4.4e9 < data < 4.6e9


def test_layout_types_and_shapes(tiny):
    ours = GGUFFile(tiny)
    assert ours.architecture == "llama"
    assert ours.arch_get("block_count") == 2 and ours.arch_get("embedding_length") == 256
    assert ours.arch_get("attention.head_count_kv") == 2
    assert ours.arch_get("rope.freq_base") == 500000.0
    assert ours.get("general.file_type") == 15
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert ours.get("tokenizer.chat_template")
    expected = {
        "token_embd.weight": ((49152, 256), T.Q4_K), "output.weight": ((49152, 256), T.Q6_K),
        "output_norm.weight": ((256,), T.F32),
        # n = 2 layers: n/8 = 0, 7n/8 = 1, so only layer 1 gets more bits
        "blk.0.attn_v.weight": ((128, 256), T.Q4_K), "blk.1.attn_v.weight": ((128, 256), T.Q6_K),
        "blk.0.ffn_down.weight": ((256, 512), T.Q4_K),
        "blk.1.ffn_down.weight": ((256, 512), T.Q6_K),
        "blk.1.attn_q.weight": ((256, 256), T.Q4_K), "blk.1.attn_k.weight": ((128, 256), T.Q4_K),
        "blk.0.attn_output.weight": ((256, 256), T.Q4_K),
        "blk.0.ffn_gate.weight": ((512, 256), T.Q4_K), "blk.0.ffn_up.weight": ((512, 256), T.Q4_K),
        "blk.0.attn_norm.weight": ((256,), T.F32), "blk.0.ffn_norm.weight": ((256,), T.F32),
    }
    assert len(ours.tensors) == 3 + 9 * 2
    for name, (shape, qtype) in expected.items():
        assert (ours.tensors[name].shape, ours.tensors[name].ggml_type) == (shape, qtype), name
    ref = gguf.GGUFReader(tiny)
    assert {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type))
            for t in ref.tensors} == {n: (i.shape, i.ggml_type) for n, i in ours.tensors.items()}
    assert synth_gguf.matches(tiny, synth_gguf.QUICK, 3)
    assert not synth_gguf.matches(tiny, synth_gguf.QUICK, 4)


def test_weights_finite_with_intended_magnitude(tiny):
    f = GGUFFile(tiny)
    for name, info in f.tensors.items():
        w = dequantize(f.raw(name), info.ggml_type, info.shape)
        assert np.isfinite(w).all(), name
        if info.ggml_type == T.F32:
            assert np.array_equal(w, np.ones(info.shape, np.float32)), name
        else:
            assert abs(w.std() - synth_gguf.SIGMA) < 0.1 * synth_gguf.SIGMA, name
            assert abs(w.mean()) < 0.05 * synth_gguf.SIGMA, name


def test_reproducible(tiny, tmp_path):
    again = synth_gguf.write_synthetic(tmp_path / "again.gguf", SHAPE, seed=3, progress=False)
    assert again.read_bytes() == tiny.read_bytes()
    other = synth_gguf.ensure_synthetic(SHAPE, seed=4, path=tmp_path / "other.gguf")
    assert other.read_bytes() != tiny.read_bytes()
    mtime = other.stat().st_mtime_ns
    assert synth_gguf.ensure_synthetic(SHAPE, seed=4, path=other).stat().st_mtime_ns == mtime


def test_llama_cpp_logits_finite(tiny):
    pytest.importorskip("llama_cpp")
    from compare_llamacpp import LlamaCpp
    theirs = LlamaCpp(str(tiny), 1)
    assert theirs.n_vocab == 49152
    ctx = theirs._context(1, 64)
    prompt = [(i * 37 + 200) % 49152 for i in range(16)]
    theirs._decode(ctx, [(t, i, 0, True) for i, t in enumerate(prompt)])
    logits = np.ctypeslib.as_array(theirs.lc.llama_get_logits(ctx), shape=(16, 49152))
    assert np.isfinite(logits).all()
    # RMS-normed hidden (norm weights 1) times output rows of std SIGMA over 256 inputs
    assert 0.5 < logits.std() / (synth_gguf.SIGMA * 16) < 2


def test_engine_generates(tiny):
    prompt = [(i * 37 + 200) % 49152 for i in range(16)]
    with LLM(str(tiny), device=DEVICE, max_model_len=64, num_gpu_blocks_override=8) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 6
    assert all(0 <= t < 49152 for t in completion.token_ids)
