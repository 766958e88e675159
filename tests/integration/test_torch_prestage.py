"""``+prestage`` on the live stack: two torch engine workers (a prefill and a decode node, a tiny
random checkpoint) on the session's nats-server, the prompts' token ids in the NATS prompt store.
A turn is prefilled on p1 and decoded on d1; a ``KvStageOrdered`` (d1 -> p1) on ``ei.<p>.route``
makes p1's worker pull the turn's output block from d1's host tier into its own (``KvMoved``
decode -> prefill, L2, on the stream), and the branch's next turn prefilled on p1 starts with the
whole previous turn cached (prompt and output), nothing fetched, the same greedy tokens. Orders
naming a turn d1 never decoded, an unknown source or an unknown destination are logged and
skipped; the workers go on serving."""

from __future__ import annotations

import pytest

from engine.backends.torch.backend import TorchBackend, TorchConfig
from engine.transfer.loopback import LoopbackFabric
from engine.worker.loop import EngineWorker
from events.catalog import (
    KvMoved,
    KvStageOrdered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from events.hashing import block_hashes, hash_block_tokens
from services.adapters.bus import NatsBus
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.tokens import NatsTokens
from tests.integration.test_worker import wait_for_event
from tests.unit.engine.torch.cluster import PROFILE, tiny_checkpoint
from tests.unit.engine.torch.test_torch_engine import prompt, reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-prestage") / "tiny.gguf")


def stage(request: str, src: str, dst: str) -> KvStageOrdered:
    return KvStageOrdered(ts=0.0, src="router", request=request, src_node=src, dst_node=dst, branch="b",
                          tier="L2", policy="prestage")


async def turn(ctl, tokens, store, rid: str, ids: list[int], n: int) -> list[int]:
    """Submit a turn of branch ``b`` (prefill p1, decode d1); its output token ids."""
    await store.put(rid, ids)
    sub = await tokens.subscribe(rid)
    await ctl.publish(RequestSubmitted(ts=0.0, src="gw", request=rid, branch="b", blocks=block_hashes(ids),
                                       prompt_tokens=len(ids), max_tokens=n, ignore_eos=True))
    await ctl.publish(RouteDecided(ts=0.0, request=rid, prefill_node="p1", decode_node="d1", policy="t"))
    msgs = []
    while not msgs or msgs[-1].kind != "done":
        msgs.append(await sub.get(20.0))
    await sub.close()
    await wait_for_event(ctl, lambda e: isinstance(e, RequestFinished) and e.request == rid)
    return [int(t) for t in "".join(m.text for m in msgs).split()]


async def test_a_stage_order_on_the_stream_moves_the_turn_and_the_next_turn_hits(ckpt, nats_url, partition):
    buses = [await NatsBus.connect(nats_url, partition=partition) for _ in range(3)]
    ctl = buses[2]
    fabric = LoopbackFabric()  # the bytes move in-process; the control messages over TCP (TcpExchange)

    roles = {"p1": "prefill", "d1": "decode"}

    def factory(host, w):
        cfg = TorchConfig(l1_blocks=32, l2_blocks=64, staging_blocks=8, fabric=fabric)
        return TorchBackend(host, w.src, roles[w.src], PROFILE, cfg, checkpoint=ckpt)

    workers = [EngineWorker(bus, NatsTokens(bus.nc, partition), node, roles[node], PROFILE, backend=factory,
                            prompts=NatsPromptStore(bus.nc, partition)) for bus, node in zip(buses, roles)]
    wp, wd = workers
    tokens, store = NatsTokens(ctl.nc, partition), NatsPromptStore(ctl.nc, partition)
    try:
        await wp.start()
        await wd.start()
        p1 = prompt(40, 170)
        out1 = await turn(ctl, tokens, store, "r1", p1, 40)
        assert out1 == reference(ckpt, p1, 40)
        full = block_hashes(p1)
        for i in range(len(full), (len(p1) + len(out1)) // 64):  # the output's block, as d1 hashed it
            full.append(hash_block_tokens(full[-1], (p1 + out1)[i * 64:(i + 1) * 64]))
        assert len(full) == 3
        mark = await ctl.last_seq()
        for bad in (stage("gone", "d1", "p1"), stage("r1", "ghost", "p1"), stage("r1", "d1", "ghost")):
            await ctl.publish(bad)
        await ctl.publish(stage("r1", "d1", "p1"))
        moved = await wait_for_event(ctl, lambda e: isinstance(e, KvMoved) and e.src_phase == "decode",
                                     start=mark + 1)
        assert (moved.src_node, moved.dst_node, moved.dst_phase, moved.dst_tier, moved.branch) == (
            "d1", "p1", "prefill", "L2", "b")
        assert moved.blocks == full[2:]  # p1 prefilled the prompt: it lacked only the output's block
        assert wp.backend.counters["stage_skipped"] == 1 and wp.backend.counters["stage_failed"] == 1
        assert wd.backend.counters["stage_skipped"] == 0  # the order for "ghost" is nobody's
        assert wp.directory.copies("p1", "L2").keys() >= set(full)  # the worker's view follows the move

        p2 = p1 + out1 + prompt(41, 30)
        out2 = await turn(ctl, tokens, store, "r2", p2, 5)
        assert out2 == reference(ckpt, p2, 5)
        start = await wait_for_event(ctl, lambda e: isinstance(e, RequestStarted) and e.request == "r2"
                                     and e.phase == "prefill")
        assert (start.node, start.cached_tokens, start.fetched_tokens) == ("p1", 192, 0)
    finally:
        for w in workers:
            await w.stop()
        for b in buses:
            await b.close()
