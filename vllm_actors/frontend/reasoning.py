"""Reasoning parsers (`--reasoning-parser`): split a model's `<think>...</think>` reasoning
from its answer, for `reasoning_content` and `content`.

- deepseek_r1: the chat template opens `<think>` in the prompt, so everything up to
  `</think>` is reasoning (a `<think>` the model writes itself is dropped); an output that
  never closes it is all reasoning.
- qwen3: reasoning only when the output opens with `<think>` (thinking can be switched off,
  then the output is all content); an unclosed `<think>` is all reasoning.

The split of a growing text only ever appends to both parts, so streaming sends the parts'
growth and the streamed pieces add up to the complete split. While streaming, a tail that
could still become a marker is held back.
"""

from __future__ import annotations

from vllm_actors.frontend.detokenizer import partial_stop_length

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, implicit_start: bool) -> None:
        self.implicit_start = implicit_start

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning or None, content) of `text`; with final=False, both without any tail
        that might still turn into a marker."""
        stripped = text.lstrip()
        opened = stripped.startswith(START)
        if not opened and not self.implicit_start:
            if not final and START.startswith(stripped):
                return None, ""            # could still be the opening marker
            return None, text
        body = stripped[len(START):] if opened else text
        if not opened and not final and START.startswith(stripped):
            return "", ""
        end = body.find(END)
        if end < 0:
            keep = len(body) if final else len(body) - partial_stop_length(body, [END])
            return body[:keep], ""
        return body[:end], body[end + len(END):]


PARSERS = {"deepseek_r1": lambda: ReasoningParser(implicit_start=True),
           "qwen3": lambda: ReasoningParser(implicit_start=False)}


def get_reasoning_parser(name: str | None, explicit_only: bool = False
                         ) -> ReasoningParser | None:
    """The named parser; `explicit_only`: reasoning only where the output opens `<think>`."""
    if name is None:
        return None
    return ReasoningParser(implicit_start=False) if explicit_only else PARSERS[name]()
