// Matmuls that read GGUF block-quantized weights as stored ([out, in] rows of blocks) and
// dequantize inside the dot product; built together with ops.cl. A work-item computes one
// output: y[t, o] = sum_k x[t, k] * w[o, k] (+ bias[o]).

// Q8_0 block (34 bytes): half d, int8 q[32]; value = d * q
__kernel void linear_q8_0(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 32;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 34;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 34;
        const float d = vload_half(0, (__global const half *)blk);
        __global const char *qs = (__global const char *)(blk + 2);
        float s = 0.0f;
        for (int j = 0; j < 32; ++j) s += (float)qs[j] * xr[b * 32 + j];
        acc += d * s;
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q4_0 block (18 bytes): half d, uchar qs[16]; low nibbles are elements 0..15, high 16..31;
// value = d * (q - 8)
__kernel void linear_q4_0(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 32;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 18;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 18;
        const float d = vload_half(0, (__global const half *)blk);
        __global const float *xb = xr + b * 32;
        float s = 0.0f;
        for (int j = 0; j < 16; ++j) {
            const uchar q = blk[2 + j];
            s += (float)((int)(q & 15) - 8) * xb[j] + (float)((int)(q >> 4) - 8) * xb[j + 16];
        }
        acc += d * s;
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q4_1 block (20 bytes): half d, half m, uchar qs[16]; value = d * q + m
__kernel void linear_q4_1(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 32;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 20;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 20;
        const float d = vload_half(0, (__global const half *)blk);
        const float m = vload_half(1, (__global const half *)blk);
        __global const float *xb = xr + b * 32;
        float s = 0.0f, xsum = 0.0f;
        for (int j = 0; j < 16; ++j) {
            const uchar q = blk[4 + j];
            s += (float)(q & 15) * xb[j] + (float)(q >> 4) * xb[j + 16];
            xsum += xb[j] + xb[j + 16];
        }
        acc += d * s + m * xsum;
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q4_K super-block (144 bytes, 256 values): half d, half dmin, 12 bytes of packed 6-bit
// (scale, min) pairs for 8 sub-blocks of 32, then 128 bytes of nibbles (each 32 bytes feed
// two sub-blocks: low nibbles the first, high nibbles the second); value = d*sc*q - dmin*m.
inline void q4k_scale_min(const int j, __global const uchar *s, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

__kernel void linear_q4_k(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 256;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 144;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 144;
        const float d = vload_half(0, (__global const half *)blk);
        const float dmin = vload_half(1, (__global const half *)blk);
        __global const uchar *scales = blk + 4, *qs = blk + 16;
        __global const float *xb = xr + b * 256;
        for (int pair = 0; pair < 4; ++pair) {
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
            acc += d * (sc1 * s1 + sc2 * s2) - dmin * (m1 * x1 + m2 * x2);
        }
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q6_K super-block (210 bytes, 256 values): ql[128] low nibbles, qh[64] high 2-bit pairs,
// int8 scales[16] (one per 16 values), half d; value = d * scale * (q - 32).
__kernel void linear_q6_k(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 256;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 210;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 210;
        __global const uchar *ql = blk, *qh = blk + 128;
        __global const char *sc = (__global const char *)(blk + 192);
        const float d = vload_half(0, (__global const half *)(blk + 208));
        __global const float *xb = xr + b * 256;
        float s = 0.0f;
        for (int half_ = 0; half_ < 2; ++half_) {
            __global const uchar *l0 = ql + 64 * half_, *h0 = qh + 32 * half_;
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
        acc += d * s;
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q5_0 block (22 bytes): half d, uint32 qh (5th bits), uchar qs[16]; element j < 16 is the
// low nibble of qs[j] with bit j of qh, element j + 16 the high nibble with bit j + 16;
// value = d * (q - 16). Q5_1 (24 bytes) adds half m after d: value = d * q + m.
inline float q5_block(__global const uchar *qh, __global const uchar *qs,
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

__kernel void linear_q5_0(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 32;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 22;
    float acc = 0.0f, xsum;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 22;
        acc += vload_half(0, (__global const half *)blk)
             * q5_block(blk + 2, blk + 6, xr + b * 32, 16.0f, &xsum);
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

__kernel void linear_q5_1(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 32;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 24;
    float acc = 0.0f, xsum;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 24;
        const float s = q5_block(blk + 4, blk + 8, xr + b * 32, 0.0f, &xsum);
        acc += vload_half(0, (__global const half *)blk) * s
             + vload_half(1, (__global const half *)blk) * xsum;
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q5_K super-block (176 bytes, 256 values): half d, half dmin, 12 bytes of (scale, min) as in
// Q4_K, qh[32], qs[128]; sub-block s takes Q4_K's nibble plus bit s of qh[l] as its 5th bit.
__kernel void linear_q5_k(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 256;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 176;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 176;
        const float d = vload_half(0, (__global const half *)blk);
        const float dmin = vload_half(1, (__global const half *)blk);
        __global const uchar *scales = blk + 4, *qh = blk + 16, *qs = blk + 48;
        __global const float *xb = xr + b * 256;
        for (int sub = 0; sub < 8; ++sub) {
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
            acc += d * sc * s - dmin * mn * xs;
        }
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q2_K super-block (84 bytes, 256 values): scales[16] (low nibble scale, high nibble min),
// qs[64], half d, half dmin. Element 128 h + 32 j + l is bits 2j..2j+1 of qs[32 h + l], in
// sub-block 8 h + 2 j + l / 16; value = d * (sc & 15) * q - dmin * (sc >> 4).
__kernel void linear_q2_k(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 256;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 84;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 84;
        __global const uchar *scales = blk, *qs = blk + 16;
        const float d = vload_half(40, (__global const half *)blk);
        const float dmin = vload_half(41, (__global const half *)blk);
        __global const float *xb = xr + b * 256;
        for (int sub = 0; sub < 16; ++sub) {
            const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
            float s = 0.0f, xs = 0.0f;
            for (int l = l0; l < l0 + 16; ++l) {
                const float a = xb[128 * h + 32 * j + l];
                s += (float)((qs[32 * h + l] >> (2 * j)) & 3) * a;
                xs += a;
            }
            acc += d * (float)(scales[sub] & 15) * s - dmin * (float)(scales[sub] >> 4) * xs;
        }
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Q3_K super-block (110 bytes, 256 values): hmask[32], qs[64], 12 bytes of 16 packed 6-bit
// scales (bias 32), half d. Element 128 h + 32 j + l is bits 2j..2j+1 of qs[32 h + l], minus
// 4 when bit 4h + j of hmask[l] is clear, in sub-block 8 h + 2 j + l / 16;
// value = d * scale * q.
inline float q3k_scale(const int i, __global const uchar *s) {
    const int low = (s[i % 8] >> (4 * (i / 8))) & 15;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (float)((low | (high << 4)) - 32);
}

__kernel void linear_q3_k(__global const float *x, __global const uchar *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    const int nb = k / 256;
    __global const float *xr = x + (size_t)t * k;
    __global const uchar *row = w + (size_t)o * nb * 110;
    float acc = 0.0f;
    for (int b = 0; b < nb; ++b) {
        __global const uchar *blk = row + b * 110;
        __global const uchar *hmask = blk, *qs = blk + 32, *scales = blk + 96;
        const float d = vload_half(54, (__global const half *)blk);
        __global const float *xb = xr + b * 256;
        for (int sub = 0; sub < 16; ++sub) {
            const int h = sub / 8, j = (sub % 8) / 2, l0 = 16 * (sub % 2);
            float s = 0.0f;
            for (int l = l0; l < l0 + 16; ++l) {
                const int q = ((qs[32 * h + l] >> (2 * j)) & 3)
                            - (((hmask[l] >> (4 * h + j)) & 1) ? 0 : 4);
                s += (float)q * xb[128 * h + 32 * j + l];
            }
            acc += d * q3k_scale(sub, scales) * s;
        }
    }
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}
