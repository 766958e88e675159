"""Two engine workers running the torch backend on one bus (in-process bus, loopback transfer):
the decode worker finds the prefill worker's KV through its ``NodeRegistered.transfer_endpoint``
(the backend is the worker's data plane), pulls it and streams the rest of the tokens."""

from __future__ import annotations

import asyncio

import pytest

from engine.backends.torch.backend import Message, TorchBackend, TorchConfig
from engine.kvplane import LocalExchange
from engine.transfer.loopback import LoopbackFabric
from engine.worker.loop import EngineWorker
from events.catalog import KvMoved, NodeRegistered, RequestFinished, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.unit.engine.torch.cluster import PROFILE, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-w") / "tiny.gguf")


async def events(bus):
    out, head = [], await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                return out


async def test_split_request_across_two_torch_workers(ckpt, partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    fabric, exchange = LoopbackFabric(), LocalExchange(messages=Message)

    def factory(host, w):
        cfg = TorchConfig(l1_blocks=32, l2_blocks=32, staging_blocks=8, fabric=fabric, exchange=exchange)
        return TorchBackend(host, w.src, w.src == "p1" and "prefill" or "decode", PROFILE, cfg, checkpoint=ckpt)

    wp = EngineWorker(bus, tokens, "p1", "prefill", PROFILE, backend=factory)
    wd = EngineWorker(bus, tokens, "d1", "decode", PROFILE, backend=factory)
    try:
        await wp.start()
        await wd.start()
        sub = await tokens.subscribe("rq")
        blocks = [5000 + i for i in range(3)]
        await bus.publish(RequestSubmitted(ts=0.0, src="test", request="rq", branch="b", blocks=blocks,
                                           prompt_tokens=230, max_tokens=7))
        await bus.publish(RouteDecided(ts=0.0, request="rq", prefill_node="p1", decode_node="d1", policy="t"))
        msgs = []
        while not msgs or msgs[-1].kind != "done":
            msgs.append(await sub.get(10.0))
        await sub.close()
        assert msgs[0].kind == "first" and msgs[0].node == "p1" and msgs[-1].node == "d1"
        assert sum(m.tokens for m in msgs) == 7 and len("".join(m.text for m in msgs).split()) == 7
        for _ in range(200):
            evs = await events(bus)
            if any(isinstance(e, RequestFinished) for e in evs):
                break
            await asyncio.sleep(0.02)
        regs = {e.node: e.transfer_endpoint for e in evs if isinstance(e, NodeRegistered)}
        assert regs["p1"].startswith("loopback://") and regs["d1"].startswith("loopback://")
        moved = [e for e in evs if isinstance(e, KvMoved)]
        assert len(moved) == 1 and moved[0].blocks == blocks and moved[0].dst_node == "d1"
        assert wd.backend.counters["recomputed"] == 0 and wp.backend.counters["served_blocks"] == 4
    finally:
        await wp.stop()
        await wd.stop()
