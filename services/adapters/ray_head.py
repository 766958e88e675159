"""A Ray head on this machine for as long as a ``with`` block lasts: the cluster that
:class:`~services.adapters.executors.RayExecutor` runs on in the ``ray`` test suite
(tests/ray/conftest.py) and in scripts/bench_experiments_ray.py.

``ray start --head --block`` with free ports, a few CPUs and a small object store (the machine is
shared), its temporary folder inside the caller's, and token authentication with a token of its
own: nothing is read from or written to ~/.ray. While the block runs, this process's environment
holds the token (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``), so a driver here presents it. At the end
the head gets SIGTERM (with ``--block``, Ray drains and stops what it started), then whatever of
its process tree is still alive is killed by id, never by name; a pid is signalled only while its
start time is the one recorded, so a pid reused by someone else's process is left alone.

Ray's command comes from this environment's scripts folder (``bash scripts/install_ray.sh``);
``ray`` itself is never imported here. Linux only (process trees are read from /proc).

Layer 2 (adapter: Ray). May import: the standard library.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: where ``ray start`` prints the address other nodes join at (Ray canonicalises 127.0.0.1)
_ADDRESS = re.compile(r"ray start --address='([^']+)'")


def ray_command() -> str | None:
    """The ``ray`` command of this environment, or None where Ray is not installed."""
    path = os.path.join(sysconfig.get_path("scripts"), "ray")
    return path if os.path.exists(path) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (index 1: parent, 19: start time)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, list[str]]:
    """``root`` and every process below it (parent links read from /proc): pid -> its stat fields."""
    stats = {int(d.name): s for d in Path("/proc").iterdir() if d.name.isdigit() and (s := _stat(int(d.name)))}
    children: dict[int, list[int]] = {}
    for pid, s in stats.items():
        children.setdefault(int(s[1]), []).append(pid)
    out: dict[int, list[str]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in out:
            out[pid] = stats[pid]
            todo.extend(children.get(pid, []))
    return out


def _client_port() -> list[str]:
    """Ray Client's server port, free, where Ray Client can run: ``ray start`` takes 10001 by
    default when grpc imports (as Ray checks it) and refuses the option when it does not (the
    minimal ``ray`` that scripts/install_ray.sh installs into a fresh .venv)."""
    if importlib.util.find_spec("grpc") is None:
        return []
    return ["--ray-client-server-port", str(free_port())]


@contextmanager
def local_ray_head(tmp: Path, num_cpus: int = 2, object_store_bytes: int = 200_000_000,
                   start_timeout_s: float = 120.0) -> Iterator[tuple[str, int]]:
    """``(address, pid of ray start)`` of a head started in ``tmp`` (its log ``tmp/ray-start.log``,
    Ray's files under ``tmp/ray``: keep ``tmp`` short, Ray's socket paths must fit in 107 bytes).
    Raises RuntimeError when Ray is not installed or the head is not up within ``start_timeout_s``."""
    ray_bin = ray_command()
    if ray_bin is None:
        raise RuntimeError("no ray command in this environment: bash scripts/install_ray.sh")
    port = free_port()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    old = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)  # the driver (this process) presents the cluster's token
    log_path = tmp / "ray-start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--port", str(port), "--num-cpus", str(num_cpus),
             "--object-store-memory", str(object_store_bytes), "--include-dashboard=false",
             "--dashboard-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
             *_client_port(), "--temp-dir", str(tmp / "ray"), "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline, text = time.monotonic() + start_timeout_s, ""
            while (found := _ADDRESS.search(text)) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray start did not come up (rc {proc.poll()}): {text[-2000:]}")
                time.sleep(0.5)
                text = log_path.read_text()
            yield found.group(1), proc.pid
        finally:
            _stop(proc)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the head, then SIGKILL, by id, to what is left of its tree."""
    pids = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        pass
    for pid, s in sorted({**pids, **process_tree(proc.pid)}.items()):
        if pid != proc.pid and (now := _stat(pid)) is not None and now[19] == s[19]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=10)
