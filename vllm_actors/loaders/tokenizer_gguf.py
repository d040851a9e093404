"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF vocabulary, the way llama.cpp reads it.

- `gpt2` vocabularies: byte-level BPE with the merges from the file and the pre-tokenizer that
  llama.cpp uses for the file's `tokenizer.ggml.pre` (regexes applied one after another).
- `llama` vocabularies: SentencePiece-style BPE with byte fallback; merges come from the file
  or are derived from the token scores.
Token types: 3 (control) become special added tokens, 4 (user-defined) plain added tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from vllm_actors.errors import UnsupportedModelError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pieces of llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), grouped by the
# `tokenizer.ggml.pre` names that share them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]
# Qwen 3.5 is Qwen 2's expression with combining marks (\p{M}) counted as letters.
_QWEN35 = _QWEN2.replace(r"\p{L}+", r"[\p{L}\p{M}]+").replace(r"[^\s\p{L}\p{N}]",
                                                             r"[^\s\p{L}\p{M}\p{N}]")
# DeepSeek's CJK runs: U+4E00-U+9FA5, U+0800-U+4E00 and U+AC00-U+D7FF, as its tokenizer.json
# writes them.
_DEEPSEEK_CJK = (f"[{chr(0x4E00)}-{chr(0x9FA5)}{chr(0x0800)}-{chr(0x4E00)}"
                 f"{chr(0xAC00)}-{chr(0xD7FF)}]+")
# DeepSeek LLM's letters are the cased letters (upper, lower, title case: \p{LC}); its
# punctuation runs are ASCII's, the full-width forms, curly quotes and the CJK space, comma
# and full stop.
_DEEPSEEK_PUNCT = (f"\\s?[!-/:-~{chr(0xFF01)}-{chr(0xFF0F)}{chr(0xFF1A)}-{chr(0xFF5E)}"
                   f"{chr(0x2018)}-{chr(0x201F)}{chr(0x3000)}-{chr(0x3002)}]+")
_DEEPSEEK_LLM = [r"[\r\n]", r"\s?\p{LC}+", _DEEPSEEK_PUNCT, r"\s+$", _DEEPSEEK_CJK, r"\p{N}+"]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"]
# GPT-4o's (tiktoken o200k) split: case-aware letter runs (an upper-case run may start a
# lower-case one, so "HTTPRequest" is "HTTP" + "Request"), contractions after any run, digits
# in threes, and slashes kept with the punctuation run before them. llama.cpp emulates the
# Unicode case classes with ASCII lookaheads; the classes themselves are used here, as the
# model's tokenizer.json writes them (the two agree on ASCII text).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# BLOOM-style: runs of anything but whitespace and a few sentence marks (Latin, CJK, Hindi,
# Urdu, Arabic), a leading space kept; Viking adds single digits.
_BLOOM = f" ?[^(\\s|.,!?{chr(0x2026)}{chr(0x3002)}{chr(0xFF0C)}{chr(0x3001)}" \
         f"{chr(0x0964)}{chr(0x06D4)}{chr(0x060C)})]+"
# DeepSeek V3: digits in threes, CJK and kana runs, then letter runs (an ASCII punctuation
# mark may lead ASCII letters), punctuation and symbol runs, newlines and spaces.
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    f"[{chr(0x4E00)}-{chr(0x9FA5)}{chr(0x3040)}-{chr(0x309F)}{chr(0x30A0)}-{chr(0x30FF)}]+",
    r"[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# `tokenizer.ggml.pre` names -> the expressions llama.cpp applies for them (one after another)
_PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    **{name: [_LLAMA3] for name in ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe",
                                     "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                                     "jina-v5-nano", "chatglm-bpe", "glm4", "glm5")},
    **{name: [r"\p{N}", _GPT2] for name in ("smollm", "starcoder", "refact", "command-r",
                                            "codeshell", "exaone", "minerva-7b")},
    **{name: [_GPT2] for name in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "jina-es",
                                  "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                                  "a.x-4.0", "mellum", "modern-bert", "jina-v1-en",
                                  "jina-v2-code", "roberta-bpe", "exaone4", "trillion",
                                  "granite-docling")},
    **{name: [_QWEN2] for name in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez",
                                   "hunyuan", "kormo", "f2llmv2")},
    **{name: [_GPT4O] for name in ("gpt-4o", "llama4", "kanana2", "talkie")},
    **{name: [_BLOOM] for name in ("bloom", "poro-chat", "gpt3-finnish")},
    **{name: _DEEPSEEK_V3 for name in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    "viking": [_BLOOM, r"\p{N}"],
    "falcon": _FALCON,
    "qwen35": [_QWEN35],
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
}
# names for which llama.cpp takes a pre-token that is itself in the vocabulary as one token
_IGNORE_MERGES = {"llama3", "llama-bpe", "llama-v3", "falcon3", "falcon-h1", "pixtral",
                  "midm-2.0", "lfm2", "jina-v5-nano", "glm4", "glm5"}


def _added_tokens(tokens: list[str], token_types: np.ndarray | None) -> list[AddedToken]:
    if token_types is None:
        return []
    out = []
    for token_id in np.nonzero((token_types == TOKEN_TYPE_CONTROL)
                               | (token_types == TOKEN_TYPE_USER_DEFINED))[0]:
        special = bool(token_types[token_id] == TOKEN_TYPE_CONTROL)
        out.append(AddedToken(tokens[token_id], special=special, normalized=False))
    return out


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    return pairs


def _build_gpt2(meta: dict[str, Any], path: Path) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    regexes = _PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise UnsupportedModelError(path, f"tokenizer.ggml.pre={pre!r} is not supported; known: "
                                          f"{', '.join(sorted(_PRE_TOKENIZER_REGEXES))}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _split_merges(meta.get("tokenizer.ggml.merges", []))
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in regexes]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """SentencePiece vocabularies carry scores, not merges: merge (a, b) ranks by the score of
    the token a+b, best first; splits of one token are ordered by the ids of their halves."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for token_id in np.argsort(-scores, kind="stable"):
        token = tokens[token_id]
        pieces = [(token[:i], token[i:]) for i in range(1, len(token))]
        pieces = [p for p in pieces if p[0] in vocab and p[1] in vocab]
        ranked.extend(sorted(pieces, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    return ranked


def _build_llama_spm(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(tokens))), np.float32)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _split_merges(meta["tokenizer.ggml.merges"])
    else:
        merges = _merges_from_scores(tokens, scores)
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id], fuse_unk=True,
                                     byte_fallback=True))
    # llama.cpp escapes spaces as U+2581 and prefixes one to the text and to every piece
    # that follows a special token; a normalizer does both (it runs per non-special segment).
    steps: list[Any] = [normalizers.Replace(" ", "\u2581")]
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps: list[Any] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                               decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def _build_bert_wpm(meta: dict[str, Any]) -> Tokenizer:
    """llama.cpp's WordPiece (`tokenizer.ggml.model = bert`): its vocabulary marks a word's
    first piece with U+2581 where BERT marks the others with `##`, so it maps back onto
    `models.WordPiece`. Each character becomes the base of its NFD form (llama.cpp keeps one
    code point per code point: accents dropped) and lower case, control characters are
    dropped, the text is split at whitespace, punctuation, ASCII symbols and CJK characters
    (BERT's normalizer and pre-tokenizer), then matched longest piece first; a word with an
    unmatched rest is one unknown token (llama.cpp's `llm_tokenizer_wpm`). Unlike llama.cpp,
    combining marks already decomposed in the input are dropped too."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if types[i] == TOKEN_TYPE_CONTROL or not tok.startswith("\u2581"):
            name = tok if types[i] == TOKEN_TYPE_CONTROL else "##" + tok
        else:
            name = tok[1:]
        vocab.setdefault(name, i)
    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 100))]
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=10**6))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      strip_accents=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def tokenizer_from_gguf(meta: dict[str, Any], path: Path) -> Tokenizer:
    """The `tokenizers.Tokenizer` for a GGUF file's `tokenizer.ggml.*` metadata.

    Raises:
        UnsupportedModelError: no vocabulary, or a tokenizer model / pre-tokenizer we lack.
    """
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise UnsupportedModelError(path, "GGUF file has no tokenizer.ggml.tokens vocabulary")
    if kind == "gpt2":
        tokenizer = _build_gpt2(meta, path)
    elif kind == "llama":
        tokenizer = _build_llama_spm(meta)
    elif kind == "bert":
        tokenizer = _build_bert_wpm(meta)
    else:
        raise UnsupportedModelError(path, f"tokenizer.ggml.model={kind!r} is not supported "
                                          "(supported: gpt2, llama, bert)")
    token_types = meta.get("tokenizer.ggml.token_type")
    added = _added_tokens(meta["tokenizer.ggml.tokens"],
                          None if token_types is None else np.asarray(token_types))
    tokenizer.add_tokens([t for t in added if not t.special])
    tokenizer.add_special_tokens([t for t in added if t.special])
    return tokenizer
