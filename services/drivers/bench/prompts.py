"""``evolving bench prompts``: what it costs per request to get a prompt's token ids from the
gateway to the engine that prefills it, on a real nats-server, for the ways considered
(docs/engines.md, "Prompts"), side by side in one run against today's request event alone.

- ``event only`` (the baseline): publish ``RequestSubmitted`` (block hashes, no ids), as today.
- ``ids in the event``: the same event with the encoded ids appended to its payload (what a
  ``tokens`` field would add): one publish, no read for the engine, but every consumer of the
  partition (directory, planner, router, recorder, every engine) reads the ids and the log
  keeps them; it does not fit NATS's 1 MB payload past ~262K ids of 4 bytes.
- ``KV bucket (file)`` / ``KV bucket (memory)``: :class:`NatsPromptStore` put (acked) + get (a
  direct get), then the request event; the event log grows by nothing.
- ``object store``: nats-py's object store (128 KiB chunks, a metadata message; a read is an
  ordered consumer).

Per size and way: put and get latency (p50, p95, ms; for the ids in the event: encoding them and
decoding them out of the payload), the event's publish, the stored bytes and the bytes the event
stream grows by per request, and put + publish + get as a ratio of the baseline publish.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import statistics
import time

import nats
from nats.js import api
from rich.console import Console
from rich.table import Table

from events import codec
from events.catalog import RequestSubmitted
from events.hashing import block_hashes
from events.subjects import dlq_stream_name, stream_name, subject_for
from services.adapters.bus.nats_bus import NatsBus
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.prompts import decode_tokens, encode_tokens

WAYS = ("event only", "ids in the event", "KV bucket (file)", "KV bucket (memory)", "object store")


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {"p50_ms": 0.0, "p95_ms": 0.0}
    s = sorted(xs)
    return {"p50_ms": round(statistics.median(s) * 1e3, 3), "p95_ms": round(s[min(len(s) - 1, int(0.95 * len(s)))] * 1e3, 3)}


async def _stream_bytes(bus) -> int:
    try:
        return (await bus.stream_info()).bytes
    except Exception:  # noqa: BLE001 - a store not created yet holds nothing
        return 0


async def _one_size(base: NatsBus, js, tokens: int, requests: int, vocab: int, seed: int) -> dict:
    """``base``: the bus every way publishes on (one partition per way, one connection);
    ``js``: the bench's own JetStream context, for what is no port's (the object store, and
    dropping what a way made)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(min(requests, 8))]
    out: dict = {}
    for way in WAYS:
        part = f"bp{tokens}{WAYS.index(way)}{seed}"
        bus = base.for_partition(part)  # one connection for every way
        await bus.ensure_streams()
        store = None
        if way.startswith("KV bucket"):
            store = NatsPromptStore.from_bus(bus, ttl_s=600, memory="memory" in way)
        obs = None
        if way == "object store":
            obs = await js.create_object_store(f"BENCH_{part.upper()}", config=api.ObjectStoreConfig(
                bucket=f"BENCH_{part.upper()}", ttl=600))
        before_log = await _stream_bytes(bus)
        puts, gets, pubs, stored = [], [], [], 0
        for i in range(requests):
            ids = prompts[i % len(prompts)]
            rid = f"b{i}/gw-{i}"
            ev = RequestSubmitted(ts=float(i), src="gw", request=rid, branch=f"b{i}", blocks=block_hashes(ids, 64),
                                  prompt_tokens=len(ids), max_tokens=100)
            payload = codec.encode(ev)
            base_len = len(payload)
            t0 = time.perf_counter()
            if store is not None:
                stored += await store.put(rid, ids)
            elif obs is not None:
                data = encode_tokens(ids)
                await obs.put(rid.replace("/", "_"), data)
                stored += len(data)
            elif way == "ids in the event":
                payload += encode_tokens(ids)
            t1 = time.perf_counter()
            await bus.publish_raw(subject_for(ev, part), payload, codec.headers())
            t2 = time.perf_counter()
            if store is not None:
                got = await store.get(rid)
                assert got == ids
            elif obs is not None:
                got = decode_tokens((await obs.get(rid.replace("/", "_"))).data)
                assert got == ids
            elif way == "ids in the event":  # what every reader of the event pays to get the ids out
                got = decode_tokens(payload[base_len:])
                assert got == ids
            t3 = time.perf_counter()
            puts.append(t1 - t0)
            pubs.append(t2 - t1)
            gets.append(t3 - t2)
        log_bytes = (await _stream_bytes(bus) - before_log) / requests
        out[way] = {"put": _ms(puts) if way != "event only" else _ms([]),  # the event way: encoding the ids
                    "get": _ms(gets) if way != "event only" else _ms([]),  # the event way: decoding them
                    "publish": _ms(pubs), "stored_bytes_per_request": round(stored / requests),
                    "event_log_bytes_per_request": round(log_bytes),
                    "total_p50_ms": round((statistics.median(puts) + statistics.median(pubs)
                                           + statistics.median(gets)) * 1e3, 3)}
        if obs is not None:
            await js.delete_object_store(f"BENCH_{part.upper()}")
        if store is not None:
            await js.delete_stream(store.stream)
        await js.delete_stream(stream_name(part))
        await js.delete_stream(dlq_stream_name(part))
    base = out["event only"]["total_p50_ms"] or 1e-9
    for way in WAYS:
        out[way]["ratio_vs_event_only"] = round(out[way]["total_p50_ms"] / base, 2)
    return out


async def run_async(sizes: list[int], requests: dict[int, int], vocab: int, seed: int) -> dict:
    with EmbeddedNats() as srv:
        nc = await nats.connect(srv.url, name="bench-prompts-objects")
        base = await NatsBus.connect(srv.url, "bp", name="bench-prompts", ensure=False)
        res = {"server": "nats-server (embedded, file store)", "max_payload": nc.max_payload, "vocab": vocab,
               "sizes": {}}
        try:
            for n in sizes:
                res["sizes"][str(n)] = {"requests": requests[n],
                                        **await _one_size(base, nc.jetstream(), n, requests[n], vocab, seed)}
        finally:
            await base.close()
            await nc.close()
    return res


def run(sizes: list[int], requests: int, vocab: int = 151_936, seed: int = 0) -> dict:
    """``requests`` per size at 1K tokens; a tenth of it (at least 20) past 10K tokens."""
    per = {n: requests if n <= 10_000 else max(20, requests // 10) for n in sizes}
    return asyncio.run(run_async(sizes, per, vocab, seed))


def format_report(res: dict) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    for n, rows in res["sizes"].items():
        t = Table(title=f"{int(n):,} token ids per request ({rows['requests']} requests, vocab {res['vocab']:,}, "
                        f"max payload {res['max_payload']:,} B)")
        for col in ("way", "put p50/p95 ms", "get p50/p95 ms", "event publish p50 ms", "stored B/req",
                    "event log B/req", "total p50 ms", "vs event only"):
            t.add_column(col)
        for way in WAYS:
            r = rows[way]
            t.add_row(way, f"{r['put']['p50_ms']:.2f} / {r['put']['p95_ms']:.2f}",
                      f"{r['get']['p50_ms']:.2f} / {r['get']['p95_ms']:.2f}", f"{r['publish']['p50_ms']:.2f}",
                      f"{r['stored_bytes_per_request']:,}", f"{r['event_log_bytes_per_request']:,}",
                      f"{r['total_p50_ms']:.2f}", f"{r['ratio_vs_event_only']:.2f}x")
        console.print(t)
    return console.export_text()


def main(sizes: list[int], requests: int, vocab: int, seed: int, as_json: bool) -> int:
    """``evolving bench prompts`` (its options: services/drivers/bench/cli.py)."""
    res = run(sizes, requests, vocab, seed)
    print(json.dumps(res, indent=2) if as_json else format_report(res))
    return 0
