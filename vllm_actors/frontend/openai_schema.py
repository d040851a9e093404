"""OpenAI request bodies (msgspec Structs), their checks, their SamplingParams, and the
OpenAI logprobs shapes.

Fields the engine does not implement yet are refused with a 400 naming the field when a
request sets them to anything but their neutral value, never silently ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.errors import ValidationError
from vllm_actors.frontend.input_processor import joined_text
from vllm_actors.sampling_params import (RequestOutputKind, SamplingParams,
                                         StructuredOutputsParams)


MAX_ERROR_CHARS = 1000


def _cut(message: str) -> str:
    """A message that quotes the client's input, kept to `MAX_ERROR_CHARS`: its head and its
    tail (where the hint usually is), so a huge field is not sent back and logged whole."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    cut = len(message) - MAX_ERROR_CHARS + 40
    return f"{message[:760]} ... ({cut} characters cut) ... {message[-200:]}"


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}};
    a message longer than `MAX_ERROR_CHARS` is cut in its middle."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        message = _cut(message)
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
    min_p: float | None = None
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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None   # completions: True, chat: False (vLLM's)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = None
    # vLLM fields this server does not implement: refused unless neutral (refuse_unsupported)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


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
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False
    continue_final_message: bool = False
    include_reasoning: bool = True
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: Any = None
    functions: Any = None        # OpenAI's deprecated forms of tools / tool_choice
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: Any
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    prompt_embeds: Any = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a `prompt` or chat `messages` (rendered as chat requests are)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # prompt: True, messages: False (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")


_NOT_YET = "is not supported yet"
# Fields (vLLM's and OpenAI's) this server cannot honour: field -> (neutral values, why).
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "suffix is not supported yet by this server"),
    "use_beam_search": ((False,), "beam search is not implemented by this server"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search only, which this "
                               "server does not implement"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported; "
                                           "use structured_outputs.disable_any_whitespace"),
    "structural_tag": ((None,), "structural tags are not supported; use a JSON schema or "
                                "a grammar"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "kv_transfer_params": ((None, {}), "KV transfer (disaggregated serving) is not "
                                       "supported"),
    "vllm_xargs": ((None, {}), "this server has no extension that reads vllm_xargs"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "functions": ((None, []), "functions is not supported; send the same definitions "
                              "as tools"),
    "function_call": ((None,), "function_call is not supported; use tool_choice"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "audio": ((None,), "audio output is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
GUIDED_BACKENDS = (None, "auto", "guidance", "llguidance", "xgrammar")
MAX_REQUEST_ID_CHARS = 256


def refuse_unsupported(req: _GenerationRequest) -> None:
    """Fields whose non-neutral values the engine cannot honour: 400 naming the field (the
    module doc). Unknown fields are ignored, as vLLM ignores them."""
    for name, (neutral, why) in _REFUSED.items():
        if getattr(req, name, None) not in neutral:
            raise APIError(400, why, name)
    if req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise APIError(400, f"guided_decoding_backend {req.guided_decoding_backend!r} is not "
                            "available; this server's structured outputs run on llguidance "
                            "(auto, guidance or xgrammar are accepted)",
                       "guided_decoding_backend")
    if req.request_id is not None and not (
            0 < len(req.request_id) <= MAX_REQUEST_ID_CHARS and req.request_id.isprintable()):
        raise APIError(400, f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable "
                            "characters", "request_id")
    if isinstance(req, ChatCompletionRequest) and req.continue_final_message and \
            req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                            "true (set add_generation_prompt to false)", "continue_final_message")
    _refuse_stream_mismatch(req)


def _refuse_stream_mismatch(req: _GenerationRequest) -> None:
    """vLLM's checks of fields that only go with (or without) streaming."""
    opts = req.stream_options
    if opts is not None and (opts.include_usage or opts.continuous_usage_stats) and \
            not req.stream:
        raise APIError(400, "stream_options can only be given with stream=true",
                       "stream_options")
    if req.stream and req.prompt_logprobs is not None and req.prompt_logprobs != 0:
        raise APIError(400, "prompt_logprobs are not available when stream=true",
                       "prompt_logprobs")


def structured_outputs_of(req: _GenerationRequest
                          ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint, from `response_format`, vLLM's `structured_outputs`
    or the older `guided_*` fields, and the field it came from (to name in a 400 when the
    grammar is refused later, see `ServerState.validate`). Raises APIError 400 for a
    malformed one or for more than one constraint."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format json_schema needs a json_schema object "
                                    "with a `schema` object", "response_format")
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            raise APIError(400, "response_format.type must be text, json_object or "
                                f"json_schema, got {kind!r}", "response_format")
    if req.structured_outputs:
        if req.structured_outputs.get("structural_tag") is not None:
            raise APIError(400, _REFUSED["structural_tag"][1], "structured_outputs")
        found.append(("structured_outputs", req.structured_outputs))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, "guided_" + name)
        if value is not None:
            found.append(("guided_" + name, {name: value}))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, "only one output constraint may be given; got "
                            f"{', '.join(name for name, _ in found)}", found[1][0])
    name, fields = found[0]
    try:
        params = msgspec.convert(fields, StructuredOutputsParams)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid {name}: {e}", name) from None
    except ValidationError as e:
        raise APIError(400, f"invalid {name}: {e}", name) from None
    return params, name


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier assistant tool call as chat templates expect it: arguments as a dict (the
    API carries them as JSON text), as transformers' and vLLM's renderers pass them."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = msgspec.json.decode(function["arguments"])
    except msgspec.DecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    """Messages as template-ready dicts; text content parts are joined into one string."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                f"got {m.role!r}", "messages")
        try:
            content = joined_text(m.content, i)
        except ValidationError as e:
            raise APIError(400, str(e), "messages") from None
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.tool_calls is not None:
            for j, call in enumerate(m.tool_calls):
                function = call.get("function")
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}] needs a `function` "
                                        "with a `name`", "messages")
            message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
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


def max_tokens_for(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                   prompt_param: str) -> int:
    """The request's max_tokens, defaulting to what the context has left; `prompt_param`
    names the prompt's field (messages or prompt) in the error.

    Raises APIError 400 naming both numbers when prompt + max_tokens exceed max_model_len.
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, "
                            f"but the prompt has {num_prompt_tokens} tokens, which leaves no "
                            "room for a completion. Please shorten the prompt.", prompt_param)
    if requested is None:
        return room
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, you requested {num_prompt_tokens + requested} tokens "
                            f"({num_prompt_tokens} in the prompt, {requested} in the "
                            "completion). Please reduce the prompt or max_tokens.",
                       "max_tokens")
    return requested


_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(req: _GenerationRequest, max_tokens: int, defaults: dict[str, Any],
                    stream: bool, structured: StructuredOutputsParams | None = None
                    ) -> SamplingParams:
    """The request's SamplingParams; fields it omits come from the generation-config
    defaults. Raises APIError 400 naming the field for an invalid value."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    chosen = {name: getattr(req, name) if getattr(req, name) is not None else defaults[name]
              for name in _DEFAULTED if getattr(req, name) is not None or name in defaults}
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:      # 0 without logprobs passes (vLLM)
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    else:
        logprobs = req.logprobs
    prompt_logprobs, max_tokens = _completion_echo(req, max_tokens)
    try:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
    try:
        return SamplingParams(
            n=req.n, best_of=req.best_of, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0, logit_bias=bias or None,
            allowed_token_ids=req.allowed_token_ids, bad_words=list(req.bad_words or []),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, truncate_prompt_tokens=req.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            **chosen)
    except ValidationError as e:
        raise APIError(400, str(e), e.param) from None


def _completion_echo(req: _GenerationRequest, max_tokens: int) -> tuple[int | None, int]:
    """(prompt_logprobs, max_tokens) as vLLM's CompletionRequest sets them: `echo` with
    `logprobs` asks for prompt logprobs (unless the request set prompt_logprobs itself), and
    `echo` with max_tokens 0 generates one token, which the response drops. Raises APIError
    400 for max_tokens 0 without echo."""
    prompt_logprobs = req.prompt_logprobs
    if not isinstance(req, CompletionRequest):
        if prompt_logprobs is None and isinstance(req, ChatCompletionRequest) and req.echo:
            prompt_logprobs = req.top_logprobs   # as vLLM's chat echo
        return prompt_logprobs, max_tokens
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    if max_tokens == 0:
        if not req.echo:
            raise APIError(400, "max_tokens must be at least 1, got 0 (max_tokens 0 is only "
                                "allowed with echo=true, which returns the prompt alone)",
                           "max_tokens")
        max_tokens = 1
    return prompt_logprobs, max_tokens


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(positions: list[dict[int, Any]] | None, token_ids: list[int],
                  k: int, as_token_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]};
    `as_token_ids` (vLLM's return_tokens_as_token_ids) names tokens "token_id:<id>"."""
    if positions is None:
        return None

    def entry(token_id: int, lp: Any) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": f"token_id:{token_id}" if as_token_ids else lp.decoded_token,
                "logprob": lp.logprob, "bytes": _token_bytes(text)}

    content = []
    for token_id, position in zip(token_ids, positions):
        top = sorted(position.items(), key=lambda item: item[1].rank)[:k]
        content.append({**entry(token_id, position[token_id]),
                        "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def prompt_logprobs_json(positions: list[dict[int, Any] | None] | None
                         ) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in p.items()} for p in positions]
