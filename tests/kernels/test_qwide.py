"""`kernels/cpu/qwide.py`, the 32-weight block types' matmuls of many rows, against the
integer GEMV computing each row of x alone (`qmatmul_int`'s one-row body, which
`test_activation_quant.py` holds to ggml's `vec_dot` bit for bit): every type, llama.cpp's
repacked order for Q4_0 and IQ4_NL, every SIMD path this host runs, a partial chunk of
weight rows and a row count that fills no vector, and the one-row kernel of decode steps.
Bit for bit: a row's floats must not depend on the rows computed beside it, nor on the
kernel."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from quant_blocks import quantize_iq4_nl, random_blocks

from vllm_actors.kernels.cpu import activations, isa, qmatmul, qmatmul_int, qwide


def _matrix(qtype: QT, n: int, k: int, rng: np.random.Generator) -> qmatmul.QuantMatrix:
    if qtype == QT.IQ4_NL:
        return qmatmul.pack_iq4_nl(quantize_iq4_nl(rng.standard_normal((n, k)).astype(
            np.float32)), (n, k))
    return qmatmul.pack(random_blocks(qtype, n, k, rng), qtype, (n, k))


@pytest.mark.parametrize("qtype, repacked", [(QT.Q4_0, False), (QT.Q4_1, False),
                                             (QT.Q5_0, False), (QT.Q5_1, False),
                                             (QT.Q8_0, False), (QT.IQ4_NL, False),
                                             (QT.Q4_0, True), (QT.IQ4_NL, True)])
def test_rows_together_equal_each_row_alone(qtype, repacked):
    rng = np.random.default_rng(int(qtype) + repacked)
    n, k, m = 37, 320, 19          # two full chunks of 16 weight rows and a partial one
    w = replace(_matrix(qtype, n, k, rng), ggml_repacked=repacked)
    if qtype == QT.Q4_0:           # 16 rows of codes 15: against the ties below, the
        w.planes[0][:16] = 0xFF    # largest block sums (AVX2 adds the repacked order's in int16)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    x[3] = 0.0                     # a zero row: scale 0
    x[4, :32] = 127.0              # a block of ties at the largest quant
    x[5, :32] = -127.0
    rows = activations.quantize_q8(x)
    base, planes, _ = qmatmul_int._plan(w)
    kind, order = qmatmul_int.REPACKED.get(base, base), (
        qwide.SCALAR_ORDER if base in qmatmul_int.REPACKED else qwide.LANES_ORDER)
    for path in isa.available():
        alone = np.concatenate([qmatmul_int._run(w, activations.quantize_q8(x[i:i + 1]), 1,
                                                 base, path) for i in range(m)])
        got = qwide.matmul(w, planes, rows, kind, order, path)
        assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), path
        # one row decoded in registers (a decode step's GEMV), x quantized in the call;
        # the last chunk of 16 weight rows overlaps the one before
        one = np.concatenate([qwide.one_row(w, planes, x[i:i + 1], kind, order, path)
                              for i in range(m)])
        assert np.array_equal(one.view(np.uint32), alone.view(np.uint32)), path
    # the integer kernels send a request of several rows there, in that order
    together = qmatmul_int.matmul(w, rows, requests=np.array([m]))
    assert np.array_equal(together.view(np.uint32), got.view(np.uint32))
    # the count of rows of x a pass this host does not take (2 with 512-bit registers, else
    # 1) gives the same floats
    other = qwide.matmul(w, planes, rows, kind, order, x_rows=3 - qwide.X_ROWS)
    assert np.array_equal(other.view(np.uint32), got.view(np.uint32))
    # 32 rows stored interleaved (`qmatmul.interleave`, as the engine keeps its linears
    # under the quantized semantics): the same floats, one row (8 rows a pass off AVX-512)
    # and many, through every entry point of the integer kernels. Not an IQ4_NL llama.cpp
    # leaves as stored: its one-row order is the pair kernels'.
    stored = replace(_matrix(qtype, 32, k, rng), ggml_repacked=repacked)
    if qtype == QT.Q4_0:
        stored.planes[0][:16] = 0xFF
    inter = qmatmul.interleave(stored)
    assert inter.interleaved == (qtype != QT.IQ4_NL or repacked)
    assert not inter.interleaved or \
        qmatmul_int.matmul_float_lora(inter, x[:1], None, False) is None
    _, planes, _ = qmatmul_int._plan(inter)
    for path in isa.available() if inter.interleaved else ():
        alone = np.concatenate([qmatmul_int._run(stored, activations.quantize_q8(x[i:i + 1]),
                                                 1, base, path) for i in range(m)])
        one = np.concatenate([qmatmul_int.matmul_float(inter, x[i:i + 1], path)
                              for i in range(m)])
        for got in (one, qwide.matmul(inter, planes, rows, kind, order, path),
                    qmatmul_int.matmul_float(inter, x[:3], path, requests=np.ones(3, int))):
            assert np.array_equal(got.view(np.uint32), alone[:len(got)].view(np.uint32)), path
    # rows of fewer than 8 blocks: their scales, mins and fifth bits are read block by
    # block, not 8 blocks at a time as above (10 blocks: the last 8 overlap the first 8)
    narrow = replace(_matrix(qtype, 20, 160, rng), ggml_repacked=repacked)
    base, planes, _ = qmatmul_int._plan(narrow)
    short = x[:3, :160]
    for path in isa.available():
        alone = np.concatenate([qmatmul_int._run(narrow, activations.quantize_q8(row[None]), 1,
                                                 base, path) for row in short])
        one = np.concatenate([qwide.one_row(narrow, planes, row[None], kind, order, path)
                              for row in short])
        wide = qwide.matmul(narrow, planes, activations.quantize_q8(short), kind, order, path)
        for got in (one, wide):
            assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), path
