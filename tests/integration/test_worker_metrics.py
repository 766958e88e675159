"""An engine worker's ``/metrics`` (engine/metrics.py): in process behind the services' metrics
server, and ``python -m engine.worker --metrics-port``; the cached prompt tokens it puts on the
"first" token message for the gateway's usage."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from engine.profiles import load_profile
from engine.worker.__main__ import build_parser
from engine.worker.loop import EngineWorker
from events.catalog import NodeRegistered, RequestFinished, RequestStarted, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.natsserver import free_port
from services.adapters.bus.tokens import MemoryTokens
from services.adapters.metrics import MetricsServer

PROFILE = load_profile("gb300-glm52")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def wait_for_event(bus, pred, timeout: float = 10.0):
    async def run():
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


def submit(request: str, max_tokens: int = 5, prompt_tokens: int = 300, base: int = 1000):
    blocks = [base + i for i in range(prompt_tokens // 64)]
    return RequestSubmitted(ts=0.0, src="test", request=request, branch="b", blocks=blocks,
                            prompt_tokens=prompt_tokens, max_tokens=max_tokens)


async def scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        text = await r.text()
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def get(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())


async def _tokens(sub) -> list:
    out = []
    while not out or out[-1].kind != "done":
        out.append(await sub.get(5.0))
    return out


async def test_worker_metrics_endpoint_and_cached_tokens_on_the_first_token(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=5.0, heartbeat_s=0.05)
    server = await MetricsServer(w.metrics, w.health, port=0).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as s, s.get(base + "/healthz") as r:
            assert r.status == 503  # not registered yet
        await w.start()
        for rid in ("r1", "r2"):  # r2 repeats r1's prompt: its blocks are cached on n1 by then
            sub = await tokens.subscribe(rid)
            await bus.publish(submit(rid))
            await bus.publish(RouteDecided(ts=0.0, request=rid, prefill_node="n1", decode_node="n1", policy="t"))
            msgs = await _tokens(sub)
            await sub.close()
            started = await wait_for_event(bus, lambda e, rid=rid: isinstance(e, RequestStarted)
                                           and e.request == rid and e.phase == "prefill")
            assert msgs[0].kind == "first" and msgs[0].cached_tokens == started.cached_tokens
            assert all(m.cached_tokens is msgspec.UNSET for m in msgs[1:])  # the first message only
        assert started.cached_tokens > 0  # r2 reused r1's blocks
        await wait_for_event(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r2")
        m = await scrape(base + "/metrics")
        lab = {"node": "n1"}
        assert get(m, "ei_engine_requests_started_total", phase="prefill", **lab) == 2
        assert get(m, "ei_engine_requests_finished_total", status="ok", **lab) == 2
        assert get(m, "ei_engine_generation_tokens_total", **lab) == 10
        assert get(m, "ei_engine_prompt_tokens_total", **lab) == 600
        assert get(m, "ei_engine_cached_tokens_total", **lab) == started.cached_tokens
        assert get(m, "ei_engine_iterations_total", phase="prefill", **lab) >= 1
        assert get(m, "ei_engine_iterations_total", phase="decode", **lab) >= 1
        assert get(m, "ei_engine_kv_blocks", tier="L1", **lab) >= 4
        assert get(m, "ei_engine_kv_used_tokens", tier="L1", **lab) > 0
        assert get(m, "ei_engine_role", role="collocated", **lab) == 1
        assert get(m, "ei_engine_num_running_reqs", **lab) == 0 and get(m, "ei_engine_num_queue_reqs", **lab) == 0
        assert get(m, "ei_engine_events_total", type="NodeRegistered", **lab) == 1
        async with aiohttp.ClientSession() as s, s.get(base + "/healthz") as r:
            assert r.status == 200 and (await r.json())["node"] == "n1"
        assert w._cached == {}  # nothing left behind
    finally:
        await w.stop()
        await server.stop()


def test_metrics_port_is_off_by_default():
    args = build_parser().parse_args(["--node", "n1", "--nats-url", "nats://x:1"])
    assert (args.metrics_port, args.metrics_host) == (-1, "127.0.0.1")


async def test_process_serves_metrics_on_its_port(nats_url, partition):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.worker", "--node", "pm", "--nats-url", nats_url, "--partition", partition,
        "--metrics-port", str(port), cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    bus = await NatsBus.connect(nats_url, partition=partition)
    try:
        await wait_for_event(bus, lambda e: isinstance(e, NodeRegistered) and e.node == "pm", timeout=30)
        m = await scrape(f"http://127.0.0.1:{port}/metrics")
        assert get(m, "ei_engine_role", node="pm", role="collocated") == 1
        assert ("ei_engine_num_running_reqs", (("node", "pm"),)) in m
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await bus.close()
