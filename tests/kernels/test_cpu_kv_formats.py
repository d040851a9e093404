"""The quantized KV cache formats (kernels/kv_quant.py) on the compiled CPU backend against the
numpy reference backend: the bytes written, and attention over them.

- Bytes: for bfloat16 and fp8 the compiled encoder writes exactly the reference's bytes (also
  on rounding ties, saturation and NaN). For turboquant the codes are equal except where a
  coordinate lands within float64 rounding of a codebook midpoint (none in these draws) and
  the float16 row scale may differ by one unit in the last place (the two sum <y, c> in a
  different order before rounding): rows are compared decoded, within 1e-3 relative.
- Attention: both backends read the same cache (the numpy one decodes whole blocks first,
  the compiled one decodes tile by tile inside its loop), so outputs agree to float32 rounding
  (atol 2e-5); decode batches, chunked prefill, GQA, a sliding window, soft-capping and
  split-context plans are covered.
- Format sanity: the quantization error of each format is what its width allows (so a
  format that silently stored float32 would fail) and turboquant's rotation is orthogonal.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.cpu import attention as cpu
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.kernels.ops import AttentionMetadata

FORMATS = ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "turboquant_2", "turboquant_2.5",
           "turboquant_3.5", "turboquant_4"]
BLOCK = 8
# relative squared error of unit-normal rows a format allows (measured values well inside)
MAX_REL_MSE = {"float16": 1e-6, "bfloat16": 2e-5, "fp8_e4m3": 2e-3, "fp8_e5m2": 8e-3,
               "turboquant_2": 0.13, "turboquant_2.5": 0.08, "turboquant_3.5": 0.025,
               "turboquant_4": 0.011}


def _meta(ctx_lens: list[int], q_lens: list[int], blocks_per_req: int) -> AttentionMetadata:
    rng = np.random.default_rng(7)
    ids = rng.permutation(np.arange(1, len(ctx_lens) * blocks_per_req + 1)).astype(np.int32)
    tables = ids.reshape(len(ctx_lens), blocks_per_req)
    slots = []
    for r, (ctx, q) in enumerate(zip(ctx_lens, q_lens)):
        pos = np.arange(ctx - q, ctx)
        slots.append(tables[r][pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
    return AttentionMetadata(query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(
        np.int32), seq_lens=np.array(ctx_lens, np.int32), block_tables=tables,
        slot_mapping=np.concatenate(slots), block_size=BLOCK)


def _fill(numpy_cache, cpu_cache, meta_all, hk, dh, rng, fp8):
    """Write every context position's K/V into both caches, as one prefill step."""
    n = int(meta_all.query_start_loc[-1])
    k = (rng.standard_normal((n, hk, dh)) * 2).astype(np.float32)
    v = rng.standard_normal((n, hk, dh)).astype(np.float32)
    if fp8:   # saturation and rounding ties, on purpose
        k[0, 0, :3] = [448.0, 1e6, -57344.0]
        k[1, 0, :2] = [2.0 ** -10, 1.5 * 2.0 ** -9]
    NumpyBackend().reshape_and_cache(k, v, numpy_cache, NumpyBackend().prepare_attention(
        meta_all))
    cpu.write_kv(k, v, cpu_cache, cpu.prepare(meta_all))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dh", [64, 40])
def test_compiled_attention_matches_reference(name, dh):
    fmt = kv_quant.kv_format(name)
    hk, g = 2, 3
    ctx_lens, q_lens = [37, 300, 5, 130], [1, 1, 5, 64]   # decodes, a prompt, a chunk
    blocks_per_req = -(-max(ctx_lens) // BLOCK)
    num_blocks = len(ctx_lens) * blocks_per_req + 1
    numpy_cache = NumpyBackend().allocate_kv_cache(1, num_blocks, BLOCK, hk, dh, fmt)[0]
    cpu_cache = cpu.allocate_kv_cache(1, num_blocks, BLOCK, hk, dh, kv_format=fmt)[0]
    assert isinstance(cpu_cache, (kv_quant.QuantizedKV, tuple))
    rng = np.random.default_rng(dh)
    _fill(numpy_cache, cpu_cache, _meta(ctx_lens, ctx_lens, blocks_per_req), hk, dh, rng,
          fmt.kind == kv_quant.FP8)
    if isinstance(cpu_cache, tuple):         # float16: the backend's own uint16 layout
        ref_k = numpy_cache.k
        np.testing.assert_array_equal(cpu_cache[0], ref_k)
        np.testing.assert_array_equal(cpu_cache[1], numpy_cache.v)
    elif fmt.kind == kv_quant.TURBOQUANT:
        for got, ref in ((cpu_cache.k, numpy_cache.k), (cpu_cache.v, numpy_cache.v)):
            np.testing.assert_array_equal(got[..., :-2], ref[..., :-2])     # the codes
            np.testing.assert_allclose(fmt.decode(got, dh), fmt.decode(ref, dh), rtol=1e-3,
                                       atol=1e-6)
    else:
        np.testing.assert_array_equal(cpu_cache.k, numpy_cache.k)
        np.testing.assert_array_equal(cpu_cache.v, numpy_cache.v)
    meta = _meta(ctx_lens, q_lens, blocks_per_req)
    q = rng.standard_normal((sum(q_lens), hk * g, dh)).astype(np.float32)
    # the same bytes in both (turboquant's scales may differ by an ulp): copy the reference's
    if not isinstance(cpu_cache, tuple):
        cpu_cache.k[...] = numpy_cache.k
        cpu_cache.v[...] = numpy_cache.v
    for window, softcap in ((0, 0.0), (48, 0.0), (0, 30.0)):
        ref = NumpyBackend().paged_attention(q, numpy_cache, NumpyBackend().prepare_attention(
            meta), 0.125, window, softcap)
        got = cpu.paged_attention(q, cpu_cache, cpu.prepare(meta, threads=2), 0.125,
                                  window=window, softcap=softcap)
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_quantization_error_fits_the_width(name):
    fmt = kv_quant.kv_format(name)
    d = 128
    x = np.random.default_rng(3).standard_normal((2000, d)).astype(np.float32)
    rot = kv_quant.rotation(5, d) if fmt.kind == kv_quant.TURBOQUANT else np.eye(d,
                                                                                  dtype=np.float32)
    y = x @ rot.T
    back = fmt.decode(fmt.encode(y), d) @ rot
    rel = float(((back - x) ** 2).sum() / (x ** 2).sum())
    assert 0 < rel < MAX_REL_MSE[name]
    assert fmt.row_bytes(d) < 4 * d


def test_turboquant_rows_are_small_and_the_rotation_orthogonal():
    fmt = kv_quant.kv_format("turboquant")
    assert fmt.bits == 3.5 and fmt.row_bytes(64) == 28 + 2 and fmt.row_bytes(128) == 56 + 2
    rot = kv_quant.rotation(3, 64)
    np.testing.assert_allclose(rot @ rot.T, np.eye(64), atol=1e-5)
    assert not np.allclose(rot, kv_quant.rotation(4, 64))       # one per cache slot
    np.testing.assert_array_equal(rot, kv_quant.rotation(3, 64))   # the same every time
    book = kv_quant.codebook(3, 64)
    np.testing.assert_allclose(book, -book[::-1])
    assert len(book) == 8 and 2.0 < book[-1] < 2.3               # Lloyd-Max, ~N(0, 1)


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="turboquant_2.5"):
        kv_quant.kv_format("turboquant_5")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_quant.kv_format("int4")


def test_fp8_bytes_decode_in_registers_as_the_table_says():
    """The compiled reads decode fp8 arithmetically (e4m3) or as a float16's top byte (e5m2);
    every one of the 256 codes equals kv_quant's table (NaN codes NaN)."""
    from vllm_actors.kernels.cpu.attention_kv import e4m3_to_f32
    from vllm_actors.kernels.cpu.attention_math import read_half
    from vllm_actors.kernels.cpu.jit import kernel

    @kernel
    def decode_all(out4, out5):
        for b in range(256):
            out4[b] = e4m3_to_f32(np.uint32(b))
            out5[b] = read_half(np.uint16(np.uint32(b) << np.uint32(8)))

    out4, out5 = np.empty(256, np.float32), np.empty(256, np.float32)
    decode_all(out4, out5)
    for got, ref in ((out4, kv_quant.FP8_E4M3), (out5, kv_quant.FP8_E5M2)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        fin = ~np.isnan(ref)
        np.testing.assert_array_equal(got[fin].view(np.uint32), ref[fin].view(np.uint32))
