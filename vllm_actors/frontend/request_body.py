"""Request bodies: read within a size limit (413), decoded as JSON within a nesting bound
(400), and converted into an OpenAI request Struct with `null` meaning "the default"."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from vllm_actors.frontend.openai_schema import APIError

MAX_JSON_DEPTH = 64   # deeper request bodies are refused (no OpenAI field nests near this)
BODY_TIMEOUT_S = 60.0  # a body still arriving after this is refused (408)


async def read_body(raw: Request, limit: int) -> bytes:
    """The request body of a JSON endpoint. Raises APIError 415 for a content type other
    than JSON or a compressed body (a page on another origin may only send "simple" text/plain or form bodies
    without asking first; absent means JSON, as FastAPI reads it), 413 once it is larger than
    `limit` bytes, 408 when it takes longer than BODY_TIMEOUT_S to arrive, and 400 (logged,
    never answered) when the client leaves before sending it all."""
    _check_content_type(raw.headers.get("content-type"))
    encoding = raw.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding[:100]!r} is not supported: send the "
                            "body uncompressed", code="unsupported_media_type")
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body ({int(declared)} bytes) is larger than this "
                            f"server accepts ({limit} bytes; --max-request-body-size)",
                       code="request_too_large")
    try:
        return await asyncio.wait_for(_read_within(raw, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise APIError(400, "the client disconnected before sending the whole body",
                       code="client_disconnected") from None


async def _read_within(raw: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than this server accepts "
                                f"({limit} bytes; --max-request-body-size)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_content_type(value: str | None) -> None:
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise APIError(415, f"Content-Type must be application/json, got {value[:100]!r}",
                       code="unsupported_media_type")


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
