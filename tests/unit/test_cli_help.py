"""The flags generated from the settings' declarations (`config_fields`) read as the
hand-written ones did: every flag in tests/golden/cli_help.json (written before the change by
tests/make_cli_help_golden.py) keeps its name, short form, default, help text and order."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_actors.config_fields import build, setting

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_cli_help_golden import GOLDEN, render  # noqa: E402


def _option_blocks(text: str) -> dict[str, str]:
    """An option's lines of the options section, by its first flag."""
    section = text.split("\noptions:\n", 1)[1]
    blocks: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", section):
        blocks[block.split()[0].rstrip(",")] = block.rstrip()
    return blocks


def test_every_flag_reads_as_it_did(monkeypatch):
    before = json.loads(GOLDEN.read_text())
    after = render()
    for command, text in before.items():
        old, new = _option_blocks(text), _option_blocks(after[command])
        assert list(old) == [flag for flag in new if flag in old], command   # same order
        for flag, block in old.items():
            assert new[flag] == block, (command, flag)


def test_sub_configs_are_filled_by_name_never_by_position():
    @dataclass(kw_only=True)
    class Part:
        a: int = 1
        b: int = 2

    @dataclass
    class Source:
        b: int = setting(5, "b")
        c: int = setting(7, "c")

    assert build(Part, Source(), a=3) == Part(a=3, b=5)
    with pytest.raises(TypeError, match="Part.a"):
        build(Part, Source())          # a default the source meant to set is never taken
    with pytest.raises(TypeError):
        Part(1, 2)                      # positional construction is refused


def test_vllm_flags_that_change_nothing_here_are_accepted(caplog):
    """vLLM command lines' --dtype, --enforce-eager, --trust-remote-code, --quantization gguf,
    --load-format, --enable-chunked-prefill, --swap-space and --disable-custom-all-reduce
    parse and build (a dtype other than float32 is logged); values this engine would not
    honour are refused, naming the flag."""
    import argparse

    from vllm_actors.config import EngineArgs
    from vllm_actors.errors import ValidationError
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--dtype", "float16", "--enforce-eager", "--trust-remote-code"]))
    assert (args.dtype, args.enforce_eager, args.trust_remote_code) == ("float16", True, True)
    with caplog.at_level("WARNING"):
        args.create_engine_config()
    assert "--dtype float16: activations compute in float32" in caplog.text
    with pytest.raises(ValidationError, match="--dtype must be one of") as info:
        EngineArgs(dtype="int4").create_engine_config()
    assert info.value.param == "dtype"
    EngineArgs.from_cli_args(parser.parse_args(
        ["--quantization", "gguf", "--load-format", "gguf", "--enable-chunked-prefill",
         "--swap-space", "4", "--disable-custom-all-reduce"])).create_engine_config()
    for kwargs, param in (({"quantization": "awq"}, "quantization"),
                          ({"load_format": "pt"}, "load_format"),
                          ({"enable_chunked_prefill": False}, "enable_chunked_prefill")):
        with pytest.raises(ValidationError) as info:
            EngineArgs(**kwargs).create_engine_config()
        assert info.value.param == param


def test_https_needs_both_files():
    from vllm_actors.config import ServerConfig
    from vllm_actors.errors import ValidationError
    ServerConfig(ssl_keyfile="k.pem", ssl_certfile="c.pem", root_path="/api")
    with pytest.raises(ValidationError, match="go together") as info:
        ServerConfig(ssl_keyfile="k.pem")
    assert info.value.param == "ssl_certfile"
