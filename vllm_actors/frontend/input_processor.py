"""InputProcessor: a user's prompt + SamplingParams -> a validated EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from vllm_actors.errors import ValidationError
from vllm_actors.grammar import check_grammar
from vllm_actors.loaders.chat_template import read_chat_template
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.protocol.engine import EngineCoreRequest, EngineReady
from vllm_actors.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, ready: EngineReady, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_logprobs = max_logprobs

    def prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValidationError("a prompt must be a string, {'prompt': str} or "
                              f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                              "prompt")

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A conversation rendered with the chat template, as {"prompt", "prompt_token_ids"}."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=read_chat_template(chat_template), tools=tools)
        assert isinstance(text, str)
        return {"prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        """Raises ValidationError for an empty or too long prompt or out-of-vocab ids."""
        text, token_ids = self.prompt_token_ids(prompt)
        if not token_ids:
            raise ValidationError("the prompt is empty (0 tokens)", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise ValidationError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one output token",
                "prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValidationError(f"token id {bad[0]} is out of range for a vocabulary of "
                                  f"{self.vocab_size}", "prompt_token_ids")
        params = self._check_params(params)
        eos = [] if params.ignore_eos else list(self.tokenizer.eos_token_ids)
        request = EngineCoreRequest(request_id, token_ids, params, eos, time.time(), priority)
        return text, request

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """Token ids within the vocabulary, logprobs within --max-logprobs, a grammar
        llguidance accepts, bad words tokenized (as written and with a leading space, as vLLM does)."""
        if params.max_token_id() >= self.vocab_size:
            raise ValidationError(f"token id {params.max_token_id()} (in stop_token_ids, "
                                  "logit_bias or allowed_token_ids) is out of range for a "
                                  f"vocabulary of {self.vocab_size}", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValidationError(f"{name}={value} is more than the server allows "
                                      f"(--max-logprobs {self.max_logprobs})", name)
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        if params.bad_words and not params.bad_words_token_ids:
            words = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(variant, add_special_tokens=False)
                    if ids and ids not in words:
                        words.append(ids)
            params = msgspec.structs.replace(params, bad_words_token_ids=words)
        return params
