"""A Ray cluster of simulated nodes (Ray's own multi-node test cluster: raylets on this
machine, loopback only).

Data parallel: one SmolLM2 engine core per node, the single core's greedy and seeded
tokens; removing one node fails only its requests (fast: its tcp connection drops), the
other core keeps serving, a replacement starts on the remaining node and rejoins; nothing
is left after shutdown. Pipeline parallel: two stages as Ray actors on two nodes, hidden
states over tcp, the single process's greedy and seeded tokens; removing the second stage's
node fails the engine's requests within 2 s and no actor is left."""

import asyncio
import os
import shutil
import time

import psutil
import pytest
from engine_death import kill_while_streaming

from vllm_actors import AsyncLLM, EngineDeadError, SamplingParams

ray = pytest.importorskip("ray", reason="ray is in the ray (and test) extra")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time",
           "Count: 1, 2, 3,"]


@pytest.fixture(scope="module")
def cluster():
    """A head node with 2 CPUs; each test adds the node it takes away."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def reference_tokens(llm) -> list[list[list[int]]]:
    """The single in-process engine's greedy and seeded tokens for PROMPTS."""
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for params in (GREEDY, SEEDED)]


async def generate_all(llm: AsyncLLM, params: SamplingParams) -> list[list[int]]:
    async def one(i: int, prompt: str) -> list[int]:
        async for out in llm.generate(prompt, params, f"r{i}-{time.monotonic()}"):
            last = out
        return last.outputs[0].token_ids
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


def test_cores_on_two_nodes_survive_a_node_loss(cluster, smollm2_path, smollm2_llm):
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    reference, seeded = reference_tokens(smollm2_llm)
    llm = AsyncLLM(str(smollm2_path), gguf_activations="float32", data_parallel_size=2,
                   data_parallel_backend="ray")
    try:
        places = [c.where() for c in llm.group.clients]
        nodes, pids = [p["node_id"] for p in places], [p["pid"] for p in places]
        assert len(set(nodes)) == 2 and second.node_id in nodes
        assert asyncio.run(generate_all(llm, GREEDY)) == reference
        assert asyncio.run(generate_all(llm, SEEDED)) == seeded
        on_second = nodes.index(second.node_id)

        async def lose_a_node() -> tuple[list, float]:
            results: dict = {}

            async def stream(name: str) -> None:
                try:
                    async for _ in llm.generate("Count:", LONG, name):
                        results.setdefault(name, "streaming")
                except EngineDeadError as e:
                    results[name] = (time.monotonic(), str(e))
            tasks = [asyncio.create_task(stream(f"s{i}")) for i in range(4)]
            while len(results) < 4:
                await asyncio.sleep(0.01)
            assert llm.group.loads == [2, 2]
            killed_at = time.monotonic()
            cluster.remove_node(second)
            while not any(isinstance(r, tuple) for r in results.values()):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            failed = [r for r in results.values() if isinstance(r, tuple)]
            assert llm.engines_alive == 1
            served = await generate_all(llm, GREEDY)    # the other core, meanwhile
            await llm.abort([f"s{i}" for i in range(4)])
            await asyncio.gather(*tasks)
            deadline = time.monotonic() + 120     # the replacement starts meanwhile
            while llm.group.num_alive < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return failed, killed_at, served

        failed, killed_at, served = asyncio.run(lose_a_node())
        assert len(failed) == 2
        for when, message in failed:
            print(f"EngineDeadError {when - killed_at:.2f}s after the node loss: {message}")
            assert when - killed_at < 2.0 and f"engine core {on_second}" in message
        assert served == reference

        assert llm.group.num_alive == 2 and llm.group.restarts[on_second] == 1
        replacement = llm.group.clients[on_second].where()
        assert replacement["node_id"] != second.node_id
        pids.append(replacement["pid"])
        assert asyncio.run(generate_all(llm, GREEDY)) == reference
    finally:
        llm.shutdown()
    # the lost node's disk keeps its core's ipc directory (a real machine would take it
    # along); every other core removed its own
    lost = places[on_second]["directory"]
    assert os.path.isdir(lost)
    shutil.rmtree(lost)
    assert not any(os.path.exists(p["directory"]) for p in places + [replacement]
                   if p["directory"] != lost)
    deadline = time.monotonic() + 10       # ray.kill returns before the process is gone
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_pipeline_stages_on_two_nodes(cluster, smollm2_path, smollm2_llm, monkeypatch):
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)   # the engine core process joins it
    reference, seeded = reference_tokens(smollm2_llm)
    llm = AsyncLLM(str(smollm2_path), gguf_activations="float32", pipeline_parallel_size=2,
                   distributed_executor_backend="ray")
    try:
        ranks = asyncio.run(llm.collective_rpc("describe"))
        assert [(r["pipeline_stage"], r["layers"]) for r in ranks] == [(0, [0, 15]),
                                                                      (1, [15, 30])]
        assert ranks[0]["ray_node_id"] != ranks[1]["ray_node_id"]
        assert asyncio.run(generate_all(llm, GREEDY)) == reference
        assert asyncio.run(generate_all(llm, SEEDED)) == seeded
        lost = next(n for n in [node, *cluster.worker_nodes]
                    if n.node_id == ranks[1]["ray_node_id"]) \
            if ranks[1]["ray_node_id"] != cluster.head_node.node_id else None
        assert lost is not None, "the second stage should not share the head node"

        killed_at, results = asyncio.run(kill_while_streaming(
            llm, lambda: cluster.remove_node(lost), 2))
        for when, message in results.values():
            print(f"EngineDeadError {when - killed_at:.2f}s after the node loss: {message}")
            assert when - killed_at < 2.0
    finally:
        llm.shutdown()
    survivor = ranks[0]["pid"]                 # stage 0's actor, on the head node
    deadline = time.monotonic() + 10
    while psutil.pid_exists(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(survivor) or \
        psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE
