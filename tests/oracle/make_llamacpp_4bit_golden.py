"""llama.cpp on the 4-bit types it repacks on x86 (Q4_0, IQ4_NL): the tiny granite of
tests/family_models.py written as a GGUF with every matrix in one type (tests/family_gguf.py;
IQ4_NL with `quant_blocks.quantize_iq4_nl`), decoded by llama-cpp-python with its default
context (float16 KV cache, 2 threads): a prefill of LORA_PROMPT[:17], then one token at a
time. Run by hand:

    pip install -e ".[oracle]"
    python tests/oracle/make_llamacpp_4bit_golden.py

Writes tests/golden/llamacpp_granite_4bit.npz, per type (q4_0/, iq4_nl/):
- `logits` [9, V]: each step's last-row logits with llama.cpp's weight repacking off
  (`use_extra_bufts = false`), `repacked` with it on (its default with AVX2: 8-row
  interleaved blocks, another float order);
- from the repacked run, layer 0's output projection and down projection, each input and
  output as llama.cpp's graph holds them (`kqv_out-0` -> `attn_out-0`, `ffn_swiglu-0` ->
  `ffn_out-0`), for the prefill (`prefill/...`, 17 rows) and the first single-token step
  (`step/...`);
and `oracle`.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import llama_cpp as L
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "oracle"),
                str(ROOT / "bench")]

from llamacpp_tensors import GGML_TYPE_F32, GgmlTensor  # noqa: E402
from make_llamacpp_golden import oracle_string  # noqa: E402
from tiny_lora import LORA_PROMPT  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "llamacpp_granite_4bit.npz"
PREFILL, STEPS = 17, 8
TYPES = ("Q4_0", "IQ4_NL")
CAPTURED = ("kqv_out-0", "attn_out-0", "ffn_swiglu-0", "ffn_out-0")


def write_model(path: Path, qtype: str, no_vocab: bool = False) -> Path:
    """The tiny granite with every matrix in `qtype`, as the golden's."""
    from family_gguf import write_family_gguf
    from gguf import GGMLQuantizationType

    write_family_gguf(path, "granite", qtype=GGMLQuantizationType[qtype], no_vocab=no_vocab)
    return path


def run(path: Path, repack: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Each step's last-row logits, and CAPTURED at steps 0 and 1 ("prefill/", "step/")."""
    captured: dict[str, np.ndarray] = {}
    step = [-1]

    @L.ggml_backend_sched_eval_callback
    def grab(tensor_p: int, ask: bool, user_data: int) -> bool:
        t = ctypes.cast(tensor_p, ctypes.POINTER(GgmlTensor)).contents
        name = t.name.decode()
        if ask or step[0] > 1 or name not in CAPTURED or t.type != GGML_TYPE_F32:
            return True
        rows, cols = int(t.ne[1]), int(t.ne[0])
        data = np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(t.data))
        captured[f"{('prefill', 'step')[step[0]]}/{name}"] = data.reshape(rows, cols).copy()
        return True

    params = L.llama_model_default_params()
    params.use_extra_bufts = repack
    model = L.llama_model_load_from_file(str(path).encode(), params)
    context = L.llama_context_default_params()
    context.n_ctx, context.n_threads, context.n_threads_batch = 128, 2, 2
    context.cb_eval = grab
    ctx = L.llama_init_from_model(model, context)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rows = []
    try:
        for tokens in [LORA_PROMPT[:PREFILL]] + [[t] for t in
                                                   LORA_PROMPT[PREFILL:PREFILL + STEPS]]:
            step[0] += 1
            arr = (L.llama_token * len(tokens))(*tokens)
            if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
                raise RuntimeError("llama_decode failed")
            rows.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1),
                                              shape=(n_vocab,)).copy())
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    return np.array(rows, np.float32), captured


def main() -> None:
    L.llama_backend_init()
    arrays: dict[str, np.ndarray] = {"oracle": np.array(oracle_string())}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in TYPES:
            path = write_model(Path(tmp) / f"granite-{qtype}.gguf", qtype, no_vocab=True)
            plain, _ = run(path, False)
            repacked, tensors = run(path, True)
            key = qtype.lower()
            arrays.update({f"{key}/logits": plain, f"{key}/repacked": repacked,
                           **{f"{key}/{k}": v for k, v in tensors.items()}})
            print(f"{qtype}: repacked against not, largest difference "
                  f"{np.abs(plain - repacked).max():.3g}; captured {sorted(tensors)}")
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
