"""``evolving bench failover``: how long a durable reader stalls when the nats-server holding its
consumer's leader is killed, with our pull consumer as it is (after a 503, the consumer looked
up with a 1 s API timeout, the next pull request as the probe) against the same reader with
the client's 5 s API timeout, as it was, side by side on fresh clusters.

Each run: three nats-servers on loopback (:class:`~services.adapters.bus.natsserver.NatsCluster`),
the partition's stream replicated on all three, a publisher at ``rate`` events/s (message ids,
retried through the election), one durable reader from sequence 1. After ``warm_s`` the server
that leads the reader's consumer is SIGKILLed; the run ends ``settle_s`` after the reader saw an
event published after the kill. Measured: seconds from the kill to the reader's next event, and
that the reader got every published event once, in order. Which server also led the stream
(the publisher's stall) is reported beside it: an election of both takes longer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.natsserver import NatsCluster
from services.drivers.bench import harness as workload

#: the two readers and their look's API timeout: ours, and the same with the client's default
VARIANTS = {"ours": 1.0, "client_timeout": 5.0}
R3 = StreamSettings(replicas=3)


@dataclass
class Run:
    variant: str
    stall_s: float  # kill -> the reader's next event
    events: int  # published (each once, by id)
    read: int  # read by the reader
    distinct: int
    in_order: bool
    stream_leader_killed: bool
    looks: int  # times the reader looked for its consumer after a 503


async def _connect(url: str, partition: str, timeout_s: float = 30.0) -> NatsBus:
    """The cluster answers before it has a JetStream leader: ask again until the stream is set up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await wait_for(NatsBus.connect(url, partition, settings=R3), 10)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def one_run(variant: str, run: int, rate: float = 20.0, warm_s: float = 2.0, settle_s: float = 2.0,
                  max_stall_s: float = 40.0) -> Run:
    look_s = VARIANTS[variant]
    partition = "fo"
    with NatsCluster(3, name=f"fo{run}{variant[0]}") as cluster:
        names = {s.server_name: i for i, s in enumerate(cluster.servers)}
        pub = await _connect(cluster.url, partition)
        rbus = await NatsBus.connect(cluster.url, partition, settings=R3)
        got: list[tuple[float, int]] = []
        ready = asyncio.Event()
        consumers = []

        async def reader() -> None:
            async with rbus.consumer("failover", start_seq=1) as c:
                c.recreate_timeout_s = look_s
                consumers.append(c)
                ready.set()
                async for d in c:
                    got.append((time.monotonic(), d.seq))

        stop = asyncio.Event()
        sent: list[float] = []  # when each event's publish returned

        async def publisher() -> None:
            b = 0
            while not stop.is_set():
                ev = workload.branch_events(b, 1)[0]
                while True:
                    try:
                        await pub.publish(ev, msg_id=f"fo-{b}")
                        break
                    except Exception:  # noqa: BLE001 - an election: the id makes the retry safe
                        await asyncio.sleep(0.1)
                sent.append(time.monotonic())
                b += 1
                await asyncio.sleep(1.0 / rate)

        rtask = asyncio.create_task(reader())
        await ready.wait()
        ptask = asyncio.create_task(publisher())
        try:
            await asyncio.sleep(warm_s)
            leader = next(c.leader for c in await pub.consumers() if c.name == "failover")
            stream_leader = (await pub.stream_info()).leader
            victim = names[leader]
            t_kill = time.monotonic()
            cluster.kill(victim)
            deadline = t_kill + max_stall_s
            while time.monotonic() < deadline and not any(t > t_kill for t, _ in got):
                await asyncio.sleep(0.02)
            after = [t for t, _ in got if t > t_kill]
            stall = after[0] - t_kill if after else float("inf")
            await asyncio.sleep(settle_s)
        finally:
            stop.set()
            await ptask
        total = len(sent)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len({s for _, s in got}) < total:
            await asyncio.sleep(0.05)
        rtask.cancel()
        await asyncio.gather(rtask, return_exceptions=True)
        for b in (pub, rbus):
            try:
                await wait_for(b.close(), 5)
            except Exception:  # noqa: BLE001, S110 - the cluster goes with the run
                pass
        seqs = [s for _, s in got]
        return Run(variant, stall, total, len(seqs), len(set(seqs)), seqs == sorted(seqs),
                   stream_leader == leader, consumers[0].looks)


def run(runs: int = 3, rate: float = 20.0, progress=None) -> dict:
    """``runs`` pairs, the two variants alternating which goes first."""
    out: list[Run] = []
    for r in range(runs):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            out.append(asyncio.run(one_run(v, r, rate)))
            if progress:
                progress(out[-1])
    summary = {}
    for v in VARIANTS:
        rs = [x for x in out if x.variant == v]
        stalls = [x.stall_s for x in rs]
        summary[v] = {"stall_median_s": statistics.median(stalls), "stall_max_s": max(stalls),
                      "stall_min_s": min(stalls), "runs": len(rs),
                      "lost": sum(max(0, x.events - x.distinct) for x in rs),
                      "duplicated": sum(x.read - x.distinct for x in rs),
                      "out_of_order_runs": sum(not x.in_order for x in rs)}
    ratio = summary["client_timeout"]["stall_median_s"] / summary["ours"]["stall_median_s"]
    return {"runs": [x.__dict__ for x in out], "summary": summary, "rate_events_per_s": rate,
            "ratio_median_stall_baseline_over_ours": ratio}
