"""The gateway as users run it (``python -m services.drivers.gateway`` against a real nats-server):
loopback by default, API keys from a file, and three 60 MB uploads at once answered with 413
in well under a second while the gateway's peak memory stays flat (it used to take 4-11 s to
fail with 503 and grow from 63 MB to 1.7 GB)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.adapters.bus.natsserver import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-process-key-01"


def _peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def gateway_proc(nats_url, partition, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# test\n{KEY}\n")
    port = free_port()
    log = tmp_path / "gateway.log"
    env = {k: v for k, v in os.environ.items() if k not in ("EI_API_KEYS", "EI_PROFILE")}
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "services.drivers.gateway", "--nats-url", nats_url, "--port", str(port),
                                 "--partition", partition, "--api-keys-file", str(keys), "--log-format", "json"],
                                cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"gateway not up: {log.read_text()[-2000:]}")
        yield proc, port, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_loopback_by_default_and_keys_from_a_file(gateway_proc):
    _proc, port, log = gateway_proc
    listening = [json.loads(ln) for ln in log.read_text().splitlines() if "gateway_listening" in ln]
    assert listening and listening[0]["host"] == "127.0.0.1" and listening[0]["auth"] == "1 key(s)"
    status, body = _get(f"http://127.0.0.1:{port}/v1/models")
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    status, body = _get(f"http://127.0.0.1:{port}/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["data"][0]["id"] == "evolving-sim"
    status, body = _get(f"http://127.0.0.1:{port}/v1/models/evolving-sim", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["max_model_len"] == 262_144


async def _upload(port: int, size: int) -> tuple[int, float]:
    """Send a whole ``size``-byte body (as an attacker would, not waiting for an answer) and
    return the status and when its first byte came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode())
    block = b"x" * (1 << 20)

    async def send_all():
        try:
            for _ in range(size // len(block)):
                writer.write(block)
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the server may close once it has answered

    sender = asyncio.create_task(send_all())
    line = await asyncio.wait_for(reader.readline(), 10)
    first = time.monotonic() - t0
    await sender
    writer.close()
    return int(line.split()[1]), first


def test_three_60mb_bodies_get_413_fast_and_memory_stays_flat(gateway_proc):
    proc, port, _log = gateway_proc
    before = _peak_kb(proc.pid)

    async def main():
        return await asyncio.gather(*(_upload(port, 60 << 20) for _ in range(3)))

    results = asyncio.run(main())
    grew_mb = (_peak_kb(proc.pid) - before) / 1024
    print(f"413 after {max(t for _, t in results):.3f} s at most; gateway peak RSS +{grew_mb:.1f} MB "
          f"(from {before / 1024:.0f} MB)")
    assert [s for s, _ in results] == [413, 413, 413]
    assert max(t for _, t in results) < 1.0
    assert grew_mb < 64, f"gateway peak RSS grew by {grew_mb:.0f} MB"
    assert proc.poll() is None and _get(f"http://127.0.0.1:{port}/health")[0] == 200
