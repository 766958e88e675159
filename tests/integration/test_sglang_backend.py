"""The SGLang backend against fake SGLang servers in this process (real HTTP, real ZMQ): PD
pairing through the bootstrap fields, the runtime role switch and what it does to the KV, the
refusals SGLang answers and the fallbacks, abort on a reroute."""

from __future__ import annotations

import asyncio

from engine.backends.attached import prompt_ids
from engine.backends.sglang.backend import SglangBackend, SglangConfig, bootstrap_room
from engine.backends.sglang.fake import FakeSglang
from engine.profiles import load_profile
from events.catalog import AnomalyReported, KvEvicted, KvStored, RequestFinished, RequestStarted, RoleSwitched
from events.hashing import block_hashes
from tests.integration.attached_host import Host, job

PROFILE = load_profile("gb300-glm52")


async def backend(h, node, fake, **cfg):
    url = await fake.start()
    kv = f"tcp://127.0.0.1:{fake.kv_events_port}" if fake.kv_events_port else None
    b = SglangBackend(h.host, node, "collocated", PROFILE, SglangConfig(url=url, kv_events_endpoint=kv, **cfg))
    await b.start()
    await asyncio.sleep(0.2)  # ZMQ slow joiner
    return b, url


def test_prompt_ids_are_a_function_of_the_blocks():
    a = prompt_ids([1, 2], 130, 64, "r1")
    b = prompt_ids([1, 3], 130, 64, "r2")
    assert len(a) == 130 and a[:64] == b[:64] and a[64:128] != b[64:128]
    assert all(0 < t < 32000 for t in a)
    assert block_hashes(a)[0] == block_hashes(b)[0]
    assert 0 <= bootstrap_room("r1") < 2**63 and bootstrap_room("r1") != bootstrap_room("r2")


async def test_prefill_pairs_with_its_decode_peer_through_the_bootstrap_room():
    h = Host()
    dfake = FakeSglang(mode="decode", kv_events_port=0, decode_s_per_token=0.001)
    seen = []
    orig = dfake._generate

    async def spy(request):  # what the decode server received
        seen.append(await request.json())
        return await orig(request)

    dfake._generate = spy
    durl = await dfake.start()
    pfake = FakeSglang(mode="prefill", kv_events_port=0)
    p, _ = await backend(h, "p1", pfake, peers={"d1": durl}, bootstrap_port=8998)
    try:
        assert p.role == "prefill"
        p.enqueue_prefill(job("r1", range(500, 504), max_tokens=5))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished))
        assert (fin.node, fin.output_tokens) == ("d1", 5)
        starts = [(e.node, e.phase) for e in h.events if isinstance(e, RequestStarted)]
        assert starts == [("p1", "prefill"), ("d1", "decode")]
        assert seen and seen[0]["bootstrap_room"] == bootstrap_room("r1")
        assert (seen[0]["bootstrap_host"], seen[0]["bootstrap_port"]) == ("127.0.0.1", 8998)
        assert seen[0]["rid"] == "r1" and seen[0]["sampling_params"]["max_new_tokens"] == 5
        # the prefill server's KV events name the request's blocks
        stored = await h.wait(lambda e: isinstance(e, KvStored))
        assert stored.node == "p1" and stored.tier == "L1" and set(stored.blocks) <= set(range(500, 504))
    finally:
        await p.close()
        await pfake.stop()
        await dfake.stop()


async def test_a_job_with_the_prompts_real_ids_sends_them_and_its_kv_names_their_blocks():
    """``job.tokens`` (from the gateway's prompt store) go out as ``input_ids``; their blocks are
    the request's blocks, so no alias is needed. A job without tokens (a replayed trace) still
    sends the ids made from its hashes."""
    h = Host()
    fake = FakeSglang(mode="null", kv_events_port=0)
    seen = []
    orig = fake._generate

    async def spy(request):
        seen.append(await request.json())
        return await orig(request)

    fake._generate = spy
    b, _ = await backend(h, "c1", fake)
    try:
        real = [(i * 37) % 49_000 + 3 for i in range(64 * 3 + 5)]  # three full blocks and a tail
        blocks = block_hashes(real, 64)
        j = job("real", blocks, decode="c1", max_tokens=2)
        j.tokens = real
        b.enqueue_prefill(j)
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "real")
        stored = await h.wait(lambda e: isinstance(e, KvStored))
        assert seen[0]["input_ids"] == real and seen[0]["rid"] == "real"
        assert set(stored.blocks) <= set(blocks) and stored.blocks and not b.pagemap.aliases
        b.enqueue_prefill(job("trace", [11, 12], decode="c1", max_tokens=2))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "trace")
        assert seen[1]["input_ids"] == prompt_ids([11, 12], 2 * 64 + 7, 64, "trace")
        assert len(b.pagemap.aliases) == 2  # the made-up ids' blocks map back to the trace's
    finally:
        await b.close()
        await fake.stop()


async def test_in_place_switch_drops_the_kv_and_says_how():
    h = Host()
    fake = FakeSglang(mode="prefill", kv_events_port=0)
    b, _ = await backend(h, "p1", fake, peers={})
    try:
        b.enqueue_prefill(job("r1", range(10, 13), decode="p1"))
        await h.wait(lambda e: isinstance(e, RequestFinished))
        await h.wait(lambda e: isinstance(e, KvStored))
        b.order_switch("decode", "in_place")
        sw = await h.wait(lambda e: isinstance(e, RoleSwitched))
        assert (sw.role, sw.kv_dropped) == ("decode", True) and b.role == "decode" and fake.mode == "decode"
        assert sw.mechanism == "in_place_drop_kv"  # the event itself says how it was done
        how = [e for e in h.events if isinstance(e, AnomalyReported)]
        assert [e.kind for e in how] == ["role_switch_in_place_drop_kv"]
        gone = await h.wait(lambda e: isinstance(e, KvEvicted))
        assert set(gone.blocks) == {10, 11, 12} and not b.pool.l1
    finally:
        await b.close()
        await fake.stop()


async def test_a_refused_switch_keeps_the_role_when_attached():
    h = Host()
    fake = FakeSglang(mode="prefill", enable_role_switch=False)
    b, _ = await backend(h, "p1", fake)
    try:
        b.order_switch("decode", "in_place")
        sw = await h.wait(lambda e: isinstance(e, RoleSwitched))
        assert (sw.role, sw.kv_dropped, sw.mechanism) == ("prefill", False, "refused") and b.role == "prefill"
        why = next(e for e in h.events if isinstance(e, AnomalyReported))
        assert why.kind == "role_switch_refused" and "--enable-pd-role-switch is not set" in why.detail
        assert fake.switches[-1]["success"] is False
    finally:
        await b.close()
        await fake.stop()


async def test_requests_routed_during_a_switch_wait_for_the_new_role():
    h = Host()
    fake = FakeSglang(mode="prefill", kv_events_port=None, prefill_s_per_token=5e-4, pair_wait_s=0.1)
    b, _ = await backend(h, "p1", fake)
    try:
        b.enqueue_prefill(job("r1", range(20, 40), decode="p1"))  # ~0.6 s of prefill
        await asyncio.sleep(0.05)
        b.order_switch("decode", "in_place")
        b.enqueue_prefill(job("r2", range(50, 52), decode="p1"))  # held, not sent to a draining server
        assert "r2" in b.queued() and "r2" not in b.tasks
        sw = await h.wait(lambda e: isinstance(e, RoleSwitched))
        assert sw.role == "decode" and sw.drained == 1
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r2")
    finally:
        await b.close()
        await fake.stop()


async def test_reroute_aborts_a_request_that_has_no_token_yet():
    h = Host()
    fake = FakeSglang(mode="null", prefill_s_per_token=1e-3)
    b, _ = await backend(h, "c1", fake)
    try:
        b.enqueue_prefill(job("r1", range(100, 130), decode="c1"))
        await asyncio.sleep(0.1)
        assert "r1" in fake.inflight
        taken = b.remove_queued("r1")
        assert taken is not None and taken.request == "r1"
        for _ in range(100):
            if "r1" not in fake.inflight:
                break
            await asyncio.sleep(0.02)
        assert "r1" not in fake.inflight  # POST /abort_request reached the server
        assert not [e for e in h.events if getattr(e, "request", None) == "r1"]
    finally:
        await b.close()
        await fake.stop()


async def test_a_decode_server_reports_the_requests_its_peers_sent_it():
    from engine.backends.attached import prom_sum

    text = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{dp="0"} 3.0\n'
            'sglang:num_running_reqs{dp="1"} 2.0\nsglang:num_running_reqs_other 9\n')
    assert prom_sum(text, "sglang:num_running_reqs") == 5.0 and prom_sum(text, "nope") == 0.0
    h = Host()
    fake = FakeSglang(mode="decode", pair_wait_s=5.0, decode_s_per_token=0.01)
    d, url = await backend(h, "d1", fake, metrics_interval_s=0.05)
    try:
        assert d.load().running == 0
        import aiohttp  # a prefill peer's request, sent straight to the decode server

        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(f"{url}/generate", json={
                "input_ids": [1, 2, 3], "rid": "x", "bootstrap_room": 7, "sampling_params": {"max_new_tokens": 3}}))
            for _ in range(100):
                if d.load().running == 1:
                    break
                await asyncio.sleep(0.02)
            assert d.load().running == 1 and d.load().role == "decode"
            task.cancel()
    finally:
        await d.close()
        await fake.stop()


async def test_launched_servers_decode_log_becomes_iteration_done():
    import sys

    h = Host()
    fake = FakeSglang(mode="null")  # only to borrow a free port pair
    url = await fake.start()
    port = fake.port
    await fake.stop()
    cmd = (f"{sys.executable} -m engine.backends.sglang.fake --port {port} --disaggregation-mode null "
           f"--decode-log-interval 8 --decode-s-per-token 0.001")
    b = SglangBackend(h.host, "c1", "collocated", PROFILE,
                      SglangConfig(url=url, launch=cmd, launch_timeout_s=60, decode_log_interval=8))
    await b.start()
    try:
        b.enqueue_prefill(job("r1", range(5), decode="c1", max_tokens=40))
        await h.wait(lambda e: isinstance(e, RequestFinished))
        it = await h.wait(lambda e: type(e).__name__ == "IterationDone")
        assert (it.node, it.phase, it.iterations, it.batch) == ("c1", "decode", 8, 1) and it.duration_s > 0
    finally:
        await b.close()
    assert b._proc.returncode is not None  # the worker stops the server it launched


async def test_kv_event_endpoint_is_discovered_from_server_info():
    h = Host()
    fake = FakeSglang(mode="null", kv_events_port=0, page_size=16)
    url = await fake.start()
    b = SglangBackend(h.host, "c1", "collocated", PROFILE, SglangConfig(url=url))  # no --kv-events-endpoint
    await b.start()
    try:
        assert b.kv_endpoints() == ([f"tcp://127.0.0.1:{fake.kv_events_port}"], "")
        await asyncio.sleep(0.2)
        b.enqueue_prefill(job("r1", range(70, 73), decode="c1"))
        stored = await h.wait(lambda e: isinstance(e, KvStored))
        assert set(stored.blocks) <= {70, 71, 72} and stored.tier == "L1"
        assert b.kv_seq == {0: 0}
    finally:
        await b.close()
        await fake.stop()
    off = SglangBackend(h.host, "c2", "collocated", PROFILE, SglangConfig(url=url, kv_events_endpoint="none"))
    assert off.kv_endpoints() == ([], "")
    off.kv_descriptor = {"publisher": "zmq", "endpoint_host": "10.0.0.5", "endpoint_port_base": 6000, "topic": "kv",
                         "dp_size": 2}
    off.cfg.kv_events_endpoint = None
    assert off.kv_endpoints() == (["tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001"], "kv")
