"""InputProcessor: a user's prompt + SamplingParams -> a validated EngineCoreRequest.

A request is processed once (tokenized, checked, bad words tokenized, grammar checked) and the
result, a `ProcessedRequest`, is what travels: the server processes it off the event loop and
hands it to `AsyncLLM` as is, and the n completions of one request are derived from it
without processing again. `chat_prompt` is the one place a conversation is rendered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_actors.errors import ValidationError
from vllm_actors.grammar import check_grammar
from vllm_actors.loaders.chat_template import read_chat_template
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.protocol.engine import EngineCoreRequest, EngineReady
from vllm_actors.sampling_params import SamplingParams

PromptType = str | dict[str, Any]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A text longer than max_model_len x the longest token x this cannot fit the context even if
# normalization merged every few characters into one: it is refused without tokenizing it.
TEXT_SLACK = 4
# keyword arguments a chat template receives from the engine itself; chat_template_kwargs
# may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                      "tokenize", "chat_template", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request, ready to send: the prompt's text (None when given as ids) and the
    engine request (its params with `bad_words_token_ids` filled)."""

    prompt: str | None
    request: EngineCoreRequest

    def child(self, index: int, request_id: str) -> EngineCoreRequest:
        """Engine request for completion `index` of n (see SamplingParams.child)."""
        params = self.request.sampling_params
        return msgspec.structs.replace(self.request, request_id=request_id,
                                       sampling_params=params.child(index))


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, ready: EngineReady, max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_logprobs = max_logprobs
        self.max_text_chars = self.max_model_len * tokenizer.max_token_chars * TEXT_SLACK

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text. Raises ValidationError, before tokenizing, for a text
        too long for any tokenization of it to fit max_model_len."""
        if len(text) > self.max_text_chars:
            raise ValidationError(
                f"the prompt has {len(text)} characters, far more than max_model_len "
                f"({self.max_model_len}) tokens can hold; shorten it", "prompt")
        return self.tokenizer.encode(text, add_special_tokens)

    def prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValidationError("prompt_token_ids must be a list of integers",
                                      "prompt_token_ids")
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None, list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.encode(prompt["prompt"])
        raise ValidationError("a prompt must be a string, {'prompt': str} or "
                              f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                              "prompt")

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A conversation rendered with the chat template (the model's, or `chat_template`:
        a path or the template text), as {"prompt", "prompt_token_ids"}.

        Raises ValidationError for kwargs that would replace the engine's own and for
        messages the template refuses (ChatTemplateError)."""
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValidationError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                                  "the server sets them", "chat_template_kwargs")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=read_chat_template(chat_template), tools=tools, **kwargs)
        assert isinstance(text, str)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0) -> ProcessedRequest:
        """Raises ValidationError for an empty or too long prompt, out-of-vocab ids, a
        priority outside int64, or params the engine cannot serve (see `_check_params`)."""
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams, got "
                                  f"{type(params).__name__}", "sampling_params")
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not INT64_MIN <= priority <= INT64_MAX:
            raise ValidationError(f"priority must be an integer in [-2^63, 2^63), got "
                                  f"{priority!r}", "priority")
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
        return ProcessedRequest(text, request)

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
            words: dict[tuple[int, ...], None] = {}   # ordered and without repeats
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(variant, add_special_tokens=False)
                    if ids:
                        words[tuple(ids)] = None
            params = msgspec.structs.replace(params,
                                             bad_words_token_ids=[list(w) for w in words])
        return params
