"""The `vllm-actors` command, run as users run it."""

import re
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_actors", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_chat_streams_answer():
    result = run_cli("generate", "--chat", "--prompt", "What is the capital of France?",
                     "--max-tokens", "24", "--gguf-activations", "float32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    lines = result.stderr.splitlines()   # every log line on a line of its own
    assert lines[0].startswith("Loading ") and lines[0].endswith("...")
    assert any(line.startswith("(EngineCore) INFO KV cache") for line in lines[1:])
    assert re.fullmatch(r"Ready in [0-9.]+s", lines[-1]), lines


def test_generate_reports_bad_model_path(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "x.gguf"), "--prompt", "hi")
    assert result.returncode == 2
    assert "error:" in result.stderr and "x.gguf" in result.stderr


def test_pull_when_installed_names_the_file():
    result = run_cli("pull")
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
