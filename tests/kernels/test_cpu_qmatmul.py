"""The CPU backend's quantized matmul (`kernels/cpu/qmatmul`) against the reference
dequantizers (`kernels.quant`, bit-identical to gguf-py's), on random blocks of every type.

Blocks are random bytes with sane float16 scales (|d|, |dmin|, |m| in [1e-3, 1e-1]), so every
bit pattern of the quant fields is exercised. Products are checked against float64 products
of the reference weights: |out - ref| <= 1e-4 * (|x| @ |W|.T), elementwise (float32
accumulation over K <= 4096 stays orders of magnitude below that).
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from vllm_actors.kernels import quant
from vllm_actors.kernels.cpu import qmatmul as qm
from vllm_actors.kernels.cpu import qmatmul_layout as layout
from vllm_actors.kernels.cpu.jit import kernel
from vllm_actors.kernels.cpu.qmatmul_prims import half_to_float, half_to_float_soft

TYPES = sorted(layout.SUPPORTED)
LEGACY = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
REL_TOL = 1e-4


def random_weights(qt: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Stored data of a random (n, k) tensor of type qt, as a loader would hand it over."""
    rng = np.random.default_rng(seed)
    if qt == T.F32:
        return rng.standard_normal((n, k), dtype=np.float32)
    if qt == T.F16:
        return rng.standard_normal((n, k)).astype(np.float16)
    if qt == T.BF16:
        return (rng.standard_normal((n, k), dtype=np.float32).view(np.uint32) >> 16).astype(
            np.uint16)
    block_size, type_size = quant.block_layout(qt)
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for name, offset in quant.BLOCK_OFFSETS[qt].items():
        if name in ("d", "dmin", "m"):
            sign = rng.choice([-1, 1], (len(blocks), 1))
            scale = rng.uniform(1e-3, 1e-1, (len(blocks), 1)) * sign
            blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def reference(data: np.ndarray, qt: int, n: int, k: int) -> np.ndarray:
    return quant.dequantize(data, qt, (n, k)).astype(np.float64)


def assert_product(out: np.ndarray, x: np.ndarray, w64: np.ndarray) -> None:
    want = x.astype(np.float64) @ w64.T
    bound = REL_TOL * (np.abs(x).astype(np.float64) @ np.abs(w64).T) + 1e-30
    worst = np.max(np.abs(out - want) / bound)
    assert worst <= 1.0, f"error {worst * REL_TOL:.2e} of sum |w||x|"


def shapes_for(qt: int) -> list[tuple[int, int]]:
    block = quant.block_layout(qt)[0]
    ks = [256, 512, 1536] if block == quant.QK_K else [32, 96, 576]
    if qt in layout.FLOAT_TYPES:
        ks = [7, 96, 577]
    return [(1, ks[0]), (3, ks[1]), (5, ks[2]), (67, ks[1])]


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: T(t).name)
def test_rows_match_reference_bit_for_bit(qt, monkeypatch):
    n, k = 13, shapes_for(qt)[1][1]
    data = random_weights(qt, n, k)
    w = qm.pack(data, qt, (n, k))
    want = quant.dequantize(data, qt, (n, k))
    # the loader's split in chunks of 3 blocks on the threads, into a stacked matrix's rows
    monkeypatch.setattr(layout, "_CHUNK_BLOCKS", 3)
    stacked = qm.pack_stacked([data[:4], data[4:]], qt, [4, n - 4], k)
    for mine, theirs in zip(stacked.planes, w.planes, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    got = np.empty((n, k), dtype=np.float32)
    qm.dequantize_rows(w, 0, n, got)
    np.testing.assert_array_equal(got, want)
    for r0, r1 in [(0, 1), (5, 12), (12, 13), (4, 4)]:
        part = np.empty((r1 - r0, k), dtype=np.float32)
        qm.dequantize_rows(w, r0, r1, part)
        np.testing.assert_array_equal(part, want[r0:r1])
    ids = np.array([12, 0, 0, 7, 3])
    taken = np.empty((len(ids), k), dtype=np.float32)
    qm.take_rows(w, ids, taken)
    np.testing.assert_array_equal(taken, want[ids])


def _pack_in_child(data, shape, queue):
    queue.put(qm.pack(data, T.Q4_K, shape).planes)


def test_a_forked_child_splits_with_threads_of_its_own(monkeypatch):
    """A process forked after a load (the parent's split threads exist only in the parent)
    still splits in threads: it must not wait on the parent's pool for ever."""
    monkeypatch.setattr(layout, "_CHUNK_BLOCKS", 3)
    data = random_weights(T.Q4_K, 16, 512)
    want = qm.pack(data, T.Q4_K, (16, 512)).planes      # starts the pool here
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_pack_in_child, args=(data, (16, 512), queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.kill()
        child.join()
    for mine, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: T(t).name)
def test_matmul_against_float64_reference(qt):
    rng = np.random.default_rng(1)
    for n, k in shapes_for(qt):
        data = random_weights(qt, n, k, seed=n + k)
        w = qm.pack(data, qt, (n, k))
        w64 = reference(data, qt, n, k)
        for m in (1, 2, 3, 7, 16, 17, 32, 33, 300):   # GEMV, fused GEMM, blocked GEMM
            x = rng.standard_normal((m, k), dtype=np.float32)
            assert_product(qm.matmul(w, x), x, w64)
        for m in (1, 3, 8):      # the GEMV kernels at every M they may be given
            x = rng.standard_normal((m, k), dtype=np.float32)
            out = np.empty((m, n), dtype=np.float32)
            qm.gemv(w, x, out)
            assert_product(out, x, w64)


@pytest.mark.parametrize("qt", sorted(qm.MULTI_MAX_ROWS), ids=lambda t: T(t).name)
def test_multi_row_gemv_against_float64_reference(qt):
    """The multi-row GEMV (`qmatmul_multi`) at every group size (M 1-9: two weight rows per
    pass up to 5, one beyond), M split into groups (10-19), K in several slices (1536
    columns: three at 9 rows), odd row counts (a task's last pass clamps its second row), x
    on a 32-byte boundary and 4 or 16 bytes past one (copied by the kernel)."""
    rng = np.random.default_rng(5)
    for n, k in [(1, shapes_for(qt)[0][1]), (13, shapes_for(qt)[1][1]), (67, 1536)]:
        data = random_weights(qt, n, k, seed=n + k)
        w = qm.pack(data, qt, (n, k))
        w64 = reference(data, qt, n, k)
        for m in range(1, 20):
            buf = np.empty(m * k + 16, dtype=np.float32)
            start = (-buf.ctypes.data % 32) // 4 + (0, 1, 4)[m % 3]
            x = buf[start:start + m * k].reshape(m, k)
            x[...] = rng.standard_normal((m, k), dtype=np.float32)
            out = np.full((m, n), np.nan, dtype=np.float32)
            qm.multi_gemv(w, x, out)
            assert_product(out, x, w64)
        x = rng.standard_normal((qm.MULTI_MAX_ROWS[qt], k), dtype=np.float32)
        assert_product(qm.matmul(w, x), x, w64)      # and through matmul's dispatch


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: T(t).name)
def test_planes_are_a_compact_copy(qt):
    n, k = 4, shapes_for(qt)[1][1]
    data = random_weights(qt, n, k)
    data.setflags(write=False)                  # as a read-only memmap would be
    w = qm.pack(data, qt, (n, k))
    assert (w.qtype, w.rows, w.cols) == (qt, n, k)
    assert all(p.flags.c_contiguous and p.flags.writeable for p in w.planes)
    assert not any(np.shares_memory(p, data) for p in w.planes)
    assert w.nbytes <= 1.15 * layout.nbytes_gguf(qt, n, k)


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q8_0, T.F16, T.Q5_0], ids=lambda t: T(t).name)
def test_concat_stacks_rows(qt):
    k = shapes_for(qt)[1][1]
    sizes = (3, 1, 6)
    datas = [random_weights(qt, n, k, seed=i) for i, n in enumerate(sizes)]
    parts = [qm.pack(d, qt, (n, k)) for d, n in zip(datas, sizes, strict=True)]
    assert qm.supports_fused(parts)
    fused = qm.concat(parts)
    assert (fused.rows, fused.cols) == (sum(sizes), k)
    w64 = np.concatenate([reference(d, qt, n, k) for d, n in zip(datas, sizes, strict=True)])
    x = np.random.default_rng(2).standard_normal((2, k), dtype=np.float32)
    assert_product(qm.matmul(fused, x), x, w64)
    other = qm.pack(random_weights(T.Q8_0, 2, 2 * k), T.Q8_0, (2, 2 * k))
    assert not qm.supports_fused([parts[0], other])
    with pytest.raises(ValueError):
        qm.concat([parts[0], other])


def d_first_blocks(qtype: int, n: int, k: int) -> np.ndarray:
    """Random blocks of a type whose float16 d is at byte 0 (IQ4_NL, IQ4_XS)."""
    rng = np.random.default_rng(3)
    block_size, type_size = quant.block_layout(qtype)
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(1e-3, 1e-1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def test_types_without_kernels_are_converted(monkeypatch):
    n, k = 9, 256
    data = d_first_blocks(T.IQ4_XS, n, k)
    exact = quant.dequantize(data, T.IQ4_XS, (n, k))
    small = qm.pack(data, T.IQ4_XS, (n, k))            # small: kept as float32, exactly
    assert small.qtype == T.F32
    np.testing.assert_array_equal(small.planes[0], exact)

    monkeypatch.setattr(layout, "CONVERT_F32_MAX", 0)   # large: requantized to Q8_0
    big = qm.pack(data, T.IQ4_XS, (n, k))
    assert big.qtype == T.Q8_0
    got = np.empty((n, k), dtype=np.float32)
    qm.dequantize_rows(big, 0, n, got)
    block_max = np.abs(exact.reshape(-1, 32)).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - exact).reshape(-1, 32) <= block_max / 226)

    nl = d_first_blocks(T.IQ4_NL, n, k)                 # IQ4_NL: its exact Q8_0 form
    lossless = qm.pack(nl, T.IQ4_NL, (n, k))
    assert lossless.qtype == T.Q8_0
    qm.dequantize_rows(lossless, 0, n, got)
    want = quant.dequantize(nl, T.IQ4_NL, (n, k))
    np.testing.assert_array_equal(got, want)
    native = qm.pack_iq4_nl(nl, (n, k))                 # or as itself: its rows
    ids = np.array([3, 0, 8, 3])
    picked = np.empty((len(ids), k), np.float32)
    qm.take_rows(native, ids, picked)
    np.testing.assert_array_equal(picked, want[ids])

    ternary = gguf_quants.quantize(np.random.default_rng(4).standard_normal(
        (4, 256), dtype=np.float32), T.TQ2_0)
    tq = qm.pack(ternary, T.TQ2_0, (4, 256))
    x = np.ones((1, 256), dtype=np.float32)
    assert_product(qm.matmul(tq, x), x, reference(ternary, T.TQ2_0, 4, 256))


def test_bad_arguments_are_refused():
    w = qm.pack(random_weights(T.Q8_0, 4, 64), T.Q8_0, (4, 64))
    with pytest.raises(ValueError):
        qm.pack(random_weights(T.Q8_0, 4, 64), T.Q8_0, (4, 96))
    with pytest.raises(ValueError):                  # 48 columns: not whole Q4_0 blocks
        qm.pack(np.zeros(18, np.uint8), T.Q4_0, (1, 48))
    with pytest.raises(ValueError):
        qm.gemv(w, np.zeros((1, 64), np.float64), np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError):
        qm.dequantize_rows(w, 3, 5, np.zeros((2, 64), np.float32))
    with pytest.raises(IndexError):
        qm.take_rows(w, np.array([4]), np.zeros((1, 64), np.float32))


@kernel
def _convert_all(bits, out_soft, out_native):  # type: ignore[no-untyped-def]
    for i in range(bits.size):
        out_soft[i] = half_to_float_soft(bits[i])
        out_native[i] = half_to_float(bits[i])


def test_half_conversions_cover_every_value():
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    soft = np.empty_like(want)
    native = np.empty_like(want)
    _convert_all(bits, soft, native)
    np.testing.assert_array_equal(soft.view(np.uint32), want.view(np.uint32))   # NaN payloads too
    np.testing.assert_array_equal(native, want)                                 # NaN == NaN here
