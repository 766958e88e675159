"""The worker fills ``PrefillJob.tokens`` / ``DecodeJob.tokens`` from the prompt store
(engine/worker/prompts.py): found, missing (a replayed trace), a failing store, a reroute while
the ids are on their way, and a decode node; on the in-memory bus and store with the sim node."""

from __future__ import annotations

import asyncio

from engine.backends.sim.backend import SimBackend
from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import RequestFinished, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.prompts import InMemoryPromptStore
from services.adapters.bus.tokens import MemoryTokens

PROFILE = load_profile("gb300-glm52")


class Recording(SimBackend):
    """The sim node, remembering the tokens each job reached it with."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.prefill_tokens: dict[str, object] = {}
        self.decode_tokens: dict[str, object] = {}

    def enqueue_prefill(self, job) -> None:
        self.prefill_tokens[job.request] = None if job.tokens is None else list(job.tokens)
        super().enqueue_prefill(job)

    def kv_arrived(self, job) -> None:
        self.decode_tokens[job.request] = None if job.tokens is None else list(job.tokens)
        super().kv_arrived(job)


class SlowStore(InMemoryPromptStore):
    def __init__(self, delay_s: float, fail: bool = False) -> None:
        super().__init__()
        self.delay_s, self.fail = delay_s, fail

    async def get(self, request):
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("the bucket's server is gone")
        return await super().get(request)


def worker(bus, tokens, node, role, store) -> EngineWorker:
    return EngineWorker(bus, tokens, node, role, PROFILE, time_scale=20.0, heartbeat_s=0.05, prompts=store,
                        backend=lambda host, w: Recording(host, node, role, PROFILE))


def submit(rid: str, prompt_tokens: int = 200) -> RequestSubmitted:
    return RequestSubmitted(ts=0.0, src="gw", request=rid, branch="b", blocks=[7, 8, 9],
                            prompt_tokens=prompt_tokens, max_tokens=3)


async def finished(bus, rids: set[str], timeout: float = 10.0) -> None:
    async def run():
        left = set(rids)
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if type(d.event) is RequestFinished:
                    left.discard(d.event.request)
                    if not left:
                        return
    await asyncio.wait_for(run(), timeout)


async def test_prefill_jobs_get_the_stored_ids_and_a_missing_entry_falls_back_to_none(partition):
    bus, tokens, store = InMemoryBus(partition), MemoryTokens(partition), InMemoryPromptStore()
    w = worker(bus, tokens, "n1", "collocated", store)
    await w.start()
    try:
        ids = list(range(100, 300))
        await store.put("r1", ids)
        for rid in ("r1", "replayed"):  # "replayed": a trace request, nothing in the store
            await bus.publish(submit(rid))
            await bus.publish(RouteDecided(ts=0.0, request=rid, prefill_node="n1", decode_node="n1", policy="t"))
        await finished(bus, {"r1", "replayed"})
        assert w.backend.prefill_tokens == {"r1": ids, "replayed": None}
        assert (w.prompt_fetch.found, w.prompt_fetch.missing, w.prompt_fetch.failed) == (1, 1, 0)
    finally:
        await w.stop()


async def test_a_failing_store_is_logged_and_the_job_still_runs(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    store = SlowStore(0.01, fail=True)
    w = worker(bus, tokens, "n1", "collocated", store)
    await w.start()
    try:
        await bus.publish(submit("r1"))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
        await finished(bus, {"r1"})
        assert w.backend.prefill_tokens == {"r1": None} and w.prompt_fetch.failed == 1
    finally:
        await w.stop()


async def test_a_reroute_while_the_ids_are_on_their_way_takes_the_job_back(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    store = SlowStore(0.5)
    await store.put("r1", [1, 2, 3])
    w = worker(bus, tokens, "n1", "collocated", store)
    await w.start()
    try:
        await bus.publish(submit("r1"))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
        for _ in range(200):
            if w.prompt_fetch.pending() == ["r1"]:
                break
            await asyncio.sleep(0.01)
        assert w.prompt_fetch.pending() == ["r1"]  # the event loop went on while the read waits
        await bus.publish(RouteDecided(ts=0.1, request="r1", prefill_node="n2", decode_node="n2", policy="t"))
        for _ in range(200):
            if not w.prompt_fetch.pending():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)  # past the read's delay: the cancelled job never reaches the backend
        assert w.prompt_fetch.pending() == [] and "r1" not in w.backend.prefill_tokens
        assert "r1" not in w._queued_here
    finally:
        await w.stop()


async def test_the_decode_node_gets_the_ids_too(partition):
    bus, tokens, store = InMemoryBus(partition), MemoryTokens(partition), InMemoryPromptStore()
    p = worker(bus, tokens, "p1", "prefill", store)
    d = worker(bus, tokens, "d1", "decode", store)
    await p.start()
    await d.start()
    try:
        ids = [5] * 200
        await store.put("r1", ids)
        await bus.publish(submit("r1"))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="p1", decode_node="d1", policy="t"))
        await finished(bus, {"r1"})
        assert p.backend.prefill_tokens == {"r1": ids} and d.backend.decode_tokens == {"r1": ids}
    finally:
        await d.stop()
        await p.stop()
