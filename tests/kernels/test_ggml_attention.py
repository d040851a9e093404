"""The llama.cpp-order attention's branch-free pieces equal the exact forms they replace
(end to end, tests/models/test_llamacpp_parity.py shows the tokens bit for bit)."""

from __future__ import annotations

import numba
import numpy as np

from vllm_actors.kernels import ggml_attention as ga
from vllm_actors.kernels import ggml_math
from vllm_actors.kernels.cpu.qmatmul_prims import HALF_LUT


@numba.njit(cache=True)
def _both(xs, lut, fast, slow, exp_fast, exp_slow):  # type: ignore[no-untyped-def]
    for i in range(xs.size):
        fast[i] = ga._half_unit(xs[i])
        slow[i] = ga._half(xs[i], lut)
        x = -xs[i] * np.float32(87.0)
        exp_fast[i] = ggml_math.expf16_normal(x)
        exp_slow[i] = ggml_math.expf16(x)


def test_probability_rounding_and_softmax_exp_equal_the_exact_forms():
    """Every 61st float32 in [0, 1] (61 is prime to 2^13, so every rounding remainder and
    tie of the float16 mantissa comes up, at every exponent), and around float16's smallest
    normal: rounded as the float16 table rounds; exp on [-87, 0] as `expf16`."""
    edges = np.float32(2.0 ** -14) * np.array([1 - 2 ** -11, 1, 1 + 2 ** -10], np.float32)
    xs = np.concatenate([np.arange(0, 0x3F800001, 61, dtype=np.uint32).view(np.float32),
                         edges, np.float32([0.0, 1.0])])
    out = [np.empty_like(xs) for _ in range(4)]
    _both(xs, HALF_LUT, *out)
    assert np.array_equal(out[0].view(np.uint32), out[1].view(np.uint32))
    assert np.array_equal(out[2].view(np.uint32), out[3].view(np.uint32))
