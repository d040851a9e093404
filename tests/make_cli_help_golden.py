"""`vllm-actors generate --help` and `serve --help` as they read at 100 columns, written to
tests/golden/cli_help.json. The flags are generated from the settings' declarations
(`config_fields`); tests/unit/test_cli_help.py checks that every flag keeps its name, default
and help text. Run from the repository root when a flag changes on purpose:

    python tests/make_cli_help_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden" / "cli_help.json"
COLUMNS = "100"


def render() -> dict[str, str]:
    """Each subcommand's help text at `COLUMNS` columns."""
    os.environ["COLUMNS"] = COLUMNS
    from vllm_actors.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: sub.choices[name].format_help() for name in ("generate", "serve")}


def main() -> None:
    GOLDEN.write_text(json.dumps(render(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
