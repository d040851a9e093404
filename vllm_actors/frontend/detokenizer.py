"""Incremental detokenization: text deltas as tokens arrive, holding back partial UTF-8.

Decodes a sliding window of ids (prefix/read offsets, as vLLM does) so each step costs O(1)
tokens, and seeds the window with the prompt's last tokens so tokenizers that strip a leading
space (SentencePiece) still produce the right first word.
"""

from __future__ import annotations

from vllm_actors.loaders.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Append tokens; return the new text they complete (all of it when `finished`)."""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT)
                                                  and not finished):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
