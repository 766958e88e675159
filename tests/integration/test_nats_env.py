"""A nats-server started here runs with one Go processor (``GOMAXPROCS=1``) unless the
environment names its own (services/adapters/bus/natsserver.py, ``GOMAXPROCS``): read back from
the real server process's environment."""

from __future__ import annotations

from services.adapters.bus.natsserver import EmbeddedNats


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


def test_a_server_started_here_runs_one_go_processor(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with EmbeddedNats() as server:
        assert _environ(server.proc.pid)["GOMAXPROCS"] == "1"


def test_a_gomaxprocs_the_environment_names_is_kept(monkeypatch):
    monkeypatch.setenv("GOMAXPROCS", "2")
    with EmbeddedNats() as server:
        assert _environ(server.proc.pid)["GOMAXPROCS"] == "2"
