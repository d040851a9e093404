"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation to token ids, ids to
text. Both are bounded: at most TOKENIZE_CONTEXTS x max_model_len tokens either way (a
longer text is refused after its first pieces, see InputProcessor.encode). GET
/tokenizer_info (behind --enable-tokenizer-info-endpoint, as in vLLM): what a client needs
to tokenize as the server does, through those two."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.frontend.openai_schema import (APIError, DetokenizeRequest, TokenizeRequest,
                                                chat_messages)
from vllm_actors.frontend.request_body import decode_request, read_body
from vllm_actors.frontend.serving import JSONBody, ServerState

TOKENIZE_CONTEXTS = 4


def _max_tokens(state: ServerState) -> int:
    return TOKENIZE_CONTEXTS * state.engine.ready.max_model_len


def tokenize_body(state: ServerState, body: bytes) -> dict[str, Any]:
    """The /tokenize answer (in the preparation pool). `add_special_tokens` defaults as in
    vLLM: true for a prompt, false for messages (their template adds what it needs)."""
    req = decode_request(body, TokenizeRequest)
    state.check_model(req.model, None)
    processor, ready = state.engine.input_processor, state.engine.ready
    if req.messages is not None:
        state.check_chat_template(req.chat_template)
        ids = processor.chat_prompt(chat_messages(req), req.chat_template,
                                    req.add_generation_prompt, req.tools,
                                    req.chat_template_kwargs,
                                    req.add_special_tokens is True)["prompt_token_ids"]
    elif req.prompt is not None:
        ids = processor.encode(req.prompt, req.add_special_tokens is not False,
                               _max_tokens(state))
    else:
        raise APIError(400, "give `prompt` (a string) or `messages`", "prompt")
    result: dict[str, Any] = {"count": len(ids), "max_model_len": ready.max_model_len,
                              "tokens": ids}
    if req.return_token_strs:
        result["token_strs"] = state.engine.tokenizer.convert_ids_to_tokens(ids)
    return result


def detokenize_body(state: ServerState, body: bytes) -> dict[str, Any]:
    req = decode_request(body, DetokenizeRequest)
    state.check_model(req.model, None)
    limit = _max_tokens(state)
    if len(req.tokens) > limit:
        raise APIError(400, f"tokens may hold at most {limit} ids ({TOKENIZE_CONTEXTS} x "
                            f"max_model_len), got {len(req.tokens)}", "tokens")
    vocab = state.engine.ready.vocab_size
    if not all(0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": state.engine.tokenizer.decode(req.tokens)}


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """vLLM's /tokenizer_info fields that this tokenizer has: its special tokens (null where
    the model has none), whether encoding adds BOS / EOS, the context length and the chat
    template the server renders with. The class is the one Hugging Face wraps around the
    `tokenizers` backend we run."""
    tok = state.engine.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
            "eos_token": tok.eos_token, "pad_token": None, "unk_token": None,
            **tok.extra_special_tokens, "add_bos_token": tok.add_bos_token,
            "add_eos_token": tok.add_eos_token,
            "model_max_length": state.engine.ready.max_model_len,
            "chat_template": tok.chat_template}


async def tokenize(state: ServerState, raw: Request) -> Response:
    body = await read_body(raw, state.config.max_request_body_size)
    return JSONBody(await state.prepare(tokenize_body, state, body, body=body))


async def detokenize(state: ServerState, raw: Request) -> Response:
    body = await read_body(raw, state.config.max_request_body_size)
    return JSONBody(await state.prepare(detokenize_body, state, body, body=body))
