"""``stream_options.continuous_usage_stats`` (vLLM's and SGLang's extension; aiperf's
``--per-chunk-usage``): with ``include_usage`` every chunk carries the usage so far; a peer's
field the gateway does not apply is counted in ``/metrics``, never a 400."""

from __future__ import annotations

from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.integration.test_gateway_app import CHAT, _sse, gateway


async def test_every_chunk_carries_the_usage_so_far(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), _fake={"chunk": 2}) as (gw, client):
        r = await client.post("/v1/chat/completions", headers={"x-branch-id": "b"}, json={
            **CHAT, "stream": True, "skip_special_tokens": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert r.status == 200, await r.text()
        chunks = _sse(await r.text())[:-1]
        assert all("usage" in c for c in chunks)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        # first token, chunks of 2, the rest with the finish, then the usage-only chunk
        assert done == [1, 3, 5, 7, 8, 8] and chunks[-1]["choices"] == []
        prompt = chunks[0]["usage"]["prompt_tokens"]
        assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
        assert gw.metrics.get("ei_gateway_ignored_fields_total", api="openai", field="skip_special_tokens") == 1
        text = await (await client.get("/metrics")).text()
        assert 'ei_gateway_ignored_fields_total{api="openai",field="skip_special_tokens"} 1.0' in text


async def test_without_include_usage_chunks_carry_none(partition):
    """vLLM's rule: continuous usage only with ``include_usage``."""
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/completions", headers={"x-branch-id": "b"}, json={
            "model": "evolving-sim", "prompt": "x" * 50, "max_tokens": 8, "stream": True,
            "stream_options": {"continuous_usage_stats": True}})
        assert r.status == 200, await r.text()
        assert not any("usage" in c for c in _sse(await r.text())[:-1])
