"""OpenAI request bodies (msgspec Structs), their checks, and their SamplingParams.

Fields the engine does not implement yet are refused with a 400 naming the field when a
request sets them to anything but their neutral value, never silently ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.errors import ValidationError
from vllm_actors.sampling_params import RequestOutputKind, SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = \
            status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (with vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: Any
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def decode_request(body: bytes, cls: type) -> Any:
    """Parse a JSON body. Raises APIError 400 naming the field for malformed input."""
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        text = str(e)
        if "at `$." in text:
            param = text.rpartition("at `$.")[2].rstrip("`").split("[")[0].split(".")[0]
        elif "missing required field `" in text:
            param = text.rpartition("missing required field `")[2].rstrip("`")
        else:
            param = None
        raise APIError(400, f"invalid request: {text}", param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


_NOT_YET = "is not supported yet"


def refuse_unsupported(req: _GenerationRequest) -> None:
    """Fields whose non-neutral values the engine cannot honour yet: 400 naming the field."""
    checks = [("top_p", req.top_p not in (None, 1.0)),
              ("top_k", req.top_k not in (None, 0, -1)),
              ("presence_penalty", req.presence_penalty not in (None, 0.0)),
              ("frequency_penalty", req.frequency_penalty not in (None, 0.0)),
              ("repetition_penalty", req.repetition_penalty not in (None, 1.0)),
              ("logit_bias", bool(req.logit_bias)),
              ("best_of", req.best_of not in (None, req.n))]
    if isinstance(req, ChatCompletionRequest):
        checks += [("logprobs", req.logprobs), ("top_logprobs", req.top_logprobs is not None),
                   ("tools", bool(req.tools) and req.tool_choice != "none"),
                   ("response_format", req.response_format not in (None, {"type": "text"}))]
    else:
        checks += [("logprobs", req.logprobs is not None),
                   ("suffix", bool(req.suffix))]
    for field, refused in checks:
        if refused:
            raise APIError(400, f"{field} {_NOT_YET} by this server", field)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as template-ready dicts; text content parts are joined into one string."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                f"got {m.role!r}", "messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are "
                                        f"supported, got type {part.get('type')!r}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    if not out:
        raise APIError(400, "messages must not be empty", "messages")
    return out


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt`: a string, list of strings, token ids or list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
               for p in prompt):
            return [list(p) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                        "list of token-id lists (non-empty)", "prompt")


def max_tokens_for(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens, defaulting to what the context has left.

    Raises APIError 400 naming both numbers when prompt + max_tokens exceed max_model_len.
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, "
                            f"but the prompt has {num_prompt_tokens} tokens, which leaves no "
                            "room for a completion. Please shorten the prompt.", "messages")
    if requested is None:
        return room
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, you requested {num_prompt_tokens + requested} tokens "
                            f"({num_prompt_tokens} in the prompt, {requested} in the "
                            "completion). Please reduce the prompt or max_tokens.",
                       "max_tokens")
    return requested


def sampling_params(req: _GenerationRequest, max_tokens: int, defaults: dict[str, Any],
                    stream: bool) -> SamplingParams:
    """Raises APIError 400 naming the field for an invalid value."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    temperature = req.temperature if req.temperature is not None else \
        float(defaults.get("temperature", 1.0))
    try:
        return SamplingParams(
            n=req.n, temperature=temperature, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except ValidationError as e:
        raise APIError(400, str(e), e.param) from None
