"""How far our greedy tokens follow llama.cpp's, per --gguf-activations semantics.

Runs the golden prompts through the engine and compares with llama.cpp's greedy tokens
(tests/golden/llamacpp_{model}_greedy.json, from tests/oracle/make_llamacpp_golden.py; no
llama.cpp needed here), and prints for each prompt the first step where they part with
llama.cpp's top-2 margin there, next to the bound llama.cpp sets itself: the largest margin at
which llama.cpp leaves its own tokens when only its thread count, batch size or attention
kernel changes (tests/golden/llamacpp_spread.json). transformers' tokens (the float32
semantics' oracle) are compared the same way.

    python bench/llamacpp_agreement.py --model smollm2 --semantics quantized float32

`--texts FILE` (a JSON list of strings; `--chat` wraps each as a user message in the model's
chat template) compares on new prompts instead: llama.cpp's tokens and margins are computed
now, with the goldens' settings (`tests/oracle/make_llamacpp_golden.py`; llama-cpp-python
from the oracle extra), and there is no transformers column. `--context N` gives llama.cpp
an N-token context for longer prompts (bench/agreement_long.json: 650-3,100 tokens, several
of llama.cpp's 512-token ubatches).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
MODELS = {"smollm2": None, "gemma3_270m": "gemma3-270m"}


def on_track(ours: list[int], ref: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))


def near_tie_bound(stem: str) -> float:
    spread = json.loads((GOLDEN / "llamacpp_spread.json").read_text())["models"][stem]
    return max(r["margin_at_divergence"] for case in spread.values() for r in case.values()
               if not r["identical"])


def report(label: str, cases: list[dict], tokens: list[list[int]], bound: float) -> None:
    steps = [on_track(t, c["tokens"]) for c, t in zip(cases, tokens)]
    full = len(cases[0]["tokens"])
    clear = [(c["name"], s, c["top2_margins"][s]) for c, s in zip(cases, steps)
             if s < full and c["top2_margins"][s] >= bound]
    print(f"{label}: identical {sum(s == full for s in steps)}/{len(cases)}, mean steps on "
          f"llama.cpp's track {sum(steps) / len(steps):.1f} of {full}; parting at a margin "
          f">= {bound:.3f}: {len(clear)} {[(n, s, round(m, 3)) for n, s, m in clear]}")


def live_cases(stem: str, texts: list[str], chat: bool, context: int = 0
               ) -> tuple[list[dict], str]:
    """Cases of new prompts with llama.cpp's greedy tokens and top-2 margins, run now."""
    sys.path.insert(0, str(GOLDEN.parent / "oracle"))
    import make_llamacpp_golden as oracle
    from vllm_actors import get_tokenizer
    path = oracle.model_path(stem)
    tokenizer = get_tokenizer(str(path))
    oracle.L.llama_log_set(oracle._collect_log, ctypes.c_void_p(0))   # kept, not printed
    oracle.L.llama_backend_init()
    model = oracle.load_model(path)
    oracle.N_CTX = context or oracle.N_CTX
    n_vocab = oracle.L.llama_vocab_n_tokens(oracle.L.llama_model_get_vocab(model))
    cases = []
    try:
        for i, text in enumerate(texts):
            ids = list(tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True,
                tokenize=True) if chat else tokenizer.encode(text))
            run = oracle.greedy(model, oracle.DEFAULT, ids, n_vocab)
            cases.append({"name": f"text{i}", "prompt_token_ids": ids, "tokens": run["tokens"],
                          "top2_margins": run["margins"]})
    finally:
        oracle.L.llama_model_free(model)
    return cases, f"{oracle.oracle_string()}, run now"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    parser.add_argument("--semantics", nargs="+", default=["quantized", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", type=int, default=0, help="first N prompts (0: all)")
    parser.add_argument("--texts", type=Path, default=None,
                        help="JSON list of new prompts, llama.cpp run on them now")
    parser.add_argument("--chat", action="store_true", help="--texts as user messages")
    parser.add_argument("--context", type=int, default=0,
                        help="llama.cpp's n_ctx for --texts (default: the goldens' 1024)")
    args = parser.parse_args()
    from vllm_actors import LLM, SamplingParams
    llama = json.loads((GOLDEN / f"llamacpp_{args.model}_greedy.json").read_text())
    bound = near_tie_bound(args.model)
    if args.texts:
        cases, oracle = live_cases(args.model, json.loads(args.texts.read_text()), args.chat,
                                   args.context)
        print(f"{args.model}: {oracle}; llama.cpp's own near-tie bound {bound:.3f}")
    else:
        cases = llama["cases"][:args.cases or None]
        exact = {c["name"]: c["tokens"] for c in
                 json.loads((GOLDEN / f"{args.model}_greedy.json").read_text())["cases"]}
        print(f"{args.model}: {llama['oracle']}, flash attention {llama['flash_attn_type']}; "
              f"llama.cpp's own near-tie bound {bound:.3f}")
        report("transformers (float32 oracle)", cases, [exact[c["name"]] for c in cases],
               bound)
    params = SamplingParams(temperature=0.0, max_tokens=len(cases[0]["tokens"]),
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
    for semantics in args.semantics:
        model = MODELS[args.model]
        kwargs = {"device": args.device, "gguf_activations": semantics, "max_model_len": 4096}
        with (LLM(model, **kwargs) if model else LLM(**kwargs)) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        report(f"ours, {args.device}, {semantics}", cases,
               [list(o.outputs[0].token_ids) for o in outs], bound)


if __name__ == "__main__":
    main()
