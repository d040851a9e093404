"""Byte-exact goldens of llama.cpp's CPU activation quantizers and integer dot products.

Our kernels reimplement what ggml's CPU backend does to an activation row before a quantized
matmul (`from_float` of the weight type's `vec_dot_type`: Q8_0, Q8_1, Q8_K, F16, BF16) and the
`vec_dot` that follows. This script calls those functions of the ggml library shipped in the
installed llama-cpp-python (through ctypes and `ggml_get_type_traits_cpu`) and stores inputs and
output bytes, so tests can compare bit for bit without llama.cpp installed. Run by hand:

    pip install -e ".[oracle]"            # llama-cpp-python (built from source, native CPU)
    python tests/oracle/make_ggml_quant_golden.py

Writes tests/golden/ggml_quant.npz:
    act/{case}/x                    float32 [1024] activation row
    act/{case}/{q8_0,q8_1,q8_k,f16,bf16}   uint8 bytes of that type's `from_float`
    dot/{TYPE}/w                    uint8 [8, row_bytes] weight rows (ggml's own `from_float`)
    dot/{TYPE}/x, dot/{TYPE}/xq     float32 [3, 1024] activations, uint8 [3, bytes] quantized
    dot/{TYPE}/vec_dot_type         int, ggml type id of xq
    dot/{TYPE}/out                  float32 [3, 8] vec_dot(w[j], xq[i])
    dot_odd/{TYPE}/...              the same at K = ODD_K (an odd count of 32-blocks), for
                                    the types whose vec_dot ends such a row apart (IQ4_NL)
    meta/llama_cpp_version, meta/cpu_flags, meta/ggml_cpu_features

SIMD paths differ from the scalar reference (rounding of ties, summation order), so the goldens
belong to the machine features recorded in meta; it prints how each quantizer compares with
gguf-py's `gguf.quants.quantize` (informational only).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
K = 1024                 # four Q8_K super-blocks of 256
SEED = 20240611
N_WEIGHT_ROWS = 8
N_ACT_ROWS = 3

# ggml_type ids (ggml/include/ggml.h)
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
            "Q8_1": 9, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
            "Q8_K": 15, "IQ4_NL": 20, "BF16": 30}
ACT_TYPES = ("Q8_0", "Q8_1", "Q8_K", "F16", "BF16")
WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "F16", "BF16", "IQ4_NL")     # new types last: the others keep their draws
ODD_K = 1056
ODD_TYPES = ("IQ4_NL",)
CPUINFO_FLAGS = ("sse3", "ssse3", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw",
                 "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni",
                 "amx_int8", "amx_bf16", "amx_tile")
GGML_FEATURES = ("sse3", "ssse3", "avx", "avx2", "fma", "f16c", "bmi2", "avx512",
                 "avx512_vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8",
                 "llamafile")

FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_int)


class TypeTraitsCpu(ctypes.Structure):
    """`struct ggml_type_traits_cpu` of ggml/include/ggml-cpu.h."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class Ggml:
    """The CPU quantizers and dot products of the ggml libraries bundled with llama_cpp."""

    def __init__(self, lib_dir: Path) -> None:
        self.base = ctypes.CDLL(str(_find_lib(lib_dir, "libggml-base")), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(_find_lib(lib_dir, "libggml-cpu")), mode=ctypes.RTLD_GLOBAL)
        self.cpu.ggml_cpu_init.restype = None
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        self.base.ggml_row_size.restype = ctypes.c_size_t
        self.base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

    def traits(self, type_id: int) -> TypeTraitsCpu:
        return self.cpu.ggml_get_type_traits_cpu(type_id).contents

    def row_size(self, type_id: int, n: int) -> int:
        return int(self.base.ggml_row_size(type_id, n))

    def from_float(self, type_id: int, x: np.ndarray) -> np.ndarray:
        """Bytes of one row `x` (float32) quantized by the CPU `from_float` of `type_id`."""
        fn = self.traits(type_id).from_float
        if not fn:
            raise ValueError(f"ggml type {type_id} has no CPU from_float")
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros(self.row_size(type_id, x.size), dtype=np.uint8)
        FROM_FLOAT(fn)(x.ctypes.data, out.ctypes.data, x.size)
        return out

    def vec_dot(self, type_id: int, n: int, w: np.ndarray, xq: np.ndarray) -> float:
        """vec_dot of weight row bytes `w` (type_id) with activation bytes `xq` (its
        vec_dot_type), one row (nrc=1)."""
        fn = self.traits(type_id).vec_dot
        s = ctypes.c_float(np.nan)
        w, xq = np.ascontiguousarray(w), np.ascontiguousarray(xq)
        VEC_DOT(fn)(n, ctypes.byref(s), 0, w.ctypes.data, 0, xq.ctypes.data, 0, 1)
        return s.value

    def cpu_features(self) -> dict[str, int]:
        """The ggml_cpu_has_* answers (compile-time SIMD of this build)."""
        out = {}
        for name in GGML_FEATURES:
            fn = getattr(self.cpu, f"ggml_cpu_has_{name}", None)
            if fn is not None:
                fn.restype = ctypes.c_int
                out[name] = int(fn())
        return out


def _find_lib(lib_dir: Path, stem: str) -> Path:
    candidates = sorted(lib_dir.glob(f"{stem}*.so*"), key=lambda p: len(p.name))
    if not candidates:
        sys.exit(f"no {stem}*.so under {lib_dir}: is llama-cpp-python installed?")
    return candidates[0]


def llama_cpp_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        sys.exit("llama_cpp is not installed: pip install -e '.[oracle]'")
    return Path(spec.origin).parent / "lib"


def cpuinfo_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return [f for f in CPUINFO_FLAGS if f in present]


# ---- activation cases -------------------------------------------------------------------------

def _ties(sign: float) -> np.ndarray:
    """Every 32-block holds sign*127 once (so the Q8 scale is exactly 1) and k+0.5 values,
    k in -126..126, which land exactly on .5 after scaling."""
    halves = np.arange(-126, 127, dtype=np.float32) + 0.5
    x = np.resize(halves, K).astype(np.float32)
    for b in range(K // 32):
        x[b * 32 + (b * 7) % 32] = 127.0
    return sign * x


def _with_extreme(rng: np.random.Generator, signs: str) -> np.ndarray:
    """Normal values in (-3, 3) plus, per 32-block, extremes of magnitude m (constant within a
    256 super-block). signs "+" or "-": one extreme of that sign; "both": +m and -m in the same
    block, which comes first alternating per block (first occurrence is Q8_K's signed max)."""
    x = np.clip(rng.standard_normal(K), -2.9, 2.9).astype(np.float32)
    for b in range(K // 32):
        m = np.float32(3.0 + (b // 8))
        i, j = sorted(rng.choice(32, 2, replace=False))
        if signs == "both":
            first = 1.0 if (b + b // 8) % 2 == 0 else -1.0
            x[b * 32 + i], x[b * 32 + j] = first * m, -first * m
        else:
            x[b * 32 + i] = m if signs == "+" else -m
    return x


def _half_ties() -> np.ndarray:
    """Values exactly halfway between neighbouring F16 (and BF16) numbers, both signs, and the
    F16 overflow edge (65504 is the largest finite, 65520 rounds to inf)."""
    j = np.arange(K // 4, dtype=np.float32)
    f16_ties = 1.0 + (2 * (j % 512) + 1) * np.float32(2.0 ** -11)
    bf16_ties = 1.0 + (2 * (j % 64) + 1) * np.float32(2.0 ** -8)
    x = np.concatenate([f16_ties, -f16_ties, bf16_ties * 4.0, -bf16_ties]).astype(np.float32)
    x[-4:] = [65504.0, 65519.0, 65520.0, -65520.0]
    return x


def activation_cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    normal = rng.standard_normal(K).astype(np.float32)
    block_scales = 10.0 ** rng.uniform(-3, 3, K // 32)
    cases = {
        "normal": normal,
        "zeros": np.zeros(K, np.float32),
        "ties_pos": _ties(1.0),
        "ties_neg": _ties(-1.0),
        "ties_scaled": _ties(1.0) * np.float32(2.0 ** -7),
        "max_pos": _with_extreme(rng, "+"),
        "max_neg": _with_extreme(rng, "-"),
        "max_both": _with_extreme(rng, "both"),
        "tiny": rng.standard_normal(K) * 1e-30,
        "denormal": rng.standard_normal(K) * 1e-39,
        "large": rng.standard_normal(K) * 1e30,
        "mixed_scales": rng.standard_normal(K) * np.repeat(block_scales, 32),
        "half_ties": _half_ties(),
    }
    return {name: np.asarray(x, dtype=np.float32) for name, x in cases.items()}


def activation_goldens(ggml: Ggml, cases: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays = {}
    for name, x in cases.items():
        arrays[f"act/{name}/x"] = x
        for t in ACT_TYPES:
            arrays[f"act/{name}/{t.lower()}"] = ggml.from_float(TYPE_IDS[t], x)
    return arrays


# ---- dot products -----------------------------------------------------------------------------

def dot_goldens(ggml: Ggml, rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = {}
    for prefix, k, types in (("dot", K, WEIGHT_TYPES), ("dot_odd", ODD_K, ODD_TYPES)):
        for t in types:
            arrays.update(_dot_case(ggml, rng, f"{prefix}/{t}", TYPE_IDS[t], k))
    return arrays


def _dot_case(ggml: Ggml, rng: np.random.Generator, key: str, tid: int, k: int
              ) -> dict[str, np.ndarray]:
    traits = ggml.traits(tid)
    row_scale = 10.0 ** rng.uniform(-1, 1, (N_WEIGHT_ROWS, 1))
    w_f = (rng.standard_normal((N_WEIGHT_ROWS, k)) * row_scale).astype(np.float32)
    x = rng.standard_normal((N_ACT_ROWS, k)).astype(np.float32)
    w = np.stack([ggml.from_float(tid, row) for row in w_f])
    xq = np.stack([ggml.from_float(traits.vec_dot_type, row) for row in x])
    out = np.array([[ggml.vec_dot(tid, k, wr, xr) for wr in w] for xr in xq], np.float32)
    print(f"{key:12s}: vec_dot_type {traits.vec_dot_type:2d}, nrows {traits.nrows}, "
          f"row bytes {w.shape[1]}, out[0,:3] {out[0, :3]}")
    return {f"{key}/w": w, f"{key}/x": x, f"{key}/xq": xq,
            f"{key}/vec_dot_type": np.array(traits.vec_dot_type), f"{key}/out": out,
            f"{key}/w_f32": w_f}


# ---- informational comparison with gguf-py ----------------------------------------------------

def compare_with_gguf_py(ggml: Ggml, x: np.ndarray, types: tuple[str, ...], label: str) -> None:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize
    except ImportError:
        print("gguf-py not installed: skipping the comparison")
        return
    for t in types:
        try:
            with np.errstate(over="ignore"):   # F16 overflow to inf is part of the case
                ref = quantize(x.reshape(1, -1), GGMLQuantizationType[t]).view(np.uint8).ravel()
        except (NotImplementedError, KeyError, ValueError) as err:
            print(f"gguf-py {t:5s} ({label}): not available ({type(err).__name__})")
            continue
        ours = ggml.from_float(TYPE_IDS[t], x)
        diff = int(np.count_nonzero(ours != ref)) if ours.size == ref.size else -1
        verdict = "identical" if diff == 0 else f"DIFFERS ({diff} bytes of {ours.size})"
        print(f"gguf-py {t:5s} ({label}): {verdict}")


def main() -> None:
    ggml = Ggml(llama_cpp_lib_dir())
    version = importlib.metadata.version("llama_cpp_python")
    features = ggml.cpu_features()
    print(f"llama-cpp-python {version}; ggml features {features}")
    rng = np.random.default_rng(SEED)
    cases = activation_cases(rng)
    arrays = activation_goldens(ggml, cases)
    arrays.update(dot_goldens(ggml, rng))
    arrays["meta/llama_cpp_version"] = np.array(version)
    arrays["meta/cpu_flags"] = np.array(cpuinfo_flags())
    arrays["meta/ggml_cpu_features"] = np.array([f"{k}={v}" for k, v in features.items()])
    compare_with_gguf_py(ggml, cases["normal"], ACT_TYPES, "normal activation")
    compare_with_gguf_py(ggml, cases["ties_pos"], ("Q8_0", "F16", "BF16"), "ties_pos")
    compare_with_gguf_py(ggml, cases["half_ties"], ("F16", "BF16"), "half_ties")
    for t in WEIGHT_TYPES:
        compare_with_gguf_py(ggml, arrays[f"dot/{t}/w_f32"][0], (t,), "weight row 0")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN / "ggml_quant.npz", **arrays)
    print(f"wrote {GOLDEN / 'ggml_quant.npz'} ({len(arrays)} arrays)")


if __name__ == "__main__":
    main()
