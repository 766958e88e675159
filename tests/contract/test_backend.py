"""The engine port's contract (engine/backend.py), one class per backend: the simulated node,
the SGLang backend driving the protocol-faithful fake server (ZMQ KV events included), the
attach-only vLLM backend on its fake (collocated only: an ordered switch is refused), and the
torch reference engine computing with a tiny random Llama checkpoint it reads from a GGUF file.

Every backend, driven only through the port, must: serve a request (RequestStarted(prefill),
FirstToken, RequestFinished with the asked output length; tokens first..done adding up to it),
report the prompt's KV as ``KvStored`` of the request's own block hashes, take a request that
has not started off its queue, stop a decoding request it is told to cancel (one
``RequestFinished(error="cancelled")``, no last token message), switch role when ordered and
acknowledge with ``RoleSwitched``, and report its load.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine.backend import EngineBackend, NodeLoad, PrefillJob
from engine.profiles import load_profile
from engine.worker.host import RemotePeer, WallClockHost
from events.catalog import FirstToken, KvStored, RequestFinished, RequestStarted, RoleSwitched
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import LruEviction

PROFILE = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)
BLOCKS = [9000 + i for i in range(6)]


class Harness:
    """The worker's side of the port: a wall-clock host, a directory folding what is emitted."""

    def __init__(self, time_scale: float) -> None:
        self.events, self.tokens = [], []
        self.dir = DirectoryCore()
        self.policy = LruEviction(PROFILE.block_tokens)
        self.backend: EngineBackend | None = None
        self.host = WallClockHost(time_scale, self.emit, self.choose, self.peer, token=self.tokens.append)

    def emit(self, e):
        self.events.append(e)
        self.dir.apply(e)

    def choose(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    def peer(self, node):
        return self.backend if node == self.backend.node_id else RemotePeer(node, self.dir)

    async def wait(self, pred, timeout=20.0):
        async def poll():
            while True:
                hit = [e for e in self.events if pred(e)]
                if hit:
                    return hit[0]
                await asyncio.sleep(0.01)
        return await asyncio.wait_for(poll(), timeout)


def job(rid, max_tokens=6, blocks=BLOCKS, prompt=None, decode="n1"):
    return PrefillJob(request=rid, blocks=list(blocks), prompt_tokens=prompt or len(blocks) * 64 + 20,
                      max_tokens=max_tokens, decode_node=decode, fetch_plan=[], enqueued_s=0.0)


class BackendContract:
    """Subclasses build a backend in a role through ``make(harness, role)``."""

    time_scale = 1.0
    big_blocks = 2000  # the long request that keeps the queue busy (a computing engine: fewer)
    long_tokens = 100_000  # output of the request cancelled while it decodes

    async def make(self, h: Harness, role: str) -> EngineBackend:  # pragma: no cover - abstract
        raise NotImplementedError

    async def close(self, h: Harness) -> None:
        await h.backend.close()

    async def start(self, role: str) -> Harness:
        h = Harness(self.time_scale)
        h.backend = await self.make(h, role)
        await h.backend.start()
        self._runner = asyncio.create_task(h.host.run())
        return h

    async def stop(self, h: Harness) -> None:
        self._runner.cancel()
        await self.close(h)

    async def test_is_an_engine_backend(self):
        h = await self.start("collocated")
        try:
            assert isinstance(h.backend, EngineBackend)
            assert h.backend.role == "collocated"
            assert isinstance(h.backend.load(), NodeLoad)
        finally:
            await self.stop(h)

    async def test_serves_a_request_and_reports_its_kv(self):
        h = await self.start("collocated")
        try:
            h.host.catch_up()
            h.backend.enqueue_prefill(job("r1", max_tokens=6))
            fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r1")
            assert fin.output_tokens == 6
            kinds = [(type(e).__name__, getattr(e, "phase", None)) for e in h.events
                     if isinstance(e, (RequestStarted, FirstToken, RequestFinished)) and e.request == "r1"]
            assert kinds[0] == ("RequestStarted", "prefill") and ("FirstToken", None) in kinds
            assert kinds[-1] == ("RequestFinished", None)
            toks = [m for m in h.tokens if m.request == "r1"]
            assert toks[0].kind == "first" and toks[-1].kind == "done" and toks[-1].total == 6
            await h.wait(lambda e: isinstance(e, KvStored) and set(BLOCKS) <= set(e.blocks) | stored_l1(h))
            assert set(BLOCKS) <= stored_l1(h)
            assert set(BLOCKS) <= set(h.dir.copies(h.backend.node_id, "L1"))
        finally:
            await self.stop(h)

    async def test_takes_a_request_that_has_not_started_off_its_queue(self):
        h = await self.start("collocated")
        try:
            h.host.catch_up()
            big = self.big_blocks
            h.backend.enqueue_prefill(job("big", max_tokens=2, blocks=range(100, 100 + big), prompt=big * 64))
            h.backend.enqueue_prefill(job("small", max_tokens=2, blocks=range(5000, 5002)))
            assert "small" in h.backend.queued()
            taken = h.backend.remove_queued("small")
            assert taken is not None and taken.request == "small"
            assert "small" not in h.backend.queued() and h.backend.remove_queued("small") is None
            await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "big", timeout=60)
            await asyncio.sleep(0.05)
            assert not [e for e in h.events if getattr(e, "request", None) == "small"]
        finally:
            await self.stop(h)

    async def test_cancel_stops_a_running_request(self):
        h = await self.start("collocated")
        try:
            h.host.catch_up()
            n = self.long_tokens
            h.backend.enqueue_prefill(job("long", max_tokens=n))
            await h.wait(lambda e: isinstance(e, FirstToken) and e.request == "long")
            await asyncio.sleep(0.05)  # decoding
            h.host.catch_up()
            assert h.backend.cancel("long") is True
            fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "long", timeout=5)
            assert fin.error == "cancelled" and fin.output_tokens < n
            await asyncio.sleep(0.2)
            assert len([e for e in h.events if isinstance(e, RequestFinished) and e.request == "long"]) == 1
            assert not [m for m in h.tokens if m.request == "long" and m.kind in ("done", "error")]
            assert h.backend.cancel("long") is False and h.backend.cancel("never-seen") is False
        finally:
            await self.stop(h)

    async def test_switches_role_when_ordered(self):
        h = await self.start("prefill")
        try:
            assert h.backend.role == "prefill"
            h.host.catch_up()
            h.backend.order_switch("decode", "in_place")
            sw = await h.wait(lambda e: isinstance(e, RoleSwitched))
            assert (sw.node, sw.role) == (h.backend.node_id, "decode") and h.backend.role == "decode"
        finally:
            await self.stop(h)


def stored_l1(h: Harness) -> set:
    return {b for e in h.events if isinstance(e, KvStored) and e.tier == "L1" for b in e.blocks}


class TestSimBackend(BackendContract):
    time_scale = 50.0

    async def make(self, h, role):
        from engine.backends.sim.backend import SimBackend

        return SimBackend(h.host, "n1", role, PROFILE, seed=1)

    async def test_ends_its_turn_before_the_budget(self):
        """A gateway request (ignore_eos false) ends at its drawn length with "stop"; asked to
        ignore EOS it runs to max_tokens with "length" (engine/backends/sim/lengths.py)."""
        from engine.backends.sim.lengths import sim_output_tokens

        h = await self.start("collocated")
        try:
            h.host.catch_up()
            h.backend.enqueue_prefill(replace(job("turn", max_tokens=64_000), ignore_eos=False))
            h.backend.enqueue_prefill(replace(job("bench", max_tokens=40, blocks=range(7000, 7006)), ignore_eos=True))
            want = sim_output_tokens("turn", 64_000, ignore_eos=False)
            for rid, n, finish in (("turn", want, "stop"), ("bench", 40, "length")):
                fin = await h.wait(lambda e, rid=rid: isinstance(e, RequestFinished) and e.request == rid)
                assert fin.output_tokens == n
                done = [m for m in h.tokens if m.request == rid and m.kind == "done"]
                assert len(done) == 1 and done[0].total == n and done[0].finish_reason == finish
            assert want < 64_000
        finally:
            await self.stop(h)


class TestSglangBackendOnTheFake(BackendContract):
    async def make(self, h, role):
        from engine.backends.sglang.backend import SglangBackend, SglangConfig
        from engine.backends.sglang.fake import FakeSglang

        mode = "null" if role == "collocated" else role
        self.fake = FakeSglang(mode=mode, kv_events_port=0, page_size=16, decode_s_per_token=0.001,
                               prefill_s_per_token=2e-5)
        url = await self.fake.start()
        cfg = SglangConfig(url=url, kv_events_endpoint=f"tcp://127.0.0.1:{self.fake.kv_events_port}")
        backend = SglangBackend(h.host, "n1", role, PROFILE, cfg)
        return backend

    async def start(self, role):
        h = await super().start(role)
        await asyncio.sleep(0.2)  # ZMQ slow joiner: the SUB socket needs a moment to connect
        return h

    async def close(self, h):
        await h.backend.close()
        await self.fake.stop()




class TestVllmBackendOnTheFake(BackendContract):
    """Attach-only vLLM on its fake: collocated only, so an ordered switch is acknowledged with
    the old role (``mechanism="refused"``) instead of carried out."""

    async def make(self, h, role):
        from engine.backends.vllm.backend import VllmBackend, VllmConfig
        from engine.backends.vllm.fake import FakeVllm

        self.fake = FakeVllm(kv_events_port=0, block_size=16, decode_s_per_token=0.001, prefill_s_per_token=2e-5)
        url = await self.fake.start()
        cfg = VllmConfig(url=url, kv_events_endpoints=[f"tcp://127.0.0.1:{self.fake.kv_events_port}"])
        return VllmBackend(h.host, "n1", role, PROFILE, cfg)

    async def start(self, role):
        h = await super().start(role)
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        return h

    async def close(self, h):
        await h.backend.close()
        await self.fake.stop()

    async def test_switches_role_when_ordered(self):
        h = await self.start("collocated")
        try:
            h.host.catch_up()
            h.backend.order_switch("prefill", "in_place")
            sw = await h.wait(lambda e: isinstance(e, RoleSwitched))
            assert (sw.node, sw.role, sw.mechanism) == (h.backend.node_id, "collocated", "refused")
            assert h.backend.role == "collocated"
        finally:
            await self.stop(h)


class TestTorchBackend(BackendContract):
    """The torch reference engine on a tiny random checkpoint (GGUF written by the test)."""

    big_blocks = 12
    long_tokens = 1500  # the tiny model's context is 2,048
    ckpt = None

    @pytest.fixture(autouse=True)
    def _checkpoint(self, tmp_path_factory):
        from tests.unit.engine.torch.cluster import tiny_checkpoint

        if TestTorchBackend.ckpt is None:
            TestTorchBackend.ckpt = tiny_checkpoint(tmp_path_factory.mktemp("torch-engine") / "tiny.gguf")

    async def make(self, h, role):
        from engine.backends.torch.backend import Message, TorchBackend, TorchConfig
        from engine.kvplane import LocalExchange
        from engine.transfer.loopback import LoopbackFabric

        cfg = TorchConfig(l1_blocks=64, l2_blocks=128, staging_blocks=8, fabric=LoopbackFabric(),
                          exchange=LocalExchange(messages=Message))
        return TorchBackend(h.host, "n1", role, PROFILE, cfg, checkpoint=self.ckpt)
