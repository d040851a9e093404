"""`--gguf-activations quantized` on the device backends (OpenCL: PoCL in CI; CUDA where
CuPy sees a GPU), against llama.cpp's own code: `tests/golden/ggml_quant.npz`
(tests/oracle/make_ggml_quant_golden.py) holds the bytes ggml's x86 quantizers write and
ggml's `vec_dot` of each weight type with them.

- The device's quantizer (`act_quant.cl` / `.cu`) writes ggml's bytes for every format, edge
  inputs included (zeros, ties at .5, +-max, subnormals).
- A linear layer gives ggml's dot within float summation order (`ORDER_TOLERANCE` of
  test_activation_quant: its bound and why), block types through their integer kernels; the
  same layer under the float32 semantics misses the bound, so the check tells them apart.
- Weights kept as floats (fused parts of two types) take x~ and Q8_1's min term on the
  device, the numpy backend's numbers within the order tolerance of test_device_ops.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants
from test_activation_quant import (CASES, DOT_TYPES, FORMATS, GOLDEN, ORDER_TOLERANCE, _bits16,
                                   q8_blocks)

from vllm_actors.kernels import activation_quant as aq
from vllm_actors.kernels import quant
from vllm_actors.kernels.device_backend import INT_KERNELS
from vllm_actors.kernels.numpy_backend import NumpyBackend
from vllm_actors.loaders.weights import RawTensor


def _device_blocks(dev, x: np.ndarray, fmt: str) -> aq.Q8Blocks:
    return q8_blocks(fmt, *(dev.to_host(a) for a in dev._quantize(dev.upload_array(x), fmt)))


def test_quantizer_writes_ggml_bytes(dev):
    for case in CASES:
        x = GOLDEN[f"act/{case}/x"].reshape(1, -1).astype(np.float32)
        for fmt in FORMATS:
            got = _device_blocks(dev, x, fmt).to_bytes().reshape(-1)
            assert np.array_equal(got, GOLDEN[f"act/{case}/{fmt}"].reshape(-1)), (case, fmt)
        for fmt in ("f16", "bf16"):
            rounded = dev.to_host(dev._simulated(dev.upload_array(x), fmt)[0])
            assert np.array_equal(_bits16(rounded, fmt), GOLDEN[f"act/{case}/{fmt}"]
                                  .reshape(-1)), (case, fmt)


def test_linear_gives_ggml_vec_dot(dev):
    for name in DOT_TYPES:
        qtype = QT[name]
        w, x, want = (GOLDEN[f"dot/{name}/{k}"] for k in ("w", "x", "out"))
        rows, cols = len(w), x.shape[1]
        fmt = aq.activation_format(qtype)
        data = w.view(np.uint16) if qtype in (QT.F16, QT.BF16) else w
        tensor = RawTensor(f"dot.{name}", (rows, cols), int(qtype), data, fmt)
        handle = dev.upload_linear([tensor])
        assert (handle.kernel in INT_KERNELS) == (int(qtype) in quant.BLOCK_FIELDS), name
        got = dev.to_host(dev.linear(dev.upload_array(x.astype(np.float32)), handle))
        dense = quant.dequantize(data, qtype, (rows, cols))
        magnitude = np.abs(aq.simulate(x, fmt)[0]) @ np.abs(dense).T
        assert np.all(np.abs(got - want) <= ORDER_TOLERANCE * magnitude), name
        exact = dev.linear(dev.upload_array(x.astype(np.float32)), dev.upload_linear(
            [RawTensor(tensor.name, tensor.shape, tensor.qtype, data)]))
        assert np.mean(np.abs(dev.to_host(exact) - want) > ORDER_TOLERANCE * magnitude) > 0.5


def test_weights_kept_as_floats_take_x_and_min_terms_on_the_device(dev):
    """Fused Q4_1 + Q5_1 parts share no block form, so they are kept as floats: x~ through
    the float kernel plus the mins times Q8_1's s - d sum(q); a bias and 5 rows of x."""
    rng = np.random.default_rng(3)
    dense = [rng.standard_normal((40, 256)).astype(np.float32) + 0.3 for _ in range(2)]
    parts = [RawTensor(f"w{i}", w.shape, int(qt), quants.quantize(w, qt), "q8_1")
             for i, (w, qt) in enumerate(zip(dense, (QT.Q4_1, QT.Q5_1)))]
    x = (rng.standard_normal((5, 256)) * 3).astype(np.float32)
    bias = rng.standard_normal(80).astype(np.float32)
    handle = dev.upload_linear(parts)
    assert handle.kernel == "linear_f32" and handle.mins is not None
    ref = NumpyBackend()
    want = ref.linear(x, ref.upload_linear(parts), bias)
    got = dev.to_host(dev.linear(dev.upload_array(x), handle, dev.upload_array(bias)))
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-5 * scale
    # without the min term the difference is far above that tolerance
    plain = dev.linear(dev.upload_array(x), handle.__class__(
        handle.data, handle.kernel, handle.out_features, handle.in_features, "q8_1"),
        dev.upload_array(bias))
    assert np.abs(dev.to_host(plain) - want).max() > 1e-4 * scale
