"""Regenerate tests/golden/pre_tokenizers.json: llama.cpp's token ids for every
`tokenizer.ggml.pre` name we implement, on llama.cpp's gpt-2 test vocabulary with only the
pre-tokenizer name changed. Run by hand (needs llama-cpp-python, the `bench` extra):

    python tests/oracle/make_pre_tokenizer_golden.py

Texts: llama.cpp's own test texts (gpt-2 and qwen35 vocabularies) and a few that tell the
expressions apart (case runs, contractions, slashes, scripts). Names whose ids agree on every
text form one group; the golden keeps, per group, the ids of the texts on which some groups
differ, plus the first texts of the list.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from llama_cpp_vocabs import fetch_vocabs, read_texts  # noqa: E402
from tiny_models import write_gguf  # noqa: E402

from vllm_actors.loaders.gguf import GGUFFile  # noqa: E402
from vllm_actors.loaders.tokenizer_gguf import _PRE_TOKENIZER_REGEXES  # noqa: E402

VOCAB = "ggml-vocab-gpt-2.gguf"
EXTRA = [
    "I'VE GOT IT, he's DONE'S. HELLOWorld camelCase XMLHttpRequest 12345678 Ünïcödé naïve café",
    "line\r\n\r\nnext   \t tabs\u2026\u3002\uff0c\u3001 \u06d4\u060c (parens) [x]",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 \ud55c\uad6d\uc5b4 "
    "\u0442\u0435\u043a\u0441\u0442 \u0391\u0392\u0393",
    " iPhone McDonald's macOS YouTube",
    "WON'T don'T a/b/\nc//",
]
KEEP_FIRST = 5


def main() -> None:
    folder = fetch_vocabs()
    meta = GGUFFile(folder / VOCAB).metadata
    texts = (read_texts(folder / f"{VOCAB}.inp")
             + read_texts(folder / "ggml-vocab-qwen35.gguf.inp") + EXTRA)
    per_name: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in sorted(_PRE_TOKENIZER_REGEXES):
            path = Path(tmp) / f"{pre}.gguf"

            def fill(writer, pre=pre):  # type: ignore[no-untyped-def]
                writer.add_tokenizer_model("gpt2")
                writer.add_tokenizer_pre(pre)
                writer.add_token_list(meta["tokenizer.ggml.tokens"])
                writer.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
                writer.add_token_merges(meta["tokenizer.ggml.merges"])

            write_gguf(path, "gpt2", fill)
            try:
                llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            except ValueError:
                print(f"{pre}: llama.cpp does not know this name; not in the golden")
                continue
            per_name[pre] = [llama.tokenize(t.encode("utf-8"), add_bos=False, special=False)
                             for t in texts]
    groups: dict[str, list[str]] = {}
    for name, ids in per_name.items():
        groups.setdefault(json.dumps(ids), []).append(name)
    signatures = [json.loads(key) for key in groups]
    keep = [i for i in range(len(texts))
            if i < KEEP_FIRST or len({json.dumps(s[i]) for s in signatures}) > 1]
    golden = {
        "vocabulary": f"{VOCAB} from llama-cpp-python 0.3.36's source distribution",
        "llama_cpp_python": llama_cpp.__version__,
        "texts": [texts[i] for i in keep],
        "groups": [{"names": names, "ids": [json.loads(key)[i] for i in keep]}
                   for key, names in groups.items()],
    }
    out = ROOT / "tests" / "golden" / "pre_tokenizers.json"
    out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n",
                   encoding="utf-8")
    print(f"{out}: {len(golden['groups'])} groups, {len(keep)} of {len(texts)} texts")


if __name__ == "__main__":
    main()
