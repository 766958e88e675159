"""A service started before its bus (docs/live.md's first block after `evolving nats` on another
port) stops when asked, SIGTERM or SIGINT, while it waits; left alone it gives up after
``--start-timeout-s`` with one line and status 2. `evolving nats` serves on 4222, the services'
default, when it is free, and prints the URL to export."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.adapters.bus.natsserver import free_port

ROOT = Path(__file__).resolve().parents[2]


def _serve(*extra: str) -> subprocess.Popen:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    return subprocess.Popen([sys.executable, "-m", "services.drivers.serve", "directory", "--nats-url", url, *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_service_waiting_for_its_bus_stops_when_asked(sig):
    proc = _serve()
    try:
        # its handlers are installed once it says it connects (a fixed 3 s sleep was too short for
        # the imports on a loaded CI machine: the signal killed it, -15); then it retries a while
        seen = []
        reader = threading.Thread(target=lambda: seen.extend(iter(proc.stderr.readline, "")), daemon=True)
        reader.start()
        t_end = time.monotonic() + 60
        while not any("bus_connecting" in line for line in seen) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert any("bus_connecting" in line for line in seen), seen
        time.sleep(1.0)  # connecting (and failing) by now
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
        assert rc == 0 and time.monotonic() - t0 < 5.0
        reader.join(timeout=5)  # it has read to the end
        assert not [line for line in seen if "Traceback" in line]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_service_with_no_bus_gives_up_with_one_line():
    proc = _serve("--start-timeout-s", "3")
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2
    last = [line for line in err.splitlines() if line.startswith("evolving serve directory:")]
    assert len(last) == 1 and "cannot reach the bus at nats://127.0.0.1:" in last[0] and "within 3 s" in last[0]
    assert "Traceback" not in err


def test_evolving_nats_prints_the_url_to_export():
    proc = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "nats", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        second = proc.stdout.readline()
        assert "nats-server with JetStream at nats://127.0.0.1:" in first
        assert second.startswith("export EI_NATS_URL=nats://127.0.0.1:") and second.split("=")[1].strip() in first
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
