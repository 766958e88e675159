"""The gateway knows its model's context length (GGUF ``<arch>.context_length``, config.json's
``max_position_embeddings``; 8192 for SmolLM2) and refuses a request whose prompt tokens +
``max_tokens`` exceed it the way vLLM/OpenAI and Anthropic do (400, nothing published), while a
request that fits is served."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package (extra: engine)")
pytest.importorskip("jinja2", reason="the optional 'jinja2' package (extra: engine)")

from aiohttp.test_utils import TestClient, TestServer

from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from services.drivers.gateway.__main__ import build_parser, resolve_limits
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.model import load_model
from tests.integration.test_gateway_app import fake_cluster
from tests.unit.drivers.gateway.test_model import SMOLLM2, write_tiny_folder, write_tiny_gguf


def _limits(argv, model):
    return resolve_limits(build_parser().parse_args(argv), (model.context_length, model.context_from))


def test_the_context_length_comes_from_the_model_files(tmp_path, monkeypatch):
    monkeypatch.delenv("EI_PROFILE", raising=False)
    smol = load_model(str(SMOLLM2))
    assert (smol.context_length, smol.context_from) == (8192, "SmolLM2-135M-Instruct.Q4_1.gguf llama.context_length")
    assert _limits([], smol)[0] == 8192 and "llama.context_length" in _limits([], smol)[3]
    assert _limits(["--context-length", "100000"], smol)[0] == 100000  # the flag wins
    prof = tmp_path / "p.toml"
    prof.write_text("context_length = 4096\n")
    assert _limits(["--profile", str(prof)], smol)[:1] == (4096,)  # the smaller of model and profile
    prof.write_text("context_length = 65536\n")
    assert _limits(["--profile", str(prof)], smol)[0] == 8192
    folder = tmp_path / "m"
    write_tiny_folder(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    m = load_model(str(folder))
    assert (m.context_length, m.context_from) == (2048, "config.json max_position_embeddings")
    (folder / "config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))  # "unset"
    assert load_model(str(folder)).context_length is None
    write_tiny_gguf(tmp_path / "t.gguf")  # no llama.context_length in its metadata
    t = load_model(str(tmp_path / "t.gguf"))
    assert t.context_length is None and _limits([], t)[0] == GatewayConfig.context_length
    assert load_model(None).context_length is None  # the byte tokenizer: the default or the profile's


async def test_smollm2_requests_over_8192_tokens_are_refused_on_both_apis(partition):
    model = load_model(str(SMOLLM2))
    bus = InMemoryBus(partition)
    gw = Gateway(bus, MemoryTokens(partition), GatewayConfig(partition=partition, model="smol",
                                                             context_length=model.context_length), model=model)
    task = asyncio.create_task(fake_cluster(bus, gw.tokens))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            text = "hello " * 8100  # ~8100 tokens: under 8192 alone, over it with 200 more
            n = len(model.tokenizer.encode(model.template.render([{"role": "user", "content": text}])))
            assert 8000 < n < 8192
            chat = {"model": "smol", "messages": [{"role": "user", "content": text}], "max_tokens": 200}
            r = await client.post("/v1/chat/completions", json=chat)
            assert r.status == 400
            err = (await r.json())["error"]
            assert (err["code"], err["param"], err["type"]) == ("context_length_exceeded", "messages",
                                                                 "invalid_request_error")
            assert err["message"].startswith("This model's maximum context length is 8192 tokens. However, you "
                                             f"requested {n + 200} tokens ({n} in the messages, 200 in the completion)")
            r = await client.post("/v1/messages", json=chat)
            assert r.status == 400
            body = await r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert "exceed context limit" in body["error"]["message"] and "> 8192" in body["error"]["message"]
            r = await client.post("/v1/messages", json={**chat, "messages": [{"role": "user", "content": text * 2}]})
            assert r.status == 400 and "prompt is too long" in (await r.json())["error"]["message"]
            assert await bus.last_seq() == 0  # nothing reached the stream
            ok = {**chat, "max_tokens": 8192 - n}  # exactly the context: served
            r = await client.post("/v1/chat/completions", json=ok)
            assert r.status == 200, await r.text()
            r = await client.get("/v1/models")
            assert (await r.json())["data"][0]["max_model_len"] == 8192
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
