"""The Responses API request (POST /v1/responses) and its translation into a chat request,
so the chat path does the rest (template, tool planning, structured outputs, parsers).

- `input`: a string or a list of items: messages (content a string or input_text /
  output_text parts), `function_call` items (an earlier tool call) and
  `function_call_output` items (its result). `reasoning` items are dropped, as templates drop
  earlier turns' reasoning. Output items are valid input, which is how
  `previous_response_id` replays a stored conversation.
- `instructions`: a system message in front (not carried over by previous_response_id);
  `tools`: function tools in the flat shape; `text.format`: text | json_object | json_schema.
- `truncation: "auto"` keeps the prompt's last tokens that leave room for the answer;
  `reasoning.effort` reaches the template as `reasoning_effort`; other `include` values
  produce nothing.

What this server cannot honour (`background`, `conversation`, `prompt`, `max_tool_calls`,
`text.verbosity`, built-in tools) is refused with a 400 naming it; unknown fields are
ignored, and vLLM's sampling extras (`SAMPLING_EXTRAS`) apply, as on the chat endpoint.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.frontend.openai_schema import APIError, ChatCompletionRequest, ChatMessage

OUTPUT_LOGPROBS = "message.output_text.logprobs"
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# vLLM's sampling extras the chat request takes as they are (and checks there)
SAMPLING_EXTRAS = ("min_p", "stop", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                   "bad_words", "allowed_token_ids", "skip_special_tokens",
                   "include_stop_str_in_output", "structured_outputs", "chat_template_kwargs")
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # Refused unless neutral (see refuse_unsupported).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    # vLLM's extras, as on the chat endpoint.
    top_k: int | None = None
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def stored(self) -> bool:
        """store defaults to true, as OpenAI's does."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])


def _refuse(field: str, why: str) -> APIError:
    return APIError(400, f"{field} {why}", field)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the field for what this server cannot honour (see the module doc)."""
    if req.background:
        raise _refuse("background", "mode is not supported by this server")
    for field in ("conversation", "prompt", "max_tool_calls"):
        if getattr(req, field) is not None:
            raise _refuse(field, "is not supported by this server")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _refuse("reasoning", "effort must be a string")
    if req.truncation not in (None, "disabled", "auto"):
        raise _refuse("truncation", f'{req.truncation!r} is not "auto" or "disabled"')
    if req.text and req.text.get("verbosity") is not None:
        raise APIError(400, "text.verbosity is not supported by this server", "text")
    if req.top_logprobs and not req.wants_logprobs:
        raise _refuse("top_logprobs", f"needs include: [{OUTPUT_LOGPROBS!r}]")
    _check_metadata(req.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys of 64 and values of 512 characters."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise _refuse("metadata", f"may have at most {MAX_METADATA_KEYS} keys")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise _refuse("metadata", f"keys may have at most {MAX_METADATA_KEY_CHARS} and "
                                      f"values {MAX_METADATA_VALUE_CHARS} characters")


def _text_of(content: Any, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A string, or text parts joined with newlines (as the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: only text parts ({', '.join(kinds)}) are supported, "
                                f"got type {kind!r}", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _required_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise APIError(400, f"{where} needs a string `{key}`", "input")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got "
                            f"{role!r}", "input")
    return {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    return {"id": _required_str(item, "call_id", where), "type": "function",
            "function": {"name": _required_str(item, "name", where),
                         "arguments": _required_str(item, "arguments", where)}}


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat message dicts. A function_call joins the assistant message just
    before it (the model wrote them as one turn), else starts one without content."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _required_str(item, "call_id", where),
                        "content": _text_of(item.get("output"), f"{where}.output",
                                            ("input_text", "output_text"))})
        elif kind != "reasoning":
            raise APIError(400, f"{where}: item type {kind!r} is not supported (only message, "
                                "function_call, function_call_output and reasoning)", "input")
    return out


def input_items(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": input}] \
        if isinstance(input, str) else list(input)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools -> the chat shape; built-in tools are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, got type "
                                f"{kind!r} (built-in tools are not available on this server)",
                           "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., "
                                "\"parameters\": {...}}", "tools")
        function = {"name": name, "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                            f'"function", "name": ...}}, got type {choice.get("type")!r}',
                       "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format json_schema needs a `schema` object", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response",
                                                       "schema": fmt["schema"]}}
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got "
                        f"{kind!r}", "text")


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """The request's chat_template_kwargs, with `reasoning.effort` as `reasoning_effort`
    (what vLLM hands templates that read it, gpt-oss's)."""
    effort = (req.reasoning or {}).get("effort")
    if effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": effort, **(req.chat_template_kwargs or {})}


def _truncation(req: ResponsesRequest, max_model_len: int | None) -> int | None:
    """`truncation: "auto"`: the prompt's last tokens that leave room for the answer
    (max_output_tokens, else half the context)."""
    if req.truncation != "auto" or max_model_len is None:
        return None
    return max(1, max_model_len - (req.max_output_tokens or max_model_len // 2))


def chat_request(req: ResponsesRequest, items: list[dict[str, Any]],
                 max_model_len: int | None = None) -> ChatCompletionRequest:
    """The chat request that generates this response: `items` is the whole conversation
    (a stored one's items and output, then this request's input); instructions go first."""
    messages = input_messages(items)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    logprobs = req.wants_logprobs
    return ChatCompletionRequest(
        model=req.model, messages=msgspec.convert(messages, list[ChatMessage]),
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, seed=req.seed, stream=bool(req.stream),
        user=req.user, priority=req.priority, cache_salt=req.cache_salt,
        logit_bias=req.logit_bias, response_format=_response_format(req.text),
        **{name: getattr(req, name) for name in SAMPLING_EXTRAS
           if name != "chat_template_kwargs"}, chat_template_kwargs=_template_kwargs(req),
        tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls is not False, logprobs=logprobs,
        top_logprobs=req.top_logprobs if logprobs else None,
        truncate_prompt_tokens=_truncation(req, max_model_len))
