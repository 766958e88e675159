"""PD between two real vLLM servers whose ExampleConnector (kv_both) shares one folder
(``pytest -m vllm``): the prefill node's server computes the prompt and the first token,
the decode node's server - which never saw the prompt - loads its KV from the store and
decodes; the output is token-identical to one server's, greedy. The roles switch in place."""

from __future__ import annotations

import asyncio

import pytest

from engine.backend import DecodeJob
from engine.backends.vllm.backend import VllmBackend, VllmConfig
from engine.profiles import load_profile
from events.catalog import FirstToken, RequestFinished, RequestStarted, RoleSwitched
from tests.integration.attached_host import Host
from tests.vllm.test_real_vllm import chat_ids, real_job

pytestmark = pytest.mark.vllm

PROFILE = load_profile("gb300-glm52")


async def attach(h, server, node: str, role: str) -> VllmBackend:
    b = VllmBackend(h.host, node, role, PROFILE,
                    VllmConfig(url=server.url, kv_events_endpoints=[server.kv_endpoint], kv_events_topic="kv",
                               metrics_interval_s=0, pd=True))
    await b.start()
    await asyncio.sleep(0.3)
    return b


async def test_prefill_on_one_server_decode_on_the_other_is_token_identical(vllm_pd_servers, hf_model):
    a, b_server = vllm_pd_servers
    ids = chat_ids(hf_model, "Explain in two sentences why the sky is blue.")
    assert (len(ids) - 1) % 64 != 0  # a prompt the connector finds (pd.py, 3)
    h = Host()
    ref = await attach(h, a, "ref", "collocated")  # one server, the whole request
    try:
        rj = real_job("ref", ids, 32, ignore_eos=True)
        rj.decode_node = "ref"  # prefilled and decoded here
        ref.enqueue_prefill(rj)
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "ref", 120)
        expected = "".join(m.text for m in h.tokens if m.request == "ref")
    finally:
        await ref.close()
    hp, hd = Host(), Host()
    p = await attach(hp, a, "p1", "prefill")
    d = await attach(hd, b_server, "d1", "decode")
    try:
        j = real_job("pd", ids, 32, ignore_eos=True)
        j.decode_node = "d1"
        p.enqueue_prefill(j)
        await hp.wait(lambda e: isinstance(e, FirstToken) and e.request == "pd", 120)
        d.kv_arrived(DecodeJob(request="pd", blocks=j.blocks, prompt_tokens=len(ids), left=31.0, total_out=32,
                               context=float(len(ids) + 1), src_node="p1", tokens=ids, max_tokens=32,
                               ignore_eos=True))
        fin = await hd.wait(lambda e: isinstance(e, RequestFinished) and e.request == "pd", 120)
        text = "".join(m.text for m in hp.tokens + hd.tokens if m.request == "pd")
        assert (fin.node, fin.output_tokens) == ("d1", 32)
        assert text == expected, (text, expected)
        assert d.loaded_tokens >= 64 and p.handed_off == 1  # the decode server loaded the prompt's KV
        assert [e.phase for e in hd.events if isinstance(e, RequestStarted)] == ["decode"]
        assert not [e for e in hp.events if isinstance(e, RequestFinished)]
        p.order_switch("decode", "in_place")
        sw = await hp.wait(lambda e: isinstance(e, RoleSwitched), 10)
        assert (sw.role, sw.mechanism) == ("decode", "") and p.role == "decode"
    finally:
        await p.close()
        await d.close()
