"""Op by op against llama.cpp: each op of ours fed llama.cpp's own input tensors, its output
next to llama.cpp's, under `--gguf-activations quantized`.

    pip install -e ".[oracle]"          # llama-cpp-python
    python bench/llamacpp_tensors.py [--model smollm2] [--device numpy|cpu] [--layers 0,1]
        [--tokens 12]

llama.cpp's tensors are read through its graph callback (`cb_eval`) while it decodes a prompt
(its default context settings, as tests/oracle/make_llamacpp_golden.py: F16 KV cache, flash
attention off, 2 threads). Each of our ops then runs on llama.cpp's inputs, so a difference
is that op's own, not one carried in from upstream. Per op: whether the output is bit for bit
llama.cpp's, the largest |difference| relative to the largest |value|, and the share of
elements that differ. Llama-family graphs (SmolLM2): llama.cpp's Q/K rows are in its
adjacent-pair order, ours in NeoX halves (`DecoderLM._neox_order`), so theirs are permuted
before comparing (under the quantized semantics they stay in llama.cpp's order).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import llama_cpp as L  # noqa: E402

from vllm_actors.kernels.kv_quant import kv_format  # noqa: E402
from vllm_actors.kernels.ops import AttentionMetadata  # noqa: E402
from vllm_actors.loaders.model_files import default_model_path, resolve_model  # noqa: E402
from vllm_actors.models.registry import load_model  # noqa: E402

GGML_TYPE_F32 = 0


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of the ggml that llama-cpp-python 0.3.36 bundles."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


@L.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log is not this script's output."""


def llama_tensors(path: Path, tokens: list[int]) -> dict[str, list[np.ndarray]]:
    """Every contiguous float32 tensor llama.cpp's graph computes for one decode of
    `tokens`, by name (a name llama.cpp gives twice keeps both, in graph order)."""
    found: dict[str, list[np.ndarray]] = {}

    @L.ggml_backend_sched_eval_callback
    def grab(tensor_p: int, ask: bool, user_data: int) -> bool:
        t = ctypes.cast(tensor_p, ctypes.POINTER(GgmlTensor)).contents
        if ask:
            return True
        shape = tuple(int(n) for n in t.ne)
        if t.type == GGML_TYPE_F32 and t.nb[0] == 4 and t.data and \
                all(t.nb[i + 1] == t.nb[i] * shape[i] for i in range(3)):
            count = int(np.prod(shape))
            data = np.ctypeslib.as_array((ctypes.c_float * count).from_address(t.data))
            array = data.reshape(shape[::-1])
            while array.ndim > 2 and array.shape[0] == 1:
                array = array[0]
            found.setdefault(t.name.decode(), []).append(array.copy())
        return True

    L.llama_log_set(_quiet, ctypes.c_void_p())
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx, params.n_threads, params.n_threads_batch = 1024, 2, 2
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.cb_eval = grab
    ctx = L.llama_init_from_model(model, params)
    try:
        arr = (L.llama_token * len(tokens))(*tokens)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    return found


def compare(name: str, ours: np.ndarray, theirs: np.ndarray) -> None:
    ours = np.asarray(ours, np.float32).reshape(theirs.shape)
    diff = np.abs(ours.astype(np.float64) - theirs)
    scale = float(np.abs(theirs).max()) or 1.0
    same = np.array_equal(ours, theirs)
    print(f"| {name} | {'yes' if same else 'no'} | {diff.max() / scale:.2e} | "
          f"{100 * np.mean(diff > 0):.2f} % |")


def _meta(n: int, block_size: int = 16) -> AttentionMetadata:
    pos = np.arange(n)
    blocks = np.arange(1, -(-n // block_size) + 1, dtype=np.int32)[None, :]
    return AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32), blocks,
                             blocks[0][pos // block_size].astype(np.int64) * block_size
                             + pos % block_size, block_size)


def check_layer(model, backend, got: dict, layer: int, n: int) -> None:
    """Each op of layer `layer` on llama.cpp's inputs (see the module docstring)."""
    a, lay = model.args, model.layers[layer]
    order = model._neox_order if model._neox_order is not None else np.arange(a.head_dim)
    heads = lambda t, h: t.reshape(n, h, a.head_dim)  # noqa: E731

    def one(key: str, i: int = -1) -> np.ndarray:
        return got[f"{key}-{layer}"][i]

    before = got[f"l_out-{layer - 1}"][-1] if layer else got["embd"][-1]
    compare(f"{layer} attn_norm", backend.rms_norm(before, lay.attn_norm.weight,
                                                    a.rms_norm_eps), one("attn_norm"))
    qkv = backend.linear(one("attn_norm"), lay.qkv)
    q, k, v = backend.split_qkv(qkv, a.num_heads, a.num_kv_heads, a.head_dim)
    q_in, k_in = heads(one("Qcur", 0), a.num_heads), heads(one("Kcur", 0), a.num_kv_heads)
    compare(f"{layer} q = attn_norm @ wq", q, q_in[..., order])
    compare(f"{layer} k = attn_norm @ wk", k, k_in[..., order])
    compare(f"{layer} v = attn_norm @ wv", v, heads(one("Vcur", 0), a.num_kv_heads))
    rope = backend.prepare_rope(np.arange(n), model.rope)
    q_rot = backend.rope(np.ascontiguousarray(q_in[..., order]), rope)
    k_rot = backend.rope(np.ascontiguousarray(k_in[..., order]), rope)
    # (llama.cpp rotates adjacent pairs of its row order; ours are the same pairs as halves)
    compare(f"{layer} rope(q)", q_rot, heads(one("Qcur", -1), a.num_heads)[..., order])
    compare(f"{layer} rope(k)", k_rot, heads(one("Kcur", -1), a.num_kv_heads)[..., order])
    meta = _meta(n)
    attn = backend.prepare_attention(meta)
    kv = backend.allocate_kv_cache(1, -(-n // 16) + 1, 16, a.num_kv_heads, a.head_dim,
                                   kv_format("float16", ggml_products=True))[0]
    q_l = np.ascontiguousarray(heads(one("Qcur", -1), a.num_heads)[..., order])
    k_l = np.ascontiguousarray(heads(one("Kcur", -1), a.num_kv_heads)[..., order])
    backend.reshape_and_cache(k_l, heads(one("Vcur", -1), a.num_kv_heads), kv, attn)
    out = backend.paged_attention(q_l, kv, attn, model.scale)
    compare(f"{layer} attention", out, one("kqv_out"))
    compare(f"{layer} kqv_out @ wo", backend.linear(one("kqv_out"), lay.attn_out),
            one("attn_out"))
    h = np.array(before, copy=True)
    h, x = backend.add_rms_norm(h, one("attn_out"), lay.ffn_norm.weight, a.rms_norm_eps)
    compare(f"{layer} ffn_inp", h, one("ffn_inp"))
    compare(f"{layer} ffn_norm", x, one("ffn_norm"))
    gate_up = backend.linear(one("ffn_norm"), lay.mlp.gate_up)
    f = gate_up.shape[1] // 2
    compare(f"{layer} ffn_gate", gate_up[:, :f], one("ffn_gate"))
    compare(f"{layer} ffn_up", gate_up[:, f:], one("ffn_up"))
    both = np.ascontiguousarray(np.concatenate([one("ffn_gate"), one("ffn_up")], axis=1))
    compare(f"{layer} silu(gate) * up", backend.silu_mul(both, ggml=True), one("ffn_swiglu"))
    compare(f"{layer} ffn_out", backend.linear(one("ffn_swiglu"), lay.mlp.down), one("ffn_out"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", choices=("numpy", "cpu"), default="numpy")
    parser.add_argument("--layers", default="0,1")
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    source = resolve_model(default_model_path() if args.model == "smollm2" else args.model)
    tokens = [1] + [(i * 613 + 29) % 40000 + 100 for i in range(args.tokens - 1)]
    got = llama_tensors(Path(source.path), tokens)
    if args.device == "cpu":
        from vllm_actors.kernels.cpu.backend import CpuBackend
        backend = CpuBackend()
    else:
        from vllm_actors.kernels.numpy_backend import NumpyBackend
        backend = NumpyBackend()
    model = load_model(source, backend, gguf_activations="quantized")
    print(f"{args.model}, {len(tokens)} tokens, --device {args.device}; llama.cpp "
          f"{L.__version__}")
    print("| op on llama.cpp's inputs | bit-identical | max rel. diff | elements differing |")
    print("|---|---|---|---|")
    for layer in (int(v) for v in args.layers.split(",")):
        check_layer(model, backend, got, layer, len(tokens))
    final = backend.rms_norm(got[f"l_out-{model.args.num_layers - 1}"][-1][-1:],
                             model.final_norm.weight, model.args.rms_norm_eps)
    compare("result_norm", final, got["result_norm"][-1].reshape(final.shape))
    logits = model.compute_logits(got["result_norm"][-1].reshape(1, -1), np.array([0]))
    compare("result_output (LM head)", logits, got["result_output"][-1].reshape(logits.shape))


if __name__ == "__main__":
    main()
