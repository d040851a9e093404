// Matmuls that read GGUF block-quantized weights as stored ([out, in] rows of blocks) and
// dequantize inside the dot product; built together with ops.cl, after the block layouts
// (<TYPE>_QK values and <TYPE>_BYTES bytes per block, <TYPE>_<FIELD> byte offsets) that
// device_backend.kernel_source generates from kernels/quant.py.
//
// One skeleton, LINEAR_QUANT_KERNEL, makes every kernel: a work-item computes one output,
// y[t, o] = sum_k x[t, k] * w[o, k] (+ bias[o]), summing over the row's blocks
// <type>_dot(block, x), the dot product of one dequantized block with its k / QK slice of
// x. A new type is its layout in quant.BLOCK_FIELDS, its <type>_dot and one expansion here.
#define LINEAR_QUANT_KERNEL(NAME, DOT, QK, BYTES)                                           \
    __kernel void NAME(__global const float *x, __global const uchar *w,                    \
                       __global const float *bias, __global float *y, const int k,          \
                       const int n, const int has_bias) {                                   \
        const int t = get_global_id(1), o = get_global_id(0);                               \
        const int nb = k / (QK);                                                            \
        __global const float *xr = x + (size_t)t * k;                                       \
        __global const uchar *row = w + (size_t)o * nb * (BYTES);                           \
        float acc = 0.0f;                                                                   \
        for (int b = 0; b < nb; ++b) acc += DOT(row + b * (BYTES), xr + b * (QK));          \
        y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);                           \
    }

inline float load_half(__global const uchar *p) {
    return vload_half(0, (__global const half *)p);
}

// Q8_0: int8 qs; value = d * q
inline float q8_0_dot(__global const uchar *blk, __global const float *xb) {
    __global const char *qs = (__global const char *)(blk + Q8_0_QS);
    float s = 0.0f;
    for (int j = 0; j < Q8_0_QK; ++j) s += (float)qs[j] * xb[j];
    return load_half(blk + Q8_0_D) * s;
}

// Q4_0: nibbles, the low ones are the first half of the block, the high ones the second;
// value = d * (q - 8)
inline float q4_0_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *qs = blk + Q4_0_QS;
    __global const float *xh = xb + Q4_0_QK / 2;
    float s = 0.0f;
    for (int j = 0; j < Q4_0_QK / 2; ++j)
        s += (float)((int)(qs[j] & 15) - 8) * xb[j] + (float)((int)(qs[j] >> 4) - 8) * xh[j];
    return load_half(blk + Q4_0_D) * s;
}

// Q4_1: Q4_0's nibbles, unsigned; value = d * q + m
inline float q4_1_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *qs = blk + Q4_1_QS;
    __global const float *xh = xb + Q4_1_QK / 2;
    float s = 0.0f, xsum = 0.0f;
    for (int j = 0; j < Q4_1_QK / 2; ++j) {
        s += (float)(qs[j] & 15) * xb[j] + (float)(qs[j] >> 4) * xh[j];
        xsum += xb[j] + xh[j];
    }
    return load_half(blk + Q4_1_D) * s + load_half(blk + Q4_1_M) * xsum;
}

// Q5_0 / Q5_1: Q4's nibbles with a 5th bit, bit j of the little-endian uint32 qh for element
// j; Q5_0's value = d * (q - 16), Q5_1's d * q + m. q5_sum: sum (q - offset) * x, and sum x.
#if Q5_0_QK != Q5_1_QK || Q5_0_QK != 32
#error "q5_sum reads one uint32 of 5th bits per block of 32"
#endif
inline float q5_sum(__global const uchar *qh, __global const uchar *qs,
                    __global const float *xb, const float offset, float *xsum) {
    const uint h = qh[0] | (qh[1] << 8) | (qh[2] << 16) | ((uint)qh[3] << 24);
    float s = 0.0f, xs = 0.0f;
    for (int j = 0; j < 16; ++j) {
        const float lo = (float)((qs[j] & 15) | (((h >> j) & 1) << 4)) - offset;
        const float hi = (float)((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - offset;
        s += lo * xb[j] + hi * xb[j + 16];
        xs += xb[j] + xb[j + 16];
    }
    *xsum = xs;
    return s;
}

inline float q5_0_dot(__global const uchar *blk, __global const float *xb) {
    float xsum;
    return load_half(blk + Q5_0_D) * q5_sum(blk + Q5_0_QH, blk + Q5_0_QS, xb, 16.0f, &xsum);
}

inline float q5_1_dot(__global const uchar *blk, __global const float *xb) {
    float xsum;
    const float s = q5_sum(blk + Q5_1_QH, blk + Q5_1_QS, xb, 0.0f, &xsum);
    return load_half(blk + Q5_1_D) * s + load_half(blk + Q5_1_M) * xsum;
}

// The K-quants' super-blocks: their decoders index sub-blocks of a 256-value super-block.
#if QK_K != 256 || Q2_K_QK != QK_K || Q3_K_QK != QK_K || Q4_K_QK != QK_K || Q5_K_QK != QK_K \
    || Q6_K_QK != QK_K
#error "the K-quant decoders are written for super-blocks of 256"
#endif

// Q2_K super-block: scales[16] (low nibble scale, high nibble min of a sub-block of 16), qs
// of 2-bit values. Element 128 h + 32 j + l is bits 2j..2j+1 of qs[32 h + l], in sub-block
// 8 h + 2 j + l / 16; value = d * (sc & 15) * q - dmin * (sc >> 4).
inline float q2_k_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *scales = blk + Q2_K_SCALES, *qs = blk + Q2_K_QS;
    float ds = 0.0f, ms = 0.0f;
    for (int sub = 0; sub < QK_K / 16; ++sub) {
        const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
        float s = 0.0f, xs = 0.0f;
        for (int l = l0; l < l0 + 16; ++l) {
            const float a = xb[128 * h + 32 * j + l];
            s += (float)((qs[32 * h + l] >> (2 * j)) & 3) * a;
            xs += a;
        }
        ds += (float)(scales[sub] & 15) * s;
        ms += (float)(scales[sub] >> 4) * xs;
    }
    return load_half(blk + Q2_K_D) * ds - load_half(blk + Q2_K_DMIN) * ms;
}

// Q3_K super-block: hmask[32], qs of 2-bit values, 16 6-bit scales (bias 32) packed in 12
// bytes. Element 128 h + 32 j + l is bits 2j..2j+1 of qs[32 h + l], minus 4 when bit 4h + j of
// hmask[l] is clear, in sub-block 8 h + 2 j + l / 16; value = d * scale * q.
inline float q3k_scale(const int i, __global const uchar *s) {
    const int low = (s[i % 8] >> (4 * (i / 8))) & 15;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (float)((low | (high << 4)) - 32);
}

inline float q3_k_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *hmask = blk + Q3_K_HMASK, *qs = blk + Q3_K_QS;
    float ds = 0.0f;
    for (int sub = 0; sub < QK_K / 16; ++sub) {
        const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
        float s = 0.0f;
        for (int l = l0; l < l0 + 16; ++l) {
            const int q = ((qs[32 * h + l] >> (2 * j)) & 3)
                        - (((hmask[l] >> (4 * h + j)) & 1) ? 0 : 4);
            s += (float)q * xb[128 * h + 32 * j + l];
        }
        ds += q3k_scale(sub, blk + Q3_K_SCALES) * s;
    }
    return load_half(blk + Q3_K_D) * ds;
}

// Q4_K super-block: 12 bytes of packed 6-bit (scale, min) pairs for 8 sub-blocks of 32, then
// nibbles (each 32 bytes feed two sub-blocks: low nibbles the first, high nibbles the
// second); value = d * sc * q - dmin * m.
inline void q4k_scale_min(const int j, __global const uchar *s, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

inline float q4_k_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *scales = blk + Q4_K_SCALES, *qs = blk + Q4_K_QS;
    float ds = 0.0f, ms = 0.0f;
    for (int pair = 0; pair < QK_K / 64; ++pair) {
        float sc1, m1, sc2, m2;
        q4k_scale_min(2 * pair, scales, &sc1, &m1);
        q4k_scale_min(2 * pair + 1, scales, &sc2, &m2);
        float s1 = 0.0f, s2 = 0.0f, x1 = 0.0f, x2 = 0.0f;
        for (int l = 0; l < 32; ++l) {
            const uchar q = qs[32 * pair + l];
            const float a = xb[64 * pair + l], c = xb[64 * pair + 32 + l];
            s1 += (float)(q & 15) * a;
            s2 += (float)(q >> 4) * c;
            x1 += a;
            x2 += c;
        }
        ds += sc1 * s1 + sc2 * s2;
        ms += m1 * x1 + m2 * x2;
    }
    return load_half(blk + Q4_K_D) * ds - load_half(blk + Q4_K_DMIN) * ms;
}

// Q5_K super-block: Q4_K's (scale, min) pairs and nibbles, and qh[32]: sub-block s takes bit
// s of qh[l] as the 5th bit of its element l.
inline float q5_k_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *scales = blk + Q5_K_SCALES, *qh = blk + Q5_K_QH, *qs = blk + Q5_K_QS;
    float ds = 0.0f, ms = 0.0f;
    for (int sub = 0; sub < QK_K / 32; ++sub) {
        float sc, mn;
        q4k_scale_min(sub, scales, &sc, &mn);
        const int shift = 4 * (sub & 1);
        float s = 0.0f, xs = 0.0f;
        for (int l = 0; l < 32; ++l) {
            const int q = ((qs[32 * (sub / 2) + l] >> shift) & 15) | (((qh[l] >> sub) & 1) << 4);
            const float a = xb[32 * sub + l];
            s += (float)q * a;
            xs += a;
        }
        ds += sc * s;
        ms += mn * xs;
    }
    return load_half(blk + Q5_K_D) * ds - load_half(blk + Q5_K_DMIN) * ms;
}

// Q6_K super-block: ql[128] low nibbles, qh[64] high 2-bit pairs, int8 scales[16] (one per
// 16 values); value = d * scale * (q - 32).
inline float q6_k_dot(__global const uchar *blk, __global const float *xb) {
    __global const char *sc = (__global const char *)(blk + Q6_K_SCALES);
    float s = 0.0f;
    for (int half_ = 0; half_ < QK_K / 128; ++half_) {
        __global const uchar *l0 = blk + Q6_K_QL + 64 * half_, *h0 = blk + Q6_K_QH + 32 * half_;
        __global const char *s0 = sc + 8 * half_;
        __global const float *x0 = xb + 128 * half_;
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = (int)((l0[l] & 15) | (((h0[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32;
            s += (float)s0[is] * q1 * x0[l] + (float)s0[is + 2] * q2 * x0[l + 32]
               + (float)s0[is + 4] * q3 * x0[l + 64] + (float)s0[is + 6] * q4 * x0[l + 96];
        }
    }
    return load_half(blk + Q6_K_D) * s;
}

// IQ4_NL: Q4_0's nibbles, each an index into a fixed table of 16 int8 values; value =
// d * table[q] (gguf-py's IQ4_NL.kvalues)
__constant char IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1, 13, 25, 38, 53, 69, 89, 113};

inline float iq4_nl_dot(__global const uchar *blk, __global const float *xb) {
    __global const uchar *qs = blk + IQ4_NL_QS;
    float s = 0.0f;
    for (int j = 0; j < IQ4_NL_QK / 2; ++j)
        s += (float)IQ4_NL_VALUES[qs[j] & 15] * xb[j]
           + (float)IQ4_NL_VALUES[qs[j] >> 4] * xb[j + IQ4_NL_QK / 2];
    return load_half(blk + IQ4_NL_D) * s;
}

LINEAR_QUANT_KERNEL(linear_q8_0, q8_0_dot, Q8_0_QK, Q8_0_BYTES)
LINEAR_QUANT_KERNEL(linear_q4_0, q4_0_dot, Q4_0_QK, Q4_0_BYTES)
LINEAR_QUANT_KERNEL(linear_q4_1, q4_1_dot, Q4_1_QK, Q4_1_BYTES)
LINEAR_QUANT_KERNEL(linear_q5_0, q5_0_dot, Q5_0_QK, Q5_0_BYTES)
LINEAR_QUANT_KERNEL(linear_q5_1, q5_1_dot, Q5_1_QK, Q5_1_BYTES)
LINEAR_QUANT_KERNEL(linear_q2_k, q2_k_dot, Q2_K_QK, Q2_K_BYTES)
LINEAR_QUANT_KERNEL(linear_q3_k, q3_k_dot, Q3_K_QK, Q3_K_BYTES)
LINEAR_QUANT_KERNEL(linear_q4_k, q4_k_dot, Q4_K_QK, Q4_K_BYTES)
LINEAR_QUANT_KERNEL(linear_q5_k, q5_k_dot, Q5_K_QK, Q5_K_BYTES)
LINEAR_QUANT_KERNEL(linear_q6_k, q6_k_dot, Q6_K_QK, Q6_K_BYTES)
LINEAR_QUANT_KERNEL(linear_iq4_nl, iq4_nl_dot, IQ4_NL_QK, IQ4_NL_BYTES)
