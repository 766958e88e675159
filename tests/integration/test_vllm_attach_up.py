"""``evolving up --engines vllm --attach URL,URL`` on two fake vLLM servers someone else started
(``python -m engine.backends.vllm.fake``; real HTTP, real ZMQ, the session's nats-server): the
stack serves a chat through the gateway that ends at the server's end of turn, the servers' KV
events reach the recorded stream as the prompt's own blocks, a client that leaves mid-stream
leaves no traceback in the gateway's log, and ``evolving verify`` reproduces
the run. The same against two real vLLM servers: tests/vllm/test_real_vllm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from events.hashing import block_hashes
from services.adapters.bus.natsserver import free_port
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.gateway.model import load_model
from services.drivers.up.testing import run_cli, stop_up, wait_ready_file
from tests.unit.drivers.gateway.test_model import write_tiny_folder

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
QUESTION = "Tell me, in a few words, what a prefill node does and why the cache of the prompt matters. " * 3


def _fake(port: int, kv: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "engine.backends.vllm.fake", "--port", str(port),
                                 "--kv-events-port", str(kv), "--model", "tiny", "--block-size", "64",
                                 "--decode-s-per-token", "0.02"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.stack
def test_up_attached_to_two_fake_vllm_servers(nats_url, partition, tmp_path):
    model = tmp_path / "tiny"
    write_tiny_folder(model)
    ports = [(free_port(), free_port()) for _ in range(2)]
    fakes = [_fake(p, k, tmp_path / f"fake-{i}.log") for i, (p, k) in enumerate(ports)]
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--engines", "vllm", "--attach", ",".join(f"http://127.0.0.1:{p}" for p, _ in ports),
         "--attach-kv-events", ",".join(f"tcp://127.0.0.1:{k}" for _, k in ports), "--model", str(model),
         "--run-dir", str(run_dir), "--gateway-port", "0", "--ready-file", str(ready), "--no-status",
         "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 120)
        client = openai.OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny"]
        r = client.chat.completions.create(model="tiny", max_tokens=40, temperature=0.5, seed=3,
                                           messages=[{"role": "user", "content": QUESTION}])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("x" * 6, "stop")  # the fake's EOS
        stream = client.chat.completions.create(model="tiny", max_tokens=200, stream=True, extra_body={
            "ignore_eos": True}, messages=[{"role": "user", "content": "Tell a long story."}])
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the client leaves mid-stream
        r = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content == "x" * 4
    finally:
        out = stop_up(up, 90)
        for f in fakes:
            f.terminate()
            f.wait(10)
    assert "Traceback" not in (run_dir / "logs" / "gateway.log").read_text()
    prompt = load_model(str(model))
    ids = prompt.tokenizer.encode(prompt.template.render([{"role": "user", "content": QUESTION}]))
    with DuckDbEventLog(run_dir / "run.duckdb", read_only=True) as log:
        live = log.run_config()["live"]
        stored = {b for (blocks,) in log.con.execute(
            "SELECT payload->'$.blocks' FROM events WHERE type = 'KvStored'").fetchall() for b in json.loads(blocks)}
    assert live["engine_backend"] == "vllm" and live["engines"] == 2, live
    assert len(ids) >= 128 and set(block_hashes(ids, 64)) <= stored, out[-2000:]
    v = run_cli("verify", str(run_dir / "run.duckdb"), timeout=300)
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
