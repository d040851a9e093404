"""Engine TokenLogprobs -> the per-position {token id: Logprob} dicts of vLLM's outputs."""

from __future__ import annotations

from vllm_actors.loaders.tokenizer import Tokenizer
from vllm_actors.outputs import Logprob, PositionLogprobs
from vllm_actors.protocol.engine import TokenLogprobs


class LogprobsBuilder:
    """Decodes token ids once each (a small cache) while building logprob dicts."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def decoded(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def positions(self, entry: TokenLogprobs, k: int) -> list[PositionLogprobs]:
        """One dict per position: the actual token (its rank as computed) and up to k of the
        best alternatives (ranks 1..k); the actual token is not repeated among them."""
        out = []
        for ids, lps, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            position = {ids[0]: Logprob(lps[0], rank, self.decoded(ids[0]))}
            for i, (token_id, lp) in enumerate(zip(ids[1:k + 1], lps[1:k + 1])):
                if token_id not in position:
                    position[token_id] = Logprob(lp, i + 1, self.decoded(token_id))
            out.append(position)
        return out
