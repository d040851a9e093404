"""The compiled CPU backend (`kernels/cpu/`) op by op and as a whole model, against the numpy
reference backend on the same inputs (random, never zeros).

Tolerances, float32: elementwise ops 1e-6 of the output's scale (the kernels compute the same
expressions, fused); reductions over the hidden size (RMSNorm, matmuls) 2e-5 of the output's
scale, since the kernels sum in another order than numpy/BLAS; whole-model logits 1e-4 on
logits of magnitude ~1-10, with the same argmax everywhere. The quantized matmul kernels and
attention have their own tests (test_cpu_qmatmul.py, test_cpu_attention.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants
from model_driver import prompt_logits
import quant_blocks
from tiny_models import TINY_PROMPT, write_llama_gguf

from vllm_actors.kernels import get_backend
from vllm_actors.kernels.cpu import elementwise, isa
from vllm_actors.kernels.cpu.backend import CpuBackend
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata, RopeTables, split_rope_cache
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.weights import RawTensor
from vllm_actors.models.base import rope_cos_sin
from vllm_actors.models.registry import load_model

REF = NumpyBackend()
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    return CpuBackend()


def rand(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) + 0.1).astype(np.float32)


def close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    scale = float(np.abs(want).max())
    assert scale > 0
    assert float(np.abs(got - want).max()) <= rel * scale


# Below PARALLEL_ROWS rows the serial kernels run, from it the parallel ones.
ROW_COUNTS = [1, 7, elementwise.PARALLEL_ROWS + 3]


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_rms_norm_and_fused_add(cpu, rows):
    x, w, d = rand(rows, 576), rand(576), rand(rows, 576)
    close(cpu.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), 2e-5)
    h, want_h = x.copy(), x + d
    h_out, normed = cpu.add_rms_norm(h, d, w, 1e-6)
    close(h_out, want_h, 1e-6)
    close(normed, REF.rms_norm(want_h, w, 1e-6), 2e-5)


def test_rms_norm_groups_equal_it_row_by_row():
    """The parallel kernels' groups of rows (their float64 sums of squares as vector lanes)
    give the row-at-a-time kernels' floats bit for bit: leftover rows, a width past the
    last whole 8, a strided view, and the fused residual add."""
    rows = 2 * elementwise.GROUP + 3
    for width in (576, 100):
        x, w = rand(rows, 2 * width)[:, ::2] * 7, rand(width)
        want = np.empty(x.shape, np.float32)
        elementwise._rms_norm_serial(x, w, 1e-6, want)
        got = elementwise.rms_norm(x, w, 1e-6)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        h, d = (np.array(x), np.array(x)), rand(rows, width)
        got = elementwise.add_rms_norm(h[0], d, w, 1e-6)
        elementwise._add_rms_norm_serial(h[1], d, w, 1e-6, want)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(h[0], h[1])


def test_rms_norm_over_heads_of_a_strided_view(cpu):
    qkv = rand(5, (4 + 2 * 2) * 16)
    _, k, _ = cpu.split_qkv(qkv, 4, 2, 16)
    w = rand(16)
    close(cpu.rms_norm(k, w, 1e-6), REF.rms_norm(np.ascontiguousarray(k), w, 1e-6), 2e-5)


@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_silu_mul(cpu, rows):
    gate_up = rand(rows, 2 * 96) * 4
    gate_up[0, :3] = [-200.0, 200.0, 0.0]        # exp overflow must give silu = -0, not nan
    with np.errstate(over="ignore"):
        want = REF.silu_mul(gate_up)
    close(cpu.silu_mul(gate_up), want, 1e-6)


EXTREMES = [-200.0, 200.0, 0.0, -9.0, 9.0, -1e-4, 3e-5, 0.7]   # exp overflow, tanh -> +-1


@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "erf"])
@pytest.mark.parametrize("rows, width", [(1, 96), (7, 97), (elementwise.PARALLEL_ROWS + 3, 33)])
def test_gelu_mul(cpu, rows, width, approximate):
    gate_up = rand(rows, 2 * width) * 4
    gate_up[0, :len(EXTREMES)] = EXTREMES
    want = REF.gelu_mul(gate_up, approximate)
    got = cpu.gelu_mul(gate_up, approximate)
    close(got, want, 1e-6)
    assert np.isfinite(got).all()
    other = REF.gelu_mul(gate_up, not approximate)    # the forms differ: each is the one asked
    assert np.abs(other - want).max() > 1e-4


@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "erf"])
@pytest.mark.parametrize("rows, width", [(1, 64), (5, 101), (elementwise.PARALLEL_ROWS + 3, 9)])
def test_gelu(cpu, rows, width, approximate):
    x = rand(rows, width) * 4
    x[0, :len(EXTREMES)] = EXTREMES
    want = REF.gelu(x.copy(), approximate)
    close(cpu.gelu(x.copy(), approximate), want, 1e-6)
    wide = rand(rows, 2 * width) * 4
    view = wide[:, ::2]                                # strided: into a new array
    close(cpu.gelu(view, approximate), REF.gelu(np.ascontiguousarray(view), approximate), 1e-6)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(1, 576), (7, 97), (elementwise.PARALLEL_ROWS + 3, 64),
                                   (3, 4, 33)])
def test_layer_norm(cpu, shape, with_bias):
    x = rand(*shape) * 3 + 5                           # off-centre: the mean matters
    w, bias = rand(shape[-1]), rand(shape[-1]) if with_bias else None
    want = REF.layer_norm(x, w, bias, 1e-5)
    got = cpu.layer_norm(x, w, bias, 1e-5)
    close(got, want, 2e-5)
    if with_bias:
        assert np.abs(REF.layer_norm(x, w, None, 1e-5) - want).max() > 1e-2


def test_scale(cpu):
    for x in (rand(3, 97), rand(elementwise.PARALLEL_ROWS + 3, 64)):
        want = x * np.float32(0.125)
        got = cpu.scale(x, 0.125)
        close(got, want, 1e-6)
        close(np.asarray(got), REF.scale(np.array(x / np.float32(0.125)), 0.125), 1e-6)


def test_greedy_ids_as_numpy_gives_them_and_non_finite_rows_refused(cpu):
    """`CpuBackend.argmax`: numpy's argmax (ties to the lowest id, -0.0 equal to +0.0, rows
    of negatives, a maximum past the last full chunk), -1 for a row with any inf or NaN;
    one row (the serial kernel) and several (the parallel one)."""
    logits = rand(8, 1000)
    logits[1, 17] = logits[1, 900] = 50.0                  # a tie goes to the lowest id
    logits[2] = -np.abs(logits[2]) - 1.0                    # all negative
    logits[2, 611] = -0.5
    logits[3] = 0.0
    logits[3, :5] = -1.0
    logits[3, 5:9] = -0.0                                    # -0.0 first, then +0.0
    logits[4, 999] = 80.0                                   # in the partial last chunk
    logits[5, 3], logits[6, 998], logits[7, 0] = np.nan, np.inf, -np.inf
    want = [int(np.argmax(r)) for r in logits[:5]] + [-1, -1, -1]
    assert want[1] == 17 and want[3] == 5
    assert cpu.argmax(logits).tolist() == want
    assert [int(cpu.argmax(logits[r:r + 1])[0]) for r in range(8)] == want
    min_float = np.full((1, 70), np.finfo(np.float32).min)
    min_float[0, 64] = np.finfo(np.float32).max
    assert cpu.argmax(min_float).tolist() == [64]


def test_paged_attention_passes_window_and_softcap(cpu):
    """The backend method hands both options to the kernels (their own tests are in
    test_cpu_attention.py): a decode and a 20-token chunk, one sequence each."""
    meta = AttentionMetadata(np.array([0, 1, 21], np.int32), np.array([30, 20], np.int32),
                             np.array([[1, 2], [3, 4]], np.int32),
                             np.array([45] + list(range(48, 68)), np.int64), 16)
    q, k, v = rand(21, 4, 8) * 4, rand(21, 2, 8), rand(21, 2, 8)
    caches = []
    for backend in (cpu, REF):
        cache = backend.allocate_kv_cache(1, 5, 16, 2, 8)[0]
        for part in cache:
            part[...] = rand(*part.shape)
        caches.append(cache)
    caches[1][0][...], caches[1][1][...] = caches[0]
    outs = []
    for backend, cache in zip((cpu, REF), caches):
        attn = backend.prepare_attention(meta)
        backend.reshape_and_cache(k, v, cache, attn)
        outs.append([backend.paged_attention(q.copy(), cache, attn, 0.35, window, softcap)
                     for window, softcap in ((0, 0.0), (5, 0.0), (0, 2.0), (5, 2.0))])
    for got, want in zip(*outs):
        close(got, want, 2e-5)
    plain = outs[1][0]
    assert all(np.abs(other - plain).max() > 1e-2 for other in outs[1][1:])


@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("interleaved, rotary_dim", [(False, 16), (True, 16), (False, 8)])
def test_rope_in_place_on_views(cpu, rows, interleaved, rotary_dim):
    cos, sin = rope_cos_sin(1.0 / (10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)), 64)
    tables = RopeTables(cos.astype(np.float32), sin.astype(np.float32), rotary_dim, interleaved)
    positions = RNG.integers(0, 64, rows)
    qkv = rand(rows, (4 + 2 * 2) * 16)
    want = [REF.rope(np.ascontiguousarray(t), REF.prepare_rope(positions, tables))
            for t in REF.split_qkv(qkv.copy(), 4, 2, 16)[:2]]
    q, k, _ = cpu.split_qkv(qkv, 4, 2, 16)
    step = cpu.prepare_rope(positions, tables)
    for got, expected in zip((cpu.rope(q, step), cpu.rope(k, step)), want):
        close(np.ascontiguousarray(got), expected, 1e-6)
    close(np.ascontiguousarray(q), want[0], 1e-6)    # rotated in place, in the fused output


@pytest.mark.parametrize("rows", [5, elementwise.PARALLEL_ROWS + 3])
@pytest.mark.parametrize("dtype, interleaved, fused, rotary_dim, normed",
                         [("float32", False, False, 8, False), ("float16", True, True, 16, True)])
def test_rope_and_cache_gives_the_bits_of_the_ops_one_by_one(rows, dtype, interleaved, fused,
                                                             rotary_dim, normed):
    """The one kernel of `rope_and_cache` (`attention.write_qkv`) against `split_qkv`,
    `rms_norm` and `rope` on q and k and `reshape_and_cache` on the same backend
    (`ops.split_rope_cache`): q and every cache cell, bit for bit, a slot of -1 left
    unwritten. Both pair orders, a partial rotary, ggml's multiply-adds, a float32 and a
    float16 cache, q/k norms (5 tokens: one kernel, against `rms_norm`'s 16-row lanes on
    q's 20 heads), and the rows RoPE splits over threads."""
    backend = CpuBackend(kv_cache_dtype=dtype)
    cos, sin = rope_cos_sin(1.0 / (10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)), 64)
    tables = RopeTables(cos.astype(np.float32), sin.astype(np.float32), rotary_dim,
                        interleaved, fused)
    slots = RNG.permutation(80)[:rows]
    slots[rows // 2] = -1                           # a row the cache does not take
    meta = AttentionMetadata(np.array([0, rows], np.int32), np.array([rows], np.int32),
                             np.zeros((1, 5), np.int32), slots.astype(np.int64), 16)
    step = backend.prepare_rope(RNG.integers(0, 64, rows), tables)
    attn = backend.prepare_attention(meta)
    qkv = rand(rows, (4 + 2 * 2) * 16) * 3
    norms = (rand(16) + 1, rand(16) + 1, 1e-6) if normed else None
    got, want = (backend.allocate_kv_cache(1, 5, 16, 2, 16)[0] for _ in range(2))
    q = backend.rope_and_cache(qkv, 4, 2, 16, step, got, attn, norms)
    q_want = split_rope_cache(backend, qkv.copy(), 4, 2, 16, step, want, attn, norms)
    assert q.tobytes() == np.ascontiguousarray(q_want).tobytes()
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
    written = got[1].reshape(80, -1)
    assert np.all(written[slots[slots >= 0]] != 0) and not written[np.isin(
        np.arange(80), slots, invert=True)].any()


def test_embedding_and_tied_lm_head_share_one_table(cpu):
    table = rand(300, 64)
    raw = RawTensor("token_embd.weight", (300, 64), int(QT.Q8_0), quants.quantize(table, QT.Q8_0))
    handle = cpu.upload_table(raw)
    head = cpu.upload_lm_head(raw)
    assert head.parts[0] is handle and len(head.parts) == 1   # no second copy of the LM head
    want_table = quants.dequantize(raw.data, QT.Q8_0).reshape(300, 64)
    ids = np.array([3, 0, 299, 3])
    close(cpu.embedding(handle, ids), want_table[ids], 1e-6)
    hidden = rand(6, 64)
    close(cpu.lm_head(hidden, head, np.array([5, 1])), hidden[[5, 1]] @ want_table.T, 2e-5)


def random_blocks(qtype: QT, rows: int, cols: int) -> np.ndarray:
    return quant_blocks.random_blocks(qtype, rows, cols, RNG)


def test_fused_linear_of_parts_in_different_formats(cpu):
    """Q4_K_M stores attn_v (and some ffn_down) as Q6_K beside Q4_K q/k: one fused QKV."""
    parts = [("q", QT.Q4_K, 256), ("k", QT.Q4_K, 64), ("v", QT.Q6_K, 64)]
    raws, dense = [], []
    for name, qtype, rows in parts:
        blocks = random_blocks(qtype, rows, 512)
        raws.append(RawTensor(name, (rows, 512), int(qtype), blocks))
        dense.append(quants.dequantize(blocks, qtype).reshape(rows, 512))
    linear = cpu.upload_linear(raws)
    bias = rand(384)
    for t in (1, 3, 40):
        x = rand(t, 512)
        close(cpu.linear(x, linear, bias), x @ np.concatenate(dense).T + bias, 2e-5)


def test_fused_linear_packs_runs_of_one_kind_each_in_its_own_order(cpu):
    """Under the quantized semantics consecutive parts of one type and float order pack into
    one matrix (Gemma 3's Q5_0 Q and K, not its Q8_0 V), each matrix in the order llama.cpp
    gives its own tensors (a Q4_0 of 16 rows repacked, one of 12 not), and every output
    equals the part's computed alone, bit for bit, for a decode step and a batch."""
    def raw(name, qtype, rows):  # type: ignore[no-untyped-def]
        fmt = "q8_0" if qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0) else None
        return RawTensor(name, (rows, 64), int(qtype), random_blocks(qtype, rows, 64), fmt)
    repacks = "avx2" in isa.available()
    for parts, kinds in (([raw("q", QT.Q5_0, 32), raw("k", QT.Q5_0, 16), raw("v", QT.Q8_0, 16)],
                          [(QT.Q5_0, 48, False), (QT.Q8_0, 16, False)]),
                         ([raw("a", QT.Q4_0, 16), raw("b", QT.Q4_0, 12)],
                          [(QT.Q4_0, 16, repacks), (QT.Q4_0, 12, False)])):
        linear = cpu.upload_linear(parts)
        assert [(m.qtype, m.rows, m.ggml_repacked) for m in linear.parts] == kinds
        alone = [cpu.upload_linear([p]) for p in parts]
        for x, requests in ((rand(1, 64), None), (rand(3, 64), np.ones(3, np.int64))):
            want = np.concatenate([cpu._linear(x, w, None, requests) for w in alone], axis=1)
            got = cpu._linear(x, linear, None, requests)      # a step's requests, as `linear`
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [None, QT.Q8_0, QT.Q4_1], ids=["f32", "q8_0", "q4_1"])
def test_tiny_llama_matches_numpy(cpu, qtype, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, qtype=qtype)
    want = prompt_logits(load_model(resolve_model(path), REF), REF, TINY_PROMPT,
                         [17, 1, 1, 21], block_size=8)
    got = prompt_logits(load_model(resolve_model(path), cpu), cpu, TINY_PROMPT,
                        [17, 1, 1, 21], block_size=8)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_weights_stay_quantized(cpu, tmp_path):
    path = tmp_path / "tiny_q4.gguf"
    write_llama_gguf(path, qtype=QT.Q4_1)
    backend = CpuBackend()
    load_model(resolve_model(path), backend)
    import gguf
    reader = gguf.GGUFReader(str(path))
    matrices = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
    assert 0 < backend.weight_bytes <= 1.15 * matrices


def test_device_names():
    assert isinstance(get_backend("cpu"), CpuBackend)
    assert isinstance(get_backend("numpy"), NumpyBackend)
    with pytest.raises(ValueError):
        CpuBackend(kv_cache_dtype="int4")
