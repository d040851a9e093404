"""`python -m vllm_actors ...` is the `vllm-actors` command."""

import sys

from vllm_actors.cli import main

sys.exit(main())
