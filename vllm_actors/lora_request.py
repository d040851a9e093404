"""LoRARequest: which adapter a request runs with, as vLLM names it (`lora_name`,
`lora_int_id`, `lora_path`). A msgspec Struct, so it travels inside requests as is.

This module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import msgspec

from vllm_actors.errors import ValidationError


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """An adapter: `lora_name` (what clients call it), `lora_int_id` (a positive id unique
    among the adapters in use; 0 is the base model), `lora_path` (a PEFT directory or a
    llama.cpp GGUF adapter), `base_model_name` (the model it fine-tunes, for /v1/models).

    Raises ValidationError on a bad id or an empty name or path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValidationError(f"lora_int_id must be a positive integer, got "
                                  f"{self.lora_int_id!r}", "lora_request")
        if not self.lora_name:
            raise ValidationError("lora_name must not be empty", "lora_request")
        if not self.lora_path:
            raise ValidationError(f"LoRA adapter {self.lora_name!r}: lora_path must name a "
                                  "PEFT directory or a GGUF adapter file", "lora_request")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def cache_key(salt: str | None, lora: LoRARequest | None) -> str | None:
    """What seeds a request's prefix-cache hash chain: its cache salt and its adapter, so
    two adapters (or an adapter and the base model) never share KV blocks. The core and the
    data-parallel router's shadow both use it."""
    if lora is None:
        return salt
    return f"{salt or ''}\x00lora\x00{lora.lora_int_id}\x00{lora.lora_name}"
