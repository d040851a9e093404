// The quantized matmuls of --gguf-activations quantized (llama.cpp's CPU semantics): x comes
// as 8-bit blocks (act_quant.cu: quants q packed 4 to an int, a scale dx a block and Q8_1's
// sum sx), a weight block's codes are packed 4 to an int the same way, and the sums of
// products are exact integers, per block or per K-quant sub-block, scaled as ggml's vec_dot
// scales them: dw dx sumi, plus Q4_1 / Q5_1's m sx, less the K-quants' dmin dx sum(mins
// bsums). Only the float sum over a row's blocks runs in another order than ggml's.
//
// One skeleton, LINEAR_INT_KERNEL, as LINEAR_QUANT_KERNEL: a thread computes one output
// y[t, o] from <type>_idot(block, x's quants, dx, sx) over the row's blocks. Built after
// linear_quant.cu (load_half, q3k_scale, q4k_scale_min). x's blocks have the weight's block
// size for every type (32, or 256 for the K-quants).
#define LINEAR_INT_KERNEL(NAME, IDOT, QK, BYTES)                                            \
    extern "C" __global__ void NAME(const int *xq, const float *xd, const float *xs,        \
                                    const unsigned char *w, const float *bias, float *y,    \
                                    int k, int n, int has_bias) {                           \
        const int t = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;                \
        if (o >= n) return;                                                                 \
        const int nb = k / (QK);                                                            \
        const int *xr = xq + (size_t)t * (k / 4);                                           \
        const float *dr = xd + (size_t)t * nb, *sr = xs + (size_t)t * nb;                   \
        const unsigned char *row = w + (size_t)o * nb * (BYTES);                            \
        float acc = 0.0f;                                                                   \
        for (int b = 0; b < nb; ++b)                                                        \
            acc += IDOT(row + b * (BYTES), xr + b * ((QK) / 4), dr[b], sr[b]);              \
        y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);                           \
    }

#define ONES 0x01010101u     // dot4(ONES, x) sums 4 quants of x
#define NIBBLES 0x0F0F0F0Fu

// acc + the sum of the products of 4 signed bytes of w and x (the codes packed here are
// below 128, so reading them signed is exact, or IQ4_NL's signed table values): one dp4a,
// as vLLM's MMVQ kernels use it
__device__ __forceinline__ int dot4(const unsigned int w, const int x, const int acc) {
    return __dp4a((int)w, x, acc);
}

// 4 bytes of a block at any alignment, little-endian
__device__ __forceinline__ unsigned int load_u32(const unsigned char *p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned int)p[3] << 24);
}

// 4 bits of a Q5 block's qh moved to bit 4 of 4 bytes
__device__ __forceinline__ unsigned int spread4(const unsigned int bits) {
    return ((bits & 1) << 4) | ((bits & 2) << 11) | ((bits & 4) << 18) | ((bits & 8) << 25);
}

__device__ __forceinline__ float q8_0_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    int sumi = 0;
    for (int i = 0; i < 8; ++i) sumi = dot4(load_u32(blk + Q8_0_QS + 4 * i), x[i], sumi);
    return load_half(blk + Q8_0_D) * dx * (float)sumi;
}

// Q4_0 / Q4_1's nibbles: the low ones meet the block's first 16 quants of x, the high ones
// its last 16; *xsum: the sum of x's quants
__device__ __forceinline__ int q4_isum(const unsigned char *qs, const int *x, int *xsum) {
    int sumi = 0, xs = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = load_u32(qs + 4 * i);
        sumi = dot4(v & NIBBLES, x[i], dot4((v >> 4) & NIBBLES, x[i + 4], sumi));
        xs = dot4(ONES, x[i], dot4(ONES, x[i + 4], xs));
    }
    *xsum = xs;
    return sumi;
}

__device__ __forceinline__ float q4_0_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    int xsum;
    const int sumi = q4_isum(blk + Q4_0_QS, x, &xsum);
    return load_half(blk + Q4_0_D) * dx * (float)(sumi - 8 * xsum);
}

__device__ __forceinline__ float q4_1_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    int xsum;
    const int sumi = q4_isum(blk + Q4_1_QS, x, &xsum);
    return load_half(blk + Q4_1_D) * dx * (float)sumi + load_half(blk + Q4_1_M) * sx;
}

// Q5_0 / Q5_1: Q4's nibbles with bit j of qh as the 5th bit of element j
__device__ __forceinline__ int q5_isum(const unsigned char *qh, const unsigned char *qs,
                   const int *x, int *xsum) {
    const unsigned int h = load_u32(qh);
    int sumi = 0, xs = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = load_u32(qs + 4 * i);
        const unsigned int lo = (v & NIBBLES) | spread4(h >> (4 * i));
        const unsigned int hi = ((v >> 4) & NIBBLES) | spread4(h >> (16 + 4 * i));
        sumi = dot4(lo, x[i], dot4(hi, x[i + 4], sumi));
        xs = dot4(ONES, x[i], dot4(ONES, x[i + 4], xs));
    }
    *xsum = xs;
    return sumi;
}

__device__ __forceinline__ float q5_0_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    int xsum;
    const int sumi = q5_isum(blk + Q5_0_QH, blk + Q5_0_QS, x, &xsum);
    return load_half(blk + Q5_0_D) * dx * (float)(sumi - 16 * xsum);
}

__device__ __forceinline__ float q5_1_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    int xsum;
    const int sumi = q5_isum(blk + Q5_1_QH, blk + Q5_1_QS, x, &xsum);
    return load_half(blk + Q5_1_D) * dx * (float)sumi + load_half(blk + Q5_1_M) * sx;
}

// Q2_K / Q3_K: sub-block sub (16 values) is 2-bit field j of qs[32 h + l], l from l0
__device__ __forceinline__ float q2_k_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    const unsigned char *scales = blk + Q2_K_SCALES, *qs = blk + Q2_K_QS;
    int ds = 0, ms = 0;
    for (int sub = 0; sub < QK_K / 16; ++sub) {
        const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
        int s = 0, xs = 0;
        for (int l = l0; l < l0 + 16; l += 4) {
            const int xi = x[(128 * h + 32 * j + l) / 4];
            s = dot4((load_u32(qs + 32 * h + l) >> (2 * j)) & 0x03030303u, xi, s);
            xs = dot4(ONES, xi, xs);
        }
        ds += (scales[sub] & 15) * s;
        ms += (scales[sub] >> 4) * xs;
    }
    return dx * load_half(blk + Q2_K_D) * (float)ds - dx * load_half(blk + Q2_K_DMIN) * (float)ms;
}

// Q3_K's codes with their hmask bit as bit 2, q + 4 in 0..7; the 4 comes off with x's sum
__device__ __forceinline__ float q3_k_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    const unsigned char *hmask = blk + Q3_K_HMASK, *qs = blk + Q3_K_QS;
    int ds = 0;
    for (int sub = 0; sub < QK_K / 16; ++sub) {
        const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
        int s = 0, xs = 0;
        for (int l = l0; l < l0 + 16; l += 4) {
            const int xi = x[(128 * h + 32 * j + l) / 4];
            const unsigned int q2 = (load_u32(qs + 32 * h + l) >> (2 * j)) & 0x03030303u;
            const unsigned int high = (load_u32(hmask + l) >> (4 * h + j)) & ONES;
            s = dot4(q2 | (high << 2), xi, s);
            xs = dot4(ONES, xi, xs);
        }
        ds += (int)q3k_scale(sub, blk + Q3_K_SCALES) * (s - 4 * xs);
    }
    return dx * load_half(blk + Q3_K_D) * (float)ds;
}

// Q4_K / Q5_K: sub-block sub's codes are the low (sub even) or high nibbles of qs[32 (sub /
// 2) + l], with Q5_K's 5th bit from bit sub of qh[l] (qh null for Q4_K)
__device__ __forceinline__ float k45_idot(const unsigned char *scales, const unsigned char *qs,
                                          const unsigned char *qh, const int *x, const float dx,
                                          const float d, const float dmin) {
    int ds = 0, ms = 0;
    for (int sub = 0; sub < QK_K / 32; ++sub) {
        float sc, mn;
        q4k_scale_min(sub, scales, &sc, &mn);
        const int shift = 4 * (sub & 1);
        int s = 0, xs = 0;
        for (int l = 0; l < 32; l += 4) {
            const int xi = x[(32 * sub + l) / 4];
            unsigned int codes = (load_u32(qs + 32 * (sub / 2) + l) >> shift) & NIBBLES;
            if (qh) codes |= ((load_u32(qh + l) >> sub) & ONES) << 4;
            s = dot4(codes, xi, s);
            xs = dot4(ONES, xi, xs);
        }
        ds += (int)sc * s;
        ms += (int)mn * xs;
    }
    return dx * d * (float)ds - dx * dmin * (float)ms;
}

__device__ __forceinline__ float q4_k_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    return k45_idot(blk + Q4_K_SCALES, blk + Q4_K_QS, 0, x, dx, load_half(blk + Q4_K_D),
                    load_half(blk + Q4_K_DMIN));
}

__device__ __forceinline__ float q5_k_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    return k45_idot(blk + Q5_K_SCALES, blk + Q5_K_QS, blk + Q5_K_QH, x, dx,
                    load_half(blk + Q5_K_D), load_half(blk + Q5_K_DMIN));
}

// Q6_K: 4 codes (q + 32, 0..63) of each of the 4 quarters of a half super-block at a time;
// the 32 comes off with x's sum, each 16 values under their own scale
__device__ __forceinline__ float q6_k_idot(const unsigned char *blk,
                                           const int *x, float dx, float sx) {
    const signed char *sc = (const signed char *)(blk + Q6_K_SCALES);
    int ds = 0;
    for (int half_ = 0; half_ < QK_K / 128; ++half_) {
        const unsigned char *l0 = blk + Q6_K_QL + 64 * half_, *h0 = blk + Q6_K_QH + 32 * half_;
        const signed char *s0 = sc + 8 * half_;
        const int *x0 = x + 32 * half_;
        for (int l = 0; l < 32; l += 4) {
            const unsigned int a = load_u32(l0 + l), b = load_u32(l0 + l + 32);
            const unsigned int h = load_u32(h0 + l);
            const unsigned int codes[4] = {(a & NIBBLES) | ((h & 0x03030303u) << 4),
                                   (b & NIBBLES) | (((h >> 2) & 0x03030303u) << 4),
                                   ((a >> 4) & NIBBLES) | (((h >> 4) & 0x03030303u) << 4),
                                   ((b >> 4) & NIBBLES) | (((h >> 6) & 0x03030303u) << 4)};
            for (int quarter = 0; quarter < 4; ++quarter) {
                const int xi = x0[(l + 32 * quarter) / 4];
                ds += s0[l / 16 + 2 * quarter]
                    * (dot4(codes[quarter], xi, 0) - 32 * dot4(ONES, xi, 0));
            }
        }
    }
    return dx * load_half(blk + Q6_K_D) * (float)ds;
}

// IQ4_NL: each of 4 packed nibbles becomes its table value, a signed byte
__device__ __forceinline__ unsigned int iq4_nl_values(const unsigned int nibbles) {
    return (unsigned char)IQ4_NL_VALUES[nibbles & 15]
         | ((unsigned int)(unsigned char)IQ4_NL_VALUES[(nibbles >> 8) & 15] << 8)
         | ((unsigned int)(unsigned char)IQ4_NL_VALUES[(nibbles >> 16) & 15] << 16)
         | ((unsigned int)(unsigned char)IQ4_NL_VALUES[nibbles >> 24] << 24);
}

__device__ __forceinline__ float iq4_nl_idot(const unsigned char *blk,
                                             const int *x, float dx, float sx) {
    int sumi = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned int v = load_u32(blk + IQ4_NL_QS + 4 * i);
        sumi = dot4(iq4_nl_values(v & NIBBLES), x[i],
                    dot4(iq4_nl_values((v >> 4) & NIBBLES), x[i + 4], sumi));
    }
    return load_half(blk + IQ4_NL_D) * dx * (float)sumi;
}

LINEAR_INT_KERNEL(linear_int_q8_0, q8_0_idot, Q8_0_QK, Q8_0_BYTES)
LINEAR_INT_KERNEL(linear_int_q4_0, q4_0_idot, Q4_0_QK, Q4_0_BYTES)
LINEAR_INT_KERNEL(linear_int_q4_1, q4_1_idot, Q4_1_QK, Q4_1_BYTES)
LINEAR_INT_KERNEL(linear_int_q5_0, q5_0_idot, Q5_0_QK, Q5_0_BYTES)
LINEAR_INT_KERNEL(linear_int_q5_1, q5_1_idot, Q5_1_QK, Q5_1_BYTES)
LINEAR_INT_KERNEL(linear_int_q2_k, q2_k_idot, Q2_K_QK, Q2_K_BYTES)
LINEAR_INT_KERNEL(linear_int_q3_k, q3_k_idot, Q3_K_QK, Q3_K_BYTES)
LINEAR_INT_KERNEL(linear_int_q4_k, q4_k_idot, Q4_K_QK, Q4_K_BYTES)
LINEAR_INT_KERNEL(linear_int_q5_k, q5_k_idot, Q5_K_QK, Q5_K_BYTES)
LINEAR_INT_KERNEL(linear_int_q6_k, q6_k_idot, Q6_K_QK, Q6_K_BYTES)
LINEAR_INT_KERNEL(linear_int_iq4_nl, iq4_nl_idot, IQ4_NL_QK, IQ4_NL_BYTES)
