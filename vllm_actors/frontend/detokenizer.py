"""Incremental detokenization with stop strings.

Text grows as tokens arrive: a sliding window of ids is decoded (prefix/read offsets, as
vLLM does) so each step costs O(1) tokens, text ending in an incomplete UTF-8 character
(U+FFFD) is held back, and the window starts with the prompt's last tokens so tokenizers that
strip a leading space still produce the right first word. Stop strings are matched on the
text once min_tokens is reached; while streaming, a tail that could still become a stop
string is held back.
"""

from __future__ import annotations

from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def find_stop_string(text: str, num_new_chars: int, stop: list[str],
                     include: bool) -> tuple[str, int] | None:
    """The first stop string (in list order) that occurs in the newly added text (or across
    its start), and where to cut the text: before it, or after it when `include`."""
    for s in stop:
        index = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if index != -1:
            return s, index + len(s) if include else index
    return None


def partial_stop_length(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that is the start of some stop string (for a few
    markers; a request's stop strings keep their `StopPrefixes`)."""
    return StopPrefixes(stop).partial_length(text)


class StopPrefixes:
    """`partial_stop_length` for one request's stop strings, indexed once: the proper prefixes
    of every stop string by their last character, longest first, so a step checks only the
    prefixes that could end the text instead of every length of every stop string."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        index: dict[str, list[tuple[int, int]]] = {}   # last char -> (stop index, length)
        for k, s in enumerate(stop):
            for n in range(1, len(s)):
                index.setdefault(s[n - 1], []).append((k, n))
        for candidates in index.values():
            candidates.sort(key=lambda kn: -kn[1])
        self.index = index

    def partial_length(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of some stop string."""
        if not text:
            return 0
        for k, n in self.index.get(text[-1], ()):
            if n <= len(text) and text.endswith(self.stop[k][:n]):
                return n
        return 0


class IncrementalDetokenizer:
    """`stop_prefixes`: the index of params.stop when already built (the n completions of a
    request share one)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams, stop_prefixes: StopPrefixes | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.detokenize = params.detokenize
        self.stop = params.stop
        if stop_prefixes is None and params.stop:
            stop_prefixes = StopPrefixes(params.stop)
        self.stop_prefixes = stop_prefixes
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_search_start = 0   # stop strings may not match text made before min_tokens
        self.num_used_tokens = 0     # of the last update's tokens (see update)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _decode_next(self, token_id: int, flush: bool) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not flush):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def _flush(self) -> str:
        """The text held back (an unfinished character), as the tokenizer decodes it."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full_text[len(prefix_text):]

    def update(self, new_token_ids: list[int], finished: bool = False,
               stop_terminated: bool = False) -> str | None:
        """Add tokens. `stop_terminated`: the engine stopped on EOS or a stop token, whose text
        is left out unless include_stop_str_in_output. Returns the stop string that matched,
        after cutting the text at it, or None. Several tokens at once (speculative decoding)
        are searched one by one: `num_used_tokens` tells how many of them came before the
        stop (the rest are dropped, as if the request had stopped there)."""
        start_len = len(self.output_text)
        self.num_used_tokens = len(new_token_ids)
        if not self.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        for i, token_id in enumerate(new_token_ids):
            last = i == len(new_token_ids) - 1
            self.num_output_tokens += 1
            if last and stop_terminated and not self.include_stop:
                self.output_text += self._flush()   # an unfinished character before it
                continue
            self.output_text += self._decode_next(token_id, flush=finished and last)
            if self.num_output_tokens <= self.min_tokens:
                self.stop_search_start = len(self.output_text)
            elif self.stop and not last:
                stop_str = self._cut_at_stop(start_len)
                if stop_str is not None:
                    self.num_used_tokens = i + 1
                    self.num_output_tokens -= len(new_token_ids) - i - 1
                    return stop_str
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._cut_at_stop(start_len)

    def _cut_at_stop(self, start_len: int) -> str | None:
        num_new = len(self.output_text) - max(start_len, self.stop_search_start)
        match = find_stop_string(self.output_text, num_new, self.stop, self.include_stop)
        if match is None:
            return None
        stop_str, cut = match
        self.output_text = self.output_text[:cut]
        return stop_str

    def releasable_text_length(self, finished: bool) -> int:
        """How much of output_text may be shown now: all of it once finished; otherwise not
        a tail that might still grow into an (excluded) stop string."""
        if finished or self.stop_prefixes is None or self.include_stop:
            return len(self.output_text)
        return len(self.output_text) - self.stop_prefixes.partial_length(self.output_text)
