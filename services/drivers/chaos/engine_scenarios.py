"""The scenarios that hit engine workers (``--engines`` only): a worker killed mid-prefill or
mid-decode, and a KV transfer cut mid-way (``--kv-bytes`` workers)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from events.catalog import (
    FirstToken,
    KvEvicted,
    KvStored,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RoleSwitched,
)
from services.cores.directory.core import DirectoryCore
from services.drivers.chaos.accounting import ScenarioResult
from services.drivers.chaos.load import PARTITIONED
from services.drivers.chaos.progress import Progress
from services.drivers.chaos.recovery import recover
from services.drivers.chaos.supervisor import ChaosCluster


def _in_flight(stack: ChaosCluster, node: str, phase: str, upto: int | None = None) -> set[str]:
    """Requests the harness's copy of the stream (its first ``upto`` deliveries, default all)
    shows running ``phase`` on ``node``: a prefill started without its first token, a decode
    started without its end."""
    upto = len(stack.tail.deliveries) if upto is None else upto
    started: set[str] = set()
    # what runs now started recently (and the scan stays cheap)
    for d in stack.tail.deliveries[max(0, upto - 4000):upto]:
        ev, t = d.event, type(d.event)
        if t is RequestStarted and ev.node == node and ev.phase == phase:
            started.add(ev.request)
        elif (t is FirstToken and phase == "prefill") or t is RequestFinished:
            started.discard(ev.request)
    return started


def _role_of(stack: ChaosCluster, node: str) -> str:
    """The node's role as the stream last said (a planner switch may have moved it)."""
    role = dict(stack.nodes)[node]
    for d in stack.tail.deliveries:
        ev = d.event
        if type(ev) in (NodeRegistered, RoleSwitched) and ev.node == node:
            role = ev.role
    return role


def _serving(stack: ChaosCluster, phase: str) -> str:
    """The first node (sorted, the one partition-engine stops last) whose role, as the stream
    last said, serves ``phase``: the planner may have switched the nodes' roles meanwhile."""
    nodes = [n for n, _ in sorted(stack.nodes) if n != PARTITIONED] + [n for n, _ in stack.nodes if n == PARTITIONED]
    for n in nodes:
        if _role_of(stack, n) in (phase, "collocated"):
            return n
    return nodes[0]


class _Stalled(Exception):
    """A wait given up: nothing moved for too long (not a "not yet" for ``ChaosCluster.wait``)."""


def kill_engine(phase: str) -> Callable[[ChaosCluster, ScenarioResult], Awaitable[None]]:
    """SIGKILL the worker of a node serving ``phase`` (:func:`_serving`) while the stream shows
    requests running ``phase`` on it (its
    queue, its running batch and the events it had not published yet die with it), start it
    again at once. Each of those requests must end: re-routed and finished elsewhere (a
    prefill: nothing had reached the client), or failed with an error (a decode: the liveness
    watcher's ``RequestFinished(error=...)``); the hung column counts any that never ends. A
    ``NodeRemoved`` of the node must come before the restarted worker's registration (its own
    ``restarted``, or the watcher's when the restart outlasted the heartbeat timeout), and a
    directory folding the stream must hold none of the node's old KV at that point."""

    async def run(stack: ChaosCluster, res: ScenarioResult) -> None:
        node = _serving(stack, phase)

        async def busy() -> bool:
            return bool(_in_flight(stack, node, phase))

        with contextlib.suppress(TimeoutError):  # under little load: kill it anyway
            await stack.wait(busy, 20, f"a request in {phase} on {node}", every_s=0.05)
        # the victims are what the copy shows up to ``mark``, and their ends are looked for from
        # ``mark`` on: the tail reads on while this awaits the head, so a victim's end read
        # meanwhile fell before a mark taken after the await, and the victim "never ended"
        # (kill-engine-decode in CI at 606 s: 1 never ended, yet no request of the run hung)
        mark = len(stack.tail.deliveries)
        victims = _in_flight(stack, node, phase, mark)
        role = _role_of(stack, node)
        head = await stack.bus.last_seq()
        t = time.monotonic()
        stack.kill_engine(node)
        stack.spawn_engine(node, role)

        async def registered() -> bool:
            return any(type(d.event) is NodeRegistered and d.event.node == node for d in stack.tail.deliveries[mark:])

        await stack.wait(registered, 120 if stack.kv_bytes else 45, f"the restarted {node} to register")
        res.recover_s = await recover(stack, t, head)

        def ended() -> dict[str, str]:
            """victim -> "" when it finished, else the error it failed with"""
            out: dict[str, str] = {}
            for d in stack.tail.deliveries[mark:]:
                if type(d.event) is RequestFinished and d.event.request in victims:
                    out[d.event.request] = min(out.get(d.event.request, d.event.error), d.event.error, key=len)
            return out

        # the re-routed ones queue behind the live nodes' backlog (minutes on a loaded machine):
        # wait until they end, or until no engine work at all has moved for 45 s - not a fixed
        # time, which under load cut off victims still queued. The load pauses meanwhile (below),
        # so the backlog only drains, and a stall means what is left has stopped. (A first try
        # also gave up 30 s after every other request decided before the kill had finished: it
        # cut off a victim that then finished, at load average 12.)
        watch = Progress(stack.tail, stall_s=45.0, since=mark)  # the work since the kill counts

        async def all_ended() -> bool:
            if len(ended()) == len(victims):
                return True
            if watch.stalled():
                raise _Stalled
            return False

        # no new requests meanwhile (heartbeats go on): under load the engines fall behind the
        # generator and the backlog the victims queue behind would grow while the row waits
        # (kill-engine-prefill waited 4 minutes at load average 25 with the load on)
        stack.load.paused = True
        try:
            with contextlib.suppress(TimeoutError, _Stalled):
                await stack.wait(all_ended, 900, f"the {len(victims)} requests in {phase} on {node} to end",
                                 every_s=0.5)
        finally:
            stack.load.paused = False
        done = ended()
        failed = sum(1 for e in done.values() if e)
        forgot, why = await asyncio.to_thread(_kv_forgotten, stack, node, mark)
        res.survived = len(done) == len(victims) and forgot
        res.detail = (f"killed {node} ({role}) with {len(victims)} requests in {phase}: "
                      f"{len(done) - failed} re-routed and finished, {failed} failed with an error, "
                      f"{len(victims) - len(done)} never ended; {why}")
    return run


def _kv_forgotten(stack: ChaosCluster, node: str, mark: int) -> tuple[bool, str]:
    """Fold the harness's stream through a fresh directory: at the restarted worker's
    registration (after ``mark``), is every block of the node's old KV gone from it?"""
    deliveries = list(stack.tail.deliveries)  # a copy: the tail grows meanwhile
    reg = next((d for d in deliveries[mark:]
                if type(d.event) is NodeRegistered and d.event.node == node), None)
    if reg is None:
        return False, f"{node} did not register again"
    removed = [d for d in deliveries[mark:]
               if type(d.event) is NodeRemoved and d.event.node == node and d.seq < reg.seq]
    if not removed:  # the worker's own (restarted), or the watcher's if it was silent that long
        return False, f"no NodeRemoved({node}) before its registration"
    directory = DirectoryCore()
    held_before = 0
    for d in deliveries:
        if d.seq == removed[0].seq and node in directory.nodes():
            held_before = sum(len(directory.copies(node, tier)) for tier in ("L1", "L2"))
        if d.seq >= reg.seq:
            break
        directory.apply(d.event)
    left = sum(len(directory.copies(node, tier)) for tier in ("L1", "L2")) if node in directory.nodes() else 0
    return left == 0, (f"the directory forgot its {held_before} blocks at the restart" if left == 0
                       else f"the directory still held {left} blocks of {node} after its restart")


async def cut_kv_transfer(stack: ChaosCluster, res: ScenarioResult) -> None:
    """Arm a cut on the next KV transfer of a node serving prefill (its next P->D push: it
    writes the blocks into the decode node's slots; SIGUSR1, services/drivers/chaos/engine_faults.py):
    half of the bytes arrive, the transport says done. The receiver's checksums must refuse it
    and the request recompute the refused blocks (``kv_recompute`` in its log: ``KvEvicted`` then
    ``KvStored`` of them for the request on the stream) and finish; nothing is lost."""
    node = _serving(stack, "prefill")
    offsets = {n: stack.engine_log_size(n) for n, _ in stack.nodes}
    head = await stack.bus.last_seq()
    mark = len(stack.tail.deliveries)
    t = time.monotonic()
    stack.cut_transfer(node)

    def refusals() -> list[tuple[str, dict]]:
        """(receiver, its kv_recompute record) after a checksum refusal in its log (a push is
        checked by ``kv_checksum_mismatch``, a read by ``kv_transfer_refused``); other
        recomputes (bytes a peer no longer had) are not this fault's"""
        out = []
        for n, _ in stack.nodes:
            recs = stack.engine_log(n, offsets[n])
            i = next((k for k, r in enumerate(recs)
                      if r.get("event") in ("kv_checksum_mismatch", "kv_transfer_refused")), None)
            if i is not None:
                out += [(n, r) for r in recs[i:] if r.get("event") == "kv_recompute"][:1]
        return out

    async def refused() -> bool:
        return bool(refusals())

    await stack.wait(refused, 30, f"a receiver to refuse {node}'s cut transfer", every_s=0.2)
    res.recover_s = await recover(stack, t, head)
    receiver, rec = refusals()[0]
    request, blocks = rec.get("request"), int(rec.get("blocks", 0))

    # the sim's data plane adopts the landed blocks, then evicts the refused ones (KvEvicted) and
    # stores them again for the request; the torch engine checks before it adopts anything, so
    # the refused blocks were never held there and the recompute stores them (KvStored) alone
    torch = stack.engine_backend == "torch"

    def trail() -> tuple[bool, bool, str | None]:
        evicted = stored = False
        error = None
        for d in stack.tail.deliveries[mark:]:
            ev, ty = d.event, type(d.event)
            if ty is KvEvicted and ev.node == receiver:
                evicted = True
            elif ty is KvStored and ev.node == receiver and ev.request == request and (evicted or torch):
                stored = True
            elif ty is RequestFinished and ev.request == request:
                error = ev.error
        return evicted, stored, error

    async def finished() -> bool:
        return trail()[2] is not None

    def recomputed_now() -> bool:
        evicted, stored, _ = trail()
        return stored if torch else evicted and (stored or rec.get("kv_event") == "KvFetched")

    async def done() -> bool:
        # the request's end and the recompute's events come in either order: with the sim, the
        # decode may finish before the plane's transfer lands and is refused (one run read the
        # trail at the RequestFinished and found neither the KvEvicted nor the KvStored yet)
        return trail()[2] is not None and recomputed_now()

    with contextlib.suppress(TimeoutError):
        await stack.wait(finished, 60, f"{request} to finish", every_s=0.2)
    with contextlib.suppress(TimeoutError):
        await stack.wait(done, 30, f"the recompute of {request}'s refused blocks on the stream", every_s=0.2)
    evicted, stored, error = trail()
    recomputed = recomputed_now()
    res.survived = error == "" and recomputed
    res.detail = (f"cut {node}'s next transfer: {receiver} refused {blocks} blocks of {request} "
                  f"({rec.get('kv_event')}) and recomputed them: evicted {evicted}, stored again {stored}; "
                  + ("the request finished" if error == "" else
                     f"the request failed: {error}" if error else "the request never finished"))
