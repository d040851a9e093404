"""LLM: the offline API. Prompts in, `RequestOutput`s out, in the order given."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence

from tqdm import tqdm

from vllm_actors.config import EngineArgs
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.core_client import InprocClient
from vllm_actors.frontend.input_processor import InputProcessor, PromptType
from vllm_actors.frontend.metrics import StatsAccumulator
from vllm_actors.frontend.output_processor import OutputProcessor
from vllm_actors.loaders.model_files import resolve_model
from vllm_actors.loaders.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.outputs import RequestOutput
from vllm_actors.sampling_params import SamplingParams

Messages = list[dict[str, Any]]


def _read_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value


class LLM:
    """Load a model and generate with it.

    Args:
        model: a .gguf file or an HF directory; None = the default model (SmolLM2).
        **engine_args: any `EngineArgs` field (max_model_len, seed, block_size, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        config = args.create_engine_config()
        source = resolve_model(config.model.model)
        self.tokenizer = load_tokenizer(source, _read_chat_template(config.model.chat_template))
        self.client = InprocClient(config)
        self.input_processor = InputProcessor(self.tokenizer, self.client.ready)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = StatsAccumulator()
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """Engine counters since start (preemptions, prefix-cache queries and hits, in tokens)
        and gauges of the latest step, under vLLM's metric names."""
        return self.stats.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False while requests still hold KV blocks."""
        return self.client.reset_prefix_cache()

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        request_id = str(next(self._request_counter))
        text, request = self.input_processor.process(request_id, prompt, params)
        self.output_processor.add_request(request, text)
        self.client.add_request(request)
        return request_id

    def _run_engine(self) -> Iterator[tuple[RequestOutput, str]]:
        while self.output_processor.has_unfinished_requests():
            engine_outputs = self.client.get_output()
            self.stats.observe(engine_outputs.scheduler_stats)
            yield from self.output_processor.process_outputs(engine_outputs.outputs)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        Raises:
            ValidationError: a bad prompt or a sampling_params list of the wrong length.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValidationError(f"got {len(prompts)} prompts but {len(params)} sampling_params",
                                  "sampling_params")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_ids.append(self._add(prompt, p))
        except Exception:
            self._abort(request_ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                  disable=not use_tqdm or len(request_ids) < 2) as progress:
            for output, _ in self._run_engine():
                if output.finished:
                    finished[output.request_id] = output
                    progress.update(1)
        return [finished[r] for r in request_ids]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced (our addition to vLLM's API)."""
        request_id = self._add(prompt, sampling_params or SamplingParams())
        try:
            for output, delta in self._run_engine():
                if output.request_id == request_id and delta:
                    yield delta
        finally:
            self._abort([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.client.abort_requests(request_ids)

    def _chat_prompt(self, messages: Messages, chat_template: str | None,
                     add_generation_prompt: bool) -> dict[str, Any]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=_read_chat_template(chat_template))
        assert isinstance(text, str)
        return {"prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to a
        list of conversations, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(list(c), chat_template, add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

