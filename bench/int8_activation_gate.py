"""Would 8-bit activations (llama.cpp's way to integer dot products: x rounded to blocks of 32
int8 values with one float16 scale, Q8_0) pass the oracle gate of 1e-3 on SmolLM2's logits?

    python bench/int8_activation_gate.py

Emulated on the numpy backend: the input of every linear and of the LM head is rounded to
Q8_0 blocks before the float32 matmul. Prints the worst |logit - transformers'| over the
golden cases' stored steps, with and without the rounding (the tests' `LOGIT_TOLERANCE`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from golden_files import GOLDEN, load_golden  # noqa: E402
from model_driver import prompt_logits  # noqa: E402

from vllm_actors.kernels.numpy_backend import NumpyBackend  # noqa: E402
from vllm_actors.loaders.model_files import default_model_path, resolve_model  # noqa: E402
from vllm_actors.models.registry import load_model  # noqa: E402


def q8_0(x: np.ndarray) -> np.ndarray:
    """x rounded to Q8_0 blocks of 32 along its last axis (scale max|x| / 127 in float16)."""
    x = np.ascontiguousarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    q = np.round(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)


class Q8ActivationBackend(NumpyBackend):
    def linear(self, x, weight, bias=None):  # type: ignore[no-untyped-def]
        return super().linear(q8_0(x), weight, bias)

    def lm_head(self, hidden, head, rows, on_device=False):  # type: ignore[no-untyped-def]
        return super().lm_head(q8_0(hidden), head, rows, on_device)


def worst_logit_errors(backend: NumpyBackend) -> list[float]:
    golden = load_golden("smollm2_greedy.json")
    stored = np.load(GOLDEN / "smollm2_logits.npz")
    model = load_model(resolve_model(default_model_path()), backend)
    worst = []
    for case in golden["cases"]:
        steps = golden["logit_steps"]
        ids = case["prompt_token_ids"] + case["tokens"][:max(steps)]
        logits = prompt_logits(model, backend, ids, chunks=[len(ids) - 5, 5])
        errs = []
        for step in steps:
            row = logits[len(case["prompt_token_ids"]) - 1 + step]
            keys = stored[f"{case['name']}/{step}/ids"]
            errs.append(float(np.abs(row[keys] - stored[f"{case['name']}/{step}/logits"]).max()))
        worst.append(max(errs))
    return worst


def main() -> None:
    print("| activations | cases | median of worst abs logit error | max | gate |")
    print("|---|---|---|---|---|")
    for name, backend in (("float32", NumpyBackend()), ("Q8_0 blocks", Q8ActivationBackend())):
        worst = worst_logit_errors(backend)
        print(f"| {name} | {len(worst)} | {np.median(worst):.2e} | {max(worst):.2e} | 1e-3 |")


if __name__ == "__main__":
    main()
