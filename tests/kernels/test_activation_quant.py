"""`--gguf-activations quantized` against llama.cpp's own code: `tests/golden/ggml_quant.npz`
(tests/oracle/make_ggml_quant_golden.py) holds the bytes ggml's x86 CPU quantizers write for
edge and random inputs, and ggml's `vec_dot` of each weight type with them.

- Each activation format equals ggml's bytes (numpy reference), and the compiled kernels equal
  the numpy reference bit for bit.
- The integer GEMVs (`qmatmul_int` on Q8_0/Q8_1 blocks, `qmatmul_int_k` on Q8_K) give ggml's
  dot bit for bit, the same floats on every SIMD path this CPU can run (portable, AVX2, VNNI), and for a
  row alone the same floats as inside a group of rows.
- A linear layer on the numpy and the cpu backend gives ggml's dot within float summation
  order: 4e-6 of sum |w~ x~| over K = 1024 (float32 rounding of one sum is at most about
  K * 2^-24 = 6e-5 of it in the worst case, about sqrt(K) * 2^-24 = 2e-6 typically). The same
  layer under float32 semantics misses that bound, so the check tells the two apart.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from quant_blocks import random_blocks

from vllm_actors.kernels import activation_quant as aq
from vllm_actors.kernels import quant
from vllm_actors.kernels.cpu import activations, isa, qmatmul, qmatmul_int, qmatmul_int_k
from vllm_actors.kernels.cpu.backend import CpuBackend
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.weights import RawTensor

GOLDEN = np.load(Path(__file__).parents[1] / "golden" / "ggml_quant.npz")
CASES = sorted({k.split("/")[1] for k in GOLDEN.files if k.startswith("act/")})
DOT_TYPES = sorted({k.split("/")[1] for k in GOLDEN.files if k.startswith("dot/")})
FORMATS = ("q8_0", "q8_1", "q8_k")
ORDER_TOLERANCE = 4e-6


def _x(case: str) -> np.ndarray:
    return GOLDEN[f"act/{case}/x"].reshape(1, -1).astype(np.float32)


def _bits16(values: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "f16":
        return values.astype(np.float16).view(np.uint8).reshape(-1)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)


def test_every_format_writes_ggml_bytes():
    assert len(CASES) >= 10 and {"zeros", "half_ties", "max_both", "denormal"} <= set(CASES)
    for case in CASES:
        x = _x(case)
        for fmt in FORMATS:
            got = aq.quantize(x, fmt).to_bytes().reshape(-1)
            assert np.array_equal(got, GOLDEN[f"act/{case}/{fmt}"].reshape(-1)), (case, fmt)
        assert np.array_equal(_bits16(aq.round_f16(x), "f16"), GOLDEN[f"act/{case}/f16"]
                              .reshape(-1)), case
        assert np.array_equal(_bits16(aq.round_bf16(x), "bf16"), GOLDEN[f"act/{case}/bf16"]
                              .reshape(-1)), case


def test_compiled_quantizers_equal_the_reference():
    rng = np.random.default_rng(3)
    inputs = [_x(case) for case in CASES] + [
        rng.standard_normal((5, 1536)).astype(np.float32) * 3,
        np.tile(np.float32([127, 0.5, -0.5, 1.5, -2.5, 63.5, -126.5, 0]), (2, 64))]
    for x in inputs:
        _same_blocks(x)
        for fmt in FORMATS + ("f16", "bf16"):
            with np.errstate(invalid="ignore"):     # the 1e30 case's inf * 0
                want, want_delta = aq.simulate(x, fmt)
            got, got_delta = activations.simulate(x, fmt)
            assert np.array_equal(got, want, equal_nan=True), fmt
            assert (got_delta is None) == (want_delta is None), fmt
            if want_delta is not None:
                assert np.array_equal(got_delta, want_delta, equal_nan=True), fmt


def q8_blocks(fmt: str, q: np.ndarray, d: np.ndarray, s: np.ndarray) -> aq.Q8Blocks:
    """A kernel's planes of x `[M, K]` (quants, scales, Q8_1's sums; `s` is ignored for the
    other formats) as `aq.Q8Blocks`, Q8_K's bsums summed here: what `to_bytes` writes."""
    size = 256 if fmt == "q8_k" else 32
    q = q.reshape(len(d), -1, size)
    bsums = q.reshape(*q.shape[:2], 16, 16).sum(axis=-1, dtype=np.int16) if fmt == "q8_k" else None
    return aq.Q8Blocks(fmt, q, d, s if fmt == "q8_1" else None, bsums)


def _same_blocks(x: np.ndarray) -> None:
    """The compiled quantizers' blocks byte for byte the reference's (x~ alone would not see
    the sign of Q8_K's peak: q and d flip together)."""
    with np.errstate(invalid="ignore", over="ignore"):
        k, want_k = activations.quantize_q8_k(x), aq.quantize_q8_k(x)
        q1, want_1 = activations.quantize_q8(x), aq.quantize_q8_0(x, with_sum=True)
    assert np.array_equal(k.qs.reshape(want_k.q.shape), want_k.q)
    assert np.array_equal(k.d, want_k.d, equal_nan=True)
    assert np.array_equal(k.bsums.reshape(want_k.bsums.shape), want_k.bsums)
    assert np.array_equal(q1.qs.reshape(want_1.q.shape), want_1.q)
    assert np.array_equal(q1.d, want_1.d, equal_nan=True)
    assert np.array_equal(q1.s, want_1.s, equal_nan=True)


def _linear_outputs(backend, tensor: RawTensor, x: np.ndarray) -> np.ndarray:
    return backend.linear(x, backend.upload_linear([tensor]))


@pytest.mark.parametrize("backend", [NumpyBackend(), CpuBackend()], ids=["numpy", "cpu"])
def test_linear_gives_ggml_vec_dot(backend):
    """A linear layer under each semantics. On cpu only the types without an integer kernel
    (x~ through the float kernels): the integer kernels are checked bit for bit below, and
    each compile costs seconds."""
    assert len(DOT_TYPES) >= 12
    for name in DOT_TYPES:
        qtype = QT[name]
        if isinstance(backend, CpuBackend) and _integer(qtype) is not None:
            continue
        w, x, want = (GOLDEN[f"dot/{name}/{k}"] for k in ("w", "x", "out"))
        rows, cols = len(w), x.shape[1]
        fmt = aq.activation_format(qtype)
        assert aq.ACTIVATION_FORMAT[qtype] == fmt and fmt is not None
        data = w.view(np.uint16) if qtype in (QT.F16, QT.BF16) else w
        tensor = RawTensor(f"dot.{name}", (rows, cols), int(qtype), data, fmt)
        got = _linear_outputs(backend, tensor, x.astype(np.float32))
        dense = quant.dequantize(data, qtype, (rows, cols))
        magnitude = np.abs(aq.simulate(x, fmt)[0]) @ np.abs(dense).T
        assert np.all(np.abs(got - want) <= ORDER_TOLERANCE * magnitude), name
        exact = _linear_outputs(backend, RawTensor(tensor.name, tensor.shape, tensor.qtype,
                                                   data), x.astype(np.float32))
        assert np.mean(np.abs(exact - want) > ORDER_TOLERANCE * magnitude) > 0.5, name


def _integer(qtype: int):
    """(quantizer, integer GEMV module) of a weight type, or None without one."""
    if qtype in qmatmul_int.KINDS:
        return activations.quantize_q8, qmatmul_int
    if qtype in qmatmul_int_k.KINDS:
        return activations.quantize_q8_k, qmatmul_int_k
    return None


# The types run on every SIMD path: one per way `qdot` forms its lanes (Q4_1 unsigned, Q5_0
# unsigned less an offset, Q8_0 signed) and the K-quants' kernel.
EVERY_PATH = (QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K)


def test_iq4_nl_gives_ggml_vec_dot_for_one_row_requests():
    """IQ4_NL kept as itself (its table looked up in registers) and in its exact Q8_0 form
    (tables): a request of one row in `vec_dot_iq4_nl_q8_0`'s order (two chains; an odd last
    block apart, K = 1056) bit for bit, alone on every SIMD path (as itself), as a batch of
    one-row requests, and quantized inside the GEMV's call; a request of three rows in
    tinyBLAS's order (Q8_0's), another float order, the same for both forms."""
    host = isa.selected()
    for key in ("dot", "dot_odd"):
        w, x, want = (GOLDEN[f"{key}/IQ4_NL/{k}"] for k in ("w", "x", "out"))
        shape = (len(w), x.shape[1])
        native, q8 = qmatmul.pack_iq4_nl(w, shape), qmatmul.pack(w, QT.IQ4_NL, shape)
        assert (q8.qtype, q8.stored_as) == (QT.Q8_0, QT.IQ4_NL)
        rows = activations.quantize_q8(x.astype(np.float32))
        ones = np.ones(len(x), np.int64)
        for path in isa.available():
            alone = np.concatenate([qmatmul_int.matmul(native, activations.quantize_q8(
                x[i:i + 1].astype(np.float32)), path=path) for i in range(len(x))])
            assert np.array_equal(alone, want), (key, path)
        for matrix in (native, q8):
            assert np.array_equal(qmatmul_int.matmul(matrix, rows, host, ones), want), key
            assert np.array_equal(qmatmul_int.matmul_float(matrix, x.astype(np.float32), host,
                                                           ones), want), key
        together = qmatmul_int.matmul(native, rows, host)
        assert np.array_equal(together, qmatmul_int.matmul(q8, rows, host)), key
        assert np.array_equal(together, qmatmul_int.matmul(replace(q8, stored_as=None), rows,
                                                           host)), key
        assert not np.array_equal(together, want), key


def test_fused_iq4_nl_parts_keep_the_order_each_takes_alone():
    """Fused IQ4_NL parts (QKV, gate+up) have no planes to stack and are concatenated after
    packing; the fused matrix keeps the float order of llama.cpp's repacked kernels that
    each part (rows a multiple of 8) takes alone, for a request of 3 rows and of one."""
    rng = np.random.default_rng(9)
    parts = [RawTensor(f"iq4.{i}", (16, 1024), int(QT.IQ4_NL),
                       random_blocks(QT.IQ4_NL, 16, 1024, rng), "q8_0") for i in range(2)]
    backend = CpuBackend()
    fused = backend.upload_linear(parts)
    assert len(fused.parts) == 1
    assert fused.parts[0].ggml_repacked == ("avx2" in isa.available())
    for x in (rng.standard_normal((3, 1024)), rng.standard_normal((1, 1024))):
        x = x.astype(np.float32)
        alone = [backend.linear(x, backend.upload_linear([p])) for p in parts]
        assert np.array_equal(backend.linear(x, fused), np.concatenate(alone, axis=1))


def test_every_simd_path_gives_the_same_floats_and_ggml_vec_dot(monkeypatch):
    """Every type on the host's path against ggml's dot; on `EVERY_PATH` a row alone as in a
    group, and every path (the SIMD code is shared by the types of a form, the decoding by
    the paths: each compile costs seconds). Q4_K in the float order of
    llama.cpp's repacked kernels: ggml's dot up to that order (no golden of those kernels)."""
    paths = isa.available()
    assert paths[0] == "portable"
    checked = set()
    for name in DOT_TYPES:
        qtype = QT[name]
        if _integer(qtype) is None:
            continue
        if qtype == QT.IQ4_NL:      # two orders by request size: its own test above
            checked.add(qtype)
            continue
        quantize, integer = _integer(qtype)
        w, x, want = (GOLDEN[f"dot/{name}/{k}"] for k in ("w", "x", "out"))
        matrix = qmatmul.pack(w, qtype, (len(w), x.shape[1]))
        got = integer.matmul(matrix, quantize(x.astype(np.float32)))
        assert np.array_equal(got, want), name          # ggml's float order, bit for bit
        if qtype in EVERY_PATH:     # each compile costs seconds
            alone = integer.matmul(matrix, quantize(x[1:2].astype(np.float32)))   # one row
            assert len(x) > 1 and np.array_equal(alone[0], got[1]), name
            rows = quantize(x.astype(np.float32))
            for path in paths:
                assert np.array_equal(integer.matmul(matrix, rows, path=path), got), path
                # x quantized inside the GEMV's own call, as decode steps take it (three
                # one-row requests, the group's padding, and a row alone)
                ones = np.ones(len(x), np.int64)
                assert integer.quantizes_inside(matrix, len(x), ones)
                inside = integer.matmul_float(matrix, x.astype(np.float32), path, ones)
                assert np.array_equal(inside, integer.matmul(matrix, rows, path=path,
                                                             requests=ones)), path
                assert np.array_equal(integer.matmul_float(
                    matrix, x[1:2].astype(np.float32), path), alone), path
        if qtype == QT.Q4_K:
            repacked = integer.matmul(replace(matrix, ggml_repacked=True),
                                      quantize(x.astype(np.float32)))
            dense = quant.dequantize(w, qtype, (len(w), x.shape[1]))
            magnitude = np.abs(aq.simulate(x, "q8_k")[0]) @ np.abs(dense).T
            assert np.all(np.abs(repacked - want) <= ORDER_TOLERANCE * magnitude)
            assert not np.array_equal(repacked, want)             # another order
            # the kernels that sum each pair to one integer (`ktotals`), on every path: the
            # repacked GEMV on a request of 1 row, then a request of 5 (its GEMM on 4 rows,
            # the GEMV on the fifth)
            six = quantize(np.concatenate([x, x[::-1]]).astype(np.float32))
            both = [integer.matmul(replace(matrix, ggml_repacked=True), six, path=path,
                                   requests=[1, 5]) for path in paths]
            assert all(np.array_equal(b, both[0]) for b in both[1:])
            assert np.array_equal(both[0][[0, 5]], repacked[[0, 0]])     # rows alone: 44
        checked.add(qtype)
    assert set(qmatmul_int.KINDS) | set(qmatmul_int_k.KINDS) <= checked
    for bad in ("sse9", "avx1024"):
        monkeypatch.setenv(isa.ENV, bad)
        with pytest.raises(ValueError, match=isa.ENV):
            isa.selected()
    monkeypatch.setenv(isa.ENV, "portable")
    assert isa.selected() == "portable"


def test_rows_take_the_kernel_llama_cpp_picks_for_their_request_alone():
    """llama.cpp's kernel (so its float order) depends on the row count of the matmul: a
    batch gives each request's rows the kernel of that request decoded alone (the Gemma 3
    parity test shows the orders bit for bit)."""
    from types import SimpleNamespace
    k = qmatmul_int_k
    repacked = SimpleNamespace(qtype=QT.Q4_K, ggml_repacked=True)
    gemm, gemv = k.REPACKED_GEMM_Q4_K, k.REPACKED_Q4_K
    assert list(k.row_kinds(repacked, [1, 5, 9])) == [gemv] + [gemm] * 4 + [gemv] \
        + [gemm] * 8 + [gemv]
    tiled = k.TILED + 6 if "avx2" in isa.available() else 6
    q6_k = SimpleNamespace(qtype=QT.Q6_K, ggml_repacked=False)
    assert list(k.row_kinds(q6_k, [7, 8, 1])) == [6] * 7 + [tiled] * 8 + [6]
    # prompt chunks: a step of 3 rows of a 7-token prompt (positions 2-4, its GEMM rows are
    # 0-3), the last 2 rows of a 515-token one (its second call of 512: 3 rows, GEMV and
    # vec_dot), a decode row, then 3 rows (positions 509-511) of the 515-token prompt's first
    # call: kinds by each row's place in llama.cpp's call of the whole prompt
    places = qmatmul.RowPlaces.of_step(np.array([3, 2, 1, 3]), np.array([5, 515, 40, 512]),
                                       np.array([7, 515, 30, 515]))
    assert places.index.tolist() == [2, 3, 4, 1, 2, 0, 509, 510, 511]
    assert places.size.tolist() == [7, 7, 7, 3, 3, 1, 512, 512, 512]
    assert list(k.row_kinds(repacked, places)) == [gemm, gemm, gemv, gemv, gemv, gemv] + \
        [gemm] * 3
    assert list(k.row_kinds(q6_k, places)) == [6] * 6 + [tiled] * 3


def test_gelu_table_is_ggml_s():
    """Every entry of ggml's float16 GELU table (tests/oracle/make_ggml_tables_golden.py),
    which llama.cpp's GeGLU looks up, equals ours; GeGLU itself follows ggml's three cases."""
    from vllm_actors.kernels import ggml_math
    golden = np.load(Path(__file__).parents[1] / "golden" / "ggml_gelu_f16.npz")["gelu"]
    ours = ggml_math.gelu_table()
    table = golden.view(np.float16).astype(np.float32)
    assert np.array_equal(ours, table, equal_nan=True)    # NaN inputs: NaN, payload aside
    edges = np.float32([-12.0, -10.0, -0.5, 0.0, 0.7, 3.0, 10.0, 10.003, 11.0, 1e-3, -3.5,
                        6e-8, 65519.0, 65520.0, -1e5, np.inf, -np.inf])
    gate = (np.random.default_rng(0).standard_normal((17, 2 * len(edges))) * 6).astype(np.float32)
    gate[:, :len(edges)] = edges               # in every row: one row alone, and 17 rows
    up = np.full_like(gate, 1.5)
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.where(gate <= -10, np.float32(0), np.where(
            gate >= 10, gate * np.float32(1.5),
            table[gate.astype(np.float16).view(np.uint16)] * np.float32(1.5)))
        for rows in (slice(0, 1), slice(None)):
            got = ggml_math.geglu(np.concatenate([gate[rows], up[rows]], axis=1))
            assert np.array_equal(got, want[rows], equal_nan=True)
