"""No silent float64 promotion: every backend op of a mixed prefill + decode step returns
float32 (NumPy 2 keeps float32 with Python scalars, but a float64 array operand would not)."""

import numpy as np

from vllm_actors.kernels.ops import AttentionMetadata

OPS = ("embedding", "linear", "rms_norm", "add", "silu_mul", "rope", "paged_attention",
       "lm_head")


def test_every_op_stays_float32(smollm2_model, monkeypatch):
    model, backend = smollm2_model
    seen: dict[str, set] = {name: set() for name in OPS}
    for name in OPS:
        fn = getattr(backend, name)

        def record(*args, _fn=fn, _name=name, **kwargs):
            out = _fn(*args, **kwargs)
            seen[_name].add(out.dtype)
            return out
        monkeypatch.setattr(backend, name, record)
    a = model.args
    kv = backend.allocate_kv_cache(a.num_layers, 5, 16, a.num_kv_heads, a.head_dim)
    # request 0: a 20-token prompt chunk; request 1: one decode token at position 29
    meta = AttentionMetadata(np.array([0, 20, 21], np.int32), np.array([20, 30], np.int32),
                             np.array([[1, 2], [3, 4]], np.int32),
                             np.append(16 + np.arange(20), 3 * 16 + 13).astype(np.int64), 16)
    hidden = model.forward(np.arange(100, 121), np.append(np.arange(20), 29), meta, kv)
    logits = model.compute_logits(hidden, np.array([19, 20]))
    assert logits.dtype == np.float32 and logits.shape == (2, a.vocab_size)
    assert seen == {name: {np.dtype(np.float32)} for name in OPS}
