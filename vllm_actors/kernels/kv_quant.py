"""KV cache formats: how one row (a token's K or V under one KV head, Dh values) is stored.

Every backend stores and reads the same bytes; this module is the numpy reference of the
formats (encode and decode) and what the kernels need to read them (`KVFormat.lut`,
`KVFormat.layout`). `--kv-cache-dtype` names (vLLM's, plus our `turboquant`):

- `auto` / `float32`: float32 (the reference).
- `float16`, `bfloat16`: 16-bit floats, rounded to nearest even (stored as their uint16 bits).
- `fp8` (= `fp8_e4m3`), `fp8_e5m2`: one byte per value, x / scale rounded to nearest even and
  saturated at the format's largest finite value (as vLLM's conversion does). The scale is per
  tensor, 1.0 unless a checkpoint carries calibrated k_scale / v_scale.
- `turboquant[_BITS]` (BITS 2, 2.5, 3, 3.5 = the default, 4): TurboQuant's MSE stage
  (Zandieh et al., 2025). A row x is rotated by a random orthogonal matrix R fixed per cache
  slot (seeded, `rotation`); the coordinates of R x / |x| * sqrt(Dh) then follow one known
  distribution (of a uniformly random unit vector's coordinate, ~N(0, 1)), and each is coded
  against the Lloyd-Max codebook of that distribution (`codebook`, computed once). The first
  half of the coordinates take ceil(BITS), the rest floor(BITS) bits (all coordinates are alike
  after the rotation, so the split needs no outlier search). Codes are packed little-endian
  into a bit stream; the row's scale s follows as float16. s is the least-squares fit of the
  codes to the rotated row (<y, c> / <c, c>), which never has more error than |x| / sqrt(Dh).
  Attention runs in the rotated space: q is rotated as the keys were (q.k = Rq.Rk), the output
  (a sum of rotated values) is rotated back with R^T. The paper's 1-bit QJL residual is not
  used (see docs/STATUS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "turboquant")
TURBOQUANT_BITS = (2.0, 2.5, 3.0, 3.5, 4.0)
DEFAULT_TURBOQUANT_BITS = 3.5
# format kinds, as the kernels branch on them
FLOAT32, FLOAT16, BFLOAT16, FP8, TURBOQUANT = range(5)


def _fp8_values(exp_bits: int) -> np.ndarray:
    """float32 value of every byte of fp8 e4m3fn (exp_bits 4: no infinities, 0x7F/0xFF NaN)
    or e5m2 (exp_bits 5: IEEE-like, 0x7C inf)."""
    man_bits = 7 - exp_bits
    bias = (1 << (exp_bits - 1)) - 1
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    value = np.where(e == 0, m / (1 << man_bits) * 2.0 ** (1 - bias),
                     (1 + m / (1 << man_bits)) * 2.0 ** (e - bias))
    if exp_bits == 4:
        value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    else:
        top = e == (1 << exp_bits) - 1
        value = np.where(top & (m == 0), np.inf, np.where(top, np.nan, value))
    return (sign * value).astype(np.float32)


FP8_E4M3 = _fp8_values(4)
FP8_E5M2 = _fp8_values(5)


def _fp8_encode(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Nearest code (ties to the even code), saturated at the largest finite value; NaN ->
    the format's NaN."""
    positive = values[:128]
    finite = int(np.flatnonzero(np.isfinite(positive))[-1])      # largest finite code
    table = positive[:finite + 1].astype(np.float64)
    a = np.minimum(np.abs(x.astype(np.float64)), table[-1])
    hi = np.clip(np.searchsorted(table, a), 1, finite)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = code | np.where(np.signbit(x), 0x80, 0)
    code = np.where(np.isnan(x), 0x7F, code)
    return code.astype(np.uint8)


def _bf16_encode(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


def _coordinate_density(d: int, x: np.ndarray) -> np.ndarray:
    """Density (unnormalized) of sqrt(d) * u_1 for u uniform on the unit sphere in R^d."""
    inside = np.clip(1.0 - x * x / d, 0.0, None)
    return inside ** ((d - 3) / 2.0)


@lru_cache(maxsize=None)
def codebook(bits: int, d: int) -> np.ndarray:
    """Lloyd-Max centroids (ascending, float32) of 2^bits levels for the coordinate
    distribution of a rotated unit vector in R^d, scaled by sqrt(d) (unit variance)."""
    grid = np.linspace(-8.0, 8.0, 64001)
    w = _coordinate_density(d, grid) if d > 3 else np.exp(-grid * grid / 2)
    w /= w.sum()
    cdf = np.cumsum(w)
    levels = 1 << bits
    c = np.interp((np.arange(levels) + 0.5) / levels, cdf, grid)
    for _ in range(500):
        edges = (c[1:] + c[:-1]) / 2
        cell = np.searchsorted(edges, grid)
        mass = np.bincount(cell, w, levels)
        new = np.bincount(cell, w * grid, levels) / np.maximum(mass, 1e-300)
        if np.max(np.abs(new - c)) < 1e-9:
            c = new
            break
        c = new
    c = (c - c[::-1]) / 2                      # exactly symmetric
    return c.astype(np.float32)


def rotation(slot: int, d: int, seed: int = 0) -> np.ndarray:
    """The random orthogonal [d, d] float32 matrix of cache slot `slot` (QR of a Gaussian
    matrix, signs fixed so that it is Haar-distributed); the same on every rank and run."""
    rng = np.random.default_rng([seed, 0x7E4B0, slot, d])
    qm, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (qm * np.sign(np.diag(r))).astype(np.float32)


@dataclass(frozen=True)
class KVFormat:
    """A KV cache storage format. `bits` only for turboquant.

    `ggml_products` (the quantized GGUF semantics, float16 and bfloat16 caches): attention
    multiplies as llama.cpp's non-flash path does, Q rounded to the cache's type before Q.K,
    the scale applied to the scores, and the probabilities normalized and rounded to the
    cache's type before P.V (ggml's mul_mat converts its input to the weight's type)."""

    name: str
    kind: int
    bits: float = 0.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    ggml_products: bool = False
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def storage(self) -> type:
        """numpy element type of the stored rows."""
        return {FLOAT32: np.float32, FLOAT16: np.uint16, BFLOAT16: np.uint16}.get(
            self.kind, np.uint8)

    def split(self, d: int) -> tuple[int, int, int]:
        """turboquant: (coordinates at the high width, high bits, low bits)."""
        high, low = math.ceil(self.bits), math.floor(self.bits)
        return (d // 2 if high != low else d), high, low

    def code_bytes(self, d: int) -> int:
        n_high, high, low = self.split(d)
        return -(-(n_high * high + (d - n_high) * low) // 8)

    def row_len(self, d: int) -> int:
        """Stored elements per row of d values."""
        if self.kind == TURBOQUANT:
            return self.code_bytes(d) + 2
        return d

    def row_bytes(self, d: int) -> int:
        return self.row_len(d) * np.dtype(self.storage).itemsize

    # -- what kernels read -------------------------------------------------------------------
    def lut(self, d: int, which: str = "k") -> np.ndarray:
        """float32 decode table: fp8, the value of each byte times the tensor's scale;
        turboquant, the high-width codebook then the low-width one; others: empty."""
        if self.kind == FP8:
            scale = self.k_scale if which == "k" else self.v_scale
            values = FP8_E4M3 if self.name == "fp8_e4m3" else FP8_E5M2
            return (values * np.float32(scale)).astype(np.float32)
        if self.kind == TURBOQUANT:
            _, high, low = self.split(d)
            return np.concatenate([codebook(high, d), codebook(low, d)])
        return np.zeros(0, np.float32)

    def layout(self, d: int) -> np.ndarray:
        """int64 [kind, row_len, n_high, high bits, low bits, code bytes] for the kernels
        (fp8: high bits = the mantissa bits, 3 for e4m3, 2 for e5m2)."""
        n_high, high, low = self.split(d) if self.kind == TURBOQUANT else (0, 0, 0)
        if self.kind == FP8:
            high = 3 if self.name == "fp8_e4m3" else 2
        return np.array([self.kind, self.row_len(d), n_high, high, low,
                         self.code_bytes(d) if self.kind == TURBOQUANT else 0], np.int64)

    # -- reference encode / decode ---------------------------------------------------------
    def encode(self, x: np.ndarray, which: str = "k") -> np.ndarray:
        """float32 [..., d] -> stored rows [..., row_len] (turboquant: x already rotated)."""
        x = np.asarray(x, np.float32)
        if self.kind == FLOAT32:
            return x.copy()
        if self.kind == FLOAT16:
            return x.astype(np.float16).view(np.uint16)
        if self.kind == BFLOAT16:
            return _bf16_encode(x)
        if self.kind == FP8:
            scale = self.k_scale if which == "k" else self.v_scale
            values = FP8_E4M3 if self.name == "fp8_e4m3" else FP8_E5M2
            return _fp8_encode(x / np.float32(scale), values)
        return self._tq_encode(x)

    def decode(self, rows: np.ndarray, d: int, which: str = "k") -> np.ndarray:
        """Stored rows [..., row_len] -> float32 [..., d] (turboquant: still rotated)."""
        if self.kind == FLOAT32:
            return np.asarray(rows, np.float32)
        if self.kind == FLOAT16:
            return rows.view(np.float16).astype(np.float32)
        if self.kind == BFLOAT16:
            return (rows.astype(np.uint32) << 16).view(np.float32)
        if self.kind == FP8:
            return self.lut(d, which)[rows]
        return self._tq_decode(rows, d)

    def _tq_encode(self, y: np.ndarray) -> np.ndarray:
        d = y.shape[-1]
        n_high, high, low = self.split(d)
        lead = y.shape[:-1]
        y = y.reshape(-1, d)
        norm = np.sqrt(np.einsum("nd,nd->n", y, y, dtype=np.float64))
        unit = y * (math.sqrt(d) / np.maximum(norm, 1e-30))[:, None]
        codes, values, widths = [], [], []
        for part, bits in ((unit[:, :n_high], high), (unit[:, n_high:], low)):
            if part.shape[1] == 0:
                continue
            book = codebook(bits, d)
            c = np.searchsorted((book[1:] + book[:-1]) / 2, part)
            codes.append(c)
            values.append(book[c])
            widths.append(bits)
        c_all = np.concatenate(values, axis=1).astype(np.float64)
        fit = np.einsum("nd,nd->n", y.astype(np.float64), c_all)
        energy = np.einsum("nd,nd->n", c_all, c_all)
        scale = np.where(energy > 0, fit / np.maximum(energy, 1e-300), 0.0)
        bitplanes = [((c[..., None] >> np.arange(bits)) & 1).reshape(len(y), -1)
                     for c, bits in zip(codes, widths)]
        packed = np.packbits(np.concatenate(bitplanes, axis=1).astype(np.uint8), axis=1,
                             bitorder="little")
        out = np.zeros((len(y), self.row_len(d)), np.uint8)
        out[:, :packed.shape[1]] = packed
        out[:, -2:] = scale.astype(np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return out.reshape(*lead, -1)

    def _tq_decode(self, rows: np.ndarray, d: int) -> np.ndarray:
        n_high, high, low = self.split(d)
        lead = rows.shape[:-1]
        rows = rows.reshape(-1, rows.shape[-1])
        nbits = n_high * high + (d - n_high) * low
        bits = np.unpackbits(rows[:, :self.code_bytes(d)], axis=1, bitorder="little")
        bits = bits[:, :nbits].astype(np.int64)
        out = np.empty((len(rows), d), np.float32)
        hi_bits = bits[:, :n_high * high].reshape(len(rows), n_high, high)
        out[:, :n_high] = codebook(high, d)[(hi_bits << np.arange(high)).sum(-1)]
        if d > n_high:
            lo_bits = bits[:, n_high * high:].reshape(len(rows), d - n_high, low)
            out[:, n_high:] = codebook(low, d)[(lo_bits << np.arange(low)).sum(-1)]
        scale = np.ascontiguousarray(rows[:, -2:]).view(np.float16).astype(np.float32)
        return (out * scale).reshape(*lead, d)


def kv_format(name: str, k_scale: float = 1.0, v_scale: float = 1.0,
              ggml_products: bool = False) -> KVFormat:
    """The format `--kv-cache-dtype name` selects; `ggml_products` (the quantized GGUF
    semantics) applies to 16-bit caches only. Raises ValueError naming the choices."""
    if name.startswith("turboquant"):
        tail = name[len("turboquant"):]
        try:
            bits = float(tail[1:]) if tail.startswith("_") else (
                DEFAULT_TURBOQUANT_BITS if not tail else float("nan"))
        except ValueError:
            bits = float("nan")
        if bits not in TURBOQUANT_BITS:
            raise ValueError(f"kv_cache_dtype {name!r}: turboquant takes "
                             f"{', '.join(f'turboquant_{b:g}' for b in TURBOQUANT_BITS)} "
                             f"(turboquant alone: {DEFAULT_TURBOQUANT_BITS:g} bits)")
        return KVFormat(f"turboquant_{bits:g}", TURBOQUANT, bits)
    kinds = {"auto": ("float32", FLOAT32), "float32": ("float32", FLOAT32),
             "float16": ("float16", FLOAT16), "bfloat16": ("bfloat16", BFLOAT16),
             "fp8": ("fp8_e4m3", FP8), "fp8_e4m3": ("fp8_e4m3", FP8),
             "fp8_e5m2": ("fp8_e5m2", FP8)}
    if name not in kinds:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                         f"(turboquant_BITS for BITS in "
                         f"{', '.join(f'{b:g}' for b in TURBOQUANT_BITS)}), got {name!r}")
    canonical, kind = kinds[name]
    return KVFormat(canonical, kind, k_scale=k_scale, v_scale=v_scale,
                    ggml_products=ggml_products and kind in (FLOAT16, BFLOAT16))


FLOAT32_FORMAT = KVFormat("float32", FLOAT32)


@dataclass
class QuantizedKV:
    """One cache slot in a format other than float32, on the host: K and V rows
    `[num_blocks, block_size, Hk, row_len]` of `fmt.storage`, and what reading them takes.

    `rotation` [d, d] (turboquant): rows are stored rotated, y = x R^T; `rotate(x)` does that
    to queries and new keys/values, `unrotate(y)` maps an attention output back.
    """

    k: np.ndarray
    v: np.ndarray
    fmt: KVFormat
    head_dim: int
    rotation: np.ndarray | None = None

    @classmethod
    def allocate(cls, fmt: KVFormat, slot: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int) -> "QuantizedKV":
        shape = (num_blocks, block_size, num_kv_heads, fmt.row_len(head_dim))
        rot = rotation(slot, head_dim) if fmt.kind == TURBOQUANT else None
        return cls(np.zeros(shape, fmt.storage), np.zeros(shape, fmt.storage), fmt, head_dim,
                   rot)

    @property
    def k_lut(self) -> np.ndarray:
        return self._tables()[0]

    @property
    def v_lut(self) -> np.ndarray:
        return self._tables()[1]

    @property
    def layout(self) -> np.ndarray:
        return self._tables()[2]

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        found = self.fmt._cache.get(self.head_dim)
        if found is None:
            found = (self.fmt.lut(self.head_dim, "k"), self.fmt.lut(self.head_dim, "v"),
                     self.fmt.layout(self.head_dim))
            self.fmt._cache[self.head_dim] = found
        return found

    def rotate(self, x: np.ndarray) -> np.ndarray:
        """[..., d] float32 into the stored space (a copy; x itself unchanged)."""
        if self.rotation is None:
            return x
        return (x.reshape(-1, self.head_dim) @ self.rotation.T).reshape(x.shape)

    def unrotate(self, y: np.ndarray) -> np.ndarray:
        if self.rotation is None:
            return y
        return (y.reshape(-1, self.head_dim) @ self.rotation).reshape(y.shape)

    def write(self, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        """Encode k, v float32 [T, Hk, d] into the rows at `slots` (negative: skipped)."""
        keep = np.asarray(slots) >= 0
        if not keep.all():
            k, v, slots = k[keep], v[keep], np.asarray(slots)[keep]
        hk = self.k.shape[2]
        self.k.reshape(-1, hk, self.k.shape[3])[slots] = self.fmt.encode(self.rotate(k), "k")
        self.v.reshape(-1, hk, self.v.shape[3])[slots] = self.fmt.encode(self.rotate(v), "v")

    def read(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 K, V [len(block_ids), block_size, Hk, d] of those blocks (still rotated)."""
        d = self.head_dim
        return (self.fmt.decode(self.k[block_ids], d, "k"),
                self.fmt.decode(self.v[block_ids], d, "v"))


def allocate_kv_cache(fmt: KVFormat | None, num_layers: int, num_blocks: int, block_size: int,
                      num_kv_heads: int, head_dim: int) -> list | None:
    """A quantized cache per slot, or None for float32 (the backend's own layout)."""
    if fmt is None or fmt.kind == FLOAT32:
        return None
    return [QuantizedKV.allocate(fmt, slot, num_blocks, block_size, num_kv_heads, head_dim)
            for slot in range(num_layers)]
