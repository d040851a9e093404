// The activation formats of --gguf-activations quantized on the device, bit for bit the
// numpy reference (kernels/activation_quant.py), which writes the bytes of ggml's x86
// quantizers. A row of x [T, K] becomes int8 quants q [T, K] and one float scale d a block
// (Q8_0 / Q8_1: 32 values, d rounded to float16; Q8_K: 256, d float32), and for Q8_1 the
// block's float16-rounded sum s. The integer matmuls (linear_quant.cl) read these planes;
// weights kept as floats read x~ = d q (dequantize_q8) or x rounded to 16 bits (round_16,
// through kv_quant.cl's encoders, built before this file).

#define FORMAT_Q8_0 0
#define FORMAT_Q8_1 1
#define FORMAT_Q8_K 2

inline float round_half(const float v) {
    ushort h;
    vstore_half_rte(v, 0, (half *)&h);
    return vload_half(0, (const half *)&h);
}

// Q8_0 / Q8_1 (s non-null): d = amax / 127, q = rint(x 127 / amax), ties to even; what no
// int32 holds (an all-subnormal block's 127 / amax overflows) saturates to -128, and Q8_1's
// sum wraps in int32 as ggml's does before its packs saturate.
inline void q8_0_block(__global const float *x, __global char *q, __global float *d,
                       __global float *s) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmax(amax, fabs(x[j]));
    const float d32 = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    uint total = 0;
    for (int j = 0; j < 32; ++j) {
        const float v = rint(x[j] * inv);
        const int iv = fabs(v) < 2147483648.0f ? (int)v : INT_MIN;
        q[j] = (char)clamp(iv, -128, 127);
        total += (uint)iv;
    }
    *d = round_half(d32);
    if (s) *s = round_half(d32 * (float)(int)total);
}

// Q8_K: the first value of largest magnitude, sign kept, gives iscale = -127 / peak; q =
// min(127, rint(iscale x)), 0 where that is not finite; d = 1 / iscale.
inline void q8_k_block(__global const float *x, __global char *q, __global float *d) {
    float amax = 0.0f, peak = 0.0f;
    for (int j = 0; j < 256; ++j)
        if (fabs(x[j]) > amax) {
            amax = fabs(x[j]);
            peak = x[j];
        }
    const float iscale = peak != 0.0f ? -127.0f / peak : 0.0f;
    for (int j = 0; j < 256; ++j) {
        const float v = rint(x[j] * iscale);
        q[j] = isfinite(v) ? (char)min(v, 127.0f) : (char)0;
    }
    *d = peak != 0.0f ? 1.0f / iscale : 0.0f;
}

// One work-item per block b of row t: items (K / block, T). s: Q8_1's sums (else unused).
__kernel void quantize_q8(__global const float *x, __global char *q, __global float *d,
                          __global float *s, const int k, const int format) {
    const int b = get_global_id(0), t = get_global_id(1);
    const int qk = format == FORMAT_Q8_K ? 256 : 32;
    const size_t at = (size_t)t * k + (size_t)b * qk, blk = (size_t)t * (k / qk) + b;
    if (format == FORMAT_Q8_K) q8_k_block(x + at, q + at, d + blk);
    else q8_0_block(x + at, q + at, d + blk, format == FORMAT_Q8_1 ? s + blk : 0);
}

// x~ = d q, the values a block dot product sees; items (K, T).
__kernel void dequantize_q8(__global const char *q, __global const float *d,
                            __global float *out, const int k, const int qk) {
    const int i = get_global_id(0), t = get_global_id(1);
    const size_t at = (size_t)t * k + i;
    out[at] = d[(size_t)t * (k / qk) + i / qk] * (float)q[at];
}

// Q8_1's s - d sum(q) a block, which a Q4_1 / Q5_1 weight's min multiplies when the weight
// is kept as floats; items (K / 32, T).
__kernel void q8_1_delta(__global const char *q, __global const float *d,
                         __global const float *s, __global float *out, const int k) {
    const int b = get_global_id(0), t = get_global_id(1);
    const size_t blk = (size_t)t * (k / 32) + b;
    __global const char *qb = q + (size_t)t * k + (size_t)b * 32;
    int sum = 0;
    for (int j = 0; j < 32; ++j) sum += qb[j];
    const float dq = d[blk] * (float)sum;
    out[blk] = s[blk] - dq;
}

// x rounded to nearest-even float16 (bf16 = 0) or bfloat16, as F16 / BF16 weights' dot
// products take it (the KV cache's encodings, NaN kept as numpy keeps it); items (n,).
__kernel void round_16(__global const float *x, __global float *out, const long n,
                       const int bf16) {
    const size_t i = get_global_id(0);
    if (i >= n) return;
    if (bf16) {
        out[i] = as_float((uint)bf16_encode(x[i]) << 16);
        return;
    }
    const ushort nan16 = f16_nan(x[i]);
    out[i] = isnan(x[i]) ? vload_half(0, (const half *)&nan16) : round_half(x[i]);
}
