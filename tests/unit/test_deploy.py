"""deploy/: the systemd unit and its environment file say what the server needs."""

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "vllm-actors.service")
    return parser


def test_unit_runs_the_server_as_a_dedicated_user_with_a_drain_window():
    service = unit()["Service"]
    assert service["ExecStart"].split()[1:3] == ["serve", "$VLLM_ACTORS_ARGS"]
    assert service["ExecStart"].split()[0].endswith("/vllm-actors")
    assert service["EnvironmentFile"] == "/etc/vllm-actors/vllm-actors.env"
    assert service["User"] == "vllm-actors" and service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    env = (DEPLOY / "vllm-actors.env").read_text()
    drain = float(env.split("--drain-timeout")[1].split()[0])
    assert float(service["TimeoutStopSec"]) > drain
    for option in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp", "ProtectHome"):
        assert option in service
    assert "AF_UNIX" in service["RestrictAddressFamilies"]   # the engine's ipc sockets


def test_env_file_sets_the_arguments_and_the_key():
    keys = {line.split("=", 1)[0] for line in (DEPLOY / "vllm-actors.env").read_text().splitlines()
            if line and not line.startswith("#")}
    assert {"VLLM_ACTORS_ARGS", "VLLM_API_KEY"} <= keys


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_accepts_the_unit(tmp_path):
    text = (DEPLOY / "vllm-actors.service").read_text().replace(
        "/opt/vllm-actors/bin/vllm-actors", shutil.which("true") or "/bin/true")
    path = tmp_path / "vllm-actors.service"
    path.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0 and "vllm-actors.service" not in result.stderr, result.stderr
