"""The benchmark scripts still run (tiny sizes; no timing is asserted, only what they count)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import API_KEY

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_serving_bench_against_our_server(server, tmp_path):
    out = tmp_path / "serving.json"
    done = run_bench(str(BENCH / "serving.py"), "--base-url", server.url, "--api-key", API_KEY,
                     "--model", "smol", "--concurrency", "1,3", "--input-len", "16",
                     "--output-len", "5", "--min-prompts", "3", "--prompts-per-level", "1",
                     "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert [r["requests"] for r in rows] == [3, 3]
    for r in rows:
        # min_tokens = max_tokens = 5, counted by the server's usage chunk; the stream carries
        # them in 1..5 chunks (tokens are merged when the client reads slower than they come)
        assert r["tokens_per_request"] == 5
        assert 1 <= r["chunks_per_request"] <= 5
        assert r["ttft_median_ms"] > 0 and r["itl_median_ms"] > 0
    assert "| concurrency |" in done.stdout


def test_compare_llamacpp_quick(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the bench extra only")
    out = tmp_path / "compare.json"
    run_bench(str(BENCH / "compare_llamacpp.py"), "--quick", "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["row"].split(",")[0] for r in result["rows"]] == \
        ["prefill", "single-stream decode", "batched decode"]
    assert all(len(r["ours"]) == len(r["llama_cpp"]) == 1 for r in result["rows"])
    assert result["machine"]["cpus"] >= 1


def test_profile_step_counts_every_op():
    done = run_bench(str(BENCH / "profile_step.py"), "--batch", "2", "--context", "24",
                     "--query", "3", "--steps", "1")
    assert "cpu, quantized: batch 2, context 24, query 3" in done.stdout
    ops = {line.split("|")[1].strip() for line in done.stdout.splitlines()
           if line.startswith("| ") and not line.startswith("| op")}
    assert {"linear", "paged_attention", "rope_and_cache", "add_rms_norm", "lm_head",
            "(other)"} <= ops


def test_shared_cores_bench_reports_alone_and_busy():
    done = run_bench(str(BENCH / "shared_cores.py"), "--devices", "cpu", "--runs", "1",
                     "--decode-tokens", "4")
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| cpu |")]
    assert len(rows) == 1 and float(rows[0][2]) > 0 and float(rows[0][3]) > 0
    assert "- cpu: the greedy tokens of all 2 runs (alone and busy) identical" in done.stdout


def test_structured_output_bench_reports_both_batches():
    done = run_bench(str(BENCH / "structured_output.py"), "--runs", "1", "--steps", "2")
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| batch")]
    assert rows == ["1", "32"]


def test_step_overhead_bench_runs_its_stub_model():
    """The stub model follows the model contract (it broke silently once when the contract
    changed)."""
    done = run_bench(str(BENCH / "step_overhead.py"), "--running", "4", "8", "--steps", "3",
                     "--runs", "1")
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| running")]
    assert rows == ["4", "8"]


def test_tp_overhead_comm_runs():
    done = run_bench(str(BENCH / "tp_overhead.py"), "comm", "--tp", "2", "--batch", "1",
                     "--steps", "5", "--runs", "1")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| comm |")]
    assert len(rows) == 1 and rows[0].startswith("| comm | 2 | 1 |")


def test_hostile_load_bench_leaves_nothing_behind(tmp_path):
    """The hostile-load bench at a tiny size: every stream ends as planned, the hostile
    requests get 200s and 4xx (never 5xx), /health answers within the bench's bound,
    nothing is left running or waiting, the greedy answer is unchanged (memory is only
    reported here: one warm-up round does not settle the allocators; bench sizes decide it)."""
    out = tmp_path / "hostile.json"
    run_bench(str(BENCH / "hostile_load.py"), "--streams", "6", "--rounds", "1",
              "--warmup-rounds", "1", "--max-tokens", "8", "--rss-bound-pct", "1000",
              "--json", str(out), timeout=600)
    result = json.loads(out.read_text())
    (round_,) = result["results"]
    assert round_["streams"] == {"done": 3, "hung up": 3}
    assert set(round_["hostile"].values()) <= {200, 400, 415}
    assert round_["hostile"]["seed 2^63"] == 200 and round_["hostile"]["deep JSON"] == 400
    assert result["running_after"] == result["waiting_after"] == 0
    assert result["greedy_unchanged"] and result["healthy"]
    assert round_["slowest_health_s"] <= 0.5


def test_parallel_benches_report_every_row():
    """The data parallel and pipeline parallel benches at a tiny size: both engines start
    and every row has a positive rate."""
    done = run_bench(str(BENCH / "data_parallel.py"), "--streams", "1", "2", "--max-tokens",
                     "2", "--runs", "1")
    rows = [line.split("|") for line in done.stdout.splitlines() if line[:4] in ("| 1 ", "| 2 ")]
    assert len(rows) == 2 and all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    done = run_bench(str(BENCH / "pipeline_parallel.py"), "--streams", "2", "--max-tokens",
                     "2", "--runs", "1")
    rows = [line.split("|") for line in done.stdout.splitlines()
            if line.startswith("| 2 ") or line.startswith("| | ")]
    assert len(rows) == 2 and all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_kv_accuracy_bench_reports_every_dtype(tmp_path):
    """The KV cache accuracy bench at a tiny size (numpy backend, two short prompts in chunks
    of 8): a row per dtype, the float32 cache as its own reference, float16 close to it."""
    out = tmp_path / "kv.json"
    done = run_bench(str(BENCH / "kv_accuracy.py"), "--device", "numpy", "--models", "smollm2",
                     "--dtypes", "float32,float16,fp8,turboquant_2.5", "--num-prompts", "2",
                     "--max-tokens", "24", "--chunk", "8", "--json", str(out))
    (result,) = json.loads(out.read_text())["results"]
    assert [p["tokens"] for p in result["prompts"]] == [24, 24]
    rows = {r["dtype"]: r for r in result["rows"]}
    assert list(rows) == ["float32", "float16", "fp8", "turboquant_2.5"]
    assert [rows[d]["times_smaller"] for d in ("float32", "float16", "fp8")] == [1.0, 2.0, 4.0]
    assert all(rows[d]["positions"] == 48 for d in ("float16", "fp8", "turboquant_2.5"))
    assert rows["float16"]["mean_kl"] < 1e-4 and rows["float16"]["top1_agreement"] > 0.9
    assert "| turboquant_2.5 |" in done.stdout


def test_gguf_header_bench_reports_its_row():
    """The GGUF open timing (bench/gguf_header.py) on the default model: the file's 272
    tensors and one row of times."""
    done = run_bench(str(BENCH / "gguf_header.py"), "--runs", "2")
    assert ": 272 tensors," in done.stdout
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and all(float(v) > 0 for v in rows[0][2:5])


def test_kv_speed_bench_reports_every_dtype(tmp_path):
    """The KV dtype decode bench at a tiny size: a row per dtype with its real bytes."""
    out = tmp_path / "speed.json"
    done = run_bench(str(BENCH / "kv_speed.py"), "--context", "40", "--batches", "2",
                     "--runs", "1", "--steps", "1", "--dtypes", "float32,fp8_e4m3",
                     "--json", str(out))
    rows = {r["dtype"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["float32"]["kv_bytes_per_token"] == 4 * rows["fp8_e4m3"]["kv_bytes_per_token"]
    assert all(r["batch_2_tok_s"] > 0 for r in rows.values())
    assert "| fp8_e4m3 |" in done.stdout


def test_frontend_cpu_socket_mode():
    done = run_bench(str(BENCH / "frontend_cpu.py"), "--socket", "--runs", "1",
                     "--messages", "50", timeout=60)
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["zmq.asyncio", "inbox"]
    assert all("us of CPU a message" in line for line in lines)
