// Every op of kernels/ops.py as OpenCL C (float32 activations). No extensions are required:
// half-precision scales of GGUF blocks are read with vload_half, which is core OpenCL.
// Linear weights are [out, in] rows, as stored in GGUF; a work-item computes one output.

__kernel void embedding(__global const float *table, __global const int *ids,
                        __global float *out, const int dim) {
    const int t = get_global_id(1), d = get_global_id(0);
    out[(size_t)t * dim + d] = table[(size_t)ids[t] * dim + d];
}

#define GROUP 64

// The sum of every work-item's `v` over a work-group of GROUP, given to all of them;
// `partial` is GROUP floats of local memory, free again on return.
float group_sum(float v, __local float *partial) {
    const int lid = get_local_id(0);
    partial[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = GROUP / 2; s > 0; s >>= 1) {
        if (lid < s) partial[lid] += partial[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float total = partial[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// One work-group of GROUP per row; `n` elements per row.
__kernel void rms_norm(__global const float *x, __global const float *w, __global float *out,
                       const int n, const float eps) {
    __local float partial[GROUP];
    const int row = get_group_id(0), lid = get_local_id(0);
    __global const float *xr = x + (size_t)row * n;
    float acc = 0.0f;
    for (int i = lid; i < n; i += GROUP) acc += xr[i] * xr[i];
    const float inv = 1.0f / sqrt(group_sum(acc, partial) / (float)n + eps);
    for (int i = lid; i < n; i += GROUP) out[(size_t)row * n + i] = xr[i] * inv * w[i];
}

// One work-group of GROUP per row: (x - mean) / sqrt(var + eps) * w (+ b), the variance taken
// of the centered values (two passes over the row, as numpy's reference does).
__kernel void layer_norm(__global const float *x, __global const float *w,
                         __global const float *b, __global float *out, const int n,
                         const float eps, const int has_bias) {
    __local float partial[GROUP];
    const int row = get_group_id(0), lid = get_local_id(0);
    __global const float *xr = x + (size_t)row * n;
    float acc = 0.0f;
    for (int i = lid; i < n; i += GROUP) acc += xr[i];
    const float mean = group_sum(acc, partial) / (float)n;
    acc = 0.0f;
    for (int i = lid; i < n; i += GROUP) acc += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / sqrt(group_sum(acc, partial) / (float)n + eps);
    for (int i = lid; i < n; i += GROUP)
        out[(size_t)row * n + i] = (xr[i] - mean) * inv * w[i] + (has_bias ? b[i] : 0.0f);
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

// gelu: the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) when `approximate`,
// else the exact 0.5 x (1 + erf(x / sqrt(2)))
float gelu_f(const float x, const int approximate) {
    const float inner = approximate ? tanh(0.7978845608f * x * (1.0f + 0.044715f * x * x))
                                    : erf(x * 0.7071067812f);
    return 0.5f * x * (1.0f + inner);
}

// gate_up [T, 2F] -> gelu(gate) * up [T, F]
__kernel void gelu_mul(__global const float *gate_up, __global float *out, const int f,
                       const int approximate) {
    const int t = get_global_id(1), i = get_global_id(0);
    const float g = gate_up[(size_t)t * 2 * f + i], u = gate_up[(size_t)t * 2 * f + f + i];
    out[(size_t)t * f + i] = gelu_f(g, approximate) * u;
}

__kernel void gelu_inplace(__global float *x, const long size, const int approximate) {
    const size_t i = get_global_id(0);
    if (i < size) x[i] = gelu_f(x[i], approximate);
}

__kernel void scale_inplace(__global float *x, const long size, const float factor) {
    const size_t i = get_global_id(0);
    if (i < size) x[i] *= factor;
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
// window > 0: a query at position p sees keys p - window < j <= p only; softcap > 0: scores
// s become softcap * tanh(s / softcap) before the softmax.
__kernel void paged_attention(__global const float *q, __global const float *k_cache,
                              __global const float *v_cache, __global const int *token_req,
                              __global const int *token_pos, __global const int *block_tables,
                              __global float *out, const int heads, const int kv_heads,
                              const int head_dim, const int block_size, const int max_blocks,
                              const float scale, const int window, const float softcap,
                              __global const float *sinks, const int has_sinks) {
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
        __global const float *kr = k_cache + (slot * kv_heads + kvh) * head_dim;
        float s = 0.0f;
        for (int d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
        s *= scale;
        if (softcap > 0.0f) s = softcap * tanh(s / softcap);
        const float m_new = fmax(m, s);
        const float correction = exp(m - m_new), p = exp(s - m_new);
        __global const float *vr = v_cache + (slot * kv_heads + kvh) * head_dim;
        for (int d = 0; d < head_dim; ++d) acc[d] = acc[d] * correction + p * vr[d];
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

__kernel void gather_rows(__global const float *x, __global const int *rows,
                          __global float *out, const int width) {
    const int r = get_global_id(1), i = get_global_id(0);
    out[(size_t)r * width + i] = x[(size_t)rows[r] * width + i];
}

// ---- LoRA (models/lora.py): xa [rows, R] = x[rows] @ A^T, then y[rows, col + j] +=
// scale * xa[:, r0:r0+r] @ B (b_t [r_max, width], this part's columns from b0) ------------

__kernel void lora_shrink(__global const float *x, __global const long *rows,
                          __global const float *a, __global float *xa, const int k,
                          const int ranks) {
    const int r = get_global_id(1), i = get_global_id(0);
    __global const float *xr = x + (size_t)rows[r] * k, *ar = a + (size_t)i * k;
    float acc = 0.0f;
    for (int d = 0; d < k; ++d) acc += xr[d] * ar[d];
    xa[(size_t)r * ranks + i] = acc;
}

__kernel void lora_expand(__global const float *xa, __global const long *rows,
                          __global const float *b_t, __global float *y, const int ranks,
                          const int r0, const int rank, const int width, const int b0,
                          const int n, const int n_out, const int col, const float scale) {
    const int r = get_global_id(1), j = get_global_id(0);
    if (j >= n) return;
    float acc = 0.0f;
    for (int i = 0; i < rank; ++i)
        acc += xa[(size_t)r * ranks + r0 + i] * b_t[(size_t)i * width + b0 + j];
    y[(size_t)rows[r] * n_out + col + j] += acc * scale;
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

// Block-quantized matmuls (GGUF Q*_0/1/K) are in linear_quant.cl, built with this file.

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
