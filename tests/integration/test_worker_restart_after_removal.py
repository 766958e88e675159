"""A worker killed mid-decode and restarted more slowly than the heartbeat timeout (``evolving
chaos --engines torch``, kill-engine-decode under load: the torch worker took 8 s to come back)
must still say that its previous run's KV and requests are gone (``NodeRemoved(reason=
"restarted")`` before its registration). Before, it said so only when the stream still listed
the node; once the liveness watcher had removed it for silence the restarted worker just
registered again, the watcher took that for a late node coming back with its decodes running,
and the requests that had been decoding on the killed process never ended (they hung)."""

from __future__ import annotations

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import FirstToken, NodeRegistered, NodeRemoved, RequestFinished, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from services.cores.liveness import LivenessWatcher
from tests.integration.test_worker import all_events, submit, wait_for_event

PROFILE = load_profile("gb300-glm52")


async def _killed(w: EngineWorker) -> None:
    """SIGKILL, in process: the tasks end, nothing is published (no NodeRemoved, no snapshot)."""
    for t in w._tasks:
        t.cancel()
    for t in w._tasks:
        try:
            await t
        except BaseException:  # noqa: BLE001, S110 - cancelled (or failed) the way a killed process is
            pass
    await w.backend.close()


def _lost_decodes(events) -> list[RequestFinished]:
    """The liveness watcher (planner service) folding the stream: the decodes it fails."""
    watcher = LivenessWatcher(timeout_s=6.0)
    out = []
    for ev in events:
        out += [e for e in watcher.apply(ev) if isinstance(e, RequestFinished)]
    return out


async def test_a_restart_after_a_removal_for_silence_still_says_restarted_and_its_decodes_end(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    await w.start()
    await bus.publish(submit("r1", max_tokens=10_000))
    await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="p0", decode_node="d0", policy="t"))
    await bus.publish(FirstToken(ts=1.0, src="p0", request="r1", node="p0"))  # decoding on d0 from here
    await _killed(w)
    # the watcher's removal for silence lands while the new process is still starting
    await bus.publish(NodeRemoved(ts=8.0, src="liveness", node="d0", reason="heartbeat timeout: silent for 6.4 s > 6 s"))
    w2 = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    await w2.start()
    try:
        await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered) and e.node == "d0", start=w2._head + 1)
        events = await all_events(bus)
        own = [(type(e).__name__, getattr(e, "reason", None)) for e in events[w2._head:]
               if isinstance(e, NodeRemoved | NodeRegistered) and e.node == "d0" and e.src == "d0"]
        assert own[:2] == [("NodeRemoved", "restarted"), ("NodeRegistered", None)], own
        lost = _lost_decodes(events)
        assert [(e.request, e.node) for e in lost] == [("r1", "d0")]
        assert "restarted" in lost[0].error
    finally:
        await w2.stop()


async def test_a_node_that_said_shutdown_restarts_without_another_removal(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    await w.start()
    await w.stop()  # NodeRemoved(shutdown): its requests were already failed then
    w2 = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    await w2.start()
    try:
        events = await all_events(bus)
        assert [e.reason for e in events if isinstance(e, NodeRemoved)] == ["shutdown"]
        assert sum(isinstance(e, NodeRegistered) for e in events) == 2
    finally:
        await w2.stop()


async def test_a_removal_for_silence_just_past_the_start_head_still_gets_restarted(partition):
    """The same race one step later (``chaos --engines --quick`` at load ~6, 2 Dec 2026): the
    watcher's removal lands after the new process read its start head and before it checks, so
    the stream no longer lists the node and the removal is not "what a previous run left"."""
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    await w.start()
    await bus.publish(submit("r1", max_tokens=10_000))
    await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="p0", decode_node="d0", policy="t"))
    await bus.publish(FirstToken(ts=1.0, src="p0", request="r1", node="p0"))
    await _killed(w)
    head_of = bus.last_seq

    async def head_then_removal() -> int:  # the removal is published right after the head is read
        head = await head_of()
        await bus.publish(NodeRemoved(ts=8.0, src="liveness", node="d0", reason="heartbeat timeout: silent for 6.1 s > 6 s"))
        return head

    w2 = EngineWorker(bus, tokens, "d0", "decode", PROFILE, heartbeat_s=0.05, snapshot_every=10**6)
    bus.last_seq = head_then_removal
    try:
        await w2.start()
    finally:
        bus.last_seq = head_of
    try:
        await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered) and e.node == "d0", start=w2._head + 1)
        events = await all_events(bus)
        own = [(type(e).__name__, getattr(e, "reason", None)) for e in events[w2._head:]
               if isinstance(e, NodeRemoved | NodeRegistered) and e.node == "d0" and e.src == "d0"]
        assert own[:2] == [("NodeRemoved", "restarted"), ("NodeRegistered", None)], own
        assert [(e.request, e.node) for e in _lost_decodes(events)] == [("r1", "d0")]
    finally:
        await w2.stop()
