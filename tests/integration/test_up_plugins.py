"""``evolving up`` with plug-ins from outside the repository, as a newcomer runs it: a
router plug-in found on the user's ``PYTHONPATH`` (a relative entry, ``up`` started
from another directory) runs in shadow in its child process and its decisions reach the stream;
the start line names the gateway URL and every metrics port (each answers); a plug-in that
``up`` can import but its child cannot makes ``up`` stop everything and exit 3 with one line
naming the plug-in and the import error. Real nats-server, real processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from events.catalog import RouteDecided
from services.adapters.bus import NatsBus
from services.drivers.bench import harness as workload

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
NEEDS_GATEWAY = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("services.drivers.gateway.app") is None, reason="needs the gateway")


def _up(args: list[str], cwd: Path, pythonpath: list[str], out: Path, **env: str) -> subprocess.Popen:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), **env}
    return subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "up", *args], cwd=cwd, env=environ,
                            stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_line(path: Path, proc: subprocess.Popen, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text())
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"evolving up exited {proc.returncode} early:\n{path.read_text()}")
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not in {path} within {timeout_s} s:\n{path.read_text()}")


def _stop(proc: subprocess.Popen, timeout_s: float = 40) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
    return proc.wait(timeout=timeout_s)


def _children_alive(nats_url: str, partition: str) -> list[str]:
    """Command lines of live processes started for this test's stack (services, gateway)."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if nats_url in cmd and f"--partition {partition} " in cmd + " " and state != "Z":
            alive.append(cmd)
    return alive


async def _shadow_decisions(nats_url: str, partition: str, name: str, wanted: int, timeout_s: float):
    """Publish two prefill and one decode node and three requests; return the shadow ``name``'s
    decisions read from its subjects once ``wanted`` arrived."""
    bus = await NatsBus.connect(nats_url, partition)
    try:
        await bus.publish_many(workload.nodes(2, 1) + workload.branch_events(0, wanted))
        deadline = time.monotonic() + timeout_s
        while True:
            got, head = [], await bus.last_seq()
            async with bus.consumer(None, start_seq=1, subjects=f"ei.{partition}.shadow.{name}.>") as c:
                async for d in c:
                    got.append((d.subject, d.event))
                    if len(got) >= wanted or d.seq >= head:
                        break
            if len(got) >= wanted or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.3)
    finally:
        await bus.close()


@NEEDS_GATEWAY
@pytest.mark.stack
def test_plugin_on_pythonpath_runs_in_shadow_and_start_line_names_ports(nats_url, partition, tmp_path):
    elsewhere = tmp_path / "elsewhere"  # the user's directory: not the repository
    elsewhere.mkdir()
    plugin_dir = os.path.relpath(FIXTURES / "plugin_pkg", elsewhere)  # relative, as users type it
    out = tmp_path / "up.out"
    up = _up(["--nats-url", nats_url, "--partition", partition, "--run-dir", str(tmp_path / "run"),
              "--engines", "0", "--gateway-port", "0", "--metrics-port", "0", "--no-status",
              "--shadow", "ext_last_node", "--stop-timeout-s", "10"],
             cwd=elsewhere, pythonpath=[str(REPO), plugin_dir], out=out)
    try:
        line = _wait_line(out, up, r".*\bstarted\b.*", 45).group(0)
        gateway = re.search(r"gateway=(http://127\.0\.0\.1:\d+)", line)
        assert gateway, line
        ports = dict(re.findall(r"([\w-]+):(\d+)", re.search(r"metrics=(\S+)", line).group(1)))
        assert set(ports) == {"recorder", "directory", "planner", "router", "shadow-ext_last_node"}, line
        for name, port in ports.items():  # the printed ports are the services' own
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200 and b"ei_service_" in r.read(), name
        got = asyncio.run(_shadow_decisions(nats_url, partition, "ext_last_node", 3, 20))
        _wait_line(out, up, r"\bready\b", 30)  # the start line comes before the gateway answers
        with urllib.request.urlopen(f"{gateway.group(1)}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        rc = _stop(up)
    text = out.read_text()
    assert rc == 0, text
    assert len(got) == 3, (got, text)
    assert {s for s, _ in got} == {f"ei.{partition}.shadow.ext_last_node.routedecided"}
    decisions = [e for _, e in got]
    assert all(isinstance(e, RouteDecided) and e.shadow and e.policy == "ext_last_node" for e in decisions)
    assert {e.prefill_node for e in decisions} == {"p1"}  # the plug-in's own rule: the last prefill node
    assert "child_exited" not in text  # the shadow child never crashed


@pytest.mark.stack
def test_child_that_cannot_import_its_plugin_stops_up_with_one_line(nats_url, partition, tmp_path):
    out = tmp_path / "up.out"
    t0 = time.monotonic()
    up = _up(["--nats-url", nats_url, "--partition", partition, "--run-dir", str(tmp_path / "run"),
              "--engines", "0", "--no-gateway", "--metrics-port", "-1", "--no-status",
              "--ready-file", str(tmp_path / "ready.json"), "--shadow", "ext_broken", "--stop-timeout-s", "10"],
             cwd=REPO, pythonpath=[str(REPO), str(FIXTURES / "broken_plugin_pkg")], out=out,
             EXT_BROKEN_PKG_PARENT=str(os.getpid()))  # importable in `up` itself, not in its children
    try:
        rc = up.wait(timeout=50)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    text = out.read_text()
    assert rc == 3, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("evolving up: shadow-ext_broken stopped: cannot load router plug-in 'ext_broken': "
                           "ImportError: ext_broken_pkg needs libbroken.so.1"), text
    assert "shadow-ext_broken.log" in last
    assert time.monotonic() - t0 < 40  # at once, not after the start-up timeout
    assert not (tmp_path / "ready.json").exists()  # never reported ready
    assert " started " not in text and "child_restarted" not in text
    if Path("/proc").is_dir():
        assert _children_alive(nats_url, partition) == []  # everything it started is stopped
