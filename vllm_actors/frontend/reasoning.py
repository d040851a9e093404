"""Reasoning parsers (`--reasoning-parser`): split a model's `<think>...</think>` reasoning
from its answer, for `reasoning` (also sent as `reasoning_content`) and `content`.

- deepseek_r1: the chat template opens `<think>` in the prompt, so everything up to
  `</think>` is reasoning (a `<think>` the model writes itself is dropped); an output that
  never closes it is all reasoning.
- qwen3: reasoning where the output opens with `<think>` (Qwen3's first templates let the
  model write it), or where the prompt opened it (Qwen3.5's and the Thinking models'
  templates end the prompt with `<think>`): then up to `</think>` or a `<tool_call>`.

Where the prompt closed the reasoning (`enable_thinking: false` in the request's
`chat_template_kwargs`, or a prompt ending with `</think>`, as templates write thinking
off) there is reasoning only where the output opens `<think>` again, with either parser.

The split of a growing text only ever appends to both parts, so streaming sends the parts'
growth and the streamed pieces add up to the complete split. While streaming, a tail that
could still become a marker is held back.
"""

from __future__ import annotations

from vllm_actors.frontend.detokenizer import partial_stop_length

START, END = "<think>", "</think>"


TOOL_CALL = "<tool_call>"


class ReasoningParser:
    """`implicit_start`: the output opens inside the reasoning. `ends`: what ends it
    (`</think>`, dropped; for qwen3 also `<tool_call>`, which Qwen3.5 may write before
    closing its reasoning and which stays in the content for the tool parser, as vLLM's
    reads it)."""

    def __init__(self, implicit_start: bool, ends: tuple[str, ...] = (END,)) -> None:
        self.implicit_start = implicit_start
        self.ends = ends

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
        found = [(i, marker) for marker in self.ends if (i := body.find(marker)) >= 0]
        if not found:
            held = 0 if final else partial_stop_length(body, list(self.ends))
            return body[:len(body) - held], ""
        end, marker = min(found)
        return body[:end], body[end + len(END):] if marker == END else body[end:]


def get_reasoning_parser(name: str | None, explicit_only: bool = False,
                         thinking: bool | None = None) -> ReasoningParser | None:
    """The named parser (config.REASONING_PARSERS); `explicit_only`: reasoning only where
    the output opens `<think>`; `thinking`: what the prompt did (`prompt_thinking`)."""
    if name is None:
        return None
    implicit = thinking is True or (name == "deepseek_r1" and thinking is None)
    return ReasoningParser(implicit and not explicit_only,
                           (END, TOOL_CALL) if name == "qwen3" else (END,))


def prompt_thinking(template_kwargs: dict | None, prompt_text: str | None) -> bool | None:
    """True when the prompt opened the reasoning (its text ends with `<think>`), False
    when it closed it or the request switched thinking off, None when it says nothing."""
    text = (prompt_text or "").rstrip()
    if (template_kwargs or {}).get("enable_thinking", True) is False or text.endswith(END):
        return False
    return True if text.endswith(START) else None
