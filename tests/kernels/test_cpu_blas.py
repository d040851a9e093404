"""The compiled backend's float32 linear of many rows through numpy's OpenBLAS called from
our own threads (`kernels/cpu/blas.py`): numpy's product, for fused parts and odd shapes."""

import numpy as np
import pytest

from vllm_actors.kernels.cpu import blas


def test_blas_linear_equals_numpy():
    if not blas.available():
        pytest.skip("numpy's BLAS here is not OpenBLAS")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((67, 45), dtype=np.float32)
    parts = [rng.standard_normal((n, 45), dtype=np.float32) for n in (13, 1, 30)]
    got = blas.linear(x[:, :45], parts)
    want = np.concatenate([x @ w.T for w in parts], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    strided = np.asfortranarray(x)                    # not C-contiguous: copied first
    np.testing.assert_allclose(blas.linear(strided, parts[:1]), want[:, :13], rtol=1e-5,
                               atol=1e-5)
