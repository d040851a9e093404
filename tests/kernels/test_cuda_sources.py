"""The CUDA program (every .cu file, joined as the backend joins them) compiles, so syntax and
types are checked without a GPU: with nvcc -ptx for sm_90 and sm_80 where nvcc exists, and
with NVRTC (what CuPy's RawModule uses) where the `nvidia-cuda-nvrtc-cu12` wheel is
installed. Numerical parity runs in test_device_ops.py where a GPU exists; the quantized
matmuls of linear_quant.cu (plain C++ but for their qualifiers) also run on the host with g++
here, against numpy."""

import ctypes
import glob
import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import vllm_actors.kernels.cuda as cuda_pkg
from vllm_actors.kernels import kv_quant, quant
from vllm_actors.kernels.device_backend import (KERNEL_NAMES, QUANT_KERNELS, SOURCE_FILES,
                                                kernel_source, quant_defines)
from vllm_actors.kernels.device_kv import kv_defines

SOURCES = sorted(p.name for p in Path(cuda_pkg.__file__).parent.glob("*.cu"))


def test_every_source_is_built():
    assert SOURCES == sorted(SOURCE_FILES["cu"])


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cuda") / "program.cu"
    path.write_text(kernel_source("cu"))
    return path


def check_entries(ptx: str) -> None:
    for name in KERNEL_NAMES:    # extern "C": unmangled entry points CuPy looks up by name
        assert f".entry {name}(" in ptx, name


def nvcc_ptx(source: Path, arch: str, tmp_path: Path) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    out = tmp_path / "out.ptx"
    done = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-Werror", "all-warnings",
                           str(source), "-o", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return out.read_text()


def nvrtc_ptx(source: Path, arch: str, tmp_path: Path) -> str:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    libs = [p for d in (spec.submodule_search_locations if spec else [])
            for p in glob.glob(f"{d}/lib/libnvrtc.so*")]
    if not libs:
        pytest.skip("the nvidia-cuda-nvrtc-cu12 wheel is not installed here")
    nvrtc = ctypes.CDLL(sorted(libs)[0])
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), b"ops.cu", 0,
                                    None, None) == 0
    options = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"--std=c++14"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode(errors="replace")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


@pytest.mark.parametrize("compile_ptx", [nvcc_ptx, nvrtc_ptx], ids=["nvcc", "nvrtc"])
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_program_compiles(program, arch, compile_ptx, tmp_path):
    check_entries(compile_ptx(program, arch, tmp_path))


# linear_quant.cu as host C++: the qualifiers defined away, one thread per call, and
# ops.cu's load_half (a PTX instruction there) in plain arithmetic.
HOST_PRELUDE = """
#include <math.h>
#include <stddef.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
static struct { int x, y; } blockIdx, blockDim = {1, 1}, threadIdx;
static float load_half(const unsigned char *p) {
    const int h = p[0] | (p[1] << 8), e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? ldexpf((float)m, -24)
                  : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), e - 25);
    return (h >> 15) ? -v : v;
}
"""
HOST_DRIVER = """
extern "C" void host_{0}(const float *x, const unsigned char *w, const float *bias, float *y,
                         int k, int n, int has_bias, int t) {{
    for (blockIdx.y = 0; blockIdx.y < t; ++blockIdx.y)
        for (blockIdx.x = 0; blockIdx.x < n; ++blockIdx.x) {0}(x, w, bias, y, k, n, has_bias);
}}
"""


def test_quant_kernels_run_on_the_host(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed here")
    source = tmp_path / "linear_quant_host.cpp"
    source.write_text(HOST_PRELUDE + quant_defines()
                      + (Path(cuda_pkg.__file__).parent / "linear_quant.cu").read_text()
                      + "".join(HOST_DRIVER.format(name) for name, _ in QUANT_KERNELS.values()))
    lib = tmp_path / "linear_quant_host.so"
    done = subprocess.run([gxx, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", str(source),
                           "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    host = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(7)
    rows, k, t = 24, 512, 3
    for qtype, (name, values) in QUANT_KERNELS.items():
        nbytes = quant.block_layout(qtype)[1]
        raw = rng.integers(0, 256, (rows * k // values, nbytes), dtype=np.uint8)
        for field, offset in quant.BLOCK_OFFSETS[qtype].items():
            if field in ("d", "m", "dmin"):     # the half floats: finite, of sane size
                halves = (rng.random(len(raw)) * 0.02 + 0.005).astype(np.float16)
                raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
        x = rng.standard_normal((t, k)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        y = np.empty((t, rows), np.float32)
        ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, raw, bias, y)]
        getattr(host, "host_" + name)(*ptr, k, rows, 1, t)
        want = x @ quant.dequantize(raw, qtype, (rows, k)).T + bias
        assert np.abs(y - want).max() <= 2e-5 * np.abs(want).max(), name


# kv_quant.cu as host C++: the KV cache stores and the decode of one value run on the host
# against kv_quant's numpy reference (the attention kernel, warp shuffles and all, is only
# compiled here; it runs in test_device_kv_formats.py where a GPU exists). ops.cu's float16
# conversions (PTX there) become _Float16 casts, which round to nearest even.
KV_HOST_PRELUDE = """
#include <math.h>
#include <stddef.h>
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
#define __shared__ static
#define __syncthreads()
#define NEG_INF (-INFINITY)
static struct { int x, y; } blockIdx, blockDim = {1, 1}, threadIdx;
static unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static float __shfl_xor_sync(unsigned int, float v, int) { return v; }
static int max(int a, int b) { return a > b ? a : b; }
static float half_to_float(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static float load_half(const unsigned char *p) { return half_to_float(p[0] | (p[1] << 8)); }
static unsigned short float_to_half(float f) {
    const _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h;
}
static unsigned short double_to_half(double d) {
    const _Float16 x = (_Float16)d; unsigned short h; memcpy(&h, &x, 2); return h;
}
"""
KV_HOST_DRIVER = """
extern "C" void host_store_kv(const float *k, const float *v, unsigned char *kc,
                              unsigned char *vc, const long long *slots, int width, int kind,
                              int man_bits, float k_scale, float v_scale, int t) {
    for (blockIdx.y = 0; blockIdx.y < t; ++blockIdx.y)
        for (blockIdx.x = 0; blockIdx.x < width; ++blockIdx.x)
            reshape_and_cache_kv(k, v, kc, vc, slots, width, kind, man_bits, k_scale, v_scale);
}
extern "C" void host_store_tq(const float *k, const float *v, unsigned char *kc,
                              unsigned char *vc, const long long *slots, const float *lut,
                              int kv_heads, int d, int row_bytes, int n_high, int high, int low,
                              int rows) {
    blockIdx.y = 0;
    for (blockIdx.x = 0; blockIdx.x < 2 * rows; ++blockIdx.x)
        reshape_and_cache_tq(k, v, kc, vc, slots, lut, kv_heads, d, row_bytes, n_high, high,
                             low, rows);
}
extern "C" void host_decode(const unsigned char *rows, int n, int d, int kind, int row_bytes,
                            int n_high, int high, int low, const float *lut, float *out) {
    for (int r = 0; r < n; ++r)
        for (int i = 0; i < d; ++i)
            out[r * d + i] = kv_value(rows + r * row_bytes, i, kind, lut, n_high, high, low)
                             * kv_row_scale(rows + r * row_bytes, kind, row_bytes);
}
"""


@pytest.fixture(scope="module")
def kv_host(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed here")
    tmp = tmp_path_factory.mktemp("kv_host")
    source = tmp / "kv_quant_host.cpp"
    source.write_text(KV_HOST_PRELUDE + kv_defines()
                      + (Path(cuda_pkg.__file__).parent / "kv_quant.cu").read_text()
                      + KV_HOST_DRIVER)
    lib = tmp / "kv_quant_host.so"
    done = subprocess.run([gxx, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", str(source),
                           "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(lib))


def _ptrs(*arrays: np.ndarray) -> list:
    return [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]


@pytest.mark.parametrize("name", ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2",
                                  "turboquant_2", "turboquant_2.5", "turboquant_3",
                                  "turboquant_3.5", "turboquant_4"])
@pytest.mark.parametrize("d", [64, 44])
def test_kv_kernels_run_on_the_host(kv_host, name, d):
    """kv_quant.cu's stores give kv_quant's bytes (fp8: K unscaled, so that the ties between
    codes are exact; V scaled by 0.05), and its per-value decode gives kv_quant's decode."""
    fmt = kv_quant.kv_format(name, 1.0, 0.05)
    rng = np.random.default_rng(11)
    t, hk = 40, 2
    x = [(rng.standard_normal((t, hk, d)) * 2.0 ** rng.integers(-30, 17, (t, hk, 1)))
         .astype(np.float32) for _ in "kv"]
    if fmt.kind == kv_quant.FP8:        # every tie between two codes, signed
        mids = np.nan_to_num((fmt.lut(d)[1:127] + fmt.lut(d)[:126]) / 2)
        x[0].reshape(-1)[:252] = np.concatenate([mids, -mids])
    if fmt.kind != kv_quant.TURBOQUANT:
        x[0].reshape(-1)[-6:] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42]
    slots = rng.permutation(t).astype(np.int64)
    slots[5] = -1                        # skipped
    row = fmt.row_len(d)
    got = [np.zeros((t, hk, row), fmt.storage) for _ in "kv"]
    lut = np.concatenate([fmt.lut(d, "k"), np.zeros(1, np.float32)])
    n_high, high, low = fmt.split(d) if fmt.kind == kv_quant.TURBOQUANT else (0, 0, 0)
    if fmt.kind == kv_quant.TURBOQUANT:
        x[0][3, 1] = 0.0                 # a zero row: scale 0
        kv_host.host_store_tq(*_ptrs(*x, *got, slots, lut), hk, d, fmt.row_bytes(d), n_high,
                              high, low, t * hk)
    else:
        kv_host.host_store_kv(*_ptrs(*x, *got, slots), hk * d, fmt.kind,
                              3 if name == "fp8_e4m3" else 2, ctypes.c_float(fmt.k_scale),
                              ctypes.c_float(fmt.v_scale), t)
    keep = slots >= 0
    for which, have, xs in zip("kv", got, x):
        want = np.zeros_like(have)
        with np.errstate(over="ignore", invalid="ignore"):
            want[slots[keep]] = fmt.encode(xs[keep], which)
        assert np.array_equal(have, want), which
    decoded = np.empty((t * hk, d), np.float32)
    kv_host.host_decode(*_ptrs(got[0]), t * hk, d, fmt.kind, fmt.row_bytes(d), n_high, high,
                        low, *_ptrs(lut, decoded))
    assert np.array_equal(decoded, fmt.decode(got[0], d, "k").reshape(-1, d), equal_nan=True)


# --gguf-activations quantized as host C++: act_quant.cu's quantizer and linear_int.cu's
# integer matmuls (after linear_quant.cu's block helpers and kv_quant.cu's float16 and
# bfloat16 encoders, as the backend builds them) against llama.cpp's own bytes and vec_dot
# (tests/golden/ggml_quant.npz, test_activation_quant), one thread per call; dp4a as its
# definition, on 4 signed bytes.
INT_HOST_PRELUDE = KV_HOST_PRELUDE + """
static int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (signed char)(a >> 8 * i) * (signed char)(b >> 8 * i);
    return c;
}
static float __fmul_rn(float a, float b) { return a * b; }
"""
INT_HOST_DRIVER = """
extern "C" void host_quantize(const float *x, signed char *q, float *d, float *s, int k,
                              int format, int t) {
    for (blockIdx.y = 0; blockIdx.y < t; ++blockIdx.y)
        for (blockIdx.x = 0; blockIdx.x < k / (format == 2 ? 256 : 32); ++blockIdx.x)
            quantize_q8(x, q, d, s, k, format);
}
extern "C" void host_round(const float *x, float *out, int n, int bf16) {
    blockIdx.y = 0;
    for (blockIdx.x = 0; blockIdx.x < n; ++blockIdx.x) round_16(x, out, n, bf16);
}
"""
INT_LINEAR_DRIVER = """
extern "C" void host_{0}(const int *xq, const float *xd, const float *xs,
                         const unsigned char *w, float *y, int k, int n, int t) {{
    for (blockIdx.y = 0; blockIdx.y < t; ++blockIdx.y)
        for (blockIdx.x = 0; blockIdx.x < n; ++blockIdx.x) {0}(xq, xd, xs, w, y, y, k, n, 0);
}}
"""


def test_quantized_semantics_runs_on_the_host(tmp_path):
    from test_activation_quant import (CASES, DOT_TYPES, GOLDEN, ORDER_TOLERANCE, _bits16,
                                       q8_blocks)

    from vllm_actors.kernels import activation_quant as aq
    from vllm_actors.kernels.device_backend import INT_KERNELS, Q8_FORMATS
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed here")
    here = Path(cuda_pkg.__file__).parent
    source = tmp_path / "int_host.cpp"
    source.write_text(INT_HOST_PRELUDE + quant_defines() + kv_defines() + "".join(
        (here / name).read_text() for name in ("linear_quant.cu", "kv_quant.cu",
                                               "act_quant.cu", "linear_int.cu"))
        + INT_HOST_DRIVER + "".join(INT_LINEAR_DRIVER.format(n) for n in INT_KERNELS.values()))
    lib = tmp_path / "int_host.so"
    done = subprocess.run([gxx, "-O1", "-shared", "-fPIC", "-Wall", "-Werror", str(source),
                           "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    host = ctypes.CDLL(str(lib))

    def quantize(x: np.ndarray, fmt: str) -> aq.Q8Blocks:
        number, size = Q8_FORMATS[fmt]
        t, k = x.shape
        q = np.empty((t, k // size, size), np.int8)
        d, s = np.empty((t, k // size), np.float32), np.zeros((t, k // size), np.float32)
        host.host_quantize(*_ptrs(np.ascontiguousarray(x), q, d, s), k, number, t)
        return q8_blocks(fmt, q, d, s)

    for case in CASES:
        x = GOLDEN[f"act/{case}/x"].reshape(1, -1).astype(np.float32)
        for fmt in Q8_FORMATS:
            assert np.array_equal(quantize(x, fmt).to_bytes().reshape(-1),
                                  GOLDEN[f"act/{case}/{fmt}"].reshape(-1)), (case, fmt)
        for bf16, fmt in enumerate(("f16", "bf16")):
            rounded = np.empty_like(x)
            host.host_round(*_ptrs(x, rounded), x.size, bf16)
            assert np.array_equal(_bits16(rounded, fmt), GOLDEN[f"act/{case}/{fmt}"]
                                  .reshape(-1)), (case, fmt)
    for qtype, (name, _) in QUANT_KERNELS.items():
        tag = quant.T(qtype).name
        assert tag in DOT_TYPES
        w, x, want = (GOLDEN[f"dot/{tag}/{k}"] for k in ("w", "x", "out"))
        fmt = aq.activation_format(qtype)
        blocks = quantize(x.astype(np.float32), fmt)
        y = np.empty(want.shape, np.float32)
        sums = blocks.s if blocks.s is not None else blocks.d
        getattr(host, "host_" + INT_KERNELS[name])(*_ptrs(blocks.q, blocks.d, sums, w, y),
                                                   x.shape[1], len(w), len(x))
        dense = quant.dequantize(w, qtype, (len(w), x.shape[1]))
        magnitude = np.abs(aq.simulate(x, fmt)[0]) @ np.abs(dense).T
        assert np.all(np.abs(y - want) <= ORDER_TOLERANCE * magnitude), tag
