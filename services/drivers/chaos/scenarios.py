"""The faults, one scenario each (the table in the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from events import codec
from events.catalog import NodeRegistered, NodeRemoved, RequestSubmitted
from events.subjects import subject_for
from services.adapters.aio import wait_for
from services.drivers.chaos.accounting import ScenarioResult
from services.drivers.chaos.engine_scenarios import cut_kv_transfer, kill_engine
from services.drivers.chaos.gateway_scenario import restart_gateway
from services.drivers.chaos.load import LOAD_SRC, PARTITIONED
from services.drivers.chaos.progress import Progress
from services.drivers.chaos.recovery import recover
from services.drivers.chaos.supervisor import SERVICES, SNAPSHOT_KINDS, ChaosCluster
from services.drivers.chaos.vllm_scenarios import cut_kv_events, kill_vllm_server

__all__ = ["Scenario", "recover", "scenarios"]


@dataclass
class Scenario:
    name: str
    fault: str
    run: Callable[[ChaosCluster, ScenarioResult], Awaitable[None]]
    quick: bool = False
    engines_only: bool = False  # kills or restarts an engine worker: only with --engines
    kv_bytes: bool = False  # needs workers moving real KV bytes (the stack then runs them with --kv-bytes)
    #: in ``--engines --quick`` (the engine faults, the CI form with engines; ``quick`` is the
    #: form without engines)
    engine_quick: bool = False
    #: in ``--engines vllm`` (two vLLM nodes, services/drivers/chaos/vllm_engines.py: the faults
    #: of a worker and of its server); ``vllm_only``: needs vLLM servers
    vllm: bool = False
    vllm_only: bool = False


def kill_service(kind: str) -> Callable[[ChaosCluster, ScenarioResult], Awaitable[None]]:
    async def run(stack: ChaosCluster, res: ScenarioResult) -> None:
        head = await stack.bus.last_seq()
        t = time.monotonic()
        stack.kill(kind)
        stack.spawn(kind)
        res.recover_s = await recover(stack, t, head)
        res.survived = True
    return run


def corrupt_snapshot(kind: str) -> Callable[[ChaosCluster, ScenarioResult], Awaitable[None]]:
    async def run(stack: ChaosCluster, res: ScenarioResult) -> None:
        async def present() -> bool:
            return await stack.bus.get_snapshot(kind) is not None

        await stack.wait(present, 20, f"a {kind} snapshot")
        head = await stack.bus.last_seq()
        t = time.monotonic()
        stack.kill(kind)
        data = bytearray(await stack.bus.get_snapshot(kind))
        data[len(data) // 2] ^= 0x04  # one bit, in the middle of the sealed body
        await wait_for(stack.bus.put_snapshot(kind, bytes(data)), 30)
        offset = stack.log_size(kind)
        stack.spawn(kind)
        res.recover_s = await recover(stack, t, head)
        recs = stack.log_events(kind, offset)
        rejected = [r for r in recs if r.get("event") == "snapshot_rejected"]
        starts = [r for r in recs if r.get("event") == "service_start"]
        rebuilt = bool(starts) and starts[0].get("from_snapshot") == 0
        res.survived = bool(rejected) and rebuilt
        res.detail = (f"rejected: {rejected[0].get('reason')}; rebuilt from 0" if res.survived
                      else f"snapshot_rejected logged: {bool(rejected)}, rebuilt from 0: {rebuilt}")
    return run


async def kill_nats_leader(stack: ChaosCluster, res: ScenarioResult) -> None:
    leader = (await stack.bus.stream_info()).leader
    names = [s.server_name for s in stack.cluster.servers]
    i = names.index(leader) if leader in names else 0
    head = await stack.bus.last_seq()
    t = time.monotonic()
    stack.cluster.kill(i)
    try:
        res.recover_s = await recover(stack, t, head)
    finally:
        await asyncio.to_thread(stack.cluster.restart, i)

    async def rejoined() -> bool:
        try:
            inf = await wait_for(stack.bus.stream_info(), 3)
        except Exception:  # noqa: BLE001 - still electing
            return False
        return inf.replicas == 3 and inf.replicas_current == 3  # the leader and two current followers

    await stack.wait(rejoined, 30, f"{names[i]} to rejoin the stream")
    res.survived = True
    res.detail = f"killed {names[i]} (the stream leader); stream still R3, all replicas current"


async def partition_engine(stack: ChaosCluster, res: ScenarioResult) -> None:
    worker = stack.engine_procs.get(PARTITIONED)
    if worker is not None:
        worker.send_signal(signal.SIGSTOP)  # the whole process stops: no heartbeat, no work
    else:
        stack.load.silent.add(PARTITIONED)
    t = time.monotonic()
    start = len(stack.tail.deliveries)

    async def removed() -> bool:
        return any(isinstance(d.event, NodeRemoved) and d.event.node == PARTITIONED
                   for d in stack.tail.deliveries[start:])

    try:
        t_seen = await stack.wait(removed, stack.heartbeat_timeout_s + 15, f"NodeRemoved({PARTITIONED})")
        res.recover_s = t_seen - t
        ticks = Progress(stack.tail)  # a few more of the watcher's ticks: removed once, not once per tick

        async def ticked() -> bool:
            ticks.poll()
            return ticks.ticks >= 2

        with contextlib.suppress(TimeoutError):
            await stack.wait(ticked, 30, "two more planner ticks", every_s=0.1)
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGCONT)
        else:
            stack.load.silent.discard(PARTITIONED)
            await stack.load.register(PARTITIONED, "decode")
    removals = [d for d in stack.tail.deliveries[start:]
                if isinstance(d.event, NodeRemoved) and d.event.node == PARTITIONED]
    res.survived = len(removals) == 1
    res.detail = (f"{PARTITIONED} removed after {res.recover_s:.1f} s of silence "
                  f"(timeout {stack.heartbeat_timeout_s:g} s), {len(removals)} NodeRemoved")
    if worker is None:
        res.detail += "; re-registered"
        return
    after = len(stack.tail.deliveries)

    async def rejoined() -> bool:
        return any(isinstance(d.event, NodeRegistered) and d.event.node == PARTITIONED
                   for d in stack.tail.deliveries[after:])

    # a worker resumed on a busy machine first works through what queued while it was stopped
    # (its registration waits behind its publisher's backlog): a condition, not a short deadline
    try:
        t_rejoin = await stack.wait(rejoined, 60, f"{PARTITIONED} to register again")
        res.detail += f"; the worker registered again {t_rejoin - t_seen:.1f} s after SIGCONT"
    except TimeoutError:
        res.detail += "; after SIGCONT the worker did not register again within 60 s (left out of routing)"


async def restart_all_nats(stack: ChaosCluster, res: ScenarioResult) -> None:
    """SIGKILL all three servers of the cluster (their stores stay, as after a power cut), then
    start all three again: the stream (file storage, R3) must come back whole, and every client
    reconnects by itself."""
    head = await stack.bus.last_seq()
    n = len(stack.cluster.servers)
    t = time.monotonic()
    for i in range(n):
        stack.cluster.kill(i)
    await asyncio.sleep(1.0)  # every client sees the outage
    for i in range(n):
        await asyncio.to_thread(stack.cluster.restart, i)
    res.recover_s = await recover(stack, t, head, timeout_s=60.0)
    last = await wait_for(stack.bus.last_seq(), 10)
    info = await wait_for(stack.bus.stream_info(), 10)
    res.survived = last >= head and info.replicas == n
    res.detail = f"all {n} servers killed and started again; stream head {head} -> {last}, R{info.replicas}"


async def duplicate_publish(stack: ChaosCluster, res: ScenarioResult, window: int = 50) -> None:
    recent = stack.load.published[-window:]
    head = await stack.bus.last_seq()
    t = time.monotonic()
    seqs = await stack.bus.publish_many([p.event for p in recent], msg_ids=[p.msg_id for p in recent])
    same = sum(s == p.seq for s, p in zip(seqs, recent, strict=True))
    res.recover_s = await recover(stack, t, head)
    res.survived = same == len(recent)
    res.detail = f"{len(recent)} republished with their ids: {same} answered with the original sequence"


async def rewind_consumer(stack: ChaosCluster, res: ScenarioResult, behind: int = 100) -> None:
    floor = await stack.bus.consumer_ack_floor("router") or 0
    start = max(1, floor - behind)
    head = await stack.bus.last_seq()
    t = time.monotonic()
    await stack.bus.rewind_consumer("router", start)
    res.recover_s = await recover(stack, t, head)
    res.survived = True
    res.detail = f"router's durable re-created at {start} (ack floor {floor}) while it ran"


def _negative_block_request() -> bytes:
    """A ``RequestSubmitted`` whose block hash is -1: valid msgpack, outside ``[0, 2**64)``."""
    ev = RequestSubmitted(ts=time.time(), src=LOAD_SRC, request="bad/neg", branch="bad", blocks=[7, 8],
                          prompt_tokens=138, max_tokens=16)
    raw = msgspec.msgpack.decode(codec.encode(ev))

    def swap(x):
        if isinstance(x, list) and x == [7, 8]:
            return [7, -1]
        if isinstance(x, list):
            return [swap(v) for v in x]
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x

    return msgspec.msgpack.encode(swap(raw))


async def malformed_events(stack: ChaosCluster, res: ScenarioResult) -> None:
    bus = stack.bus
    good = RequestSubmitted(ts=time.time(), src=LOAD_SRC, request="bad/x", branch="bad", blocks=[1],
                            prompt_tokens=74, max_tokens=16)
    subject = subject_for(good, bus.partition)
    newer = str(int(codec.SCHEMA_VERSION.split(".")[0]) + 1) + ".0"
    bad = [("garbage", b"\xc1\x00garbage\xff" * 4, codec.headers()),
           ("newer-major-schema", codec.encode(good), {codec.SCHEMA_HEADER: newer}),
           ("negative-block-hash", _negative_block_request(), codec.headers())]
    t = time.monotonic()
    seqs = {}
    for i, (what, data, hdrs) in enumerate(bad):
        seqs[what] = await bus.publish_raw(subject, data, hdrs, msg_id=f"chaos:bad:{i}")
    res.recover_s = await recover(stack, t, max(seqs.values()))
    wanted = {(c, s) for s in seqs.values() for c in SERVICES}

    async def all_dead_lettered() -> bool:
        got = {(d.consumer, d.seq) for d in await bus.dead_letters()}
        return wanted <= got

    try:
        await stack.wait(all_dead_lettered, 20, "every malformed event in the dead-letter stream")
        res.survived = True
    except TimeoutError:
        res.survived = False
    got = {(d.consumer, d.seq) for d in await bus.dead_letters()}
    res.detail = (f"{len(wanted & got)}/{len(wanted)} dead letters "
                  f"({len(bad)} messages x {len(SERVICES)} consumers); decisions went on")


def scenarios() -> list[Scenario]:
    out = [Scenario(f"kill-{k}", f"SIGKILL the {k}, restart it", kill_service(k), quick=k in ("router", "planner"))
           for k in SERVICES]
    out.append(Scenario("kill-nats-leader", "SIGKILL the stream's leader server (1 of 3)", kill_nats_leader, True))
    out += [Scenario(f"corrupt-{k}-snapshot", f"flip a bit of the {k} snapshot, restart it", corrupt_snapshot(k),
                     quick=k == "planner") for k in SNAPSHOT_KINDS]
    out += [
        Scenario("partition-engine", f"{PARTITIONED} stops heartbeating", partition_engine, True, engine_quick=True),
        Scenario("duplicate-publish", "republish the last 50 events with their ids", duplicate_publish, True),
        Scenario("rewind-consumer", "re-create the router's durable 100 behind its ack floor", rewind_consumer),
        Scenario("malformed-events", "garbage, newer major schema, negative block hash", malformed_events, True),
        Scenario("restart-all-nats", "SIGKILL all 3 NATS servers, start them again", restart_all_nats),
        Scenario("kill-engine-prefill", "SIGKILL a prefill worker mid-prefill, restart it", kill_engine("prefill"),
                 engines_only=True, engine_quick=True),
        Scenario("kill-engine-decode", "SIGKILL a decode worker mid-decode, restart it", kill_engine("decode"),
                 engines_only=True, engine_quick=True, vllm=True),
        Scenario("kill-vllm-server", "SIGKILL a vLLM server mid-decode, start it again", kill_vllm_server,
                 engines_only=True, vllm=True, vllm_only=True),
        Scenario("cut-kv-events", "cut a vLLM server's KV-event socket, mend it", cut_kv_events,
                 engines_only=True, vllm=True, vllm_only=True),
        Scenario("cut-kv-transfer", "cut a KV transfer mid-way (half of its bytes)", cut_kv_transfer,
                 engines_only=True, kv_bytes=True, engine_quick=True),
        Scenario("restart-gateway", "SIGTERM the gateway mid-stream, start it again", restart_gateway,
                 engines_only=True, engine_quick=True),
    ]
    return out
