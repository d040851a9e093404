"""vllm_actors: vLLM's V1 serving engine in Python, without PyTorch."""

from vllm_actors.config import EngineArgs
from vllm_actors.errors import EngineDeadError, ValidationError
from vllm_actors.frontend.async_llm import AsyncLLM
from vllm_actors.frontend.input_processor import TextPrompt, TokensPrompt
from vllm_actors.frontend.llm import LLM
from vllm_actors.loaders.tokenizer import Tokenizer, get_tokenizer
from vllm_actors.lora_request import LoRARequest
from vllm_actors.outputs import (ClassificationOutput, CompletionOutput, EmbeddingOutput,
                                 Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput,
                                 ScoringOutput)
from vllm_actors.pooling_params import PoolingParams
from vllm_actors.sampling_params import (RequestOutputKind, SamplingParams,
                                         StructuredOutputsParams)
from vllm_actors.version import __version__

AsyncEngineArgs = EngineArgs   # vLLM's name for AsyncLLM.from_engine_args's arguments


__all__ = ["LLM", "AsyncLLM", "AsyncEngineArgs", "CompletionOutput", "EngineArgs", "Logprob",
           "TextPrompt", "TokensPrompt", "EngineDeadError", "LoRARequest",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
           "Tokenizer", "PoolingParams", "PoolingRequestOutput", "PoolingOutput",
           "EmbeddingOutput", "ClassificationOutput", "ScoringOutput",
           "ValidationError", "get_tokenizer", "__version__"]
