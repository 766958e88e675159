"""``evolving bench bus``: events/s published and folded through JetStream by our bus adapter,
against bare nats-py doing the same wire work on the same server, in one run."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.js import api

from events import codec
from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    KvStored,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Tick,
)
from events.subjects import subject_for
from services.adapters.bus.nats_bus import NatsBus
from services.adapters.bus.natsserver import EmbeddedNats


def representative_events(n: int) -> list[Event]:
    """A mix like a busy partition: per 100 events one RequestSubmitted of ~1,000 block
    hashes, KV facts of 64 blocks, iterations, request lifecycle and route decisions."""
    out: list[Event] = []
    for i in range(n):
        k = i % 100
        ts = i * 0.001
        if k == 0:
            out.append(RequestSubmitted(ts=ts, src="gw", request=f"r{i}", branch=f"b{i % 97}", version=0,
                                        blocks=list(range(2**63 + i, 2**63 + i + 1000)), prompt_tokens=64_000,
                                        max_tokens=300))
        elif k < 20:
            out.append(KvStored(ts=ts, src="n1", node=f"n{k % 9}", tier="L2",
                                blocks=list(range(2**62 + i, 2**62 + i + 64))))
        elif k < 60:
            out.append(IterationDone(ts=ts, src="n1", node=f"n{k % 9}", phase="decode", duration_s=0.03,
                                     batch=32, t_fwd=2.0, accepted_tokens=64))
        elif k < 70:
            out.append(RequestStarted(ts=ts, src="n1", request=f"r{i}", node="n1", phase="prefill"))
        elif k < 80:
            out.append(FirstToken(ts=ts, src="n1", request=f"r{i}", node="n1"))
        elif k < 90:
            out.append(RequestFinished(ts=ts, src="n1", request=f"r{i}", node="n2", output_tokens=300))
        elif k < 99:
            out.append(RouteDecided(ts=ts, src="router", request=f"r{i}", prefill_node="n1", decode_node="n5",
                                    t_c=60_000, t_uc=4_000, predicted_ttft_s=1.2, policy="evolving"))
        else:
            out.append(Tick(ts=ts, src="planner"))
    return out


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def bench_codec(events: list[Event]) -> dict:
    t0 = time.perf_counter()
    payloads = [codec.encode(e) for e in events]
    t1 = time.perf_counter()
    for p in payloads:
        codec.decode(p)
    t2 = time.perf_counter()
    return {"encode_events_per_s": _rate(len(events), t1 - t0), "decode_events_per_s": _rate(len(events), t2 - t1),
            "mean_payload_bytes": sum(map(len, payloads)) / len(payloads)}


async def _ours(url: str, events: list[Event], partition: str) -> dict:
    bus = await NatsBus.connect(url, partition)
    chunk = 2000
    t0 = time.perf_counter()
    for i in range(0, len(events), chunk):
        await bus.publish_many(events[i:i + chunk])
    t1 = time.perf_counter()
    folded: dict[str, int] = {}
    n = len(events)
    t2 = time.perf_counter()
    async with bus.consumer("bench-fold") as c:
        async for d in c:
            name = type(d.event).__name__
            folded[name] = folded.get(name, 0) + 1
            await c.ack(d.seq)
            if d.seq == n:
                break
    t3 = time.perf_counter()
    await bus.close()
    assert sum(folded.values()) == n, folded
    return {"publish_events_per_s": _rate(n, t1 - t0), "consume_events_per_s": _rate(n, t3 - t2)}


async def _raw(url: str, events: list[Event], partition: str) -> dict:
    """The same wire messages (payload bytes and the schema header) and delivery semantics
    (durable push consumer, cumulative acks every 256 messages) with bare nats-py: no codec,
    no typed deliveries, no dead-letter checks."""
    payloads = [codec.encode(e) for e in events]
    hdrs = codec.headers()
    subjects = [subject_for(e, partition) for e in events]
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = f"RAW_{partition.upper()}"
    await js.add_stream(api.StreamConfig(name=stream, subjects=[f"ei.{partition}.>"], storage=api.StorageType.FILE))
    n = len(payloads)
    chunk = 2000
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        futs = [await js.publish_async(subjects[j], payloads[j], headers=hdrs) for j in range(i, min(n, i + chunk))]
        await asyncio.gather(*futs)
    t1 = time.perf_counter()
    done = asyncio.Event()
    count = 0

    async def cb(msg):
        nonlocal count
        count += 1
        if count % 256 == 0 or count == n:
            await msg.ack()
        if count == n:
            done.set()

    t2 = time.perf_counter()
    cfg = api.ConsumerConfig(durable_name="raw", ack_policy=api.AckPolicy.ALL, max_ack_pending=100_000,
                             deliver_policy=api.DeliverPolicy.ALL)
    sub = await js.subscribe(f"ei.{partition}.>", durable="raw", stream=stream, config=cfg, cb=cb,
                             manual_ack=True, flow_control=True, idle_heartbeat=5.0)
    await done.wait()
    t3 = time.perf_counter()
    await sub.unsubscribe()
    await nc.drain()
    return {"publish_events_per_s": _rate(n, t1 - t0), "consume_events_per_s": _rate(n, t3 - t2)}


async def run_bench_bus(n: int, url: str | None) -> dict:
    events = representative_events(n)
    result = {"events": n, "codec": bench_codec(events)}

    async def both(u: str) -> None:
        result["raw_nats_py"] = await _raw(u, events, "benchraw")
        result["evolving"] = await _ours(u, events, "benchours")

    if url:
        await both(url)
    else:
        with EmbeddedNats() as srv:
            await both(srv.url)
    ours, raw = result["evolving"], result["raw_nats_py"]
    result["ratio"] = {k: ours[k] / raw[k] for k in ours}
    result["target_consume_ratio"] = 0.5
    return result
