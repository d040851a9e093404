"""The tokenizer every part of the engine uses: HF `tokenizers` underneath, from GGUF metadata
or from `tokenizer.json` + `tokenizer_config.json`, with its chat template and special ids.

BOS/EOS come from the model files and are added here (not by a post-processor) so that chat
prompts, which usually spell their own BOS in the template, are encoded without a second one.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer

from vllm_actors.errors import ModelFormatError, ModelNotFoundError
from vllm_actors.loaders.builtin_templates import builtin_template, turn_end_ids
from vllm_actors.loaders.chat_template import ChatTemplateError, render_chat_template
from vllm_actors.loaders.gguf import GGUFFile
from vllm_actors.loaders.model_files import ModelSource, resolve_model
from vllm_actors.loaders.tokenizer_gguf import tokenizer_from_gguf

logger = logging.getLogger(__name__)


@dataclass
class Tokenizer:
    """Encode/decode and chat templating for one model.

    Attributes:
        backend: the underlying `tokenizers.Tokenizer`.
        bos_token_id / eos_token_id: None when the model has none.
        add_bos_token / add_eos_token: whether `encode(..., add_special_tokens=True)` adds them.
        chat_template: Jinja2 source, or None when the model ships no template.
        eos_token_ids: every id that ends generation (the EOS plus generation_config's extras).
    """

    backend: HFTokenizer
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra_special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for, bounded from above by the
        longest token string (byte-level and SentencePiece markers and byte-fallback tokens
        only make token strings longer than the text they stand for)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, tok in self.backend.get_added_tokens_decoder().items()
                      if tok.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings inside the text are matched as tokens."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """A text pair as a cross-encoder reads it ([CLS] first [SEP] second [SEP] for
        BERT): the ids, and where the second text's part (token type 1) starts."""
        head = self.encode(first, True)
        tail = self.backend.encode(second, add_special_tokens=False).ids
        if self.add_eos_token and self.eos_token_id is not None:
            tail.append(self.eos_token_id)
        return head + tail, len(head)

    def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added), tokenized together: one call
        into the tokenizer, which runs without the GIL (bad words, prompt pieces)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of `ids`, as a Hugging Face fast tokenizer (and so vLLM) decodes them:
        `spaces_between_special_tokens` is accepted and, as there, inserts nothing (only
        the slow tokenizers put spaces around added tokens, which broke Gemma's newline
        and whitespace tokens)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    # -- the parts of Hugging Face's tokenizer interface that callers of vLLM's use --------
    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True
                 ) -> dict[str, Any]:
        """{"input_ids": ids} (a list of id lists for a list of texts)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> list[str]:
        """The token strings of `text` (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).tokens

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __await__(self) -> Any:
        """`await engine.get_tokenizer()` as older vLLM's async AsyncLLM method is called
        works too: awaiting the tokenizer gives itself."""
        if False:   # a generator that returns at once
            yield
        return self

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, tools: list[Any] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render a conversation with the model's template (or `chat_template`).

        Returns the prompt text, or its token ids (no extra BOS) when `tokenize`.
        Raises:
            ChatTemplateError: no template available, or the template rejected the messages.
        """
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError("this model has no chat template; pass chat_template= "
                                    "(or --chat-template) to use chat")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   **self.extra_special_tokens, **kwargs}
        text = render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, **context)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _from_gguf(path: Path) -> Tokenizer:
    meta = GGUFFile(path).metadata
    backend = tokenizer_from_gguf(meta, path)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    is_spm = meta.get("tokenizer.ggml.model") == "llama"
    is_wpm = meta.get("tokenizer.ggml.model") == "bert"
    if is_wpm:   # llama.cpp wraps a WordPiece text in [CLS] ... [SEP]
        bos = meta.get("tokenizer.ggml.cls_token_id", bos)
        eos = meta.get("tokenizer.ggml.seperator_token_id", eos)
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    eos_ids = (_as_id_tuple(eos) + _as_id_tuple(meta.get("tokenizer.ggml.eot_token_id"))
               + turn_end_ids(tokens, meta.get("tokenizer.ggml.token_type")))
    return Tokenizer(
        backend=backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", is_spm or is_wpm)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", is_wpm)),
        chat_template=meta.get("tokenizer.chat_template") or builtin_template(tokens),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelFormatError(path, f"not valid JSON ({e})") from None


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _post_processor_adds(backend: HFTokenizer, bos: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (llama-3 style configs say so
    only there, not in tokenizer_config.json)."""
    if bos is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos


def _post_processor_ends(backend: HFTokenizer, eos: int | None) -> bool:
    """Whether tokenizer.json's post-processor appends `eos` (BERT's [SEP])."""
    if eos is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[-1] == eos


def _from_hf_dir(model_dir: Path) -> Tokenizer:
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelNotFoundError(tokenizer_file, "model directory has no tokenizer.json")
    backend = HFTokenizer.from_file(str(tokenizer_file))
    backend.no_padding()
    backend.no_truncation()
    config = _read_json(model_dir / "tokenizer_config.json")
    generation = _read_json(model_dir / "generation_config.json")
    model_config = _read_json(model_dir / "config.json")

    def token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        token = None if content is None else backend.token_to_id(content)
        if token is None:
            fallback = generation.get(f"{key}_id", model_config.get(f"{key}_id"))
            ids = _as_id_tuple(fallback)
            token = ids[0] if ids else None
        return token

    bos, eos = token_id("bos_token"), token_id("eos_token")
    add_eos = config.get("add_eos_token", False)
    if bos is None and eos is None:   # an encoder's [CLS] text [SEP], as llama.cpp reads it
        cls, sep = token_id("cls_token"), token_id("sep_token")
        if _post_processor_adds(backend, cls):
            bos = cls
        if _post_processor_ends(backend, sep):
            eos, add_eos = sep, True
    eos_ids = _as_id_tuple(eos) + _as_id_tuple(generation.get("eos_token_id"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    template_file = model_dir / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    extras = {k: _token_content(config[k]) for k in ("unk_token", "pad_token")
              if isinstance(_token_content(config.get(k)), str)}
    return Tokenizer(
        backend=backend, bos_token_id=bos, eos_token_id=eos,
        add_bos_token=bool(config.get("add_bos_token", _post_processor_adds(backend, bos))),
        add_eos_token=bool(add_eos),
        chat_template=template, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        extra_special_tokens=extras,
    )


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a resolved model; `chat_template` (source text) overrides the model's."""
    tokenizer = _from_gguf(source.path) if source.kind == "gguf" else _from_hf_dir(source.path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tokenizer_source(model: ModelSource, tokenizer: str | None) -> ModelSource:
    """Where `--tokenizer` says to read the tokenizer: a local .gguf file or a directory
    with tokenizer.json. A name that is no local path (vLLM's GGUF recipes give a hub id)
    leaves the model's own tokenizer, with a warning: nothing is downloaded here, and a GGUF
    file's vocabulary is the one llama.cpp reads. Raises ModelNotFoundError for a path
    (./x, /x, ~/x, *.gguf) that does not exist."""
    if tokenizer is None:
        return model
    path = Path(tokenizer).expanduser()
    if path.is_file():
        return ModelSource("gguf", path)
    if (path / "tokenizer.json").is_file():
        return ModelSource("safetensors", path)
    if path.exists() or tokenizer.startswith(("/", ".", "~")) or tokenizer.endswith(".gguf"):
        raise ModelNotFoundError(tokenizer, "--tokenizer needs a .gguf file or a directory "
                                            "with tokenizer.json")
    logger.warning("--tokenizer %s is not a local path (nothing is downloaded here): using "
                   "the model's own tokenizer", tokenizer)
    return model


def get_tokenizer(path: str | Path | None = None, chat_template: str | None = None) -> Tokenizer:
    """Public helper: the tokenizer of a GGUF file (tensors optional) or HF model directory."""
    return load_tokenizer(resolve_model(path), chat_template)


__all__ = ["ChatTemplateError", "Tokenizer", "get_tokenizer", "load_tokenizer",
           "tokenizer_source"]
