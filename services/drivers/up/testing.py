"""Helpers for the live integration tests and the live benchmark: read a partition's stream,
wait for a condition with a bounded timeout, start a service as a child process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from events.catalog import RouteDecided
from services.adapters.aio import wait_for
from services.adapters.bus import Bus, Delivery

REPO = Path(__file__).resolve().parents[3]


async def read_all(bus: Bus, subjects: str | None = None, idle_s: float = 0.5) -> list[Delivery]:
    """Every decodable event of the partition up to the head seen now (an ephemeral consumer)."""
    head = await bus.last_seq()
    out: list[Delivery] = []
    if head == 0:
        return out
    async with bus.consumer(None, start_seq=1, subjects=subjects) as c:
        it = c.__aiter__()
        while True:
            try:
                d = await wait_for(it.__anext__(), timeout=idle_s)
            except (TimeoutError, StopAsyncIteration):
                break
            out.append(d)
            if d.seq >= head:
                break
    return out


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, every_s: float = 0.1,
                     what: str = "condition") -> None:
    """Poll ``pred`` until it is true; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if await pred():
            return
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


def acting_route_counts(deliveries: Sequence[Delivery], reroutes: bool = False) -> Counter:
    """request -> number of acting (non-shadow) ``RouteDecided`` on the stream."""
    c: Counter = Counter()
    for d in deliveries:
        ev = d.event
        if isinstance(ev, RouteDecided) and not ev.shadow and (reroutes or not ev.reroute):
            c[ev.request] += 1
    return c


def spawn_service(kind: str, nats_url: str, partition: str, *extra: str, env: dict | None = None,
                  log_path: str | os.PathLike | None = None, fault: str | None = None) -> subprocess.Popen:
    """``python -m services.drivers.serve <kind> --nats-url URL --partition P ...`` as a child process;
    ``fault`` arms one fault through ``services.drivers.chaos.faults`` (e.g. ``crash_after_publish:7``)."""
    prog = ["services.drivers.chaos.faults", fault, kind] if fault else ["services.drivers.serve", kind]
    cmd = [sys.executable, "-m", *prog, "--nats-url", nats_url, "--partition", partition, *extra]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    if not log_path:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    """The JSON ``evolving up --ready-file`` writes, once it is there; an ``up`` that exits first
    fails with its exit code (and its output when it was piped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"evolving up exited early with {proc.returncode}: {out}")
        time.sleep(0.2)
    raise TimeoutError(f"{path} not written within {timeout_s} s")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``evolving ARGS...`` as a child process from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", "services.drivers.cli", *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def stop_up(proc: subprocess.Popen, timeout_s: float = 90) -> str:
    """Ctrl-C an ``evolving up`` still running and return its output; it must exit cleanly."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return out
