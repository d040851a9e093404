"""The llama.cpp-order attention's and SwiGLU's branch-free pieces equal the exact forms they
replace (end to end, tests/models/test_llamacpp_parity.py shows the tokens bit for bit)."""

from __future__ import annotations

import math

import numba
import numpy as np

from vllm_actors.kernels import ggml_attention as ga
from vllm_actors.kernels import ggml_math
from vllm_actors.kernels.cpu.activations import _f16_bits
from vllm_actors.kernels.cpu.attention_math import half_to_f32
from vllm_actors.kernels.cpu.intrinsics import fma_f32
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT


@numba.njit(cache=True)
def _both(xs, lut, fast, slow, exp_fast, exp_slow):  # type: ignore[no-untyped-def]
    for i in range(xs.size):
        fast[i] = ga._half_unit(xs[i])
        slow[i] = ga._half(xs[i], lut)
        x = -xs[i] * np.float32(87.0)
        exp_fast[i] = ggml_math.expf16_normal(x)
        exp_slow[i] = ggml_math.expf16(x)


def test_probability_rounding_and_softmax_exp_equal_the_exact_forms():
    """Every 61st float32 in [0, 1] (61 is prime to 2^13, so every rounding remainder and
    tie of the float16 mantissa comes up, at every exponent), and around float16's smallest
    normal: rounded as the float16 table rounds; exp on [-87, 0] as `expf16`."""
    edges = np.float32(2.0 ** -14) * np.array([1 - 2 ** -11, 1, 1 + 2 ** -10], np.float32)
    xs = np.concatenate([np.arange(0, 0x3F800001, 61, dtype=np.uint32).view(np.float32),
                         edges, np.float32([0.0, 1.0])])
    out = [np.empty_like(xs) for _ in range(4)]
    _both(xs, HALF_LUT, *out)
    assert np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32))
    assert np.array_equal(out[2].view(np.uint32), out[3].view(np.uint32))


@numba.njit(cache=True)
def _softmax_per_chunk(s, n):  # type: ignore[no-untyped-def]
    """ggml's soft_max as its loops run: the max one select after another, exp (`expf16`,
    every element) 16 keys at a time, each 16's `_mm512_reduce_add_ps` added in float64, the
    scaled probabilities rounded to float16: the reference of `_softmax16`'s passes."""
    top = np.float32(-np.inf)
    for i in range(n):
        v = s[i]
        top = v if v > top else top
    chunk = np.empty(16, np.float32)
    total = 0.0
    for c in range(0, n, 16):
        for lane in range(16):
            chunk[lane] = ggml_math.expf16(np.float32(s[c + lane] - top))
            s[c + lane] = chunk[lane]
        total += np.float64(ga._reduce16(chunk))
    inv = np.float32(1.0 / total)
    for i in range(n):
        s[i] = HALF_LUT[_f16_bits(np.float32(s[i] * inv))]


def test_softmax_equals_it_a_chunk_at_a_time():
    """Rows of 16 to 528 keys (the 16-chunk reductions 16 at once and one by one), masked
    keys at both ends, scores far below the max (subnormal and zero exps), equal maxima,
    +0 beside -0 as the max."""
    rng = np.random.default_rng(7)
    for n, spread in [(n, spread) for n in (16, 48, 256, 272, 528) for spread in (1.0, 40.0)
                      for _ in range(64)]:     # many rows: a sum's last bit seldom shows
        row = (rng.standard_normal(n) * spread).astype(np.float32)
        row[rng.integers(0, n, 3)] = row.max()
        row[-5:] = -np.inf
        row[:n // 8] = -np.inf
        if n == 48:
            row[n // 8:] = np.where(rng.random(n - n // 8) < 0.5, 0.0, -0.0) - 100 * (
                rng.random(n - n // 8) < 0.3)
            row[-5:] = -np.inf
        fast, ref = row.copy(), row.copy()
        ga._softmax16(fast, n, np.empty(n, np.float32))
        _softmax_per_chunk(ref, n)
        assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32)), (n, spread)


@numba.njit(cache=True)
def _swiglu_per_element(gate_up, out, width):  # type: ignore[no-untyped-def]
    """ggml's SwiGLU element by element (`expf` of the vector width on whole vectors, libm's
    on the tail): the form `ggml_math.swiglu` vectorizes."""
    f = out.shape[1]
    whole = f - f % width
    for r in range(out.shape[0]):
        for i in range(f):
            x = gate_up[r, i]
            e = ggml_math.expf(-x, width) if i < whole else np.float32(math.exp(-x))
            out[r, i] = np.float32(x / np.float32(np.float32(1.0) + e)) * gate_up[r, f + i]


def test_vectorized_swiglu_equals_it_element_by_element(monkeypatch):
    """On both widths, one row and several, a tail past the last vector,
    and the elements the branch-free loop must redo: outside exp's normal range, at its
    ends, NaN and infinities."""
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((17, 2 * 1541)) * 30).astype(np.float32)
    below, above = (np.nextafter(np.float32(v), np.float32(0)) for v in (-87.0, 88.0))
    gate_up[0, :16] = [np.nan, np.inf, -np.inf, 87.0, -88.0, 87.5, -88.5, 89.0, -89.0,
                       150.0, -150.0, 0.0, 1e-40, -1e-40, below, above]
    for width in (8, 16):
        monkeypatch.setattr(ggml_math, "ggml_width", lambda width=width: width)
        for rows in (gate_up[:1], gate_up):
            want = np.empty((len(rows), 1541), np.float32)
            _swiglu_per_element(rows, want, width)
            got = ggml_math.swiglu(rows)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (width, len(rows))


def _per_lane_decode(q, k, v, tables, ctx, bs, scale, window):  # type: ignore[no-untyped-def]
    """One-token attention through the per-lane forms of ggml's order (`_scores` and
    `_weighted_values` with one key, or one output lane, per vector lane): the reference
    of the one-token path `_attend` takes. The scores are compared on the way (the
    probabilities' float16 rounding hides most score differences)."""
    hq, dh = q.shape[1], q.shape[2]
    hk = k.shape[2]
    g = hq // hk
    out = np.empty_like(q)
    for r in range(q.shape[0]):
        p = ctx[r] - 1
        for kvh in range(hk):
            q16 = np.array([[ga._half(q[r, kvh * g + i, d], HALF_LUT) for d in range(dh)]
                            for i in range(g)], np.float32)
            pos = np.full(g, p, np.int64)
            s = np.empty((g, p + 1 + ga.LANES), np.float32)
            ga._scores(q16, k, tables[r], bs, kvh, pos, window, True,
                       np.float32(scale), s, np.empty(dh * ga.LANES, np.float32),
                       np.empty(64 * ga.LANES, np.float32),
                       np.empty(max(dh, ga.LANES), np.float32))
            fast = np.empty_like(s)
            koff = np.empty(p + 1, np.int64)
            ga._key_offsets(tables[r], bs, bs, hk, dh, kvh, p, koff)
            ga._decode_scores(q16, k.reshape(-1), v.reshape(-1), koff, p, window,
                              np.float32(scale), fast)
            assert np.array_equal(fast[:, :p + 1].view(np.uint32),
                                  s[:, :p + 1].view(np.uint32)), (dh, window, p)
            m = (p + ga.LANES) // ga.LANES * ga.LANES
            for i in range(g):
                s[i, p + 1:m] = -np.inf
                _softmax_per_chunk(s[i], m)
            rows = np.empty((g, dh), np.float32)
            ga._weighted_values(v, tables[r], bs, kvh, pos, True, s,
                                np.empty(64 * dh, np.float32),
                                np.empty((p + 1) * dh, np.float32), rows)
            out[r, kvh * g:(kvh + 1) * g] = rows
    return out


def test_one_token_path_equals_the_per_lane_forms(monkeypatch):
    """The one-token path (`_decode_scores`: one key at a time along vectors;
    `_decode_values`: 16 dimensions and 4 query heads at a time) gives the per-lane forms'
    floats bit for bit: a head dim of whole 64s (SmolLM2), one with leftovers added in
    float64 (80), Gemma's 256, GQA with 3, 4 and 5 query heads a KV head (a pass of 4 and a
    partial one), one query head a KV head, a sliding window, and contexts from 1 key to
    several blocks."""
    monkeypatch.setattr(ggml_math, "ggml_width", lambda: 16)   # the 16-lane items anywhere
    rng = np.random.default_rng(3)
    bs = 16
    for hq, hk, dh, ctx, window in ((9, 3, 64, [65, 1, 300], 0), (8, 2, 80, [50, 17], 7),
                                    (4, 1, 256, [40, 129], 0), (4, 4, 64, [33], 5),
                                    (10, 2, 32, [70], 0)):
        blocks = sum((c + bs - 1) // bs for c in ctx) + 1
        k, v = (rng.standard_normal((blocks, bs, hk, dh)).astype(np.float16).view(np.uint16)
                for _ in range(2))
        q = rng.standard_normal((len(ctx), hq, dh)).astype(np.float32)
        tables = np.zeros((len(ctx), blocks), np.int32)
        start = 1
        for r, c in enumerate(ctx):
            n = (c + bs - 1) // bs
            tables[r, :n] = np.arange(start, start + n)
            start += n
        qsl = np.arange(len(ctx) + 1, dtype=np.int32)
        fast = ga.attend(q, k, v, qsl, np.array(ctx, np.int32), tables, bs, 0.125, window)
        ref = _per_lane_decode(q, k, v, tables, ctx, bs, 0.125, window)
        assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32)), (hq, hk, dh, window)


def _per_lane_tiles(q, k, v, table, ctx0, bs, scale, window):  # type: ignore[no-untyped-def]
    """One request of len(q) tokens after ctx0 cached ones through the per-lane forms of
    tinyBLAS's order (`_scores`, `_weighted_values` with one key, or one output lane, per
    vector lane), tile by tile: the reference of the path `_attend` takes for such steps."""
    hq, dh = q.shape[1], q.shape[2]
    hk = k.shape[2]
    g = hq // hk
    out = np.empty_like(q)
    for kvh in range(hk):
        for t0 in range(0, len(q), ga.TILE):
            nt = min(ga.TILE, len(q) - t0)
            q16 = np.array([[ga._half(q[t0 + ti, kvh * g + i, d], HALF_LUT) for d in range(dh)]
                            for ti in range(nt) for i in range(g)], np.float32)
            pos = np.repeat(np.arange(ctx0 + t0, ctx0 + t0 + nt), g).astype(np.int64)
            s = np.empty((nt * g, pos.max() + 1 + ga.LANES), np.float32)
            ga._scores(q16, k, table, bs, kvh, pos, window, False, np.float32(scale), s,
                       np.empty(dh * ga.LANES, np.float32), np.empty(64 * ga.LANES, np.float32),
                       np.empty(max(dh, ga.LANES), np.float32))
            for i in range(nt * g):
                m = (pos[i] + ga.LANES) // ga.LANES * ga.LANES
                s[i, pos[i] + 1:m] = -np.inf
                _softmax_per_chunk(s[i], m)
            rows = np.empty((nt * g, dh), np.float32)
            ga._weighted_values(v, table, bs, kvh, pos, False, s, np.empty(ga.LANES * dh,
                                np.float32), np.empty((pos.max() + 1) * dh, np.float32), rows)
            out[t0:t0 + nt, kvh * g:(kvh + 1) * g] = rows.reshape(nt, g, dh)
    return out


def test_tile_path_equals_the_per_lane_forms(monkeypatch):
    """Steps of several tokens (register tiles of 4 query rows x 4 keys and 8 rows x 2
    dimensions) give the per-lane forms' floats bit for bit: a whole tile and a partial one
    after a cached context, GQA with 3 query heads a KV head (96 rows a tile, 15 in the
    partial one), 5 with a sliding window (105 rows), and a head dim of 80."""
    monkeypatch.setattr(ggml_math, "ggml_width", lambda: 16)
    rng = np.random.default_rng(5)
    bs = 16
    for hq, hk, dh, ctx0, tokens, window in ((9, 3, 64, 20, 37, 0), (10, 2, 80, 3, 21, 9)):
        blocks = (ctx0 + tokens + bs - 1) // bs + 1
        k, v = (rng.standard_normal((blocks, bs, hk, dh)).astype(np.float16).view(np.uint16)
                for _ in range(2))
        q = rng.standard_normal((tokens, hq, dh)).astype(np.float32)
        table = np.arange(1, blocks, dtype=np.int32)
        fast = ga.attend(q, k, v, np.array([0, tokens], np.int32),
                         np.array([ctx0 + tokens], np.int32), table[None], bs, 0.125, window)
        ref = _per_lane_tiles(q, k, v, table, ctx0, bs, 0.125, window)
        assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32)), (hq, hk, dh, window)


def test_one_token_order_only_where_llama_cpp_computes_a_row_alone():
    """A step's one-row requests: a decode (past its prompt), a 1-token prompt and the first
    row of a prompt's last 512-row call holding only it take the one-token order; the last
    row of a 33-token prompt (the cache held 32) and a lone chunk row inside a prompt do not;
    requests of several rows never."""
    starts = np.array([0, 1, 2, 3, 4, 5, 9], np.int32)
    seq_lens = np.array([40, 1, 513, 33, 17, 9], np.int32)     # rows 39, 0, 512, 32, 16
    prompts = np.array([33, 1, 513, 33, 33, 20], np.int32)
    assert ga.one_token(starts, seq_lens, prompts).tolist() == [
        True, True, True, False, False, False]
    assert ga.one_token(starts, seq_lens, None).tolist() == [True] * 5 + [False]


@numba.njit(cache=True)
def _per_lane8(q, k, v, table, ctx0, bs, scale, window, one_token, out):  # type: ignore[no-untyped-def]
    """One request's rows (positions ctx0 ..) through the 8-lane orders one element at a
    time: each key's score and each output's sum chained onto lane d % 8 (tinyBLAS<8>) or
    accumulator d % 32 (`ggml_vec_dot_f16`, then (a0 + a2) + (a1 + a3) per lane and two
    horizontal adds), soft_max's exp per key and its sums per 8 in float64; every key up to
    whole 32s, masked ones included (their probability 0 adds nothing)."""
    hq, dh, hk = q.shape[1], q.shape[2], k.shape[2]
    g = hq // hk
    for t in range(q.shape[0]):
        p = ctx0 + t
        n = (p + 32) // 32 * 32
        s, e = np.empty(n, np.float32), np.empty(n, np.float32)
        for h in range(hq):
            q16 = np.empty(dh, np.float32)
            for d in range(dh):
                q16[d] = ga._half(q[t, h, d], HALF_LUT)
            for j in range(n):
                if j > p or (window > 0 and j <= p - window):
                    s[j] = -np.inf
                    continue
                row = k[table[j // bs], j % bs, h // g]
                s[j] = np.float32(_dot8(row, q16, dh, one_token, True) * scale)
            top = np.float32(-np.inf)
            for j in range(n):
                top = max(top, s[j])
            total = 0.0
            for c in range(0, n, 8):
                for lane in range(8):
                    e[c + lane] = ggml_math.expf8(np.float32(s[c + lane] - top))
                total += np.float64(_hsum8(e[c:c + 8]))
            inv = np.float32(1.0 / total)
            for j in range(n):
                s[j] = ga._half_unit(np.float32(e[j] * inv))
            for d in range(dh):
                col = np.empty(n, np.float32)
                for j in range(n):      # past the context: llama.cpp's cells of zeros
                    col[j] = half_to_f32(v[table[j // bs], j % bs, h // g, d]) if j <= p \
                        else np.float32(0.0)
                out[t, h, d] = _dot8(col, s, n, one_token, False)


@numba.njit(cache=True)
def _hsum8(a):  # type: ignore[no-untyped-def]
    """The 8 float32 lanes a[0:8] summed as tinyBLAS's and soft_max's `hsum`: the high half
    added to the low, then (0 + 2) + (1 + 3)."""
    h0, h1, h2, h3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
    return (h0 + h2) + (h1 + h3)


@numba.njit(cache=True)
def _dot8(a, b, n, one_token, halves):  # type: ignore[no-untyped-def]
    """a . b (a float16 bits where `halves`) in tinyBLAS<8>'s or AVX2 vec_dot_f16's order."""
    chains = 32 if one_token else 8
    acc = np.zeros(chains, np.float32)
    whole = n - n % chains
    for d in range(whole):
        x = half_to_f32(a[d]) if halves else np.float32(a[d])
        acc[d % chains] = fma_f32(x, b[d], acc[d % chains])
    if not one_token:
        return _hsum8(acc)
    a8 = np.empty(8, np.float32)
    for i in range(8):
        a8[i] = (acc[i] + acc[16 + i]) + (acc[8 + i] + acc[24 + i])
    t0, t1, t2, t3 = a8[0] + a8[4], a8[1] + a8[5], a8[2] + a8[6], a8[3] + a8[7]
    dot = (t0 + t1) + (t2 + t3)
    if whole == n:
        return dot
    total = np.float64(dot)
    for d in range(whole, n):
        x = half_to_f32(a[d]) if halves else np.float32(a[d])
        total += np.float64(np.float32(x * b[d]))
    return np.float32(total)


def test_eight_lane_items_equal_the_per_lane_forms(monkeypatch):
    """Where the host's llama.cpp is 8 lanes wide (AVX2), `attend` takes `ggml_attention8`'s
    items (two keys a vector for the scores, every dimension at once for P . V): their
    floats equal the 8-lane orders element by element, bit for bit: one-token steps over
    1 to 70 keys (head dims 64 and 48, whose last 16 `ggml_vec_dot_f16` adds in float64),
    and steps of several tokens (a whole tile and a partial one) after a cached context,
    GQA with 3 query heads a KV head, with and without a sliding window. (llama.cpp's AVX2
    build gives the same tokens end to end: tests/models/test_llamacpp_parity.py.)"""
    monkeypatch.setattr(ggml_math, "ggml_width", lambda: 8)
    rng = np.random.default_rng(8)
    bs = 16
    for hq, hk, dh, window in ((9, 3, 64, 0), (6, 3, 48, 7)):
        for ctx0, tokens in ((0, 1), (32, 1), (69, 1), (20, 37)):
            blocks = (ctx0 + tokens + bs - 1) // bs + 1
            k, v = (rng.standard_normal((blocks, bs, hk, dh)).astype(np.float16)
                    .view(np.uint16) for _ in range(2))
            q = rng.standard_normal((tokens, hq, dh)).astype(np.float32)
            table = rng.permutation(np.arange(1, blocks)).astype(np.int32)
            fast = ga.attend(q, k, v, np.array([0, tokens], np.int32),
                             np.array([ctx0 + tokens], np.int32), table[None], bs, 0.125,
                             window)
            ref = np.empty_like(q)
            _per_lane8(q, k, v, table, ctx0, bs, np.float32(0.125), window, tokens == 1, ref)
            assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32)), \
                (hq, dh, window, ctx0, tokens)
