"""A real local Ray cluster for the ``ray`` suite (``pytest -m ray tests/ray``; bash
scripts/install_ray.sh installs Ray into .venv): ``ray start --head --block`` in a temporary
folder, free ports, 2 CPUs and a 200 MB object store (the machine is shared), token
authentication with a token of its own (nothing read from or written to ~/.ray). Stopped at the
end by its own process id (SIGTERM: Ray drains and stops the processes it started), then anything
of its process tree still alive is killed by id."""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(root: int) -> dict[int, str]:
    """``root`` and every process below it (parent links read from /proc): pid -> start time, so
    that a pid reused by someone else's process is never signalled."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append(int(d.name))
            started[int(d.name)] = fields[19]
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in out and pid in started:
            out[pid] = started[pid]
            todo.extend(children.get(pid, []))
    return out


def _started(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@pytest.fixture(scope="session")
def ray_installed() -> None:
    """Skips (each test, so the suite reports why) where Ray is not installed. Looked up, not
    imported: Ray reads its auth settings once, when first imported."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: bash scripts/install_ray.sh (the ray extra)")


def _client_port() -> list[str]:
    """Ray Client's server port, free, where Ray Client can run: ``ray start`` takes 10001 by
    default when grpc imports (as Ray checks it) and refuses the option when it does not (the
    minimal ``ray`` that scripts/install_ray.sh installs into a fresh .venv)."""
    if importlib.util.find_spec("grpc") is None:
        return []
    return ["--ray-client-server-port", str(_free_port())]


@pytest.fixture(scope="session")
def ray_cluster(ray_installed):
    """The head's address (``HOST:PORT``), with the auth token in this process's environment."""
    ray_bin = os.path.join(sysconfig.get_path("scripts"), "ray")
    if not os.path.exists(ray_bin):
        pytest.skip(f"no ray command at {ray_bin}: bash scripts/install_ray.sh")
    tmp = tempfile.mkdtemp(prefix="ei-ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port = _free_port()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    old = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)  # the driver (the CLI, in this process) presents the cluster's token
    log = open(Path(tmp) / "ray-start.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--port", str(port),
         "--num-cpus", "2", "--object-store-memory", "200000000", "--include-dashboard=false",
         "--dashboard-port", str(_free_port()), "--dashboard-agent-listen-port", str(_free_port()),
         *_client_port(), "--temp-dir", tmp, "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        text = ""
        while "Ray runtime started" not in text:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not come up (rc {proc.poll()}): {text[-2000:]}")
            time.sleep(0.5)
            text = (Path(tmp) / "ray-start.log").read_text()
        # the address it prints for other nodes: Ray canonicalises 127.0.0.1 to the node's address
        found = re.search(r"ray start --address='([^']+)'", text)
        yield found.group(1) if found else f"127.0.0.1:{port}"
    finally:
        pids = _tree(proc.pid)
        proc.send_signal(signal.SIGTERM)  # --block: Ray drains and stops what it started
        try:
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            pass
        for pid, start in sorted({**pids, **_tree(proc.pid)}.items()):  # what is left: by id, never by name
            if pid != proc.pid and _started(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(timeout=10)
        log.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"ray cluster {port} stopped", file=sys.stderr)
