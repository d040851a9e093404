"""Warm-up of a backend that compiles kernels on first use (the cpu backend): before the engine
reports ready, the model runs on dummy tokens whose KV goes to the null block (never read), at
1 and 3 rows (the GEMV kernels, decode attention) and 16 and 64 rows (the fused small-M GEMM,
the blocked GEMM, prefill attention), with logits for every row so the LM head takes each
path too.

The first start compiles every kernel: numba, one core. When the kernel cache is cold, a
second CPU is free and memory allows a second copy of the weights, a helper process (`python
-m vllm_actors.workers.warm_up`) compiles into the same on-disk cache while this process runs
its 1-row step (the one-row GEMVs, one-token attention, the elementwise kernels). The rest is
shared as tasks (`SharedWork`): with the weights loaded, the multi-row (2..15 rows) and
3/16/64-row matmul kernels of each kind of weight (`CpuBackend.compile_matmuls`), the greedy
ids, the parallel RMSNorm, and the attention of steps of several tokens
(`ggml_attention.compile_prefill` where the cache takes llama.cpp's attention, else the
backend's blocked lane: `attention.compile_blocked_lane`). The helper takes them in that
order, this process from the back once its 1-row step is done; it then waits for the helper
and runs 3, 16 and 64 rows, loading what was compiled. The two processes compile different
kernels: where both ran the same steps, attention compiled twice (measured: 42.4 s alone,
40.1 s with such a helper). A marker file per kernel-source state records a finished
warm-up, so warm starts (2-3 s) start no helper.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_actors.kernels import ggml_attention
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.version import __version__

logger = logging.getLogger(__name__)

FIRST_SIZES = (1,)          # before the helper is waited for
STEP_SIZES = (3, 16, 64)    # after it
HELPER_SIZES = (3, 16, 64)  # the helper's matmuls (3 rows: Q8_0's GEMV of 4 rows, below `qwide`)
HELPER_TIMEOUT_S = 600
GGML_ATTENTION = "ggml-attention"
LANE = "lane:"              # + `attention.blocked_lane_of`: the helper compiles that lane


def run_sizes(model: Any, kv_caches: list, block_size: int, sizes: tuple[int, ...]) -> None:
    """One dummy step of each size (tokens of one sequence, all KV in the null block), on
    the model cut to one layer of each kind where it can be (`warm_up_view`)."""
    if hasattr(model, "warm_up_view"):
        model, kv_caches = model.warm_up_view(kv_caches)
    for n in sorted(set(sizes)):
        pos = np.arange(n)
        meta = AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32),
                                 np.zeros((1, -(-n // block_size)), np.int32),
                                 (pos % block_size).astype(np.int64), block_size)
        stage = getattr(model, "stage", None)     # a pipeline stage: its own part only
        if stage is None or stage.first:
            hidden = model.forward(np.zeros(n, np.int64), pos, meta, kv_caches)
        else:
            zeros = np.zeros((n, model.args.hidden_size), np.float32)
            hidden = model.forward(None, pos, meta, kv_caches,
                                   hidden_in=model.backend.from_host(zeros))
        if stage is None or stage.last:
            model.compute_logits(hidden, np.arange(n))


def warm_greedy(backend: Any, rows: tuple[int, ...] = (1, 2)) -> None:
    """Compile (or load) the greedy ids' kernels of a backend that takes the argmax on the
    host logits (`host_logits`) at each row count: one row runs the serial kernel, more the
    parallel one."""
    if getattr(backend, "host_logits", False):
        for n in rows:
            backend.argmax(np.zeros((n, 64), np.float32))


def marker_path() -> Path:
    """Where a finished warm-up of the current kernel sources is recorded."""
    import numba
    from llvmlite import binding

    kernels = Path(__file__).resolve().parents[1] / "kernels" / "cpu"
    state = [__version__, numba.__version__, sys.version, binding.get_host_cpu_name(),
             binding.get_host_cpu_features().flatten()]
    state += [f"{f.name}:{f.stat().st_mtime_ns}:{f.stat().st_size}"
              for f in sorted(kernels.glob("*.py"))]
    key = hashlib.sha256("\n".join(state).encode()).hexdigest()[:16]
    root = os.environ.get("NUMBA_CACHE_DIR") or Path.home() / ".cache" / "vllm_actors"
    return Path(root) / f"cpu-kernels-{key}.ready"


def attention_for_helper(kv_caches: list) -> str:
    """What of attention the helper compiles: llama.cpp's work item of several tokens where a
    cache takes llama.cpp's attention (`GGML_ATTENTION`), else the backend's blocked lane of
    the first cache (`LANE` + its kind), "-" for none."""
    from vllm_actors.kernels.cpu.attention import blocked_lane_of

    if any(isinstance(c, ggml_attention.GgmlCache) for c in kv_caches):
        return GGML_ATTENTION
    spec = blocked_lane_of(kv_caches[0]) if kv_caches and kv_caches[0] is not None else ""
    return LANE + spec if spec else "-"


class SharedWork:
    """The compile work a cold start shares between the engine and its helper, as tasks:
    the matmuls of each kind of weight (`CpuBackend.compile_matmuls`), the greedy ids (one
    row's too, which the engine's 1-row step then loads), the attention of several tokens
    (`attention_for_helper`) and the parallel RMSNorm (`elementwise.compile_norm_rows`). The
    helper takes them from the front, the engine from the back once its 1-row step is done,
    so the one that finishes its own work first takes more; a task is run by the process
    that creates its file in `folder` first."""

    def __init__(self, folder: Path, attention: str, sizes: tuple[int, ...]) -> None:
        self.folder, self.attention, self.sizes = folder, attention, sizes

    def tasks(self, backend: Any) -> list[str]:
        """In the helper's order: the matmuls first, which the engine's 1-row step shares
        some kernels with (it loads those the helper has compiled)."""
        return [f"matmul{i}" for i in range(backend.matmul_kinds())] + \
            ["greedy", "attention", "norm"]

    def take(self, task: str) -> bool:
        try:
            os.close(os.open(self.folder / task, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:         # no shared folder: each process compiles what it needs
            return True
        return True

    def run(self, task: str, backend: Any) -> None:
        """Compile (or load from the cache) what `task` names."""
        from vllm_actors.kernels.cpu.attention import compile_blocked_lane
        from vllm_actors.kernels.cpu.elementwise import compile_norm_rows

        if task == "greedy":
            warm_greedy(backend, (1, 2))
        elif task == "norm":
            compile_norm_rows()
        elif task.startswith("matmul"):
            backend.compile_matmuls(self.sizes, [int(task[len("matmul"):])])
        elif self.attention == GGML_ATTENTION:
            ggml_attention.compile_prefill()
        elif self.attention.startswith(LANE):
            compile_blocked_lane(self.attention[len(LANE):])


def _start_helper(model_path: str, gguf_activations: str, work: SharedWork
                  ) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm_actors.workers.warm_up", model_path,
             ",".join(map(str, work.sizes)), gguf_activations, work.attention,
             str(work.folder)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:            # no helper: this process compiles everything itself
        logger.warning("kernel compile helper did not start: %s", e)
        return None


def _helper_fits(model_path: Path) -> bool:
    """A second CPU, and memory for a second copy of the weights with room to spare."""
    from vllm_actors.kernels.cpu.threads import usable_cpus
    from vllm_actors.kernels.numpy_backend import available_host_memory

    files = [model_path] if model_path.is_file() else \
        [f for f in model_path.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    return usable_cpus() >= 2 and 4 * size < available_host_memory()


def warm_up(model: Any, kv_caches: list, block_size: int, max_model_len: int,
            backend: Any, model_path: Path | None, gguf_activations: str = "quantized"
            ) -> None:
    """Warm the kernels up, the greedy ids' too (`warm_greedy`). `model_path`: the model's
    file or directory, when a helper process may load it (None: this process compiles
    everything); the helper loads it under the same `gguf_activations` semantics, so it
    compiles the kernels the engine runs."""
    backend_name = backend.name
    start = time.perf_counter()
    logger.info("preparing %s kernels (compiled on the first start, then loaded from the "
                "cache)", backend_name)
    first = tuple(min(n, max_model_len) for n in FIRST_SIZES)
    rest = tuple(min(n, max_model_len) for n in STEP_SIZES)
    marker = marker_path()
    helper, work = None, None
    if backend_name == "cpu" and model_path is not None and not marker.exists() \
            and _helper_fits(Path(model_path)):
        logger.info("first start: a helper process compiles the larger-step kernels")
        work = SharedWork(Path(tempfile.mkdtemp(prefix="vllm-actors-warm-up-")),
                          attention_for_helper(kv_caches),
                          tuple(min(n, max_model_len) for n in HELPER_SIZES))
        helper = _start_helper(str(model_path), gguf_activations, work)
    try:
        run_sizes(model, kv_caches, block_size, first)
        warm_greedy(backend, (1,) if helper is not None else (1, 2))
        if helper is not None:
            _share(helper, work, backend)
    finally:
        if helper is not None:
            try:
                helper.wait(timeout=HELPER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
        if work is not None:
            shutil.rmtree(work.folder, ignore_errors=True)
    run_sizes(model, kv_caches, block_size, rest)
    if helper is not None:
        warm_greedy(backend, (2,))      # loaded: a task of the shared work
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass
    logger.info("%s kernels ready in %.1f s", backend_name, time.perf_counter() - start)


def _share(helper: subprocess.Popen, work: SharedWork, backend: Any) -> None:
    """The engine's part of the shared work: the tasks the helper has not taken, from the
    back, while it runs (after it, the larger steps compile what is left)."""
    for task in reversed(work.tasks(backend)):
        if helper.poll() is not None:
            return
        if work.take(task):
            work.run(task, backend)


def main(argv: list[str]) -> None:
    """The helper: the model's weights loaded on the cpu backend, then the shared work's
    tasks from the front (`SharedWork`; argv: model path, comma-separated sizes,
    --gguf-activations, `attention_for_helper`, the work's folder)."""
    from vllm_actors.kernels.cpu.backend import CpuBackend
    from vllm_actors.loaders.model_files import resolve_model
    from vllm_actors.models.registry import load_model

    work = SharedWork(Path(argv[4]), argv[3], tuple(int(s) for s in argv[1].split(",")))
    backend = CpuBackend()
    load_model(resolve_model(argv[0]), backend, gguf_activations=argv[2])
    for task in work.tasks(backend):
        if work.take(task):
            work.run(task, backend)


if __name__ == "__main__":
    main(sys.argv[1:])
