"""PD between two vLLM servers through two workers on a bus, against fake
vLLM servers that share a KV store as vLLM's ExampleConnector does (kv_both): the prefill
worker's server computes the prompt and gives the first token, the decode worker's server loads
the prompt's KV from the store and streams the rest; the roles switch in place. The same with
two real vLLM servers and token-identical output: tests/vllm/test_real_vllm.py."""

from __future__ import annotations

import asyncio

from engine.backends.vllm.backend import VllmBackend, VllmConfig
from engine.backends.vllm.fake import FakeVllm
from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    FirstToken,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
    SwitchRole,
)
from events.hashing import block_hashes
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens

PROFILE = load_profile("gb300-glm52")


async def wait_bus(bus, pred, timeout=20.0):
    async def run():
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


async def test_prefill_on_one_server_decode_on_the_other_and_roles_switch_in_place(partition):
    store: dict = {}
    fakes = {n: FakeVllm(kv_events_port=0, block_size=64, shared_store=store, eos_after=1000,
                         decode_s_per_token=0.001) for n in ("p1", "d1")}
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    workers = {}
    for node, role in (("p1", "prefill"), ("d1", "decode")):
        url = await fakes[node].start()
        cfg = VllmConfig(url=url, kv_events_endpoints=[f"tcp://127.0.0.1:{fakes[node].kv_events_port}"],
                         metrics_interval_s=0, pd=True)
        workers[node] = EngineWorker(bus, tokens, node, role, PROFILE, heartbeat_s=0.1,
                                     backend=lambda host, wk, cfg=cfg, role=role: VllmBackend(host, wk.src, role,
                                                                                              PROFILE, cfg))
        await workers[node].start()
    try:
        regs = [await wait_bus(bus, lambda e, n=n: isinstance(e, NodeRegistered) and e.node == n) for n in workers]
        assert [r.role for r in regs] == ["prefill", "decode"]
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        ids = [(i * 37) % 30_000 + 3 for i in range(3 * 64 + 9)]  # a trace's request: both make the same ids
        sub = await tokens.subscribe("r1")
        await bus.publish(RequestSubmitted(ts=0.0, src="test", request="r1", branch="b", blocks=block_hashes(ids, 64),
                                           prompt_tokens=len(ids), max_tokens=12, temperature=0.8, ignore_eos=False))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="p1", decode_node="d1", policy="t"))
        fin = await wait_bus(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r1")
        assert (fin.node, fin.output_tokens, fin.error) == ("d1", 12, "")
        first = await wait_bus(bus, lambda e: isinstance(e, FirstToken) and e.request == "r1")
        assert first.node == "p1"
        phases = {}
        for node in ("p1", "d1"):
            phases[node] = (await wait_bus(bus, lambda e, n=node: isinstance(e, RequestStarted) and e.node == n
                                           and e.request == "r1")).phase
        assert phases == {"p1": "prefill", "d1": "decode"}
        msgs = []
        while not msgs or msgs[-1].kind not in ("done", "error"):
            msgs.append(await sub.get(5.0))
        await sub.close()
        assert msgs[0].kind == "first" and msgs[-1].kind == "done"
        assert sum(m.tokens for m in msgs) == 12 and "".join(m.text for m in msgs) == "x" * 12  # first sent once
        p_body, d_body = fakes["p1"].requests[-1], fakes["d1"].requests[-1]
        assert p_body["max_tokens"] == 1 and d_body["max_tokens"] == 12
        assert p_body["prompt"] == d_body["prompt"] and p_body["seed"] == d_body["seed"]  # the same first draw
        assert fakes["d1"].loaded == 1 and workers["d1"].backend.loaded_tokens == 3 * 64  # the KV came from the store
        assert workers["p1"].backend.handed_off == 1
        await bus.publish(SwitchRole(ts=0.0, node="p1", to_role="decode"))
        sw = await wait_bus(bus, lambda e: isinstance(e, RoleSwitched) and e.node == "p1")
        assert (sw.role, sw.mechanism, sw.kv_dropped) == ("decode", "", False)
        assert workers["p1"].backend.role == "decode"
    finally:
        for w in workers.values():
            await w.stop()
        for f in fakes.values():
            await f.stop()
