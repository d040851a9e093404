"""Hostile load on a running `vllm-actors serve`: many concurrent streams of which half hang up
early, with hostile requests interleaved; afterwards nothing may be left running or waiting,
the server's memory must be back where it was, and a greedy request must return what it
returned before.

    python bench/hostile_load.py [--streams 64] [--rounds 3] [--max-tokens 48] [--json OUT]
        (starts its own server on the default model; or --url URL --pid SERVER_PID)

Per round: `--streams` streaming requests (chat and completions alternating, half of them
closed by the client after a few events, as the chat page's Stop button does), and
meanwhile every hostile request of HOSTILE once (values that once killed the engine, a
request template, deep JSON, a body near the size limit, 10,000 bad words, malformed
JSON, and the grammars, schemas, lists and bodies of issue 29's attack), while /health is
polled every 50 ms (the slowest answer is reported per round). Memory is the resident set of the server and its engine core, measured after
`--warmup-rounds` (allocators settle, and every KV block of the deliberately small cache has
been touched: its pages are mapped lazily) and after the last round; the result prints the
resident sets of the server and of the core after each round.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

HEALTH_BOUND_S = 0.5     # /health while hostile requests are prepared and served (README)
RSS_BOUND_PCT = 10.0     # memory after the measured rounds against before them
GREEDY = {"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0}
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
HOSTILE: list[tuple[str, Any]] = [
    ("seed 2^63", {"prompt": "Hi", "max_tokens": 4, "seed": 2**63}),
    ("n=2, seed 2^64-1", {"prompt": "Hi", "max_tokens": 4, "n": 2, "seed": 2**64 - 1}),
    ("top_k 2^64-1", {"prompt": "Hi", "max_tokens": 4, "top_k": 2**64 - 1}),
    ("temperature 1e39 + json", {"prompt": "Hi", "max_tokens": 4, "temperature": 1e39,
                                 "response_format": {"type": "json_object"}}),
    ("repetition 1e-300", {"prompt": "Hi", "max_tokens": 4, "repetition_penalty": 1e-300}),
    ("priority 2^70", {"prompt": "Hi", "max_tokens": 4, "priority": 2**70}),
    ("seed 2^64", {"prompt": "Hi", "max_tokens": 4, "seed": 2**64}),
    ("request template", {"messages": CHAT, "chat_template": "{{ ('x'*10**9)|length }}"}),
    ("tool_choice str", {"messages": CHAT, "tool_choice": {"type": "function", "function": "f"},
                         "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("reserved kwargs", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}),
    ("10,000 bad words", {"prompt": "Hi", "max_tokens": 2,
                          "bad_words": [f"w{i}q" for i in range(10_000)]}),
    ("deep JSON", '{"prompt": "x", "response_format": ' + "[" * 5000 + "]" * 5000 + "}"),
    ("5 MB prompt", {"prompt": "hello " * 850_000, "max_tokens": 1}),
    ("invalid JSON", '{"prompt": "x", '),
    ("nulls", {"prompt": "Hi", "max_tokens": 2, "n": None, "stream": None, "echo": None}),
    # issue 29's attack: grammars that overflowed the stack, exponential $refs, big lists
    ("Lark chain 3,000", {"prompt": "x", "max_tokens": 2, "guided_grammar": "\n".join(
        ["start: r0"] + [f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(3000)]
        + ['r3000: "z"'])}),
    ("$ref chain 1,000", {"prompt": "x", "max_tokens": 2, "guided_json": {
        "$ref": "#/$defs/d0", "$defs": {**{f"d{i}": {"type": "object", "properties": {
            "x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(1000)},
            "d1000": {"type": "integer"}}}}),
    ("doubling $refs x18", {"prompt": "x", "max_tokens": 2, "guided_json": {
        "$ref": "#/$defs/d0", "$defs": {**{f"d{i}": {"allOf": [
            {"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(18)},
            "d18": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    ("10 MB /tokenize", ("/tokenize", {"prompt": "hello world " * 850_000})),
    ("40k stop ids x n=32", {"prompt": "Hi", "max_tokens": 2, "n": 32,
                             "stop_token_ids": list(range(40_000))}),
    ("200 stops x n=128", {"prompt": "Hi", "max_tokens": 2, "n": 128,
                           "stop": [f"s{i}q" for i in range(200)]}),
    ("metadata 16 x 1.5 MB", ("/v1/responses", {"input": "Hi", "max_output_tokens": 2,
                                                "metadata": {f"k{i}": "v" * 1_500_000
                                                             for i in range(16)}})),
    ("text/plain body", ("text/plain", {"prompt": "Hi", "max_tokens": 2})),
]


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory (MiB) of the server process and of its children (the engine core)."""
    proc = psutil.Process(pid)
    children = sum(p.memory_info().rss for p in proc.children(recursive=True))
    return proc.memory_info().rss / 2**20, children / 2**20


def engine_counts(client: httpx.Client) -> tuple[float, float]:
    text = client.get("/metrics").text
    values = []
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        values.append(float(match.group(1)) if match else float("nan"))
    return values[0], values[1]


async def stream(client: httpx.AsyncClient, i: int, max_tokens: int, hang_up: bool) -> str:
    chat = i % 2 == 0
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "temperature": 0.8,
                            "seed": i, "ignore_eos": True}
    body.update({"messages": CHAT} if chat else {"prompt": f"Story {i}: Once upon a time"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if hang_up and events >= 3:
                    return "hung up"
                if line == "data: [DONE]":
                    return "done"
    return "cut"


def _request(body: Any) -> tuple[str, dict[str, Any]]:
    """(path, httpx keyword arguments) of a HOSTILE entry: a JSON body, raw text, or
    (path or content type, body)."""
    if isinstance(body, tuple) and body[0] == "text/plain":
        return "/v1/completions", {"content": json.dumps(body[1]),
                                   "headers": {"Content-Type": "text/plain"}}
    if isinstance(body, tuple):
        return body[0], {"json": body[1]}
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body \
        else "/v1/completions"
    if isinstance(body, str):
        return path, {"content": body, "headers": {"Content-Type": "application/json"}}
    return path, {"json": body}


async def hostile(client: httpx.AsyncClient) -> dict[str, int]:
    statuses = {}
    for name, body in HOSTILE:
        await asyncio.sleep(random.uniform(0, 0.05))
        path, kw = _request(body)
        statuses[name] = (await client.post(path, **kw)).status_code
    return statuses


async def slowest_health(client: httpx.AsyncClient, done: asyncio.Event) -> float:
    """The slowest /health answer (seconds) while the round runs, polled every 50 ms."""
    slowest = 0.0
    while not done.is_set():
        start = time.monotonic()
        await client.get("/health")
        slowest = max(slowest, time.monotonic() - start)
        await asyncio.sleep(0.05)
    return slowest


async def one_round(url: str, streams: int, max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        done = asyncio.Event()
        probe = asyncio.ensure_future(slowest_health(client, done))
        tasks = [stream(client, i, max_tokens, hang_up=i % 2 == 1) for i in range(streams)]
        *outcomes, statuses = await asyncio.gather(*tasks, hostile(client))
        done.set()
        slowest = await probe
    ends: dict[str, int] = {}
    for outcome in outcomes:
        ends[outcome] = ends.get(outcome, 0) + 1
    return {"seconds": round(time.monotonic() - start, 1), "streams": ends,
            "hostile": statuses, "slowest_health_s": round(slowest, 3)}


def settle(client: httpx.Client, timeout: float = 60) -> tuple[float, float, float]:
    """Wait until nothing runs or waits; returns (running, waiting, seconds waited)."""
    start = time.monotonic()
    while True:
        running, waiting = engine_counts(client)
        if (running == 0 and waiting == 0) or time.monotonic() - start > timeout:
            return running, waiting, round(time.monotonic() - start, 2)
        time.sleep(0.2)


def run(url: str, pid: int, streams: int, rounds: int, max_tokens: int,
        warmup_rounds: int) -> dict[str, Any]:
    client = httpx.Client(base_url=url, timeout=300)
    greedy = client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    warmup = [asyncio.run(one_round(url, streams, max_tokens)) for _ in range(warmup_rounds)]
    settle(client)
    gc.collect()
    time.sleep(1)
    before = sum(rss_mib(pid))
    results = []
    for _ in range(rounds):
        results.append(asyncio.run(one_round(url, streams, max_tokens)))
        settle(client)
        results[-1]["rss_server_core_mib"] = [round(v, 1) for v in rss_mib(pid)]
    running, waiting, waited = settle(client)
    time.sleep(1)
    after = sum(rss_mib(pid))
    again = client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    healthy = client.get("/health").status_code == 200
    return {"streams": streams, "rounds": rounds, "warmup_rounds": len(warmup),
            "results": results,
            "running_after": running, "waiting_after": waiting, "settled_in_s": waited,
            "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
            "rss_change_pct": round(100 * (after - before) / before, 2),
            "greedy_unchanged": again == greedy, "healthy": healthy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (with --pid); default: start one")
    parser.add_argument("--pid", type=int, help="the server's process id (for its memory)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--warmup-rounds", type=int, default=2,
                        help="rounds before memory is measured (allocators, KV pages settle)")
    parser.add_argument("--rss-bound-pct", type=float, default=RSS_BOUND_PCT,
                        help="fail when memory after the rounds exceeds memory before them by "
                             "more (a bench-sized run; a smoke run's allocators do not settle)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    server = None
    if args.url is None:
        from server_process import ServerProcess
        from vllm_actors.loaders.model_files import default_model_path
        # a KV cache small enough for the warm-up round to touch all of it: its pages are
        # mapped lazily, so a large one grows the core's resident set as blocks are first used
        server = ServerProcess(str(default_model_path()), "--disable-log-requests",
                               "--uvicorn-log-level", "warning", "--max-model-len", "2048",
                               "--num-gpu-blocks-override", str(max(128, args.streams * 6)))
        args.url, args.pid = server.url, server.proc.pid
    try:
        result = run(args.url, args.pid, args.streams, args.rounds, args.max_tokens,
                     args.warmup_rounds)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = result["running_after"] == 0 and result["waiting_after"] == 0 and \
        result["greedy_unchanged"] and result["healthy"] and \
        all(r["streams"] == {"done": (args.streams + 1) // 2, "hung up": args.streams // 2}
            and all(status < 500 for status in r["hostile"].values())
            and r["slowest_health_s"] <= HEALTH_BOUND_S for r in result["results"]) and \
        result["rss_change_pct"] <= args.rss_bound_pct
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
