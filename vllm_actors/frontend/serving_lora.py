"""LoRA adapters over HTTP, as vLLM's server has them: a request names an adapter by
`model`, /v1/models lists the adapters (`parent`: the base model), and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING set, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
load and unload them while the server runs."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from vllm_actors.config import LoRAModulePath
from vllm_actors.errors import ValidationError
from vllm_actors.frontend.openai_schema import APIError
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import ServerState
from vllm_actors.lora_request import LoRARequest

MAX_LORA_BODY = 1 << 16


def runtime_updates_allowed() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it ("1" or "true")."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1",
                                                                                     "true")


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None


def _next_id(state: ServerState) -> int:
    """A LoRA id never used before on this server: an unloaded adapter's requests may still
    be running with its id."""
    state.last_lora_id = max([state.last_lora_id, *(lora.lora_int_id for lora in
                                                    state.engine.loras.values())]) + 1
    return state.last_lora_id


async def add_module(state: ServerState, module: LoRAModulePath) -> LoRARequest:
    """Load a --lora-modules entry (or a runtime load). Raises ValidationError."""
    lora = LoRARequest(module.name, _next_id(state), module.path,
                       module.base_model_name or state.model_name)
    await state.engine.add_lora(lora)
    return lora


async def load_lora_adapter(state: ServerState, raw: Request) -> Response:
    """200 with vLLM's success text; 400 for a name already loaded (unless load_inplace), a
    name that is the base model's, or an adapter the workers refuse; 404 for a path that
    does not exist."""
    req = decode_request(await read_body(raw, MAX_LORA_BODY), LoadLoRAAdapterRequest)
    if not req.lora_name or not req.lora_path:
        raise APIError(400, "both 'lora_name' and 'lora_path' must be provided", "lora_name")
    if req.lora_name == state.model_name:
        raise APIError(400, f"'{req.lora_name}' is the base model's name", "lora_name")
    held = state.engine.loras.get(req.lora_name)
    if held is not None and not req.load_inplace:
        raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.",
                       "lora_name")
    if not os.path.exists(req.lora_path):
        raise APIError(404, f"LoRA adapter path {req.lora_path!r} does not exist",
                       "lora_path", "not_found", "not_found_error")
    if held is not None:
        await state.engine.remove_lora(held.lora_int_id)
    try:
        await add_module(state, LoRAModulePath(req.lora_name, req.lora_path))
    except ValidationError as e:
        raise APIError(400, str(e), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(state: ServerState, raw: Request) -> Response:
    """200 with vLLM's success text; 404 for a name that is not loaded. Requests already
    running with the adapter finish with it."""
    req = decode_request(await read_body(raw, MAX_LORA_BODY), UnloadLoRAAdapterRequest)
    held = state.engine.loras.get(req.lora_name)
    if held is None:
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                       "lora_name", "not_found", "not_found_error")
    await state.engine.remove_lora(held.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries for the loaded adapters."""
    return [{"id": lora.lora_name, "object": "model", "created": int(time.time()),
             "owned_by": "vllm-actors", "root": lora.lora_path,
             "parent": lora.base_model_name or state.model_name,
             "max_model_len": state.engine.ready.max_model_len, "permission": []}
            for lora in state.engine.loras.values()]
