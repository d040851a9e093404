"""The compiled CPU backend's results do not depend on its thread count, so the count can
follow the machine's load (`threads.LoadFollower`) without changing a token.

SmolLM2 under `--gguf-activations quantized` (the semantics where a one-ulp difference
anywhere moves a rounding) over a 700-token prompt, whose attention is split into parts
(`attention_plan.SPLIT_KEYS`): logits bit for bit equal on one thread and on two.
"""

from __future__ import annotations

import numpy as np
from model_driver import prompt_logits

from vllm_actors.kernels.cpu import threads
from vllm_actors.kernels.cpu.attention_plan import SPLIT_KEYS

PROMPT = [(i * 389 + 11) % 40000 + 100 for i in range(700)]


def test_logits_equal_on_one_and_two_threads(smollm2_path):
    from vllm_actors.kernels.cpu.backend import CpuBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model
    assert len(PROMPT) > SPLIT_KEYS
    logits = {}
    try:
        for count in (1, 2):
            backend = CpuBackend(num_threads=count)
            model = load_model(resolve_model(smollm2_path), backend,
                               gguf_activations="quantized")
            # a prefill in chunks, then one-token steps over the split context
            logits[count] = prompt_logits(model, backend, PROMPT, [600, 97, 1, 1, 1],
                                          first_row=600)
    finally:
        threads.configure()
    assert np.array_equal(logits[1], logits[2])


def test_load_follower_leaves_the_cpus_others_use(monkeypatch):
    """Two CPUs; a neighbour busy for 1.2 of them -> one thread; idle again -> two."""
    readings = iter([(0, 0, 0), (160, 200, 40), (200, 400, 80)])
    state = {}

    def busy_total(cpus):
        state["now"] = next(readings)
        return state["now"][:2]

    set_to = []
    monkeypatch.setattr(threads, "_busy_jiffies", busy_total)
    monkeypatch.setattr(threads, "_own_jiffies", lambda: state["now"][2])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("numba.set_num_threads", set_to.append)
    clock = iter([0.0, 1.0, 1.2, 2.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    follower = threads.LoadFollower(2)
    assert follower.follow() == 1 and set_to == [1]      # 160 busy - 40 own of 200: 1.2 CPUs
    assert follower.follow() == 1                         # within the interval: no reading
    assert follower.follow() == 2 and set_to == [1, 2]   # 40 - 40 of 200: idle
