"""The quantized KV cache formats (`kernels/kv_quant.py`) on the device backends (OpenCL: PoCL
in CI; CUDA where CuPy sees a GPU) against the numpy backend's `QuantizedKV`.

- Stores: the device cache's bytes after `reshape_and_cache` equal `QuantizedKV.write`'s on
  the same k, v and slots, for float16, bfloat16 and fp8 on random values and on the edge
  cases of each format (ties, saturation, infinities, NaN, subnormals, signed zeros). For
  turboquant the device rotates rows with its own float32 matmul, which sums in another order
  than BLAS: rows are byte-identical but for a rare coordinate sitting on a centroid boundary
  (or a scale on a float16 rounding boundary), so up to 1% of the rows may differ, and only
  where the device's encoding is as close to the row as the reference's (within 1%).
- Attention: `paged_attention` over the device cache equals numpy's over its QuantizedKV
  (float32, 1e-4 of the output's scale) with GQA (3 query heads per KV head), on a decode
  batch, a chunked-prefill step, and a mixed step with a window, a soft cap and sinks; the
  turboquant caches are given the reference's bytes first, so that both read the same rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.device_kv import DeviceKV
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata

REF = NumpyBackend()
RNG = np.random.default_rng(4321)
FORMATS = ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "turboquant_2", "turboquant_2.5",
           "turboquant_3", "turboquant_3.5", "turboquant_4"]
BS, NUM_BLOCKS, KV_HEADS, HEADS = 4, 128, 2, 6


def fmt_of(name: str) -> kv_quant.KVFormat:
    """fp8 with per-tensor scales other than 1 (as a calibrated checkpoint carries)."""
    return kv_quant.kv_format(name, 0.05, 1.5) if name.startswith("fp8") \
        else kv_quant.kv_format(name)


def rand(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) + 0.1).astype(np.float32)


def both_caches(dev, fmt: kv_quant.KVFormat, head_dim: int):
    """Slot 1 of two on each backend (slot 1: turboquant's rotation must be the second
    slot's), both zeroed."""
    ref = REF.allocate_kv_cache(2, NUM_BLOCKS, BS, KV_HEADS, head_dim, fmt)
    got = dev.allocate_kv_cache(2, NUM_BLOCKS, BS, KV_HEADS, head_dim, fmt)
    assert len(got) == 2 and all(isinstance(c, DeviceKV) for c in got)
    assert np.array_equal(dev.to_host(got[1].k), ref[1].k)      # same shape, dtype, zeros
    return ref[1], got[1]


def step_meta(q_lens, seq_lens) -> AttentionMetadata:
    """Each request's blocks drawn at random from blocks 1.. (0 is the null block)."""
    q_lens, seq_lens = np.array(q_lens), np.array(seq_lens, np.int32)
    need = -(-seq_lens // BS)
    perm = RNG.permutation(np.arange(1, NUM_BLOCKS))
    tables = np.zeros((len(q_lens), int(need.max()) + 1), np.int32)
    for r, offset in enumerate(np.cumsum(need) - need):
        tables[r, :need[r]] = perm[offset:offset + need[r]]
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[rows, positions // BS].astype(np.int64) * BS + positions % BS
    return AttentionMetadata(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                             seq_lens, tables, slots, BS)


def store_meta(slots: np.ndarray) -> AttentionMetadata:
    """A step writing one token to each of `slots` (negative: skipped)."""
    n = len(slots)
    return AttentionMetadata(np.arange(n + 1, dtype=np.int32), np.ones(n, np.int32),
                             np.zeros((n, 1), np.int32), np.asarray(slots, np.int64), BS)


def store(dev, ref, got, k, v, meta) -> None:
    REF.reshape_and_cache(k, v, ref, REF.prepare_attention(meta))
    dev.reshape_and_cache(dev.upload_array(k), dev.upload_array(v), got,
                          dev.prepare_attention(meta))


def assert_same_rows(dev, ref, got, rotated: tuple[np.ndarray, np.ndarray] | None) -> None:
    """The device cache holds the reference's bytes (turboquant: see the module docstring;
    `rotated`: the rotated K and V rows the reference encoded, by slot)."""
    for which, want, y in zip("kv", (ref.k, ref.v), rotated or (None, None)):
        have = dev.to_host(getattr(got, which))
        assert have.dtype == want.dtype and have.shape == want.shape
        if ref.fmt.kind != kv_quant.TURBOQUANT:
            assert np.array_equal(have, want), which
            continue
        d = ref.head_dim
        have, want = have.reshape(-1, want.shape[-1]), want.reshape(-1, want.shape[-1])
        differ = np.flatnonzero((have != want).any(axis=1))
        assert len(differ) <= len(have) // 100, (which, len(differ))
        if len(differ):
            rows = y.reshape(-1, d)[differ]
            err_dev = np.linalg.norm(ref.fmt.decode(have[differ], d) - rows, axis=1)
            err_ref = np.linalg.norm(ref.fmt.decode(want[differ], d) - rows, axis=1)
            assert (err_dev <= err_ref * 1.01 + 1e-6).all(), which


def fill(dev, ref, got, head_dim: int) -> None:
    """Every slot but the null block's written on both, in scrambled order; some tokens of
    the step skipped (slot -1). Checks the stored bytes."""
    slots = RNG.permutation(np.arange(BS, NUM_BLOCKS * BS))
    slots = np.insert(slots, [3, 50, 51], -1)
    k, v = rand(len(slots), KV_HEADS, head_dim) * 2, rand(len(slots), KV_HEADS, head_dim)
    if ref.fmt.kind == kv_quant.TURBOQUANT:
        k[7] = 0.0           # a zero row: scale 0
    store(dev, ref, got, k, v, store_meta(slots))
    rotated = None
    if ref.fmt.kind == kv_quant.TURBOQUANT:
        rotated = tuple(np.zeros((NUM_BLOCKS * BS, KV_HEADS, head_dim), np.float32)
                        for _ in "kv")
        keep = slots >= 0
        for by_slot, x in zip(rotated, (k, v)):
            by_slot[slots[keep]] = ref.rotate(x[keep])
    assert_same_rows(dev, ref, got, rotated)


@pytest.mark.parametrize("head_dim", [64, 44, 128])
@pytest.mark.parametrize("name", FORMATS)
def test_store_matches_numpy(dev, name, head_dim):
    ref, got = both_caches(dev, fmt_of(name), head_dim)
    fill(dev, ref, got, head_dim)


def edge_values(fmt: kv_quant.KVFormat, which: str) -> np.ndarray:
    """Values at each format's edges (already multiplied by fp8's tensor scale), and random
    ones over 60 binades."""
    if fmt.kind == kv_quant.FP8:
        table = fmt.lut(1, which).astype(np.float64)[:128]
        finite = table[np.isfinite(table)]
        mids = (finite[1:] + finite[:-1]) / 2        # ties between neighbouring codes
        edges = np.concatenate([finite, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                                finite[-1] * np.array([1.01, 1.07, 1.2, 4.0, 1e30])])
    elif fmt.kind == kv_quant.FLOAT16:
        h = np.arange(0, 0x7C00, 97, dtype=np.uint16).view(np.float16).astype(np.float64)
        edges = np.concatenate([h, (h[1:] + h[:-1]) / 2, [65504.0, 65519.0, 65520.0, 1e6,
                                                          2.0 ** -25, 2.0 ** -24 * 1.5]])
    else:
        b = np.arange(0, 0x7F80, 61, dtype=np.uint32) << 16
        up = b | 0x8000             # ties: even and odd upper halves
        edges = np.concatenate([b.view(np.float32), up.view(np.float32),
                                (up + 1).view(np.float32), (up - 1).view(np.float32)])
    spread = 2.0 ** RNG.uniform(-40, 20, 4096)
    x = np.concatenate([edges, spread, [0.0, np.inf, 1e-45, 1e-40]]).astype(np.float32)
    x = np.concatenate([x, -x, [np.nan, -np.nan]])
    return x.astype(np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # numpy's float16 inf
@pytest.mark.parametrize("name", ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_store_edge_values(dev, name):
    """fp8: K unscaled (its ties are exact), V scaled by 0.05 (x / scale rounds first)."""
    fmt = kv_quant.kv_format(name, 1.0, 0.05)
    head_dim, width = 32, KV_HEADS * 32
    k_vals, v_vals = edge_values(fmt, "k"), edge_values(fmt, "v")
    tokens = -(-max(len(k_vals), len(v_vals)) // width)
    assert tokens <= (NUM_BLOCKS - 1) * BS
    k, v = np.zeros(tokens * width, np.float32), np.zeros(tokens * width, np.float32)
    k[:len(k_vals)], v[:len(v_vals)] = k_vals, v_vals
    k, v = (x.reshape(tokens, KV_HEADS, head_dim) for x in (k, v))
    ref, got = both_caches(dev, fmt, head_dim)
    store(dev, ref, got, k, v, store_meta(np.arange(BS, BS + tokens)))
    assert_same_rows(dev, ref, got, None)


STEPS = {"decode": ([1, 1, 1, 1], [230, 37, 3, 120]),
         "prefill": ([9, 5, 24], [29, 5, 224]),         # chunks after cached tokens, or at 0
         "mixed": ([1, 9, 5, 1], [230, 29, 5, 3])}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("head_dim", [64, 44])
@pytest.mark.parametrize("name", FORMATS)
def test_paged_attention_matches_numpy(dev, name, head_dim, step):
    """The mixed step also runs with a window of 16, a soft cap of 30 and sinks."""
    ref, got = both_caches(dev, fmt_of(name), head_dim)
    fill(dev, ref, got, head_dim)
    q_lens, seq_lens = STEPS[step]
    meta = step_meta(q_lens, seq_lens)
    t = sum(q_lens)
    q, k, v = rand(t, HEADS, head_dim) * 3, rand(t, KV_HEADS, head_dim), rand(t, KV_HEADS,
                                                                             head_dim)
    store(dev, ref, got, k, v, meta)
    if ref.fmt.kind == kv_quant.TURBOQUANT:    # the same bytes on both (store: tested above)
        got.k.set(ref.k)
        got.v.set(ref.v)
    else:
        assert_same_rows(dev, ref, got, None)
    window, softcap, sinks = (16, 30.0, rand(HEADS)) if step == "mixed" else (0, 0.0, None)
    ref_attn, dev_attn = REF.prepare_attention(meta), dev.prepare_attention(meta)
    want = REF.paged_attention(q, ref, ref_attn, 0.125, window, softcap, sinks)
    have = dev.to_host(dev.paged_attention(dev.upload_array(q), got, dev_attn, 0.125, window,
                                           softcap,
                                           None if sinks is None else dev.upload_array(sinks)))
    assert have.shape == want.shape and have.dtype == np.float32
    assert np.abs(have - want).max() <= 1e-4 * np.abs(want).max()


def test_float32_format_is_the_plain_cache(dev):
    for fmt in (None, kv_quant.kv_format("auto")):
        caches = dev.allocate_kv_cache(2, 3, BS, KV_HEADS, 8, fmt)
        assert len(caches) == 2 and all(isinstance(c, tuple) for c in caches)
        assert dev.to_host(caches[0][0]).shape == (3, BS, KV_HEADS, 8)
