"""A decode step's Q6_K linear: rows of x (Q8_K blocks, each a one-row request) against a Q6_K
weight, in the float order of ggml's `vec_dot_q6_K_q8_K` (its AVX2 form, which x86 builds
run), with 16 weight rows as the lanes of a vector and no decoded copy. The low bits, high
bits and scales are stored 16 rows interleaved (`qmatmul.interleave`), so each 64 bytes of a
chunk's superblock are one word of every row, and d 16 rows side by side.

ggml keeps 8 int32 lanes a row: lane t of a superblock is

    sum_c s_(2c + t // 4) (q_(32c + 4t ..) . x_(32c + 4t ..)) - 32 (s_2t b_2t + s_2t+1 b_2t+1)

(c the 8 runs of 32 weights, q the unsigned 6-bit codes, s the 16 scales, b x's sums of 16),
then acc_t = fma(d_w d_x, lane t, acc_t) per superblock and the 8 float lanes added as
`hsum_float_8` adds them. Here each of those 8 lanes is a vector of 16 weight rows: a run's
4 codes of every row times x's 4 quants (broadcast) is one `vpmaddubsw`, its scale taken with
the sum by one `vpdpwssd` on (s, s) int16 pairs (ggml's `vpmaddubsw` + `vpmaddwd` on AVX2,
widening multiplies elsewhere): the same integers, so the same floats, bit for bit a direct
computation of ggml's lanes (`tests/kernels/test_krow6.py`). The next chunk is prefetched
as the superblocks go.
Parallel over fixed chunks of 16 weight rows (`krow._rows`).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_actors.kernels.cpu.intrinsics import prefetch_line
from vllm_actors.kernels.cpu.jit import Callback, callback
from vllm_actors.kernels.cpu.ktiled import (LANES, arguments, array_ptr, fma16, llvm_call,
                                            madd_pairs, q6_codes)
from vllm_actors.kernels.cpu.qdot import AVX2, AVX512
from vllm_actors.kernels.cpu.qmatmul_prims import prefetch_span
from vllm_actors.kernels.cpu.qmatmul_simd import splat
from vllm_actors.kernels.cpu.qwide import half_lanes

_I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (8, 16, 32, 64))
_B64 = ir.VectorType(_I8, 64)
_W32 = ir.VectorType(_I16, 32)
_L16 = ir.VectorType(_I32, 16)
_F16 = ir.VectorType(ir.FloatType(), 16)
GROUP = 4            # rows of x one pass over a chunk's superblocks takes


def _c(n):  # type: ignore[no-untyped-def]
    return ir.Constant(_I64, n)


@intrinsic
def q6_k_rows(typingctx, isa_, m, ql, qh, sc, qo, d, do, nsb, lut, x, xb, xd, x0, out, oo, po, no):  # type: ignore[no-untyped-def]
    """x's rows x0 .. x0 + m - 1 (m a literal; row r's quants at x.flat[256 nsb r ..], sums of
    16 at xb.flat[16 nsb r ..], scales at xd.flat[nsb r ..]) against a chunk of 16 interleaved
    Q6_K rows: superblock sb's low bits at ql.flat[qo + 2048 sb ..], high bits at
    qh.flat[qo / 2 + 1024 sb ..], scales at sc.flat[qo / 8 + 256 sb ..] (bytes), row l's d
    at d.flat[do + 16 sb + l]; out.flat[r no + oo : .. + 16] = row r's 16 outputs. The
    chunk at ql.flat[po ..] (and its other planes) is prefetched as the superblocks go."""
    if not (isinstance(isa_, types.IntegerLiteral) and isinstance(m, types.IntegerLiteral)
            and isinstance(x, types.Array) and x.dtype == types.int8):
        return None
    path, count = isa_.literal_value, m.literal_value

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        (qo_, do_, nsb_, x0_, oo_, po_, no_), load = arguments(context, builder, sig, args,
                                                              (5, 7, 8, 13, 15, 16, 17))

        def at(r, per, sb):  # type: ignore[no-untyped-def]
            """Element sb * per of x's row x0 + r in an array of `per` values a superblock."""
            row = builder.add(x0_, _c(r))
            return builder.mul(builder.add(builder.mul(nsb_, row), sb), _c(per))

        zero = ir.Constant(_F16, [0.0] * 16)
        accs = cgutils.alloca_once(builder, _F16, size=8 * count)    # lane t of row r: 8 r + t
        for i in range(8 * count):
            builder.store(zero, builder.gep(accs, [_c(i)]))
        offsets = cgutils.alloca_once(builder, _L16, size=8)
        with cgutils.for_range(builder, nsb_) as loop:
            sb = loop.index
            bases = [builder.add(builder.udiv(qo_, _c(div)), builder.mul(sb, _c(size)))
                     for div, size in ((1, 2048), (2, 1024), (8, 256))]
            ahead = [builder.add(builder.udiv(po_, _c(div)), builder.mul(sb, _c(size)))
                     for div, size in ((1, 2048), (2, 1024), (8, 256))]

            def plane(i, off):  # type: ignore[no-untyped-def]
                """64 bytes of plane i (0 ql, 1 qh, 2 scales) at off in the superblock,
                the same bytes of the next chunk hinted into cache."""
                prefetch_line(builder, array_ptr(context, builder, sig, args, 2 + i,
                                                 builder.add(ahead[i], off), _I8))
                return load(2 + i, builder.add(bases[i], off), _B64)
            dw = half_lanes(builder, load(6, builder.add(do_, builder.mul(sb, _c(LANES))),
                                          ir.VectorType(_I16, LANES), 2),
                            lambda v: load(9, builder.zext(v, _I64), ir.FloatType(), 4))
            dd = [builder.fmul(dw, splat(builder, load(12, at(r, 1, sb), ir.FloatType(), 4),
                                         _F16)) for r in range(count)]     # d_w d_x
            _superblock(builder, path, plane, load, offsets, accs, dd,
                        [at(r, 256, sb) for r in range(count)],
                        [at(r, 16, sb) for r in range(count)])
        for r in range(count):
            o = builder.add(builder.mul(no_, builder.add(x0_, _c(r))), oo_)
            builder.store(hsum_lanes(builder, [builder.load(builder.gep(accs, [_c(8 * r + t)]))
                                               for t in range(8)]),
                          array_ptr(context, builder, sig, args, 14, o, _F16), align=4)
        return context.get_dummy_value()
    return types.none(isa_, m, ql, qh, sc, qo, d, do, nsb, lut, x, xb, xd, x0, out, oo, po,
                      no), codegen


def hsum_lanes(builder, a):  # type: ignore[no-untyped-def]
    """8 float lanes (vectors) added as ggml's `hsum_float_8` adds them:
    ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    return builder.fadd(builder.fadd(builder.fadd(a[4], a[0]), builder.fadd(a[6], a[2])),
                        builder.fadd(builder.fadd(a[5], a[1]), builder.fadd(a[7], a[3])))


def _superblock(builder, path, plane, load, offsets, accs, dd, xos, bos):  # type: ignore[no-untyped-def]
    """One superblock of the chunk onto each row r of x's 8 float lanes (accs[8 r + t]):
    lane t's integers (`_lane`) less 32 (s_2t b_2t + s_2t+1 b_2t+1) (b x's sums of 16 from
    bos[r]), then acc = fma(lane, d_w d_x (dd[r]), acc). The lanes run as a loop of 4 for
    each half of the scales, so LLVM keeps one lane's values in registers (unrolled, it
    loaded every lane's codes first and spilled them)."""
    scales = [plane(2, _c(64 * v)) for v in range(4)]
    for t in range(8):          # each lane's offset scales (s_2t, s_2t+1)
        builder.store(scale_pair(builder, scales, 2 * t, 2 * t + 1),
                      builder.gep(offsets, [_c(t)]))
    for h in range(2):          # lanes 4 h .. 4 h + 3 share their runs' scales
        pairs = [scale_pair(builder, scales, 2 * c + h, 2 * c + h) for c in range(8)]
        with cgutils.for_range(builder, _c(4)) as lanes:
            t = builder.add(lanes.index, _c(4 * h))
            sums = _lane(builder, path, plane, pairs, t, xos, load)
            off = builder.load(builder.gep(offsets, [t]))
            for r, total in enumerate(sums):
                b = splat(builder, load(11, builder.add(bos[r], builder.mul(t, _c(2))),
                                        _I32, 2), _L16)
                total = builder.sub(total, builder.shl(madd_pairs(builder, path, off, b),
                                                       ir.Constant(_L16, [5] * 16)))
                slot = builder.gep(accs, [builder.add(t, _c(8 * r))])
                builder.store(fma16(builder, builder.sitofp(total, _F16), dd[r],
                                    builder.load(slot)), slot)


def _lane(builder, path, plane, pairs, t, xos, load):  # type: ignore[no-untyped-def]
    """ggml's integer lane t (a value: 4 h + 0..3) of 16 weight rows for each row of x
    (quants from xos[r]) before the offset: the 8 runs' codes of weights 32 c + 4 t .. (low
    bits in word 16 (c // 4) + 8 (c % 2) + t of the superblock, nibble c % 4 // 2; high bits
    in word 8 (c // 4) + t, bits 2 (c % 4)), each times its scale pair (s_(2c + h), twice).
    With one or two rows of x the runs alternate between 4 or 2 sums a row, added at the
    end: one chain of 8 multiply-adds waited on each one's latency."""
    def word(i, n):  # type: ignore[no-untyped-def]
        return plane(i, builder.mul(builder.add(t, _c(n)), _c(64)))
    low = {(hh, j): word(0, 16 * hh + 8 * j) for hh in range(2) for j in range(2)}
    high = [word(1, 8 * hh) for hh in range(2)]
    chains = max(1, 4 // len(xos))
    sums = [[ir.Constant(_L16, [0] * 16)] * chains for _ in xos]
    for c in range(8):
        hh, j = divmod(c, 4)
        codes = q6_codes(builder, path, low[hh, j % 2], high[hh], j)
        for r, xo in enumerate(xos):
            at = builder.add(builder.add(xo, builder.mul(t, _c(4))), _c(32 * c))
            xv = builder.bitcast(splat(builder, load(10, at, _I32), _L16), _B64)
            sums[r][c % chains] = scaled_dot4(builder, path, sums[r][c % chains], codes, xv,
                                              pairs[c])
    out = []
    for parts in sums:
        while len(parts) > 1:
            parts = [builder.add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
        out.append(parts[0])
    return out


def scale_pair(builder, scales, i, j):  # type: ignore[no-untyped-def]
    """Scales i and j of 16 rows (from the interleaved scale vectors: word i // 4 of row l
    in lane l of vector i // 4, i // 4 == j // 4) as int16 pairs: s_i in the low half of
    lane l, s_j in the high, sign-extended (a byte shuffle, then an arithmetic shift)."""
    v = scales[i // 4]
    picks = []
    for lane in range(LANES):
        picks += [64, 4 * lane + i % 4, 64, 4 * lane + j % 4]
    moved = builder.shuffle_vector(v, ir.Constant(_B64, [0] * 64),
                                   ir.Constant(ir.VectorType(_I32, 64), picks))
    wide = builder.ashr(builder.bitcast(moved, _W32), ir.Constant(_W32, [8] * 32))
    return builder.bitcast(wide, _L16)


def scaled_dot4(builder, path, acc, w, x, pair):  # type: ignore[no-untyped-def]
    """acc + lane i of s_i (w[4i] x[4i] + .. + w[4i+3] x[4i+3]), w unsigned bytes <= 63, x
    int8, s_i the low half of pair's lane i (its high half equal): `vpmaddubsw`'s two int16
    sums (within 2 * 63 * 128), then one multiply-add of pairs with (s, s), exact."""
    if path in (AVX512, AVX2):
        if path == AVX512:
            p16 = llvm_call(builder, "llvm.x86.avx512.pmaddubs.w.512", _W32, [w, x])
            return llvm_call(builder, "llvm.x86.avx512.vpdpwssd.512", _L16,
                             [acc, builder.bitcast(p16, _L16), pair])
        halves = []
        for h in range(2):
            pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
            wh, xh = (builder.shuffle_vector(v, v, pick) for v in (w, x))
            halves.append(llvm_call(builder, "llvm.x86.avx2.pmadd.ub.sw",
                                    ir.VectorType(_I16, 16), [wh, xh]))
        p16 = builder.shuffle_vector(halves[0], halves[1],
                                     ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    else:
        wide = ir.VectorType(_I16, 64)
        p = builder.mul(builder.zext(w, wide), builder.sext(x, wide))
        p16 = builder.add(*(builder.shuffle_vector(p, p, ir.Constant(
            ir.VectorType(_I32, 32), list(range(u, 64, 2)))) for u in range(2)))
    return builder.add(acc, madd_pairs(builder, path, builder.bitcast(p16, _L16), pair))


@functools.cache
def body(path: int) -> Callback:
    """One chunk of 16 interleaved Q6_K weight rows against x's m rows, `GROUP` at a time
    (`q6_k_rows`: the chunk is read from memory by the first group, from L2 by the rest),
    compiled once per SIMD path as a C callback of `krow._rows`' form (its scales and mins
    planes: Q6_K's scales and high bits)."""
    def chunk(q_p, n, rb, sc_p, h_p, d_p, dm_p, lut_p, x_p, m, k, xb_p, xd_p, out_p, c):  # type: ignore[no-untyped-def]
        nsb = k // 256
        ql, qh, sc = carray(q_p, (n * rb,)), carray(h_p, (n * rb // 2,)), carray(sc_p, (n * rb // 8,))
        d, lut = carray(d_p, (n * nsb,)), carray(lut_p, (1 << 16,))
        x, xb, xd = carray(x_p, (m * k,)), carray(xb_p, (m * k // 16,)), carray(xd_p, (m * nsb,))
        out = carray(out_p, (m * n,))
        r0 = LANES * c
        p0 = min(r0 + LANES, n - LANES)
        if p0 > r0:         # the next chunk's d, a few lines
            prefetch_span(d, p0 * nsb, (p0 + LANES) * nsb, 32)
        whole = m - m % GROUP
        for g in range(0, whole, GROUP):
            q6_k_rows(path, GROUP, ql, qh, sc, r0 * rb, d, r0 * nsb, nsb, lut, x, xb, xd, g,
                      out, r0, p0 * rb, n)
        left = m - whole
        if left == 3:
            q6_k_rows(path, 3, ql, qh, sc, r0 * rb, d, r0 * nsb, nsb, lut, x, xb, xd, whole,
                      out, r0, p0 * rb, n)
        elif left == 2:
            q6_k_rows(path, 2, ql, qh, sc, r0 * rb, d, r0 * nsb, nsb, lut, x, xb, xd, whole,
                      out, r0, p0 * rb, n)
        elif left == 1:
            q6_k_rows(path, 1, ql, qh, sc, r0 * rb, d, r0 * nsb, nsb, lut, x, xb, xd, whole,
                      out, r0, p0 * rb, n)
    u8, u16, i64, f32 = (types.CPointer(types.uint8), types.CPointer(types.uint16), types.int64,
                         types.CPointer(types.float32))
    return callback(u8, i64, i64, u8, u8, u16, u16, f32, types.CPointer(types.int8), i64, i64,
                    types.CPointer(types.int16), f32, f32, i64, exact=True)(chunk)
