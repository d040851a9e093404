"""Does a grammar accept a whole text? llguidance matchers over a byte-level vocabulary (one
token per byte, then EOS), so a check needs no model and no tokenizer files."""

from __future__ import annotations

import llguidance

from vllm_actors.grammar import check_grammar
from vllm_actors.sampling_params import StructuredOutputsParams


class _ByteVocabulary:
    """The duck-typed tokenizer llguidance.LLTokenizer reads: tokens 0..255 are the bytes."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.special_token_ids = [256]
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


BYTES = llguidance.LLTokenizer(_ByteVocabulary())


def accepts(grammar: str, text: str) -> bool:
    """True when `grammar` allows exactly `text` (every byte, and then the end)."""
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def params_accept(params: StructuredOutputsParams, text: str) -> bool:
    """`accepts` for the grammar the engine compiles for `params` (checked as the frontend
    checks it)."""
    return accepts(check_grammar(params), text)
