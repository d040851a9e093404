// KV cache formats other than float32 (kernels/kv_quant.py, kernels/device_kv.py), as
// kv_quant.cl does them: a row is a token's K or V under one KV head, stored exactly as
// kv_quant.KVFormat.encode stores it. Caches are bytes, [slots, Hk, row_bytes]; KV_* (the
// format kinds) are defined before this, half_to_float / float_to_half / double_to_half in
// ops.cu. Encoding matches the numpy reference bit for bit: float16 and bfloat16 round to
// nearest even; fp8 rounds x / scale to the nearest value (ties to the even code), saturated,
// NaN -> 0x7F; turboquant sums in double, as numpy does (its rows come rotated by the float32
// matmul kernel, which sums in another order than BLAS: a rare row's scale, or a code on a
// centroid boundary, may come out one step away).

// x (already divided by the tensor's scale) -> fp8 byte: e4m3fn (man_bits 3: bias 7, largest
// finite 448) or e5m2 (man_bits 2: bias 15, 57344).
__device__ __forceinline__ unsigned char fp8_encode(float x, int man_bits) {
    if (isnan(x)) return 0x7F;
    const int bias = man_bits == 3 ? 7 : 15;
    const float a = fminf(fabsf(x), man_bits == 3 ? 448.0f : 57344.0f);
    unsigned int code;
    if (a < ldexpf(1.0f, 1 - bias)) {     // subnormal: steps of 2^(1 - bias - man_bits)
        code = (unsigned int)rintf(ldexpf(a, bias - 1 + man_bits));
    } else {                              // drop mantissa bits, rounding to nearest even
        const unsigned int bits = __float_as_uint(a), shift = 23 - man_bits;
        const unsigned int rem = bits & ((1u << shift) - 1), half_step = 1u << (shift - 1);
        code = (bits >> shift) - ((unsigned int)(127 - bias) << man_bits);
        code += (rem > half_step || (rem == half_step && (code & 1))) ? 1u : 0u;
    }
    return (unsigned char)(code | (signbit(x) ? 0x80u : 0u));
}

__device__ __forceinline__ unsigned short bf16_encode(float x) {
    const unsigned int b = __float_as_uint(x);
    return isnan(x) ? (unsigned short)((b >> 16) | 0x40)
                    : (unsigned short)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// float16 bits of x, rounded to nearest even; NaN keeps its sign and the top of its payload,
// quiet (as numpy converts it)
__device__ __forceinline__ unsigned short f16_encode(float x) {
    const unsigned int b = __float_as_uint(x);
    return isnan(x) ? (unsigned short)(((b >> 16) & 0x8000) | 0x7E00 | ((b >> 13) & 0x3FF))
                    : float_to_half(x);
}

// k, v [T, Hk * Dh] -> float16, bfloat16 or fp8 rows at slot_mapping[t] (negative: skipped);
// one thread per value, grid (ceil(width / THREADS), T). man_bits: fp8's (3: e4m3, 2: e5m2).
extern "C" __global__ void reshape_and_cache_kv(const float *k, const float *v,
                                                unsigned char *k_cache, unsigned char *v_cache,
                                                const long long *slots, int width, int kind,
                                                int man_bits, float k_scale, float v_scale) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const long long slot = slots[t];
    if (i >= width || slot < 0) return;
    const size_t src = (size_t)t * width + i, dst = (size_t)slot * width + i;
    if (kind == KV_FLOAT16) {
        ((unsigned short *)k_cache)[dst] = f16_encode(k[src]);
        ((unsigned short *)v_cache)[dst] = f16_encode(v[src]);
    } else if (kind == KV_BFLOAT16) {
        ((unsigned short *)k_cache)[dst] = bf16_encode(k[src]);
        ((unsigned short *)v_cache)[dst] = bf16_encode(v[src]);
    } else {
        k_cache[dst] = fp8_encode(k[src] / k_scale, man_bits);
        v_cache[dst] = fp8_encode(v[src] / v_scale, man_bits);
    }
}

// Turboquant: one rotated row y [d] -> its codes (the first n_high coordinates against the
// high-width codebook lut[0, 2^high), the rest against the low one after it, each the nearest
// centroid of y * sqrt(d) / |y|), packed little-endian, then the least-squares scale
// <y, c> / <c, c> as float16 in the last 2 bytes.
__device__ void tq_encode(const float *y, unsigned char *out, const float *lut, int d,
                          int row_bytes, int n_high, int high, int low) {
    double sq = 0.0;
    for (int j = 0; j < d; ++j) sq += (double)y[j] * (double)y[j];
    const double f = sqrt((double)d) / fmax(sqrt(sq), 1e-30);
    double fit = 0.0, energy = 0.0;
    unsigned int pending = 0;
    int npending = 0, byte = 0;
    for (int j = 0; j < d; ++j) {
        const int bits = j < n_high ? high : low;
        const float *book = j < n_high ? lut : lut + (1 << high);
        const double u = (double)y[j] * f;
        int code = 0;     // the midpoints below u (numpy's searchsorted, side left)
        for (int c = 0; c + 1 < (1 << bits); ++c)
            code += (double)((book[c] + book[c + 1]) * 0.5f) < u ? 1 : 0;
        const float value = book[code];
        fit += (double)y[j] * (double)value;
        energy += (double)value * (double)value;
        pending |= (unsigned int)code << npending;
        npending += bits;
        for (; npending >= 8; npending -= 8, pending >>= 8) out[byte++] = (unsigned char)pending;
    }
    if (npending > 0) out[byte] = (unsigned char)pending;
    const unsigned short h = double_to_half(energy > 0.0 ? fit / fmax(energy, 1e-300) : 0.0);
    out[row_bytes - 2] = (unsigned char)(h & 0xFF);
    out[row_bytes - 1] = (unsigned char)(h >> 8);
}

// k, v [T * Hk, Dh], already rotated -> turboquant rows at slot_mapping[t] (negative:
// skipped); one thread per row, K (even ids) and V (odd) of a row side by side.
extern "C" __global__ void reshape_and_cache_tq(const float *k, const float *v,
                                                unsigned char *k_cache, unsigned char *v_cache,
                                                const long long *slots, const float *lut,
                                                int kv_heads, int head_dim, int row_bytes,
                                                int n_high, int high, int low, int rows) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, row = i >> 1;
    if (row >= rows) return;
    const long long slot = slots[row / kv_heads];
    if (slot < 0) return;
    const size_t dst = ((size_t)slot * kv_heads + row % kv_heads) * row_bytes;
    tq_encode(((i & 1) ? v : k) + (size_t)row * head_dim, ((i & 1) ? v_cache : k_cache) + dst,
              lut, head_dim, row_bytes, n_high, high, low);
}

// Element i of a stored row, before the row's scale (turboquant's, `kv_row_scale`). A
// turboquant code is read from the two bytes at its bit offset (the scale follows the codes,
// so the second byte is always inside the row).
__device__ __forceinline__ float kv_value(const unsigned char *row, int i, int kind,
                                          const float *lut, int n_high, int high, int low) {
    if (kind == KV_FLOAT16) return half_to_float(((const unsigned short *)row)[i]);
    if (kind == KV_BFLOAT16)
        return __uint_as_float((unsigned int)((const unsigned short *)row)[i] << 16);
    if (kind == KV_FP8) return lut[row[i]];
    const int hi = i < n_high, bits = hi ? high : low;
    const int offset = hi ? i * high : n_high * high + (i - n_high) * low;
    const unsigned int two = (unsigned int)row[offset >> 3]
                             | ((unsigned int)row[(offset >> 3) + 1] << 8);
    const int code = (int)((two >> (offset & 7)) & ((1u << bits) - 1));
    return lut[hi ? code : (1 << high) + code];
}

__device__ __forceinline__ float kv_row_scale(const unsigned char *row, int kind, int row_bytes) {
    return kind == KV_TURBOQUANT ? load_half(row + row_bytes - 2) : 1.0f;
}

// paged_attention (ops.cu, same arguments and launch: one warp per (token, query head)) over a
// quantized cache: each key and value is decoded as it is read, the decode tables held in
// shared memory. Turboquant: q comes rotated, the output goes out rotated.
extern "C" __global__ void paged_attention_kv(const float *q, const unsigned char *k_cache,
                                              const unsigned char *v_cache,
                                              const int *token_req, const int *token_pos,
                                              const int *block_tables, float *out, int heads,
                                              int kv_heads, int head_dim, int block_size,
                                              int max_blocks, float scale, int window,
                                              float softcap, const float *sinks, int has_sinks,
                                              const float *k_lut, const float *v_lut, int kind,
                                              int row_bytes, int n_high, int high, int low) {
    __shared__ float k_table[256], v_table[256];   // fp8: 256 values; turboquant: <= 32
    const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    const int table_len = kind == KV_FP8 ? 256
                        : kind == KV_TURBOQUANT ? (1 << high) + (1 << low) : 0;
    for (int i = lane; i < table_len; i += 32) {
        k_table[i] = k_lut[i];
        v_table[i] = v_lut[i];
    }
    __syncthreads();
    const int kvh = h / (heads / kv_heads);
    const float *qr = q + ((size_t)t * heads + h) * head_dim;
    const int *table = block_tables + (size_t)token_req[t] * max_blocks;
    float acc[8];   // head_dim <= 256: 8 elements per lane
    float qv[8];
    for (int r = 0; r < 8; ++r) {
        const int d = lane + 32 * r;
        acc[r] = 0.0f;
        qv[r] = d < head_dim ? qr[d] : 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const int last = token_pos[t];
    const int first = window > 0 ? max(0, last - window + 1) : 0;
    for (int j = first; j <= last; ++j) {
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const unsigned char *kr = k_cache + (slot * kv_heads + kvh) * row_bytes;
        float s = 0.0f;
        for (int r = 0; r < 8; ++r) {
            const int d = lane + 32 * r;
            if (d < head_dim) s += qv[r] * kv_value(kr, d, kind, k_table, n_high, high, low);
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= scale * kv_row_scale(kr, kind, row_bytes);
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new), p = expf(s - m_new);
        const unsigned char *vr = v_cache + (slot * kv_heads + kvh) * row_bytes;
        const float pv = p * kv_row_scale(vr, kind, row_bytes);
        for (int r = 0; r < 8; ++r) {
            const int d = lane + 32 * r;
            if (d < head_dim)
                acc[r] = acc[r] * correction
                         + pv * kv_value(vr, d, kind, v_table, n_high, high, low);
        }
        l = l * correction + p;
        m = m_new;
    }
    if (has_sinks) {   // one more softmax column with no value (gpt-oss)
        const float m_new = fmaxf(m, sinks[h]), correction = expf(m - m_new);
        for (int r = 0; r < 8; ++r) acc[r] *= correction;
        l = l * correction + expf(sinks[h] - m_new);
    }
    float *o = out + ((size_t)t * heads + h) * head_dim;
    for (int r = 0; r < 8; ++r) {
        const int d = lane + 32 * r;
        if (d < head_dim) o[d] = acc[r] / l;
    }
}
