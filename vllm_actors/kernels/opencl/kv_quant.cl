// KV cache formats other than float32 (kernels/kv_quant.py, kernels/device_kv.py): a row is a
// token's K or V under one KV head, stored exactly as kv_quant.KVFormat.encode stores it. The
// caches are bytes, [slots, Hk, row_bytes]; KV_* (the format kinds) are defined before this.
// Encoding matches the numpy reference bit for bit: float16 and bfloat16 round to nearest even;
// fp8 rounds x / scale to the nearest value (ties to the even code), saturated, NaN -> 0x7F;
// turboquant sums in double where the device has it, as numpy does (its rows come rotated by
// the float32 matmul kernel, which sums in another order than BLAS: a rare row's scale, or a
// code on a centroid boundary, may come out one step away).

#if defined(cl_khr_fp64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double wide;
#define WIDE_TINY 1e-30
#define WIDE_TINIER 1e-300
#else
typedef float wide;    // no double on this device: a rare turboquant code or scale may differ
#define WIDE_TINY 1e-30f
#define WIDE_TINIER 0.0f
#endif

// x (already divided by the tensor's scale) -> fp8 byte: e4m3fn (man_bits 3: bias 7, largest
// finite 448) or e5m2 (man_bits 2: bias 15, 57344).
uchar fp8_encode(const float x, const int man_bits) {
    if (isnan(x)) return 0x7F;
    const int bias = man_bits == 3 ? 7 : 15;
    const float a = fmin(fabs(x), man_bits == 3 ? 448.0f : 57344.0f);
    uint code;
    if (a < ldexp(1.0f, 1 - bias)) {     // subnormal: steps of 2^(1 - bias - man_bits)
        code = (uint)rint(ldexp(a, bias - 1 + man_bits));
    } else {                             // drop mantissa bits, rounding to nearest even
        const uint bits = as_uint(a), shift = 23 - man_bits;
        const uint rem = bits & ((1u << shift) - 1), half_step = 1u << (shift - 1);
        code = (bits >> shift) - ((uint)(127 - bias) << man_bits);
        code += (rem > half_step || (rem == half_step && (code & 1))) ? 1u : 0u;
    }
    return (uchar)(code | (signbit(x) ? 0x80u : 0u));
}

ushort bf16_encode(const float x) {
    const uint b = as_uint(x);
    return isnan(x) ? (ushort)((b >> 16) | 0x40) : (ushort)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// NaN as float16: the sign and the top of the payload, quiet (as numpy converts it)
ushort f16_nan(const float x) {
    const uint b = as_uint(x);
    return (ushort)(((b >> 16) & 0x8000) | 0x7E00 | ((b >> 13) & 0x3FF));
}

void store_f16(const float x, const size_t i, __global uchar *cache) {
    if (isnan(x)) ((__global ushort *)cache)[i] = f16_nan(x);
    else vstore_half_rte(x, i, (__global half *)cache);
}

// k, v [T, Hk * Dh] -> float16, bfloat16 or fp8 rows at slot_mapping[t] (negative: skipped);
// one work-item per value. man_bits: fp8's (3: e4m3, 2: e5m2).
__kernel void reshape_and_cache_kv(__global const float *k, __global const float *v,
                                   __global uchar *k_cache, __global uchar *v_cache,
                                   __global const long *slots, const int width, const int kind,
                                   const int man_bits, const float k_scale, const float v_scale) {
    const int t = get_global_id(1), i = get_global_id(0);
    const long slot = slots[t];
    if (slot < 0) return;
    const size_t src = (size_t)t * width + i, dst = (size_t)slot * width + i;
    if (kind == KV_FLOAT16) {
        store_f16(k[src], dst, k_cache);
        store_f16(v[src], dst, v_cache);
    } else if (kind == KV_BFLOAT16) {
        ((__global ushort *)k_cache)[dst] = bf16_encode(k[src]);
        ((__global ushort *)v_cache)[dst] = bf16_encode(v[src]);
    } else {
        k_cache[dst] = fp8_encode(k[src] / k_scale, man_bits);
        v_cache[dst] = fp8_encode(v[src] / v_scale, man_bits);
    }
}

// Turboquant: one rotated row y [d] -> its codes (the first n_high coordinates against the
// high-width codebook lut[0, 2^high), the rest against the low one after it, each the nearest
// centroid of y * sqrt(d) / |y|), packed little-endian, then the least-squares scale
// <y, c> / <c, c> as float16 in the last 2 bytes.
void tq_encode(__global const float *y, __global uchar *out, __global const float *lut,
               const int d, const int row_bytes, const int n_high, const int high,
               const int low) {
    wide sq = 0;
    for (int j = 0; j < d; ++j) sq += (wide)y[j] * (wide)y[j];
    const wide f = sqrt((wide)d) / fmax(sqrt(sq), (wide)WIDE_TINY);
    wide fit = 0, energy = 0;
    uint pending = 0;
    int npending = 0, byte = 0;
    for (int j = 0; j < d; ++j) {
        const int bits = j < n_high ? high : low;
        __global const float *book = j < n_high ? lut : lut + (1 << high);
        const wide u = (wide)y[j] * f;
        int code = 0;     // the midpoints below u (numpy's searchsorted, side left)
        for (int c = 0; c + 1 < (1 << bits); ++c)
            code += (wide)((book[c] + book[c + 1]) * 0.5f) < u;
        const float value = book[code];
        fit += (wide)y[j] * (wide)value;
        energy += (wide)value * (wide)value;
        pending |= (uint)code << npending;
        npending += bits;
        for (; npending >= 8; npending -= 8, pending >>= 8) out[byte++] = (uchar)pending;
    }
    if (npending > 0) out[byte] = (uchar)pending;
    const wide s = energy > 0 ? fit / fmax(energy, (wide)WIDE_TINIER) : (wide)0;
    ushort h;
    vstore_half_rte(s, 0, (half *)&h);
    out[row_bytes - 2] = (uchar)(h & 0xFF);
    out[row_bytes - 1] = (uchar)(h >> 8);
}

// k, v [T * Hk, Dh], already rotated -> turboquant rows at slot_mapping[t] (negative:
// skipped); one work-item per row, K (even ids) and V (odd) of a row side by side.
__kernel void reshape_and_cache_tq(__global const float *k, __global const float *v,
                                   __global uchar *k_cache, __global uchar *v_cache,
                                   __global const long *slots, __global const float *lut,
                                   const int kv_heads, const int head_dim, const int row_bytes,
                                   const int n_high, const int high, const int low,
                                   const int rows) {
    const int i = get_global_id(0), row = i >> 1;
    if (row >= rows) return;
    const long slot = slots[row / kv_heads];
    if (slot < 0) return;
    const size_t dst = ((size_t)slot * kv_heads + row % kv_heads) * row_bytes;
    tq_encode(((i & 1) ? v : k) + (size_t)row * head_dim, ((i & 1) ? v_cache : k_cache) + dst,
              lut, head_dim, row_bytes, n_high, high, low);
}

// Element i of a stored row, before the row's scale (turboquant's, `kv_row_scale`). A
// turboquant code is read from the two bytes at its bit offset (the scale follows the codes,
// so the second byte is always inside the row).
float kv_value(__global const uchar *row, const int i, const int kind,
               __global const float *lut, const int n_high, const int high, const int low) {
    if (kind == KV_FLOAT16) return vload_half(i, (__global const half *)row);
    if (kind == KV_BFLOAT16) return as_float((uint)((__global const ushort *)row)[i] << 16);
    if (kind == KV_FP8) return lut[row[i]];
    const int hi = i < n_high, bits = hi ? high : low;
    const int offset = hi ? i * high : n_high * high + (i - n_high) * low;
    const uint two = (uint)row[offset >> 3] | ((uint)row[(offset >> 3) + 1] << 8);
    const int code = (int)((two >> (offset & 7)) & ((1u << bits) - 1));
    return lut[hi ? code : (1 << high) + code];
}

float kv_row_scale(__global const uchar *row, const int kind, const int row_bytes) {
    if (kind != KV_TURBOQUANT) return 1.0f;
    const ushort h = (ushort)(row[row_bytes - 2] | (row[row_bytes - 1] << 8));
    return vload_half(0, (const half *)&h);   // a row's scale need not be 2-byte aligned
}

// paged_attention (ops.cl, same arguments and launch) over a quantized cache: each key and
// value is decoded as it is read. Turboquant: q comes rotated, the output goes out rotated.
__kernel void paged_attention_kv(__global const float *q, __global const uchar *k_cache,
                                 __global const uchar *v_cache, __global const int *token_req,
                                 __global const int *token_pos,
                                 __global const int *block_tables, __global float *out,
                                 const int heads, const int kv_heads, const int head_dim,
                                 const int block_size, const int max_blocks, const float scale,
                                 const int window, const float softcap,
                                 __global const float *sinks, const int has_sinks,
                                 __global const float *k_lut, __global const float *v_lut,
                                 const int kind, const int row_bytes, const int n_high,
                                 const int high, const int low) {
    const int t = get_global_id(1), h = get_global_id(0);
    const int kvh = h / (heads / kv_heads);
    __global const float *qr = q + ((size_t)t * heads + h) * head_dim;
    __global const int *table = block_tables + (size_t)token_req[t] * max_blocks;
    float acc[MAX_HEAD_DIM];
    for (int d = 0; d < head_dim; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int last = token_pos[t];
    const int first = window > 0 ? max(0, last - window + 1) : 0;
    for (int j = first; j <= last; ++j) {
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        __global const uchar *kr = k_cache + (slot * kv_heads + kvh) * row_bytes;
        float s = 0.0f;
        for (int d = 0; d < head_dim; ++d)
            s += qr[d] * kv_value(kr, d, kind, k_lut, n_high, high, low);
        s *= scale * kv_row_scale(kr, kind, row_bytes);
        if (softcap > 0.0f) s = softcap * tanh(s / softcap);
        const float m_new = fmax(m, s);
        const float correction = exp(m - m_new), p = exp(s - m_new);
        __global const uchar *vr = v_cache + (slot * kv_heads + kvh) * row_bytes;
        const float pv = p * kv_row_scale(vr, kind, row_bytes);
        for (int d = 0; d < head_dim; ++d)
            acc[d] = acc[d] * correction + pv * kv_value(vr, d, kind, v_lut, n_high, high, low);
        l = l * correction + p;
        m = m_new;
    }
    if (has_sinks) {   // one more softmax column with no value (gpt-oss)
        const float m_new = fmax(m, sinks[h]), correction = exp(m - m_new);
        for (int d = 0; d < head_dim; ++d) acc[d] *= correction;
        l = l * correction + exp(sinks[h] - m_new);
    }
    __global float *o = out + ((size_t)t * heads + h) * head_dim;
    for (int d = 0; d < head_dim; ++d) o[d] = acc[d] / l;
}
