"""The live stack with real engines: ``evolving up --engines torch:2 --model tiny`` (a tiny random
Llama checkpoint the test writes as a Hugging Face folder: config.json, model.safetensors and a
byte-level BPE tokenizer.json with a ChatML template in tokenizer_config.json) on the session's
nats-server. The engines register ``collocated``, the planner gives them roles
and the torch backend carries the switch out in place; then the official ``openai`` client
streams a chat completion through the gateway. The answer is the text the same model gives for
the same prompt ids in this process (greedy, recomputing the whole sequence per token), which
it can only be if the prefill engine computed on the prompt's own ids from the prompt store
(ids made from block hashes give another answer); the KV moved from the prefill engine's
process to the decode engine's (``KvMoved`` in the recorded log)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

MISSING = [m for m in ("torch", "gguf", "tokenizers", "jinja2", "openai") if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(f"missing {MISSING}", allow_module_level=True)

import openai
import torch

from engine.backends.torch.loader import load, random_weights, write_safetensors
from events.catalog import NodeRegistered, RoleSwitched
from events.hashing import block_hashes
from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.gateway.model import load_model
from services.drivers.up.testing import read_all, stop_up, wait_ready_file, wait_until
from tests.unit.drivers.gateway.test_model import tiny_vocab, write_tiny_folder
from tests.unit.engine.torch.cluster import TINY
from tests.unit.engine.torch.test_torch_engine import reference

pytestmark = pytest.mark.torch  # its own suite after the default one (pyproject.toml, scripts/test.sh)

REPO = Path(__file__).resolve().parents[2]
QUESTION = ("Tell me, in a few words, what a prefill node does and what a decode node does, and why the "
            "key-value cache of the prompt moves from one to the other.")


async def roles(bus) -> dict[str, str]:
    """Each engine's role as the stream says it now (registration, then switches)."""
    out: dict[str, str] = {}
    for d in await read_all(bus, subjects=f"ei.{bus.partition}.node.>"):
        if isinstance(d.event, NodeRegistered | RoleSwitched):
            out[d.event.node] = d.event.role
    return out


def test_up_with_torch_engines_streams_the_models_answer(nats_url, partition, tmp_path):
    model = tmp_path / "tiny"
    cfg = replace(TINY, vocab=len(tiny_vocab()[0]))  # the tokenizer's vocabulary is the model's
    write_safetensors(model, cfg, random_weights(cfg, seed=3))
    write_tiny_folder(model)  # tokenizer.json + tokenizer_config.json (ChatML template) beside the weights
    ck = load(str(model))
    prompt = load_model(str(model))  # the gateway's tokenizer and template, from the same folder
    ids = prompt.tokenizer.encode(prompt.template.render([{"role": "user", "content": QUESTION}]))
    assert len(ids) > 128 and ids == ck.tokenizer.encode(
        prompt.template.render([{"role": "user", "content": QUESTION}]), add_special_tokens=False).ids
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "torch:2", "--model", str(model), "--gateway-port", "0",
         "--ready-file", str(ready), "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15",
         "--planner-arg", "window_s=2", "--planner-arg", "warmup_s=1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # while the stack starts beside it: one thread is faster on a shared box
        try:
            greedy_ids = reference(ck, ids, 12)
            if ck.cfg.eos in greedy_ids:  # the engine stops at the end-of-sequence token (worker default)
                greedy_ids = greedy_ids[: greedy_ids.index(ck.cfg.eos) + 1]
            expected = ck.tokenizer.decode([i for i in greedy_ids if i not in (ck.cfg.bos, ck.cfg.eos)],
                                           skip_special_tokens=True)  # the engine's way
        finally:
            torch.set_num_threads(threads)
        urls = wait_ready_file(ready, up, 180)

        async def split_in_place() -> None:
            bus = await NatsBus.connect(nats_url, partition)
            try:
                async def split() -> bool:
                    r = await roles(bus)
                    return sorted(r.values()) == ["decode", "prefill"]
                await wait_until(split, 60, 0.5, "the planner's split of the two collocated engines")
            finally:
                await bus.close()

        asyncio.run(split_in_place())
        client = openai.OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny"]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=12, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected and text
    finally:
        out = stop_up(up, 90)
    logs = run_dir / "logs"
    with DuckDbEventLog(run_dir / "run.duckdb", read_only=True) as log:
        q = log.con.execute
        live = log.run_config()["live"]
        switched = q("SELECT payload->>'$.node', payload->>'$.role', payload->>'$.kv_dropped', "
                     "payload->>'$.mechanism' FROM events WHERE type = 'RoleSwitched'").fetchall()
        started = q("SELECT payload->>'$.node', payload->>'$.phase' FROM events WHERE type = 'RequestStarted'")\
            .fetchall()
        submitted = q("SELECT (payload->>'$.prompt_tokens')::INT, payload->'$.blocks' FROM events "
                      "WHERE type = 'RequestSubmitted'").fetchall()
        moved = [(s, d, json.loads(b)) for s, d, b in q(
            "SELECT payload->>'$.src_node', payload->>'$.dst_node', payload->'$.blocks' FROM events "
            "WHERE type = 'KvMoved'").fetchall()]
        ordered = q("SELECT count(*) FROM events WHERE type = 'RoleSwitchOrdered'").fetchone()[0]
    assert live["engine_backend"] == "torch" and live["model"] == str(model), live
    # the planner ordered the split and each engine switched in place, its KV kept
    assert ordered >= 2 and {r for _, r, _, _ in switched} == {"prefill", "decode"}, switched
    assert all(drop in (None, "false") and mech in (None, "") for _, _, drop, mech in switched), switched
    by_phase = {ph: node for node, ph in started}
    assert set(by_phase) == {"prefill", "decode"} and by_phase["prefill"] != by_phase["decode"], started
    # the gateway's ids: their count and their block hashes are the request's
    assert [(n, json.loads(b)) for n, b in submitted] == [(len(ids), block_hashes(ids, 64))], submitted
    # the KV of the prompt's two full blocks went from the prefill engine's process to the decode one's
    assert moved == [(by_phase["prefill"], by_phase["decode"], block_hashes(ids, 64)[:2])], moved
    for node in by_phase.values():  # every engine read the ids from the store and moved KV
        text = (logs / f"engine-{node}.log").read_text()
        for bad in ("prompt_missing", "prompt_fetch_failed", "torch_no_transfer", "torch_kv_pull_failed"):
            assert bad not in text, (node, bad, out[-2000:])
