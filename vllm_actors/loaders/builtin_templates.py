"""Chat templates for GGUF files that ship without one, chosen by the vocabulary's turn
markers (as llama.cpp falls back to its built-in formats); and the turn-end tokens llama.cpp
stops on although the file names another EOS.

Gemma's format: turns `<start_of_turn>{user|model}\\n...<end_of_turn>\\n`, a system message
folded into the first user turn, roles strictly alternating."""

from __future__ import annotations

from collections.abc import Sequence

GEMMA_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(prefix='') -%}
{%- set turns = messages -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set ns.prefix = messages[0]['content'] if messages[0]['content'] is string else
    messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')
    | join('\\n') -%}
{%- set ns.prefix = ns.prefix + '\\n\\n' -%}
{%- set turns = messages[1:] -%}
{%- endif -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{%- set content = message['content'] if message['content'] is string else
    message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')
    | join('\\n') -%}
{{- '<start_of_turn>' + role + '\\n' + (ns.prefix if loop.first else '') + content | trim
    + '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

# Vocabulary markers -> the template a file without `tokenizer.chat_template` gets.
_BY_MARKERS = ((("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE),)

# Token texts that end a turn (llama.cpp's end-of-generation list, turn markers only).
TURN_END_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>",
                   "<EOT>")


def builtin_template(tokens: Sequence[str]) -> str | None:
    """The built-in template for a vocabulary holding its turn markers, else None."""
    vocab = set(tokens)
    for markers, template in _BY_MARKERS:
        if all(m in vocab for m in markers):
            return template
    return None


def turn_end_ids(tokens: Sequence[str], token_types: Sequence[int] | None) -> tuple[int, ...]:
    """Ids of control tokens (GGUF token type 3) whose text ends a turn."""
    wanted = set(TURN_END_TOKENS)
    return tuple(i for i, t in enumerate(tokens)
                 if t in wanted and (token_types is None or int(token_types[i]) == 3))
