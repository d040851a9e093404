"""The text and OpenAI `logprobs` of each /v1/completions choice, with vLLM's echo.

With `echo` a choice starts with its prompt: the prompt text before the generated text, and
with `logprobs` the prompt's tokens before the generated ones in all four lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`); the first prompt token has no logprob and
no top_logprobs (null). `max_tokens: 0` with echo (vLLM's echo without generation: one token
is generated and dropped) returns the prompt alone and counts no generated tokens.

Offsets are character offsets into the choice's text, counted as vLLM counts them: the
running sum of the lengths of the tokens' decoded strings. A streamed choice continues the
count of its earlier chunks, so its chunks concatenate to the non-streamed lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.outputs import CompletionOutput, PositionLogprobs

# The floor OpenAI and vLLM put on logprobs, so that -inf is still a JSON number.
LOGPROB_FLOOR = -9999.0


@dataclass
class ChoicePiece:
    """A choice, or one streamed chunk of it.

    Attributes:
        text: the text to send (with echo, the prompt's text comes first).
        logprobs: OpenAI's completions logprobs lists, or None when not asked for.
        num_generated: generated tokens in this piece (for usage; 0 for echo alone).
        has_tokens: whether the piece carries any token (prompt or generated).
    """

    text: str
    logprobs: dict[str, Any] | None
    num_generated: int
    has_tokens: bool


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        num_logprobs: int, decode: Callable[[int], str],
                        text_offset: int = 0, as_token_ids: bool = False
                        ) -> tuple[dict[str, Any], int]:
    """OpenAI's completions logprobs for `token_ids`, and the offset after the last token.

    Args:
        positions: per token, {token id: Logprob} holding that token (first) and the best
            alternatives by rank; None for a token without logprobs (the first prompt
            token), which gets a null logprob and null top_logprobs.
        num_logprobs: the request's `logprobs` k; each top_logprobs dict holds the
            position's first k + 1 entries (the chosen token and the k best), as vLLM does.
        decode: a token id's text, for tokens without logprobs.
        text_offset: the offset of the first token in the choice's text.
        as_token_ids: name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids; the
            offsets then count those names, as vLLM's do).
    """
    def name(token_id: int, text: str | None) -> str:
        return f"token_id:{token_id}" if as_token_ids else text or ""

    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions, strict=True):
        if position is None:
            token, value, top = name(token_id, decode(token_id)), None, None
        else:
            chosen = position[token_id]
            token = name(token_id, chosen.decoded_token)
            value = max(chosen.logprob, LOGPROB_FLOOR)
            top = {name(t, lp.decoded_token): max(lp.logprob, LOGPROB_FLOOR)
                   for t, lp in list(position.items())[:num_logprobs + 1]}
        tokens.append(token)
        values.append(value)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return ({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
             "text_offset": offsets}, text_offset)


@dataclass
class ChoiceShaper:
    """Shapes the choices of one completions request, whole or as streamed deltas.

    Attributes:
        prompt_texts: per prompt, the text echoed before its completions.
        echo: the request's `echo`.
        echo_only: `echo` with `max_tokens: 0`: the generated token is dropped.
        num_logprobs: the request's `logprobs` k (None: no logprobs).
        decode: a token id's text.
        as_token_ids: the request's `return_tokens_as_token_ids`.
    """

    prompt_texts: list[str]
    echo: bool
    echo_only: bool
    num_logprobs: int | None
    decode: Callable[[int], str]
    as_token_ids: bool = False
    _offsets: dict[int, int] = field(default_factory=dict)     # choice -> next token's offset
    _echoed: set[int] = field(default_factory=set)
    _prompt_logprobs: dict[int, list[PositionLogprobs | None]] = field(default_factory=dict)

    def piece(self, prompt_index: int, choice_index: int, prompt_token_ids: list[int],
              prompt_logprobs: list[PositionLogprobs | None] | None,
              completion: CompletionOutput) -> ChoicePiece:
        """The next piece of choice `choice_index` (of prompt `prompt_index`): the whole
        choice for a final output, or the next chunk for a delta. The prompt is echoed in
        the choice's first piece. Prompt logprobs, which a stream delivers once per prompt,
        are remembered for the prompt's other choices."""
        if prompt_logprobs is not None:
            self._prompt_logprobs.setdefault(prompt_index, prompt_logprobs)
        text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs
        num_generated = len(token_ids)
        if self.echo_only:
            text, token_ids, positions, num_generated = "", [], [], 0
        if self.echo and choice_index not in self._echoed:
            self._echoed.add(choice_index)
            text = self.prompt_texts[prompt_index] + text
            token_ids = [*prompt_token_ids, *token_ids]
            if self.num_logprobs is not None:
                positions = [*self._prompt_logprobs_of(prompt_index, len(prompt_token_ids)),
                             *(positions or [])]
        logprobs = None
        if self.num_logprobs is not None:
            if positions is None:
                raise AssertionError("the engine returned no logprobs for a request that asked")
            logprobs, self._offsets[choice_index] = completion_logprobs(
                token_ids, positions, self.num_logprobs, self.decode,
                self._offsets.get(choice_index, 0), self.as_token_ids)
        return ChoicePiece(text, logprobs, num_generated, bool(token_ids))

    def _prompt_logprobs_of(self, prompt_index: int, num_prompt_tokens: int
                            ) -> list[PositionLogprobs | None]:
        positions = self._prompt_logprobs.get(prompt_index)
        if positions is None or len(positions) != num_prompt_tokens:
            raise AssertionError(f"prompt {prompt_index}: the engine returned no prompt "
                                 "logprobs for an echo with logprobs")
        return positions
