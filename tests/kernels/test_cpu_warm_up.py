"""The cpu backend's warm-up: every step size runs before READY, and a cold first start hands
the larger-step matmuls and attention to a helper process exactly once per kernel-source
state, waited for after the 1-row step."""

import json
import subprocess
import sys

import numpy as np

from vllm_actors.kernels import ggml_attention
from vllm_actors.kernels.cpu import elementwise
from vllm_actors.kernels.ops import AttentionMetadata
from vllm_actors.workers import warm_up as wu


class StubModel:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.logit_rows: list[int] = []

    def forward(self, ids, positions, meta, kv_caches):
        assert len(ids) == len(positions) == int(meta.query_start_loc[-1])
        self.sizes.append(len(ids))
        return np.zeros((len(ids), 4), np.float32)

    def compute_logits(self, hidden, rows):
        self.logit_rows.append(len(rows))


class StubBackend:
    name = "cpu"
    host_logits = True      # greedy ids taken on the host logits: their kernels warm up too

    def __init__(self) -> None:
        self.argmax_rows: list[int] = []
        self.matmuls: list[list[int]] = []

    def argmax(self, logits):
        self.argmax_rows.append(len(logits))

    def matmul_kinds(self):
        return 3

    def compile_matmuls(self, sizes, kinds):
        self.matmuls.append(list(kinds))


CPU = StubBackend()


def test_cold_start_starts_one_helper_then_the_marker_skips_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(wu, "_helper_fits", lambda path: True)
    model = StubModel()
    backend = StubBackend()

    class Helper:
        """Has taken the first matmul kind and the attention when the engine's 1-row step
        is done, and runs until it is waited for."""

        def __init__(self, path, semantics, work):
            started.append((work.sizes, work.attention))
            for task in ("matmul0", "attention"):
                assert work.take(task)

        def poll(self):
            return None

        def wait(self, timeout):
            # waited for after the 1-row step, the one-row greedy kernel and the tasks the
            # helper had not taken, from the back: RMSNorm's rows, the greedy ids of one
            # row and two, matmul kinds
            assert model.sizes == [1] and backend.argmax_rows == [1, 1, 2]
            assert backend.matmuls == ["norm", [2], [1]]

    monkeypatch.setattr(wu, "_start_helper", Helper)
    monkeypatch.setattr(elementwise, "compile_norm_rows",
                        lambda: backend.matmuls.append("norm"))
    cache = ggml_attention.GgmlCache(np.zeros((2, 16, 1, 16), np.uint16),
                                     np.zeros((2, 16, 1, 16), np.uint16))
    wu.warm_up(model, [cache], 16, 4096, backend, tmp_path / "model.gguf")
    assert started == [((3, 16, 64), wu.GGML_ATTENTION)]
    assert model.sizes == [1, 3, 16, 64] and model.logit_rows == [1, 3, 16, 64]
    assert backend.argmax_rows == [1, 1, 2, 2]   # several rows: loaded after the wait
    assert wu.marker_path().parent == tmp_path and wu.marker_path().exists()
    wu.warm_up(StubModel(), [], 16, 4096, CPU, tmp_path / "model.gguf")
    assert started == [((3, 16, 64), wu.GGML_ATTENTION)]     # warm: no second helper
    for caches, attention in (([], "-"),                      # caches of other formats
                              ([(np.zeros((2, 16, 1, 16), np.uint16),) * 2], "lane:uint16:0"),
                              ([(np.zeros((2, 16, 1, 6), np.float32),) * 2], "-")):
        wu.marker_path().unlink()
        model, backend = StubModel(), StubBackend()
        wu.warm_up(model, caches, 16, 4096, backend, tmp_path / "model.gguf")
        assert started[-1] == ((3, 16, 64), attention)


def test_no_helper_without_a_model_path_and_sizes_capped_by_the_context(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(wu, "_start_helper", lambda *args: started.append(args))
    model = StubModel()
    wu.warm_up(model, [], 16, 10, CPU, None)
    assert started == [] and model.sizes == [1, 3, 10]


def test_helper_compiles_each_weight_types_matmul_paths(smollm2_path, tmp_path):
    """The helper process (as the engine starts it, under the default semantics) leaves the
    integer kernels of SmolLM2's Q4_1 and Q8_0 weights for its larger steps compiled (`qwide`:
    the Q4_1 linears interleaved, the Q8_0 head the tied embedding as stored), the ones the
    engine runs, and the attention work item of steps of several tokens (in the lanes of the
    host's llama.cpp)."""
    script = (
        "import json, sys\n"
        "from vllm_actors.workers import warm_up\n"
        "warm_up.main(sys.argv[1:])\n"
        "from vllm_actors.kernels.cpu import isa, qmatmul_int as qi, qwide\n"
        "from vllm_actors.kernels import ggml_attention as ga\n"
        "code = isa.selected_code()\n"
        "bodies = [qi.body(code, kind, group) for kind in (4, 8) for group in (1, qi.GROUP)]\n"
        "bodies += [qwide.body(code, 4, qwide.LANES_ORDER, '|u1', qwide.X_ROWS, True),\n"
        "           qwide.body(code, 8, qwide.LANES_ORDER, '|i1', qwide.X_ROWS, False)]\n"
        "print(json.dumps(['address' in vars(c) for c in\n"
        "                  bodies + [ga._items()[1], ga._items()[0]]]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(smollm2_path), "16,64",
                           "quantized", wu.GGML_ATTENTION, str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    # Q4_1 (kind 4) and Q8_0 (kind 8) in `qwide`, which the larger steps take, not the GEMV's
    # one-row or 4-row forms; the attention of several tokens, not the one-token one
    assert compiled == [False, False, False, False, True, True, True, False]


def test_helper_compiles_the_attention_it_is_named(tmp_path, monkeypatch):
    """The helper's tasks: the matmul kinds, the greedy ids (one row and several), the
    attention it is named (llama.cpp's item of several tokens, the backend's blocked lane of
    a cache kind and the parallel entry it runs through, or none), then RMSNorm's rows,
    each unless the engine has taken it."""
    from vllm_actors.kernels.cpu import attention, attention_kernels, backend
    from vllm_actors.loaders import model_files
    from vllm_actors.models import registry

    done = []
    monkeypatch.setattr(ggml_attention, "compile_prefill", lambda: done.append("ggml"))
    monkeypatch.setattr(model_files, "resolve_model", lambda path: path)
    monkeypatch.setattr(registry, "load_model", lambda *args, **kwargs: None)
    monkeypatch.setattr(backend.CpuBackend, "matmul_kinds", lambda self: 2)
    monkeypatch.setattr(backend.CpuBackend, "compile_matmuls",
                        lambda self, sizes, kinds: done.append((sizes, kinds)))
    for i, spec in enumerate((wu.GGML_ATTENTION, "lane:float32:0", "-", wu.GGML_ATTENTION)):
        folder = tmp_path / str(i)
        folder.mkdir()
        if i == 3:                          # the engine took these
            (folder / "attention").touch()
            (folder / "matmul1").touch()
        wu.main(["model.gguf", "3,16", "quantized", spec, str(folder)])
    assert done == [((3, 16), [0]), ((3, 16), [1]), "ggml", ((3, 16), [0]), ((3, 16), [1]),
                    ((3, 16), [0]), ((3, 16), [1]), ((3, 16), [0])]
    assert "address" in vars(attention_kernels.lane_callback("float32", False, True))
    assert attention.blocked_lane_of((np.zeros((1, 16, 2, 64), np.uint16),) * 2) == "uint16:0"
    # the parallel entry compiled as a step calls it: a prefill of other shapes adds none
    compiled = len(attention_kernels.run_items.signatures)
    cache = attention.allocate_kv_cache(1, 4, 32, 2, 128, "float32")[0]
    meta = AttentionMetadata(np.array([0, 5, 12, 20], np.int32), np.array([5, 7, 8], np.int32),
                             np.arange(3, dtype=np.int32).reshape(3, 1) + 1,
                             np.arange(20, dtype=np.int64), 32)
    out = attention.paged_attention(np.ones((20, 4, 128), np.float32), cache,
                                    attention.prepare(meta, threads=2), 0.1)
    assert np.isfinite(out).all() and len(attention_kernels.run_items.signatures) == compiled
