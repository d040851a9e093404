"""llama.cpp's logits for an IQ4_NL model: the tiny granite of tests/family_models.py written
as a GGUF with every matrix in IQ4_NL (tests/family_gguf.py, `quant_blocks.quantize_iq4_nl`),
decoded by llama-cpp-python with its default context (float16 KV cache, 2 threads): a
prefill of IQ4_NL_PROMPT[:17], then one token at a time, the logits of each step's last row.
Run by hand:

    pip install -e ".[oracle]"
    python tests/oracle/make_llamacpp_iq4_nl_golden.py

Writes tests/golden/llamacpp_granite_iq4_nl.npz: `logits` [9, V] with llama.cpp's weight
repacking off (`use_extra_bufts = false`: IQ4_NL then runs in tinyBLAS for two rows or
more, `vec_dot_iq4_nl_q8_0` for one), `repacked` the same with it on (the default on x86
with AVX2: IQ4_NL in 8-row interleaved blocks, another float order), and `oracle`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import llama_cpp as L
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "oracle")]

from make_llamacpp_golden import oracle_string  # noqa: E402
from tiny_lora import LORA_PROMPT  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "llamacpp_granite_iq4_nl.npz"
PREFILL, STEPS = 17, 8


def write_model(path: Path, no_vocab: bool = False) -> Path:
    """The tiny granite with every matrix in IQ4_NL, as the golden's."""
    from family_gguf import write_family_gguf
    from gguf import GGMLQuantizationType

    write_family_gguf(path, "granite", qtype=GGMLQuantizationType.IQ4_NL, no_vocab=no_vocab)
    return path


def logits(path: Path, repack: bool) -> np.ndarray:
    params = L.llama_model_default_params()
    params.use_extra_bufts = repack
    model = L.llama_model_load_from_file(str(path).encode(), params)
    context = L.llama_context_default_params()
    context.n_ctx, context.n_threads, context.n_threads_batch = 128, 2, 2
    ctx = L.llama_init_from_model(model, context)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rows = []
    try:
        for tokens in [LORA_PROMPT[:PREFILL]] + [[t] for t in
                                                   LORA_PROMPT[PREFILL:PREFILL + STEPS]]:
            arr = (L.llama_token * len(tokens))(*tokens)
            if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) != 0:
                raise RuntimeError("llama_decode failed")
            rows.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1),
                                              shape=(n_vocab,)).copy())
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    return np.array(rows, np.float32)


def main() -> None:
    L.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "granite-iq4_nl.gguf", no_vocab=True)
        plain, repacked = logits(path, False), logits(path, True)
    np.savez_compressed(GOLDEN, logits=plain, repacked=repacked,
                        oracle=np.array(oracle_string()))
    print(f"wrote {GOLDEN}: repacked against not, largest difference "
          f"{np.abs(plain - repacked).max():.3g}")


if __name__ == "__main__":
    main()
