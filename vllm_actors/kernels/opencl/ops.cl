// Every op of kernels/ops.py as OpenCL C (float32 activations). No extensions are required:
// half-precision scales of GGUF blocks are read with vload_half, which is core OpenCL.
// Linear weights are [out, in] rows, as stored in GGUF; a work-item computes one output.

__kernel void embedding(__global const float *table, __global const int *ids,
                        __global float *out, const int dim) {
    const int t = get_global_id(1), d = get_global_id(0);
    out[(size_t)t * dim + d] = table[(size_t)ids[t] * dim + d];
}

#define GROUP 64

// One work-group of GROUP per row; `n` elements per row.
__kernel void rms_norm(__global const float *x, __global const float *w, __global float *out,
                       const int n, const float eps) {
    __local float partial[GROUP];
    const int row = get_group_id(0), lid = get_local_id(0), lsz = GROUP;
    __global const float *xr = x + (size_t)row * n;
    float acc = 0.0f;
    for (int i = lid; i < n; i += lsz) acc += xr[i] * xr[i];
    partial[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = lsz / 2; s > 0; s >>= 1) {
        if (lid < s) partial[lid] += partial[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float inv = 1.0f / sqrt(partial[0] / (float)n + eps);
    for (int i = lid; i < n; i += lsz) out[(size_t)row * n + i] = xr[i] * inv * w[i];
}

__kernel void add_inplace(__global float *x, __global const float *y, const long size) {
    const size_t i = get_global_id(0);
    if (i < size) x[i] += y[i];
}

// gate_up [T, 2F] -> silu(gate) * up [T, F]
__kernel void silu_mul(__global const float *gate_up, __global float *out, const int f) {
    const int t = get_global_id(1), i = get_global_id(0);
    const float g = gate_up[(size_t)t * 2 * f + i], u = gate_up[(size_t)t * 2 * f + f + i];
    out[(size_t)t * f + i] = g / (1.0f + exp(-g)) * u;
}

// qkv [T, (H + 2 Hk) * Dh] -> q [T, H, Dh], k and v [T, Hk, Dh]
__kernel void split_qkv(__global const float *qkv, __global float *q, __global float *k,
                        __global float *v, const int q_size, const int kv_size) {
    const int t = get_global_id(1), i = get_global_id(0);
    const int width = q_size + 2 * kv_size;
    const float x = qkv[(size_t)t * width + i];
    if (i < q_size) q[(size_t)t * q_size + i] = x;
    else if (i < q_size + kv_size) k[(size_t)t * kv_size + i - q_size] = x;
    else v[(size_t)t * kv_size + i - q_size - kv_size] = x;
}

// Rotate x [T, H, Dh] in place; pair (i, i + rot/2) (NeoX) or (2i, 2i + 1) (interleaved).
__kernel void rope(__global float *x, __global const int *positions,
                   __global const float *cos_t, __global const float *sin_t, const int heads,
                   const int head_dim, const int rot, const int interleaved) {
    const int t = get_global_id(2), h = get_global_id(1), i = get_global_id(0);
    const int half_rot = rot / 2;
    const float c = cos_t[(size_t)positions[t] * half_rot + i];
    const float s = sin_t[(size_t)positions[t] * half_rot + i];
    __global float *row = x + ((size_t)t * heads + h) * head_dim;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half_rot;
    const float x1 = row[a], x2 = row[b];
    row[a] = x1 * c - x2 * s;
    row[b] = x2 * c + x1 * s;
}

// k, v [T, Hk * Dh] -> caches [num_blocks * block_size, Hk * Dh] at slot_mapping[t]
__kernel void reshape_and_cache(__global const float *k, __global const float *v,
                                __global float *k_cache, __global float *v_cache,
                                __global const long *slots, const int width) {
    const int t = get_global_id(1), i = get_global_id(0);
    const size_t dst = (size_t)slots[t] * width + i;
    k_cache[dst] = k[(size_t)t * width + i];
    v_cache[dst] = v[(size_t)t * width + i];
}

// One work-item per (token, query head): online softmax over the token's visible context,
// read through its request's block table. MAX_HEAD_DIM is set when the program is built.
__kernel void paged_attention(__global const float *q, __global const float *k_cache,
                              __global const float *v_cache, __global const int *token_req,
                              __global const int *token_pos, __global const int *block_tables,
                              __global float *out, const int heads, const int kv_heads,
                              const int head_dim, const int block_size, const int max_blocks,
                              const float scale) {
    const int t = get_global_id(1), h = get_global_id(0);
    const int kvh = h / (heads / kv_heads);
    __global const float *qr = q + ((size_t)t * heads + h) * head_dim;
    __global const int *table = block_tables + (size_t)token_req[t] * max_blocks;
    float acc[MAX_HEAD_DIM];
    for (int d = 0; d < head_dim; ++d) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int last = token_pos[t];
    for (int j = 0; j <= last; ++j) {
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        __global const float *kr = k_cache + (slot * kv_heads + kvh) * head_dim;
        float s = 0.0f;
        for (int d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
        s *= scale;
        const float m_new = fmax(m, s);
        const float correction = exp(m - m_new), p = exp(s - m_new);
        __global const float *vr = v_cache + (slot * kv_heads + kvh) * head_dim;
        for (int d = 0; d < head_dim; ++d) acc[d] = acc[d] * correction + p * vr[d];
        l = l * correction + p;
        m = m_new;
    }
    __global float *o = out + ((size_t)t * heads + h) * head_dim;
    for (int d = 0; d < head_dim; ++d) o[d] = acc[d] / l;
}

__kernel void gather_rows(__global const float *x, __global const int *rows,
                          __global float *out, const int width) {
    const int r = get_global_id(1), i = get_global_id(0);
    out[(size_t)r * width + i] = x[(size_t)rows[r] * width + i];
}

// ---- linear: y [T, N] = x [T, K] @ W^T (+ bias), W [N, K] -------------------------------

__kernel void linear_f32(__global const float *x, __global const float *w,
                         __global const float *bias, __global float *y, const int k,
                         const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    __global const float *xr = x + (size_t)t * k, *wr = w + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * wr[i];
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// F16 storage (any device: vload_half needs no extension), float32 arithmetic
__kernel void linear_f16(__global const float *x, __global const half *w,
                         __global const float *bias, __global float *y, const int k,
                         const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    __global const float *xr = x + (size_t)t * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * vload_half((size_t)o * k + i, w);
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// BF16 storage: the top 16 bits of a float32
__kernel void linear_bf16(__global const float *x, __global const ushort *w,
                          __global const float *bias, __global float *y, const int k,
                          const int n, const int has_bias) {
    const int t = get_global_id(1), o = get_global_id(0);
    __global const float *xr = x + (size_t)t * k;
    __global const ushort *wr = w + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * as_float((uint)wr[i] << 16);
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

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

// ---- sampling helpers ------------------------------------------------------------------

// Greedy: one work-group of GROUP per row of logits [rows, vocab]; ties go to the lowest id;
// a row holding any non-finite logit gives -1.
__kernel void argmax_rows(__global const float *logits, const int vocab, __global int *out) {
    __local float best[GROUP];
    __local int best_id[GROUP], bad[GROUP];
    const int row = get_group_id(0), lid = get_local_id(0);
    __global const float *lr = logits + (size_t)row * vocab;
    float b = -INFINITY;
    int bi = 0x7fffffff, nonfinite = 0;
    for (int i = lid; i < vocab; i += GROUP) {
        if (!isfinite(lr[i])) nonfinite = 1;
        else if (lr[i] > b) { b = lr[i]; bi = i; }
    }
    best[lid] = b;
    best_id[lid] = bi;
    bad[lid] = nonfinite;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = GROUP / 2; s > 0; s >>= 1) {
        if (lid < s) {
            bad[lid] |= bad[lid + s];
            if (best[lid + s] > best[lid] ||
                (best[lid + s] == best[lid] && best_id[lid + s] < best_id[lid])) {
                best[lid] = best[lid + s];
                best_id[lid] = best_id[lid + s];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[row] = bad[0] ? -1 : best_id[0];
}

// logits[row, :] /= temperature[row] (rows with temperature 0 are greedy and left alone)
__kernel void apply_temperature(__global float *logits, __global const float *temperature,
                                const int vocab) {
    const int row = get_global_id(1), i = get_global_id(0);
    const float temp = temperature[row];
    if (temp > 0.0f) logits[(size_t)row * vocab + i] /= temp;
}

// Mask every logit below the row's threshold (top-k / top-p cut) to -inf.
__kernel void mask_below(__global float *logits, __global const float *threshold,
                         const int vocab) {
    const int row = get_global_id(1), i = get_global_id(0);
    if (logits[(size_t)row * vocab + i] < threshold[row])
        logits[(size_t)row * vocab + i] = -INFINITY;
}
