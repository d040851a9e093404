// Every op of kernels/ops.py as CUDA C for CuPy's RawModule (NVRTC) or nvcc. No header is
// included: GGUF's half-precision block scales are converted with one PTX instruction, so
// the source compiles anywhere NVRTC does. Activations are float32; linear weights are
// [out, in] rows as stored in GGUF. Launch shapes are in kernels/cuda/backend.py: x covers
// the innermost index in blocks of THREADS, y (and z) the rows.

#define THREADS 128
#define NEG_INF __int_as_float(0xff800000)   // -infinity; NVRTC has no math.h for INFINITY

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float16 bits of x, rounded to nearest even (KV cache writes, kv_quant.cu)
__device__ __forceinline__ unsigned short float_to_half(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ unsigned short double_to_half(double x) {
    unsigned short h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h) : "d"(x));
    return h;
}

__device__ __forceinline__ float load_half(const unsigned char *p) {
    return half_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

extern "C" __global__ void embedding(const float *table, const int *ids, float *out, int dim) {
    const int t = blockIdx.y, d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d < dim) out[(size_t)t * dim + d] = table[(size_t)ids[t] * dim + d];
}

// The sum of every thread's `v` over a block of THREADS, given to all of them; `partial` is
// THREADS floats of shared memory, free again on return.
__device__ float block_sum(float v, float *partial) {
    const int lid = threadIdx.x;
    partial[lid] = v;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (lid < s) partial[lid] += partial[lid + s];
        __syncthreads();
    }
    const float total = partial[0];
    __syncthreads();
    return total;
}

// One block of THREADS per row.
extern "C" __global__ void rms_norm(const float *x, const float *w, float *out, int n,
                                    float eps) {
    __shared__ float partial[THREADS];
    const int row = blockIdx.x, lid = threadIdx.x;
    const float *xr = x + (size_t)row * n;
    float acc = 0.0f;
    for (int i = lid; i < n; i += THREADS) acc += xr[i] * xr[i];
    const float inv = rsqrtf(block_sum(acc, partial) / (float)n + eps);
    for (int i = lid; i < n; i += THREADS) out[(size_t)row * n + i] = xr[i] * inv * w[i];
}

// One block of THREADS per row: (x - mean) / sqrt(var + eps) * w (+ b), the variance taken of
// the centered values (two passes over the row, as numpy's reference does).
extern "C" __global__ void layer_norm(const float *x, const float *w, const float *b,
                                      float *out, int n, float eps, int has_bias) {
    __shared__ float partial[THREADS];
    const int row = blockIdx.x, lid = threadIdx.x;
    const float *xr = x + (size_t)row * n;
    float acc = 0.0f;
    for (int i = lid; i < n; i += THREADS) acc += xr[i];
    const float mean = block_sum(acc, partial) / (float)n;
    acc = 0.0f;
    for (int i = lid; i < n; i += THREADS) acc += (xr[i] - mean) * (xr[i] - mean);
    const float inv = rsqrtf(block_sum(acc, partial) / (float)n + eps);
    for (int i = lid; i < n; i += THREADS)
        out[(size_t)row * n + i] = (xr[i] - mean) * inv * w[i] + (has_bias ? b[i] : 0.0f);
}

extern "C" __global__ void add_inplace(float *x, const float *y, long long size) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < size) x[i] += y[i];
}

extern "C" __global__ void silu_mul(const float *gate_up, float *out, int f) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= f) return;
    const float g = gate_up[(size_t)t * 2 * f + i], u = gate_up[(size_t)t * 2 * f + f + i];
    out[(size_t)t * f + i] = g / (1.0f + expf(-g)) * u;
}

// gelu: the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) when `approximate`,
// else the exact 0.5 x (1 + erf(x / sqrt(2)))
__device__ __forceinline__ float gelu_f(float x, int approximate) {
    const float inner = approximate ? tanhf(0.7978845608f * x * (1.0f + 0.044715f * x * x))
                                    : erff(x * 0.7071067812f);
    return 0.5f * x * (1.0f + inner);
}

extern "C" __global__ void gelu_mul(const float *gate_up, float *out, int f, int approximate) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= f) return;
    const float g = gate_up[(size_t)t * 2 * f + i], u = gate_up[(size_t)t * 2 * f + f + i];
    out[(size_t)t * f + i] = gelu_f(g, approximate) * u;
}

extern "C" __global__ void gelu_inplace(float *x, long long size, int approximate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < size) x[i] = gelu_f(x[i], approximate);
}

extern "C" __global__ void scale_inplace(float *x, long long size, float factor) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < size) x[i] *= factor;
}

extern "C" __global__ void split_qkv(const float *qkv, float *q, float *k, float *v,
                                     int q_size, int kv_size) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const int width = q_size + 2 * kv_size;
    if (i >= width) return;
    const float x = qkv[(size_t)t * width + i];
    if (i < q_size) q[(size_t)t * q_size + i] = x;
    else if (i < q_size + kv_size) k[(size_t)t * kv_size + i - q_size] = x;
    else v[(size_t)t * kv_size + i - q_size - kv_size] = x;
}

// grid (ceil(rot/2 / THREADS), heads, T)
extern "C" __global__ void rope(float *x, const int *positions, const float *cos_t,
                                const float *sin_t, int heads, int head_dim, int rot,
                                int interleaved) {
    const int t = blockIdx.z, h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const int half_rot = rot / 2;
    if (i >= half_rot) return;
    const float c = cos_t[(size_t)positions[t] * half_rot + i];
    const float s = sin_t[(size_t)positions[t] * half_rot + i];
    float *row = x + ((size_t)t * heads + h) * head_dim;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half_rot;
    const float x1 = row[a], x2 = row[b];
    row[a] = x1 * c - x2 * s;
    row[b] = x2 * c + x1 * s;
}

extern "C" __global__ void reshape_and_cache(const float *k, const float *v, float *k_cache,
                                             float *v_cache, const long long *slots,
                                             int width) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const size_t dst = (size_t)slots[t] * width + i;
    k_cache[dst] = k[(size_t)t * width + i];
    v_cache[dst] = v[(size_t)t * width + i];
}

// One warp per (token, query head): lanes split the head dimension; online softmax over the
// token's visible context through its request's block table. grid (heads, T), block 32.
// window > 0: a query at position p sees keys p - window < j <= p only; softcap > 0: scores
// s become softcap * tanh(s / softcap) before the softmax.
extern "C" __global__ void paged_attention(const float *q, const float *k_cache,
                                           const float *v_cache, const int *token_req,
                                           const int *token_pos, const int *block_tables,
                                           float *out, int heads, int kv_heads, int head_dim,
                                           int block_size, int max_blocks, float scale,
                                           int window, float softcap, const float *sinks,
                                           int has_sinks) {
    const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
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
        const float *kr = k_cache + (slot * kv_heads + kvh) * head_dim;
        float s = 0.0f;
        for (int r = 0; r < 8; ++r) {
            const int d = lane + 32 * r;
            if (d < head_dim) s += qv[r] * kr[d];
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new), p = expf(s - m_new);
        const float *vr = v_cache + (slot * kv_heads + kvh) * head_dim;
        for (int r = 0; r < 8; ++r) {
            const int d = lane + 32 * r;
            if (d < head_dim) acc[r] = acc[r] * correction + p * vr[d];
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

extern "C" __global__ void gather_rows(const float *x, const int *rows, float *out,
                                       int width) {
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < width) out[(size_t)r * width + i] = x[(size_t)rows[r] * width + i];
}

// ---- LoRA (models/lora.py): xa [rows, R] = x[rows] @ A^T, then y[rows, col + j] +=
// scale * xa[:, r0:r0+r] @ B (b_t [r_max, width], this part's columns from b0) ------------

extern "C" __global__ void lora_shrink(const float *x, const long long *rows, const float *a,
                                       float *xa, int k, int ranks) {
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ranks) return;
    const float *xr = x + (size_t)rows[r] * k, *ar = a + (size_t)i * k;
    float acc = 0.0f;
    for (int d = 0; d < k; ++d) acc += xr[d] * ar[d];
    xa[(size_t)r * ranks + i] = acc;
}

extern "C" __global__ void lora_expand(const float *xa, const long long *rows, const float *b_t,
                                       float *y, int ranks, int r0, int rank, int width,
                                       int b0, int n, int n_out, int col, float scale) {
    const int r = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float acc = 0.0f;
    for (int i = 0; i < rank; ++i)
        acc += xa[(size_t)r * ranks + r0 + i] * b_t[(size_t)i * width + b0 + j];
    y[(size_t)rows[r] * n_out + col + j] += acc * scale;
}

// ---- linear: y [T, N] = x [T, K] @ W^T (+ bias), W [N, K]; grid (ceil(N / THREADS), T) ----

extern "C" __global__ void linear_f32(const float *x, const float *w, const float *bias,
                                      float *y, int k, int n, int has_bias) {
    const int t = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n) return;
    const float *xr = x + (size_t)t * k, *wr = w + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * wr[i];
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// F16 storage, float32 arithmetic
extern "C" __global__ void linear_f16(const float *x, const unsigned short *w, const float *bias,
                                      float *y, int k, int n, int has_bias) {
    const int t = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n) return;
    const float *xr = x + (size_t)t * k;
    const unsigned short *wr = w + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * half_to_float(wr[i]);
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// BF16 storage: the top 16 bits of a float32
extern "C" __global__ void linear_bf16(const float *x, const unsigned short *w, const float *bias,
                                       float *y, int k, int n, int has_bias) {
    const int t = blockIdx.y, o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= n) return;
    const float *xr = x + (size_t)t * k;
    const unsigned short *wr = w + (size_t)o * k;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc += xr[i] * __uint_as_float((unsigned int)wr[i] << 16);
    y[(size_t)t * n + o] = acc + (has_bias ? bias[o] : 0.0f);
}

// Block-quantized matmuls (GGUF Q*_0/1/K) are in linear_quant.cu, compiled after this file.

// ---- sampling helpers ------------------------------------------------------------------

// Greedy: one block of THREADS per row of logits [rows, vocab]; ties go to the lowest id;
// a row holding any non-finite logit gives -1.
extern "C" __global__ void argmax_rows(const float *logits, int vocab, int *out) {
    __shared__ float best[THREADS];
    __shared__ int best_id[THREADS], bad[THREADS];
    const int row = blockIdx.x, lid = threadIdx.x;
    const float *lr = logits + (size_t)row * vocab;
    float b = NEG_INF;
    int bi = 0x7fffffff, nonfinite = 0;
    for (int i = lid; i < vocab; i += THREADS) {
        if (!isfinite(lr[i])) nonfinite = 1;
        else if (lr[i] > b) { b = lr[i]; bi = i; }
    }
    best[lid] = b;
    best_id[lid] = bi;
    bad[lid] = nonfinite;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (lid < s) {
            bad[lid] |= bad[lid + s];
            if (best[lid + s] > best[lid] ||
                (best[lid + s] == best[lid] && best_id[lid + s] < best_id[lid])) {
                best[lid] = best[lid + s];
                best_id[lid] = best_id[lid + s];
            }
        }
        __syncthreads();
    }
    if (lid == 0) out[row] = bad[0] ? -1 : best_id[0];
}

// logits[row, :] /= temperature[row] (rows with temperature 0 are greedy and left alone)
extern "C" __global__ void apply_temperature(float *logits, const float *temperature,
                                             int vocab) {
    const int row = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    const float temp = temperature[row];
    if (i < vocab && temp > 0.0f) logits[(size_t)row * vocab + i] /= temp;
}

// Mask every logit below the row's threshold (the k-th largest for top-k, or the value at
// which the sorted probabilities reach top_p, found on the host or by a sort) to -inf.
extern "C" __global__ void mask_below(float *logits, const float *threshold, int vocab) {
    const int row = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < vocab && logits[(size_t)row * vocab + i] < threshold[row])
        logits[(size_t)row * vocab + i] = NEG_INF;
}
