"""``evolving up`` on its own embedded nats-server, real processes:

- the server is secured: every child runs on its own throwaway account (credential files 0600,
  each child handed only its own), requests are served with no permission violation on the
  server, an anonymous client cannot connect, and a ``SwitchRole`` forged with the gateway's
  account is refused (the stream does not change); ``sql --live`` finds the operator account;
- ``up`` supervises the bus: the nats-server SIGKILLed, ``up`` reaps it and restarts it on the
  same port, store and accounts; the gateway's ``/health`` goes 503 and back to 200, requests
  are served again, and nobody prints a traceback;
- a bus that cannot be kept up stops everything with one line and exit 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats
import pytest

from events import codec
from events.catalog import SwitchRole
from events.subjects import subject_for
from services.adapters.bus import NatsBus
from services.adapters.bus.security import Credentials

REPO = Path(__file__).resolve().parents[2]
NEEDS = [m for m in ("engine.worker", "services.drivers.gateway.app")
         if __import__("importlib.util").util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"needs {NEEDS}")


def _start(run_dir: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    out = run_dir.parent / f"{run_dir.name}.out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--run-dir", str(run_dir), "--no-status",
         "--metrics-port", "-1", "--stop-timeout-s", "8", *extra],
        cwd=REPO, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _wait(pred, timeout_s: float, what: str, proc: subprocess.Popen | None = None, out: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"evolving up exited {proc.returncode} while waiting for {what}:\n"
                                 f"{out.read_text() if out else ''}")
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout_s} s\n{out.read_text() if out else ''}")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _complete(gateway: str, prompt: str) -> dict:
    req = urllib.request.Request(f"{gateway}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 4, "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=40) as r:
        return json.loads(r.read())


def _nats_pid(run_dir: Path) -> int | None:
    conf = str(run_dir / "nats" / "nats.conf")
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if conf.encode() in cmd and cmd[0].endswith(b"nats-server"):
                return int(d.name)
    return None


def _zombie(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False  # gone: reaped


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One secured ``up`` (2 sim engines, the gateway) for the tests of this module, in order."""
    tmp = tmp_path_factory.mktemp("up-secured")
    run_dir, ready = tmp / "run", tmp / "ready.json"
    proc, out = _start(run_dir, "--engines", "2", "--gateway-port", "0", "--ready-file", str(ready))
    try:
        urls = _wait(lambda: ready.exists() and json.loads(ready.read_text()), 90, "ready", proc, out)
        yield {"proc": proc, "out": out, "run_dir": run_dir, "urls": urls}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_up_runs_every_child_on_its_own_account_and_refuses_forgery(stack):
    run_dir, urls = stack["run_dir"], stack["urls"]
    creds = run_dir / "credentials"
    accounts = {p.stem for p in creds.iterdir()}
    assert accounts == {"admin", "operator", "recorder", "directory", "planner", "router", "gateway",
                        "engine-n0", "engine-n1"}
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in creds.iterdir())
    assert oct(creds.stat().st_mode & 0o777) == "0o700"
    for name, pid in urls["pids"].items():  # each child is handed its own file and no other
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        given = [a for a in cmd if a.startswith(str(creds))]
        assert given == [str(creds / f"{name}.json")], (name, cmd)
    reply = _complete(urls["gateway"], "hello secured bus")
    assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] == 4

    async def attack() -> tuple[int, int, bool]:
        with pytest.raises(Exception, match="(?i)authoriz"):  # no anonymous client
            await nats.connect(urls["nats"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        admin = await NatsBus.connect(urls["nats"], "default", credentials=Credentials.from_file(creds / "admin.json"))
        gw = await NatsBus.connect(urls["nats"], "default", ensure=False,
                                   credentials=Credentials.from_file(creds / "gateway.json"))
        try:
            before = await admin.last_seq()
            forged = SwitchRole(ts=time.time(), src="planner", node="n0", to_role="prefill")
            refused = False
            try:
                await gw.js.publish(subject_for(forged, "default"), codec.encode(forged), headers=codec.headers(),
                                    timeout=2)
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                refused = True
            stored = [d.event async for d in _tail(admin, before)]
            return before, sum(isinstance(e, SwitchRole) for e in stored), refused
        finally:
            await gw.close()
            await admin.close()

    _before, forged_stored, refused = asyncio.run(attack())
    assert refused and forged_stored == 0
    log = (run_dir / "logs" / "nats.log").read_text()
    violations = re.findall(r'Violation.*?"([^"]+)"', log)
    # the forged command is the only subject the server refused: every service has what it needs
    assert violations and set(violations) == {"ei.default.cmd.n0"}, violations
    sql = subprocess.run([sys.executable, "-m", "services.drivers.cli", "sql", "--live", str(run_dir / "run.duckdb"),
                          "SELECT count(*) AS n FROM events WHERE type = 'RequestFinished'", "--json"],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert sql.returncode == 0, sql.stderr  # the operator account, found next to the log
    assert json.loads(sql.stdout.splitlines()[0])["n"] >= 1  # JSON lines


def test_up_without_a_status_line_reads_no_stream(stack):
    """``--no-status``: ``up`` folds no event (its status fold read every event of the partition,
    heartbeats included, for a line nobody sees). The bus's consumers are the services' durables,
    the engines' and the gateway's readers, and none of ``up``'s (admin) account."""
    urls = stack["urls"]
    deadline = time.monotonic() + 20
    while True:
        with urllib.request.urlopen(f"{urls['gateway']}/health", timeout=3) as r:
            names = set(json.loads(r.read())["consumers"])
        engines = {n for n in names if n.startswith("engine-n")}
        if len(engines) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"recorder", "directory", "planner", "router"} <= names and len(engines) >= 2, names
    assert not [n for n in names if n.startswith("admin-")], names


async def _tail(bus: NatsBus, after: int):
    head = await bus.last_seq()
    if head <= after:
        return
    async with bus.consumer(None, start_seq=after + 1) as c:
        async for d in c:
            yield d
            if d.seq >= head:
                return


def test_up_restarts_its_killed_nats_server_and_serves_again(stack):
    proc, out, run_dir, urls = stack["proc"], stack["out"], stack["run_dir"], stack["urls"]
    health = f"{urls['gateway']}/health"
    assert _get(health) == 200
    old = _nats_pid(run_dir)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    _wait(lambda: _get(health) == 503, 10, "/health 503 while the bus is down", proc, out)
    _wait(lambda: "nats_restarted" in out.read_text(), 20, "nats_restarted", proc, out)
    new = _nats_pid(run_dir)
    assert new is not None and new != old and not _zombie(old)
    _wait(lambda: _get(health) == 200, 20, "/health 200 again", proc, out)
    reply = _complete(urls["gateway"], "served after the restart")
    assert reply["usage"]["completion_tokens"] == 4
    url = json.loads((run_dir.parent / "ready.json").read_text())["nats"]
    assert url == urls["nats"]  # the same port (and the same accounts: the children reconnected)
    text = out.read_text() + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log") if p.name != "nats.log")
    assert "Traceback" not in text
    assert proc.poll() is None


@pytest.mark.stack
def test_a_bus_that_cannot_be_kept_up_stops_everything_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc, out = _start(run_dir, "--engines", "1", "--no-gateway", "--nats-restarts", "0")
    try:
        _wait(lambda: " started " in out.read_text(), 90, "started", proc, out)
        nats_pid = _nats_pid(run_dir)
        kids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(int(d.name)) == proc.pid]
        os.kill(nats_pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert rc == 1, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("evolving up: the embedded nats-server exited (-9)") and "stopping" in last, last
    assert "Traceback" not in text and len(kids) >= 6  # the server, recorder, 3 services, an engine
    assert not any(Path(f"/proc/{k}").exists() and not _zombie(k) for k in kids)  # everything stopped


def _ppid(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
