"""The ``evolving up`` under soak, :class:`LiveUp` (not a "stack": that word names a serving
composition, replay/sim/stacks.py): one the soak starts (and stops), or one already running
(``--ready-file``), and the end-of-run checks against its stream and its recorder's log.

Owned: ``python -m services.drivers.cli up --run-dir DIR --gateway-port 0 --ready-file
DIR/ready.json --no-status --engines E [--up-arg ...]`` in a session of its own (so a Ctrl-C
of the terminal reaches the soak, which then stops ``up`` in order); at the end the soak reads
the stream's head, stops ``up`` with SIGINT (the recorder drains to the head), and reads the
finished DuckDB file. Attached: the ready file names the gateway, NATS, the log and the pids;
at the end the soak asks the running recorder for a snapshot of its log that covers the head
(the ``evolving sql --live`` request) and leaves the stack running.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.profiles import PROFILE_DIR, load_profile
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus
from services.adapters.bus.security import Credentials
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder.live import read_sidecar, request_snapshot_async
from services.drivers.recorder.verify import verify_log
from services.drivers.soak.stats import Recorded, recorded_check
from services.drivers.up.testing import REPO, wait_ready_file


class LiveUpError(RuntimeError):
    """The stack could not be started or read; ``str`` says why in one line."""


@dataclass
class StreamState:
    head: int
    messages: int
    dead_letters: int


def soak_profile(base: str, l1_tokens: int, dest: Path) -> Path:
    """``base`` (a profile name or path) with ``l1_tokens`` of GPU KV per node and twice that of
    host KV, written to ``dest``. A soak must reach steady state: at gb300-glm52's 5 M + 20 M
    tokens per node a 10-minute soak never fills the KV directory, whose memory then grows with
    every block stored (by design, until capacity) and hides a leak. Small tiers fill in the
    first minutes and eviction runs from then on."""
    src = Path(base) if Path(base).suffix else PROFILE_DIR / f"{base}.toml"
    text = src.read_text()
    for key, val in (("l1_capacity_tokens", l1_tokens), ("l2_capacity_tokens", 2 * l1_tokens)):
        text, n = re.subn(rf"(?m)^{key}\s*=\s*[0-9_]+", f"{key} = {val}", text)
        if n != 1:
            raise LiveUpError(f"profile {src}: expected one {key} line, found {n}")
    text = re.sub(r'(?m)^name\s*=\s*"([^"]*)"', r'name = "\1-soak"', text, count=1)
    dest.write_text(text)
    prof = load_profile(str(dest))
    assert prof.l1_capacity_tokens == l1_tokens, "invariant: the written profile holds the capacity asked for"
    return dest


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().decode(errors="replace").rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class LiveUp:
    """Start (or attach to) ``evolving up``; read its stream; check its log."""

    def __init__(self, *, run_dir: Path, engines: int = 4, up_args: list[str] | None = None,
                 ready_file: Path | None = None, start_timeout_s: float = 180.0) -> None:
        self.attached = ready_file is not None
        self.run_dir = run_dir
        self.ready_file = ready_file or run_dir / "ready.json"
        self.engines, self.up_args, self.start_timeout_s = engines, list(up_args or []), start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.ready: dict[str, Any] = {}
        self.partition = "default"
        self.up_rc: int | None = None

    @property
    def gateway(self) -> str:
        return str(self.ready["gateway"]).rstrip("/")

    @property
    def db(self) -> Path:
        return Path(self.ready["db"])

    def root_pid(self) -> int | None:
        """The ``up`` process (the root of the tree the sampler walks)."""
        if self.proc is not None:
            return self.proc.pid
        pids = list((self.ready.get("pids") or {}).values())
        return parent_of(pids[0]) if pids else None

    def pids(self) -> dict[str, int]:
        return dict(self.ready.get("pids") or {})

    async def start(self) -> None:
        if self.attached:
            if not self.ready_file.exists():
                raise LiveUpError(f"--ready-file {self.ready_file} does not exist: start `evolving up "
                                 f"--ready-file {self.ready_file}` first")
            self.ready = json.loads(self.ready_file.read_text())
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.ready_file.unlink(missing_ok=True)
            self.proc = self._spawn_up()
            try:
                self.ready = await asyncio.to_thread(wait_ready_file, self.ready_file, self.proc,
                                                     self.start_timeout_s)
            except (AssertionError, TimeoutError) as exc:
                raise LiveUpError(f"evolving up did not become ready: {str(exc).splitlines()[0]} "
                                 f"(its output: {self.run_dir / 'up.log'})") from exc
        for key in ("gateway", "nats", "db"):
            if key not in self.ready:
                raise LiveUpError(f"{self.ready_file} has no {key!r}: was `evolving up` started with a gateway?")
        self.partition = read_sidecar(self.db).get("partition") or self.partition

    def _spawn_up(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "services.drivers.cli", "up", "--run-dir", str(self.run_dir),
               "--gateway-port", "0", "--ready-file", str(self.ready_file), "--no-status",
               "--engines", str(self.engines), *self.up_args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with open(self.run_dir / "up.log", "ab") as out:
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def credentials(self) -> Credentials | None:
        """Admin, else operator, of up's secured bus (RUN_DIR/credentials); else the environment."""
        folder = self.ready.get("credentials")
        for name in ("admin", "operator"):
            path = Path(folder or "", f"{name}.json")
            if folder and path.is_file():
                return Credentials.from_file(path)
        env = Credentials.from_env()
        return None if env.empty else env

    async def stream_state(self) -> StreamState:
        bus = await NatsBus.connect(self.ready["nats"], self.partition, credentials=self.credentials(),
                                    ensure=False, name="evolving-soak")
        try:
            info = await bus.stream_info()
            return StreamState(info.last_seq, info.messages, info.dead_letters)
        finally:
            await wait_for(bus.close(), 5)

    async def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGINT ``up`` (owned) and wait; its exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
                self.up_rc = None
                return None
        self.up_rc = self.proc.returncode
        return self.up_rc

    def kill(self) -> None:
        """Stop an owned ``up`` now (from ``finally``): SIGINT, then SIGKILL of its session."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def log_for_check(self, head: int, timeout_s: float = 60.0) -> Path:
        """The DuckDB file to check: the finished log (owned, after :meth:`stop`), or a live
        snapshot from the running recorder that covers ``head`` (attached)."""
        if not self.attached:
            return self.db
        deadline = time.monotonic() + timeout_s
        creds = self.credentials()
        while True:
            snap = await request_snapshot_async(str(self.db), nats_url=self.ready["nats"], partition=self.partition,
                                                timeout_s=30, credentials=creds)
            if snap.applied_seq >= head:
                return Path(snap.path)
            if time.monotonic() > deadline:
                raise LiveUpError(f"the recorder's snapshot holds seq {snap.applied_seq}, the stream's head was "
                                 f"{head}, after {timeout_s:g} s")
            await asyncio.sleep(1.1)  # the recorder reuses a snapshot younger than 1 s


def check_log(path: Path, state: StreamState, run_id: str) -> tuple[Recorded, dict[str, int], dict[str, int]]:
    """Rows of the log up to the stream head seen at the end of the load, and the soak's own
    requests on it (submitted, decided once / never / more than once, finished without error),
    and the log's events by type."""
    with DuckDbEventLog(path, read_only=True) as log:
        con = log.con
        recorded = con.execute("SELECT count(*) FROM events WHERE seq <= ?", [state.head]).fetchall()[0][0]
        rows, max_seq = con.execute("SELECT count(*), coalesce(max(seq), 0) FROM events").fetchall()[0]
        like = f"{run_id}-%"
        submitted = con.execute("SELECT count(*) FROM events WHERE type = 'RequestSubmitted' "
                                "AND payload->>'$.branch' LIKE ?", [like]).fetchall()[0][0]
        decided = con.execute(
            "WITH s AS (SELECT payload->>'$.request' AS r FROM events WHERE type = 'RequestSubmitted' "
            "AND payload->>'$.branch' LIKE ?), d AS (SELECT payload->>'$.request' AS r, count(*) AS n FROM events "
            "WHERE type = 'RouteDecided' AND NOT coalesce((payload->>'$.shadow')::BOOLEAN, false) "
            "AND NOT coalesce((payload->>'$.reroute')::BOOLEAN, false) GROUP BY 1) "
            "SELECT count(*) FILTER (WHERE d.n = 1), count(*) FILTER (WHERE d.n IS NULL), "
            "count(*) FILTER (WHERE d.n > 1) FROM s LEFT JOIN d USING (r)", [like]).fetchall()[0]
        finished = con.execute(
            "SELECT count(*) FROM events WHERE type = 'RequestFinished' AND coalesce(payload->>'$.error', '') = '' "
            "AND payload->>'$.request' IN (SELECT payload->>'$.request' FROM events "
            "WHERE type = 'RequestSubmitted' AND payload->>'$.branch' LIKE ?)", [like]).fetchall()[0][0]
        by_type = log.count_by_type()
    rec = recorded_check(state.head, state.messages, int(recorded), state.dead_letters, int(rows), int(max_seq))
    requests = {"submitted": int(submitted), "decided_once": int(decided[0]), "undecided": int(decided[1]),
                "decided_twice": int(decided[2]), "finished_ok": int(finished)}
    return rec, requests, {k: int(v) for k, v in sorted(by_type.items())}


def verify(path: Path) -> dict[str, Any]:
    """``evolving verify`` of the log (every divergence counted)."""
    with DuckDbEventLog(path, read_only=True) as log:
        return verify_log(log, keep_going=True).to_dict()
