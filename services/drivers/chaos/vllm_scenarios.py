"""The scenarios that hit the vLLM side of a node (``--engines vllm`` only): its server killed
mid-decode, its KV-event socket cut (services/drivers/chaos/vllm_engines.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from events.catalog import AnomalyReported, KvStored, NodeRegistered, RequestFinished, RequestStarted
from services.cores.directory.core import DirectoryCore
from services.drivers.chaos.accounting import ScenarioResult
from services.drivers.chaos.engine_scenarios import _in_flight, _serving
from services.drivers.chaos.recovery import recover
from services.drivers.chaos.supervisor import ChaosCluster

RESYNC = "engine_kv_resync"  # the worker's AnomalyReported kind when it drops its view (vllm/backend.py, 7)


def _resyncs(stack: ChaosCluster, node: str, mark: int) -> list:
    """The node's view drops after delivery ``mark`` (their deliveries)."""
    return [d for d in stack.tail.deliveries[mark:]
            if type(d.event) is AnomalyReported and d.event.kind == RESYNC and d.event.src == node]


def _held(stack: ChaosCluster, node: str, upto_seq: int, only: set[int] | None = None) -> int:
    """Blocks of ``node`` a directory folding the stream up to ``upto_seq`` holds (of ``only``)."""
    directory = DirectoryCore()
    for d in list(stack.tail.deliveries):
        if d.seq > upto_seq:
            break
        directory.apply(d.event)
    if node not in directory.nodes():
        return 0
    held = set().union(*(directory.copies(node, tier) for tier in ("L1", "L2")))
    return len(held if only is None else held & only)


def _stored_before(stack: ChaosCluster, node: str, mark: int) -> set[int]:
    """The block hashes the stream said ``node`` stored before delivery ``mark``."""
    return {h for d in stack.tail.deliveries[:mark] if type(d.event) is KvStored and d.event.node == node
            for h in d.event.blocks}


def _served_after(stack: ChaosCluster, node: str, seq: int) -> int:
    """Requests finished without an error on ``node`` after stream sequence ``seq``."""
    return sum(1 for d in stack.tail.deliveries if d.seq > seq and type(d.event) is RequestFinished
               and d.event.node == node and not d.event.error)


async def kill_vllm_server(stack: ChaosCluster, res: ScenarioResult) -> None:
    """SIGKILL the vLLM server (API server and engine core) of a node while the stream shows a
    request decoding on it, and start it again at once; its worker stays. The requests it was
    running must end (with an error: their tokens were streaming), nothing may hang; once the new
    server answers, the worker must notice it is a new instance (its sequence starts over, its
    start time differs) and drop the node's view, so the directory holds none of the old
    server's blocks; the node must then serve again and its view refill from the new server's
    events. The load pauses while the server loads (minutes here), as for a killed worker."""
    node = _serving(stack, "decode")

    async def busy() -> bool:
        return bool(_in_flight(stack, node, "decode"))

    with contextlib.suppress(TimeoutError):  # under little load: kill it anyway
        await stack.wait(busy, 60, f"a request decoding on {node}", every_s=0.05)
    mark = len(stack.tail.deliveries)
    victims = _in_flight(stack, node, "decode", mark)
    old = _stored_before(stack, node, mark)
    head = await stack.bus.last_seq()
    t = time.monotonic()
    stack.vllm.kill_server(node)
    stack.vllm.start_server(node)

    def ended() -> dict[str, str]:
        return {d.event.request: d.event.error for d in stack.tail.deliveries[mark:]
                if type(d.event) is RequestFinished and d.event.request in victims}

    stack.load.paused = True
    try:
        await stack.wait(lambda: asyncio.to_thread(stack.vllm.healthy, node), 900, f"{node}'s vLLM server to load",
                         every_s=1.0)
        t_up = time.monotonic() - t

        async def dropped() -> bool:
            return bool(_resyncs(stack, node, mark))

        await stack.wait(dropped, 60, f"{node}'s worker to drop the old server's blocks")
    finally:
        stack.load.paused = False
    res.recover_s = await recover(stack, t, head)
    drop = _resyncs(stack, node, mark)[0]

    async def all_ended() -> bool:
        return len(ended()) == len(victims)

    with contextlib.suppress(TimeoutError):
        await stack.wait(all_ended, 120, f"the {len(victims)} requests decoding on {node} to end", every_s=0.5)

    async def serving_again() -> bool:
        refilled = any(type(d.event) is KvStored and d.event.node == node and d.seq > drop.seq
                       for d in stack.tail.deliveries)
        return refilled and _served_after(stack, node, drop.seq) > 0

    with contextlib.suppress(TimeoutError):
        await stack.wait(serving_again, 180, f"{node} to serve again and its view to refill", every_s=0.5)
    done = ended()
    failed = sum(1 for e in done.values() if e)
    left = await asyncio.to_thread(_held, stack, node, drop.seq, old)
    again = await serving_again()
    res.survived = len(done) == len(victims) and left == 0 and again
    res.detail = (f"killed {node}'s vLLM server with {len(victims)} requests decoding: {failed} failed with an "
                  f"error, {len(done) - failed} finished, {len(victims) - len(victims & set(done))} never ended; "
                  f"it answered again after {t_up:.0f} s; the worker dropped the view ({drop.event.detail}); "
                  f"the directory held {left} of the old server's {len(old)} blocks after that; "
                  + ("serving again with its view refilling" if again else "it did not serve again"))


async def cut_kv_events(stack: ChaosCluster, res: ScenarioResult) -> None:
    """Cut a node's KV-event socket (kill the forwarder between its server and its worker) while
    requests run on it, until the server has stored blocks nobody heard of (two requests that
    started on the node after the cut - each brings new blocks of its branch - have finished),
    then mend it. The worker must see the gap in the sequence at the
    next event, drop the node's view (the directory then holds none of the blocks it knew) and
    reset the server's prefix cache, and the view must refill from the events after it."""
    node = _serving(stack, "decode")
    mark = len(stack.tail.deliveries)
    head = await stack.bus.last_seq()
    t = time.monotonic()
    stack.vllm.cut(node)

    async def missed() -> bool:  # two requests ran on it while nobody listened
        started = {d.event.request for d in stack.tail.deliveries[mark:]
                   if type(d.event) is RequestStarted and d.event.node == node and d.event.phase == "prefill"}
        return sum(1 for d in stack.tail.deliveries[mark:] if type(d.event) is RequestFinished
                   and d.event.node == node and not d.event.error and d.event.request in started) >= 2

    try:
        await stack.wait(missed, 180, f"two requests to run on {node} with its event socket cut", every_s=0.5)
    finally:
        stack.vllm.start_proxy(node)
    t_mend = time.monotonic()

    async def dropped() -> bool:
        return bool(_resyncs(stack, node, mark))

    await stack.wait(dropped, 180, f"{node}'s worker to see the gap and drop its view", every_s=0.5)
    drop = _resyncs(stack, node, mark)[0]
    res.recover_s = await recover(stack, t, head)
    left = await asyncio.to_thread(_held, stack, node, drop.seq)

    async def refilled() -> bool:
        return any(type(d.event) is KvStored and d.event.node == node and d.seq > drop.seq
                   for d in stack.tail.deliveries) and _served_after(stack, node, drop.seq) > 0

    with contextlib.suppress(TimeoutError):
        await stack.wait(refilled, 180, f"{node}'s view to refill", every_s=0.5)
    again = await refilled()
    reregistered = any(type(d.event) is NodeRegistered and d.event.node == node for d in stack.tail.deliveries[mark:])
    res.survived = left == 0 and again and not reregistered
    res.detail = (f"cut {node}'s KV-event socket for {t_mend - t:.0f} s; the worker dropped its view "
                  f"{time.monotonic() - t_mend:.0f} s after the mend or less ({drop.event.detail}); the directory "
                  f"held {left} of its blocks after that; "
                  + ("its view refilled from later events" if again else "its view did not refill")
                  + ("; the node registered again (it should not have)" if reregistered else ""))
