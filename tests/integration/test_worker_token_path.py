"""The progress loop publishes an iteration's token messages itself when nothing waits in the
worker's queue (engine/worker/publish.py, ``_progress_step``): they reach the token channel
before the step returns, without the publisher task; and whatever path a message takes, the
node's token messages and events reach the bus's connection in the order they were emitted."""

from __future__ import annotations

import asyncio

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.wire import TokenMsg
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens

PROFILE = load_profile("gb300-glm52")


def _worker(partition: str) -> tuple[EngineWorker, list[str]]:
    wire: list[str] = []  # what reached the connection, in order

    class Bus(InMemoryBus):
        async def publish(self, event, *, msg_id=None, shadow=None) -> int:
            wire.append(type(event).__name__)
            return await super().publish(event, msg_id=msg_id, shadow=shadow)

    class Tokens(MemoryTokens):
        async def publish(self, msg: TokenMsg) -> None:
            wire.append(msg.kind)
            await super().publish(msg)

    return EngineWorker(Bus(partition), Tokens(partition), "n1", "collocated", PROFILE), wire


def _tok(kind: str) -> TokenMsg:
    return TokenMsg(request="r1", kind=kind, tokens=1, total=1, node="n1")


async def test_an_idle_publishers_tokens_go_out_from_the_step_in_order(partition):
    w, wire = _worker(partition)
    publisher = asyncio.create_task(w._publisher())
    await asyncio.sleep(0)  # the publisher waits on its empty queue

    def progress():  # one iteration: a chunk, an event, a chunk (as a RequestFinished between them would)
        w._out_token(_tok("first"))
        w._out.put_nowait(w.registration())  # what _on_emit does with an event
        w._out_token(_tok("chunk"))

    await w._progress_step(progress)
    assert wire == ["first"]  # sent by the step itself, before the publisher ran
    await asyncio.wait_for(w._out.join(), 5)
    assert wire == ["first", "NodeRegistered", "chunk"]  # the chunk after the event queued behind it

    def chunks():
        w._out_token(_tok("chunk"))
        w._out_token(_tok("done"))

    await w._progress_step(chunks)
    assert wire[3:] == ["chunk", "done"] and w._out.empty()  # sent before the step returned: no queue
    publisher.cancel()


async def test_while_the_publisher_sends_an_event_tokens_queue_behind_it(partition):
    w, wire = _worker(partition)
    publisher = asyncio.create_task(w._publisher())
    await asyncio.sleep(0)
    async with w._pub_lock:  # the publisher is handing something to the bus (an event awaiting its ack)
        await w._progress_step(lambda: w._out_token(_tok("chunk")))
        assert wire == [] and w._out.qsize() == 1  # not sent past it: queued
    await asyncio.wait_for(w._out.join(), 5)
    assert wire == ["chunk"]
    publisher.cancel()


async def test_tokens_outside_a_progress_step_take_the_queue(partition):
    """A first token comes from the prefill's end callback (engine/backends/sim/backend.py), not
    from the progress loop: it is queued for the publisher as before, not held for a step."""
    w, wire = _worker(partition)
    w._out_token(_tok("first"))
    assert w._out.qsize() == 1 and wire == []
