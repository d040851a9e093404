"""Request bodies: read within a size limit (413), decoded as JSON within a nesting bound
(400), and converted into an OpenAI request Struct with `null` meaning "the default"."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from vllm_actors.frontend.openai_schema import APIError

MAX_JSON_DEPTH = 64   # deeper request bodies are refused (no OpenAI field nests near this)


async def read_body(raw: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it is larger than `limit` bytes."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({int(declared)} bytes) is larger than this "
                            f"server accepts ({limit} bytes; --max-request-body-size)",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than this server accepts "
                                f"({limit} bytes; --max-request-body-size)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json_body(body: bytes) -> dict[str, Any]:
    """A JSON object body. Raises APIError 400 for invalid JSON, a non-object, or nesting
    deeper than MAX_JSON_DEPTH."""
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        value = None
        depth = MAX_JSON_DEPTH + 1
    else:
        depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:
            stack.extend((child, depth + 1) for child in item
                         if isinstance(child, (dict, list)))
    return deepest


def decode_request(body: bytes, cls: type) -> Any:
    """Parse a JSON body into `cls`. A top-level `null` means the field's default (OpenAI
    and vLLM type their optional fields as nullable). Raises APIError 400 naming the field
    for malformed input."""
    value = {k: v for k, v in decode_json_body(body).items() if v is not None}
    if isinstance(value.get("stream_options"), dict):
        value["stream_options"] = {k: v for k, v in value["stream_options"].items()
                                   if v is not None}
    try:
        return msgspec.convert(value, cls)
    except msgspec.ValidationError as e:
        text = str(e)
        if "at `$." in text:
            param = text.rpartition("at `$.")[2].rstrip("`").split("[")[0].split(".")[0]
        elif "missing required field `" in text:
            param = text.rpartition("missing required field `")[2].rstrip("`")
        else:
            param = None
        raise APIError(400, f"invalid request: {text}", param) from None
