"""InputProcessor: a user's prompt + SamplingParams -> a validated EngineCoreRequest.

A request is processed once (tokenized, checked, bad words tokenized, grammar checked) and the
result, a `ProcessedRequest`, is what travels: the server processes it off the event loop and
hands it to `AsyncLLM` as is, and the n completions of one request are derived from it
without processing again. `chat_prompt` is the one place a conversation is rendered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Required, TypedDict

import msgspec

from vllm_actors.errors import ValidationError
from vllm_actors.grammar import check_grammar
from vllm_actors.loaders.chat_template import read_chat_template
from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.lora_request import LoRARequest
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.protocol.engine import EngineCoreRequest, EngineReady
from vllm_actors.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict[str, Any]


class TextPrompt(TypedDict, total=False):
    """vLLM's dict form of a text prompt (a plain dict of these keys works the same)."""

    prompt: Required[str]
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's dict form of a prompt given as token ids (`prompt`: its text, if known)."""

    prompt_token_ids: Required[list[int]]
    prompt: str
    cache_salt: str

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A text longer than max_model_len x the longest token x this cannot fit the context even if
# normalization merged every few characters into one: it is refused without tokenizing it.
TEXT_SLACK = 4
# A text longer than this many characters per token of its budget is counted in pieces
# first, so that one far over the context is refused after a piece rather than all of it;
# a cut before a word changes the count by at most a few tokens.
PIECE_CHARS_PER_TOKEN = 4
PIECE_MARGIN_TOKENS = 4
MAX_CACHE_SALT_CHARS = 1024
# what a pooling request carries in place of sampling (it never samples)
POOLING_SAMPLING = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
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

    def engine_request(self, request_id: str) -> EngineCoreRequest:
        """The one engine request for all n completions, under `request_id`: the core runs
        them as `child_request_ids` sharing these params (see EngineCoreRequest.n)."""
        return msgspec.structs.replace(self.request, request_id=request_id,
                                       n=self.request.sampling_params.n)


class InputProcessor:
    """Args: the tokenizer, the core's READY facts, --max-logprobs, and the core's
    --scheduling-policy (a priority other than 0 needs "priority", as in vLLM)."""

    def __init__(self, tokenizer: Tokenizer, ready: EngineReady, max_logprobs: int = 20,
                 scheduling_policy: str = "fcfs") -> None:
        self.tokenizer = tokenizer
        self.ready = ready
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_logprobs = max_logprobs
        self.scheduling_policy = scheduling_policy
        self.max_text_chars = self.max_model_len * tokenizer.max_token_chars * TEXT_SLACK

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: int | None = None, param: str = "prompt") -> list[int]:
        """Token ids of a prompt text. Raises ValidationError naming `param`, before
        tokenizing all of it, for a text too long for any tokenization of it to fit
        max_model_len, or (with `max_tokens`) one whose first pieces already hold more
        than `max_tokens` tokens."""
        if len(text) > self.max_text_chars:
            raise ValidationError(
                f"{self._context()} However, the {param} {_has(param)} {len(text)} "
                "characters, far more than that can hold; shorten it", param)
        if max_tokens is not None and len(text) > max_tokens * PIECE_CHARS_PER_TOKEN:
            self._check_token_budget(text, max_tokens, param)
        return self.tokenizer.encode(text, add_special_tokens)

    def _context(self) -> str:
        """How vLLM (and OpenAI) open a too-long error; clients such as litellm map an error
        to a context-window one by these words."""
        return (f"This model's maximum context length is {self.max_model_len} tokens "
                "(max_model_len).")

    def _check_token_budget(self, text: str, max_tokens: int, param: str) -> None:
        """Count a long text's tokens piece by piece (cut before a word) and refuse it as
        soon as the pieces counted hold more than `max_tokens`, with PIECE_MARGIN_TOKENS of
        slack per cut: a text far over the context costs one piece, not all of it."""
        size = max_tokens * PIECE_CHARS_PER_TOKEN
        counted = start = pieces = 0
        while start < len(text):
            end = _piece_end(text, start, size)
            counted += len(self.tokenizer.encode_pieces([text[start:end]])[0])
            pieces += 1
            if counted > max_tokens + pieces * PIECE_MARGIN_TOKENS:
                raise ValidationError(
                    f"{self._context()} However, the {param} {_has(param)} more than "
                    f"{max_tokens} tokens ({counted} in its first {end} of {len(text)} "
                    "characters); shorten it", param)
            start = end

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` ids (vLLM's truncate_prompt_tokens; -1: max_model_len; None: all).
        Raises ValidationError when `keep` is larger than max_model_len."""
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise ValidationError(f"truncate_prompt_tokens ({keep}) is larger than "
                                  f"max_model_len ({self.max_model_len})",
                                  "truncate_prompt_tokens")
        return token_ids[-keep:]

    def prompt_token_ids(self, prompt: PromptType, add_special_tokens: bool = True,
                         truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, {"prompt": str} or
        {"prompt_token_ids": [...]}, truncated to the last `truncate` ids when given (a
        text is then not held to the context length before tokenizing)."""
        budget = self.max_model_len - 1 if truncate is None else None
        if isinstance(prompt, str):
            return prompt, self.truncate(self.encode(prompt, add_special_tokens, budget),
                                         truncate)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValidationError("prompt_token_ids must be a list of integers",
                                      "prompt_token_ids")
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None, self.truncate(list(ids), truncate)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.truncate(
                self.encode(prompt["prompt"], add_special_tokens, budget), truncate)
        raise ValidationError("a prompt must be a string, {'prompt': str} or "
                              f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                              "prompt")

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    add_special_tokens: bool = False, truncate: int | None = None,
                    continue_final_message: bool = False,
                    documents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A conversation rendered with the chat template (the model's, or `chat_template`:
        a path or the template text), as {"prompt", "prompt_token_ids"}; the ids are cut to
        the last `truncate` when given. `continue_final_message` leaves the last message
        open (the rendering ends where its content ends), as transformers does; `documents`
        reach the template for retrieval-augmented templates.

        Raises ValidationError for kwargs that would replace the engine's own and for
        messages the template refuses (ChatTemplateError)."""
        messages = [_text_content(m, i) for i, m in enumerate(messages)]
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValidationError(f"chat_template_kwargs may not set {', '.join(reserved)}: "
                                  "the server sets them", "chat_template_kwargs")
        if documents is not None:
            kwargs["documents"] = documents
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=read_chat_template(chat_template), tools=tools, **kwargs)
        assert isinstance(text, str)
        if continue_final_message:
            text = _open_final_message(text, messages)
        budget = self.max_model_len - 1 if truncate is None else None
        ids = self.encode(text, add_special_tokens, budget, "messages")
        return {"prompt": text, "prompt_token_ids": self.truncate(ids, truncate)}

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0, lora_request: LoRARequest | None = None
                ) -> ProcessedRequest:
        """`prompt` may carry a `cache_salt` (vLLM's prompt dicts do): prefix-cache hits then
        happen only between requests with the same salt. Raises ValidationError for an
        empty or too long prompt, out-of-vocab ids, a bad priority or salt, or params the
        engine cannot serve (see `_check_params`)."""
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams, got "
                                  f"{type(params).__name__}", "sampling_params")
        if self.ready.runner == "pooling":
            raise ValidationError("this is a pooling model (--runner pooling): it serves "
                                  "embeddings, classification and scores, not generation",
                                  "model")
        self._check_priority(priority)
        salt = _cache_salt(prompt)
        text, token_ids = self.prompt_token_ids(prompt, truncate=params.truncate_prompt_tokens)
        if not token_ids:
            raise ValidationError("the prompt is empty (0 tokens)", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise ValidationError(
                f"{self._context()} However, the prompt has {len(token_ids)} tokens, which "
                "leaves no room for an output token; shorten it", "prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValidationError(f"token id {bad[0]} is out of range for a vocabulary of "
                                  f"{self.vocab_size}", "prompt_token_ids")
        params, grammar = self._check_params(params)
        eos, params = self._eos_and_stop_ids(params)
        request = EngineCoreRequest(request_id, token_ids, params, eos, time.time(), priority,
                                    salt, grammar=grammar, lora_request=lora_request)
        return ProcessedRequest(text, request)

    def _eos_and_stop_ids(self, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The request's EOS ids and params, as vLLM's `update_from_generation_config`
        sets them: the model's EOS ends it as EOS; the other ids that end generation
        (Gemma's <end_of_turn>, generation_config's extras) join `stop_token_ids`, so a
        stop on one names it in `stop_reason`; with ignore_eos neither ends it."""
        if params.ignore_eos:
            return [], params
        primary = self.tokenizer.eos_token_id
        every = self.tokenizer.eos_token_ids
        extras = [t for t in every if t != primary] if primary is not None else []
        if not extras:
            return list(every), params
        stops = list(dict.fromkeys([*params.stop_token_ids, *extras]))
        return [primary], msgspec.structs.replace(params, stop_token_ids=stops)

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                        priority: int = 0, lora_request: LoRARequest | None = None,
                        pair: str | None = None) -> ProcessedRequest:
        """A pooling request (embed, classify, score, encode) for a pooling model: the
        prompt may fill max_model_len, and `params.truncate_prompt_tokens` cuts a longer
        one on the right with its special tokens kept. `pair`: the second text of a
        cross-encoder's pair (`prompt` is then the first text). Raises ValidationError for
        a generative model, a task it does not serve, bad dimensions, or a bad prompt."""
        if not isinstance(params, PoolingParams):
            raise ValidationError("pooling_params must be a PoolingParams, got "
                                  f"{type(params).__name__}", "pooling_params")
        self._check_pooling(params)
        self._check_priority(priority)
        if pair is not None:
            if not isinstance(prompt, str):
                raise ValidationError("a text pair must be two strings", "text_1")
            token_ids, start = self.tokenizer.encode_pair(prompt, pair)
            text: str | None = prompt
            params = msgspec.structs.replace(params, token_type_start=start)
        else:
            text, token_ids = self._pooling_token_ids(prompt, params.truncate_prompt_tokens)
        if not token_ids:
            raise ValidationError("the input is empty (0 tokens)", "input")
        if len(token_ids) > self.max_model_len:
            raise ValidationError(
                f"{self._context()} However, the input has {len(token_ids)} tokens; shorten "
                "it or set truncate_prompt_tokens", "input")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValidationError(f"token id {bad[0]} is out of range for a vocabulary of "
                                  f"{self.vocab_size}", "input")
        request = EngineCoreRequest(request_id, token_ids, POOLING_SAMPLING, [], time.time(),
                                    priority, lora_request=lora_request,
                                    pooling_params=params)
        return ProcessedRequest(text, request)

    def _check_pooling(self, params: PoolingParams) -> None:
        ready = self.ready
        if ready.runner != "pooling":
            raise ValidationError("this model generates text; embeddings, classification "
                                  "and scores need a pooling model (--runner pooling)",
                                  "model")
        if params.task not in ready.pooling_tasks:
            raise ValidationError(f"this model does not serve the {params.task!r} task "
                                  f"(it serves {', '.join(ready.pooling_tasks)}); "
                                  "classification and scores need a "
                                  "*ForSequenceClassification model", "task")
        if params.dimensions is not None:
            if not ready.matryoshka:
                raise ValidationError("this model does not support Matryoshka "
                                      "representation: `dimensions` cannot be set",
                                      "dimensions")
            if params.dimensions > ready.hidden_size:
                raise ValidationError(f"dimensions ({params.dimensions}) is more than the "
                                      f"model's {ready.hidden_size}", "dimensions")

    def _pooling_token_ids(self, prompt: PromptType, keep: int | None
                           ) -> tuple[str | None, list[int]]:
        """(text or None, ids) of a pooling input; a text longer than `keep` tokens is cut
        on the right, its special tokens kept (as a tokenizer's truncation does)."""
        if keep == -1:
            keep = self.max_model_len
        if keep is not None and keep > self.max_model_len:
            raise ValidationError(f"truncate_prompt_tokens ({keep}) is larger than "
                                  f"max_model_len ({self.max_model_len})",
                                  "truncate_prompt_tokens")
        text = prompt if isinstance(prompt, str) else \
            prompt.get("prompt") if isinstance(prompt, dict) and \
            "prompt_token_ids" not in prompt else None
        if not isinstance(text, str):
            return self.prompt_token_ids(prompt, truncate=keep)
        # {"prompt": text, "add_special_tokens": False}: the text's own tokens only (vLLM's
        # embeddings field of that name)
        special = not (isinstance(prompt, dict) and prompt.get("add_special_tokens") is False)
        ids = self.encode(text, special, None if keep is not None else self.max_model_len,
                          "input")
        if keep is None or len(ids) <= keep:
            return text, ids
        return text, _cut_right(ids, self.tokenizer.encode(text, False), keep) if special \
            else ids[:keep]

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not INT64_MIN <= priority <= INT64_MAX:
            raise ValidationError(f"priority must be an integer in [-2^63, 2^63), got "
                                  f"{priority!r}", "priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValidationError(f"priority {priority} needs --scheduling-policy priority "
                                  f"(this engine schedules {self.scheduling_policy})",
                                  "priority")

    def _check_params(self, params: SamplingParams) -> tuple[SamplingParams, str | None]:
        """(params, their checked grammar): token ids within the vocabulary, logprobs
        within --max-logprobs, a grammar llguidance accepts, bad words tokenized (as
        written and with a leading space, as vLLM does)."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(params, name) or ()
            if len(ids) > self.vocab_size:
                raise ValidationError(f"{name} has {len(ids)} ids, more than the vocabulary "
                                      f"({self.vocab_size})", name)
            largest = max(ids, default=-1)
            if largest >= self.vocab_size:
                raise ValidationError(f"token id {largest} (in {name}) is out of range for a "
                                      f"vocabulary of {self.vocab_size}", name)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValidationError(f"{name}={value} is more than the server allows "
                                      f"(--max-logprobs {self.max_logprobs})", name)
        grammar = None
        if params.structured_outputs is not None:
            grammar = check_grammar(params.structured_outputs)
        if params.bad_words and not params.bad_words_token_ids:
            variants = [v for word in params.bad_words for v in (word, " " + word.lstrip())]
            words = dict.fromkeys(tuple(ids) for ids in self.tokenizer.encode_pieces(variants)
                                  if ids)   # ordered and without repeats
            params = msgspec.structs.replace(params,
                                             bad_words_token_ids=[list(w) for w in words])
        return params, grammar


def _cache_salt(prompt: PromptType) -> str | None:
    """The prompt dict's `cache_salt`. Raises ValidationError unless it is None or a
    non-empty string of at most MAX_CACHE_SALT_CHARS characters."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValidationError(f"cache_salt must be a non-empty string of at most "
                              f"{MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    return salt


def _cut_right(with_special: list[int], plain: list[int], keep: int) -> list[int]:
    """`with_special` (the special tokens around `plain`) cut to `keep` ids by dropping the
    end of `plain`, its special tokens kept."""
    n = len(plain)
    head = next((p for p in range(len(with_special) - n + 1)
                 if with_special[p:p + n] == plain), 0)
    tail = len(with_special) - head - n
    if keep <= head + tail:
        return with_special[:keep]
    return with_special[:head] + plain[:keep - head - tail] + \
        with_special[len(with_special) - tail:]


def _piece_end(text: str, start: int, size: int) -> int:
    """Where a piece of about `size` characters from `start` ends: just before a space that
    starts a word when there is one in the piece's last eighth (tokenizers split there)."""
    end = start + size
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", end - size // 8, end)
    return space if space > start and not text[space + 1].isspace() else end


# content parts read as text, and the key holding it (OpenAI's refusal parts, the Responses
# API's input_text / output_text, as vLLM's chat parser reads them)
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal"}


def _has(param: str) -> str:
    """The verb for a field named in a sentence ("the messages have", "the prompt has")."""
    return "have" if param == "messages" else "has"


def joined_text(content: Any, index: int) -> Any:
    """Message `index`'s content with OpenAI's list of text parts (`TEXT_PART_KEYS`) joined by
    newlines (templates expect a string); any other content as it is. Raises
    ValidationError for a part that is not text."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise ValidationError(f"messages[{index}].content: only text parts are "
                                  f"supported, got type {kind!r}", "messages")
        if not isinstance(part.get(key), str):
            raise ValidationError(f"messages[{index}].content: a part of type {kind} needs a "
                                  f"string `{key}`", "messages")
        texts.append(part[key])
    return "\n".join(texts)


def _text_content(message: Any, index: int) -> Any:
    """The message with its content `joined_text` (a message that is no dict as it is)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    return {**message, "content": joined_text(message["content"], index)}


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation cut just after the final message's content (its closing
    tokens dropped), so the model continues that message. Raises ValidationError when the
    template does not render the content as given."""
    final = messages[-1].get("content") if messages else None
    content = final.strip() if isinstance(final, str) else ""
    end = text.rfind(content) if content else -1
    if end < 0:
        raise ValidationError("continue_final_message needs a final message with text "
                              "content that the chat template renders as given", "messages")
    return text[:end + len(content)]
