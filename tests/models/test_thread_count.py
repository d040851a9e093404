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


def _fake_machine(monkeypatch, readings):  # type: ignore[no-untyped-def]
    """Two CPUs whose /proc readings (busy, total, own jiffies) come from `readings`; a
    clock set by hand; the thread counts set, in a list."""
    readings = iter(readings)
    state = {"t": 0.0}

    def busy_total(cpus):
        state["now"] = next(readings)
        return state["now"][:2]

    set_to = []
    monkeypatch.setattr(threads, "_busy_jiffies", busy_total)
    monkeypatch.setattr(threads, "_own_jiffies", lambda: state["now"][2])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("numba.set_num_threads", set_to.append)
    monkeypatch.setattr(threads.time, "monotonic", lambda: state["t"])
    return state, set_to


def _run_until(follower, state, t):  # type: ignore[no-untyped-def]
    """Steps (a layer every 0.05 s) until time t, then the next step's `follow`."""
    while state["t"] + 0.05 < t:
        state["t"] += 0.05
        follower.working()
    state["t"] = t
    return follower.follow()


def test_load_follower_leaves_the_cpus_others_use(monkeypatch):
    """Two CPUs; a neighbour busy for 1.2 of them while we run -> one thread; idle
    again -> two after a tenth of a second of work."""
    state, set_to = _fake_machine(monkeypatch, [(0, 0, 0), (160, 200, 40), (200, 240, 80)])
    follower = threads.LoadFollower(2)
    assert _run_until(follower, state, 1.0) == 1 and set_to == [1]   # 160 - 40 of 200
    assert _run_until(follower, state, 1.05) == 1         # within RAISE_S: no reading
    assert _run_until(follower, state, 1.2) == 2 and set_to == [1, 2]   # 40 - 40 of 40


def test_short_pauses_while_a_neighbour_works_do_not_count(monkeypatch):
    """Bursts of 0.3 s of work, each after a 0.3 s pause in which a neighbour kept a CPU
    busy (as runs alternating with llama.cpp's): every pause ends the interval, so the
    neighbour's work is never counted and the count stays two."""
    state, set_to = _fake_machine(monkeypatch, [(0, 0, 0), (90, 120, 30), (180, 240, 60)])
    follower = threads.LoadFollower(2)
    for burst in range(3):
        state["t"] = 0.6 * burst
        assert follower.follow() == 2
        assert _run_until(follower, state, 0.6 * burst + 0.3) == 2
    assert set_to == []


def test_load_while_we_waited_for_work_does_not_count(monkeypatch):
    """While this process waited 2 s for work, a neighbour kept 1.6 CPUs busy (its burst
    may be over): the count stays as our last working interval left it (two), and a new
    interval starts; busy beside us over that one, one thread. After another wait the
    count stays one (a neighbour that kept running stays counted)."""
    state, set_to = _fake_machine(monkeypatch, [(0, 0, 0), (170, 200, 10), (270, 300, 30),
                                                (570, 600, 40), (670, 700, 80)])
    follower = threads.LoadFollower(2)
    state["t"] = 2.0                                       # no step for 2 s
    assert follower.follow() == 2 and set_to == []         # 160 others of 200 ignored
    assert _run_until(follower, state, 2.6) == 1 and set_to == [1]   # 80 others of 100
    state["t"] = 5.6                                       # waited 3 s
    assert follower.follow() == 1 and set_to == [1]
    assert _run_until(follower, state, 6.2) == 1 and set_to == [1]   # 60 others of 100
