// The activation formats of --gguf-activations quantized on the device, bit for bit the
// numpy reference (kernels/activation_quant.py), which writes the bytes of ggml's x86
// quantizers. A row of x [T, K] becomes int8 quants q [T, K] and one float scale d a block
// (Q8_0 / Q8_1: 32 values, d rounded to float16; Q8_K: 256, d float32), and for Q8_1 the
// block's float16-rounded sum s. The integer matmuls (linear_int.cu) read these planes;
// weights kept as floats read x~ = d q (dequantize_q8) or x rounded to 16 bits (round_16).
// Built after ops.cu (half_to_float, THREADS) and kv_quant.cu (f16_encode, bf16_encode).

#define FORMAT_Q8_0 0
#define FORMAT_Q8_1 1
#define FORMAT_Q8_K 2
#define INT32_MIN_ (-2147483647 - 1)

__device__ __forceinline__ float round_half(const float v) {
    return half_to_float(f16_encode(v));
}

// Q8_0 / Q8_1 (s non-null): d = amax / 127, q = rint(x 127 / amax), ties to even; what no
// int32 holds (an all-subnormal block's 127 / amax overflows) saturates to -128, and Q8_1's
// sum wraps in int32 as ggml's does before its packs saturate.
__device__ void q8_0_block(const float *x, signed char *q, float *d, float *s) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float d32 = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    unsigned int total = 0;
    for (int j = 0; j < 32; ++j) {
        const float v = rintf(x[j] * inv);
        const int iv = fabsf(v) < 2147483648.0f ? (int)v : INT32_MIN_;
        q[j] = (signed char)(iv < -128 ? -128 : iv > 127 ? 127 : iv);
        total += (unsigned int)iv;
    }
    *d = round_half(d32);
    if (s) *s = round_half(d32 * (float)(int)total);
}

// Q8_K: the first value of largest magnitude, sign kept, gives iscale = -127 / peak; q =
// min(127, rint(iscale x)), 0 where that is not finite; d = 1 / iscale.
__device__ void q8_k_block(const float *x, signed char *q, float *d) {
    float amax = 0.0f, peak = 0.0f;
    for (int j = 0; j < 256; ++j)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            peak = x[j];
        }
    const float iscale = peak != 0.0f ? -127.0f / peak : 0.0f;
    for (int j = 0; j < 256; ++j) {
        const float v = rintf(x[j] * iscale);
        q[j] = fabsf(v) <= 3.402823466e38f ? (signed char)fminf(v, 127.0f) : (signed char)0;
    }
    *d = peak != 0.0f ? 1.0f / iscale : 0.0f;
}

// One thread per block b of row t: grid (ceil(K / block / THREADS), T). s: Q8_1's sums.
extern "C" __global__ void quantize_q8(const float *x, signed char *q, float *d, float *s,
                                       int k, int format) {
    const int qk = format == FORMAT_Q8_K ? 256 : 32;
    const int b = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (b >= k / qk) return;
    const size_t at = (size_t)t * k + (size_t)b * qk, blk = (size_t)t * (k / qk) + b;
    if (format == FORMAT_Q8_K) q8_k_block(x + at, q + at, d + blk);
    else q8_0_block(x + at, q + at, d + blk, format == FORMAT_Q8_1 ? s + blk : 0);
}

// x~ = d q, the values a block dot product sees; grid (ceil(K / THREADS), T).
extern "C" __global__ void dequantize_q8(const signed char *q, const float *d, float *out,
                                         int k, int qk) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= k) return;
    const size_t at = (size_t)t * k + i;
    out[at] = d[(size_t)t * (k / qk) + i / qk] * (float)q[at];
}

// Q8_1's s - d sum(q) a block, which a Q4_1 / Q5_1 weight's min multiplies when the weight
// is kept as floats; grid (ceil(K / 32 / THREADS), T).
extern "C" __global__ void q8_1_delta(const signed char *q, const float *d, const float *s,
                                      float *out, int k) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (b >= k / 32) return;
    const size_t blk = (size_t)t * (k / 32) + b;
    const signed char *qb = q + (size_t)t * k + (size_t)b * 32;
    int sum = 0;
    for (int j = 0; j < 32; ++j) sum += qb[j];
    out[blk] = s[blk] - __fmul_rn(d[blk], (float)sum);
}

// x rounded to nearest-even float16 (bf16 = 0) or bfloat16, as F16 / BF16 weights' dot
// products take it (the KV cache's encodings); grid (ceil(n / THREADS)).
extern "C" __global__ void round_16(const float *x, float *out, long long n, int bf16) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = bf16 ? __uint_as_float((unsigned int)bf16_encode(x[i]) << 16) : round_half(x[i]);
}
