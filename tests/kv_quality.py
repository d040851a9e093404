"""Teacher-forced quality of a quantized KV cache against the float32 cache (tests only): each
golden sequence (prompt + golden tokens) runs as a chunked prefill through a float32 cache and
through a cache of each format, and the next-token distributions of every position are
compared: KL(p_float32 || p_format) (float64 log-softmax) and whether the argmax agrees.

Chunks of 256 tokens: later chunks read the earlier chunks' KV back from the cache, and within
a chunk KV is written before it is attended, so every position reads quantized KV (as in
bench/kv_accuracy.py, which measures the same on longer stdlib prompts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from golden_files import load_golden
from model_driver import prompt_logits

from vllm_actors.kernels.kv_quant import kv_format

CHUNK = 256
ROWS = 256          # log-softmax rows at a time: bounds the [rows, V] float64 arrays


@dataclass
class Quality:
    """Sums over positions of one format and one prompt set."""

    kl_sum: float = 0.0
    agree: int = 0
    positions: int = 0
    prompt_kl: list = field(default_factory=list)    # mean KL of each prompt

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.positions, 1)

    @property
    def agreement(self) -> float:
        return self.agree / max(self.positions, 1)

    def __str__(self) -> str:
        return (f"mean KL {self.mean_kl:.4f}, top-1 agreement {100 * self.agreement:.2f} % "
                f"({self.agree}/{self.positions}), worst prompt's mean KL "
                f"{max(self.prompt_kl, default=0.0):.4f}")


def golden_sequences(name: str = "smollm2_greedy.json") -> dict[str, list[list[int]]]:
    """Prompt + golden tokens of each golden case, by kind (the prompt sets: chat, plain)."""
    sets: dict[str, list[list[int]]] = {}
    for case in load_golden(name)["cases"]:
        sets.setdefault(case["kind"], []).append(case["prompt_token_ids"] + case["tokens"])
    return sets


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def measure(model, backend, sets: dict[str, list[list[int]]], dtypes: list[str]
            ) -> dict[str, dict[str, Quality]]:
    """{dtype: {prompt set: Quality}} of each dtype's cache against the float32 cache, with the
    set "all" over every prompt."""
    out = {d: {name: Quality() for name in [*sets, "all"]} for d in dtypes}
    for name, sequences in sets.items():
        for ids in sequences:
            chunks = [min(CHUNK, len(ids) - s) for s in range(0, len(ids), CHUNK)]
            ref = prompt_logits(model, backend, ids, chunks)
            got = {d: prompt_logits(model, backend, ids, chunks, kv_format=kv_format(d))
                   for d in dtypes}
            kl = {d: 0.0 for d in dtypes}
            for r0 in range(0, len(ids), ROWS):
                lp = _log_softmax64(ref[r0:r0 + ROWS])
                p, top = np.exp(lp), lp.argmax(axis=1)
                for d in dtypes:
                    lq = _log_softmax64(got[d][r0:r0 + ROWS])
                    kl[d] += float(np.maximum((p * (lp - lq)).sum(axis=1), 0.0).sum())
                    agree = int((lq.argmax(axis=1) == top).sum())
                    for q in (out[d][name], out[d]["all"]):
                        q.agree += agree
            for d in dtypes:
                for q in (out[d][name], out[d]["all"]):
                    q.kl_sum += kl[d]
                    q.positions += len(ids)
                    q.prompt_kl.append(kl[d] / len(ids))
    return out
