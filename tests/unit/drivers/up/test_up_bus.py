"""``evolving up``'s bus supervision and accounts without processes: a dead server that will
not start again stops everything with one reason; the accounts ``up`` generates match the
children it starts, and the permission table gives each service exactly its own config
snapshot."""

from __future__ import annotations

import argparse
import asyncio

from services.adapters.bus.natsserver import NatsServerError
from services.adapters.bus.security import ServiceSpec, service_permissions, snapshot_bucket
from services.drivers.up.launch import Up, account_specs, plan_children
from services.drivers.up.options import UpSpec, add_up_args, up_spec


class DeadProc:
    returncode = -9
    stderr = None

    def poll(self) -> int:
        return self.returncode


class FakeNats:
    url, log_file = "nats://127.0.0.1:1", "nats.log"

    def __init__(self, fails: bool) -> None:
        self.proc, self.fails, self.starts = DeadProc(), fails, 0

    def start(self):
        self.starts += 1
        if self.fails:
            raise NatsServerError("nats-server exited with 1: listen tcp 127.0.0.1:1: bind: address already in use")
        self.proc = None
        return self


def _up(nats: FakeNats, restarts: int = 5) -> Up:
    up = Up.__new__(Up)
    up.spec = UpSpec(nats_restarts=restarts)
    up.nats, up.nats_deaths, up.failure, up.exit_code = nats, [], None, 3
    up.stop, up._console = asyncio.Event(), None
    return up


async def test_a_server_that_will_not_start_again_stops_everything_with_its_reason():
    up = _up(FakeNats(fails=True))
    await up._check_bus()
    assert up.stop.is_set() and up.exit_code == 1
    assert up.failure.startswith("the embedded nats-server exited (-9) and could not be restarted: nats-server "
                                 "exited with 1: listen tcp"), up.failure
    assert "\n" not in up.failure


async def test_a_dead_server_is_restarted_until_it_dies_too_often():
    nats = FakeNats(fails=False)
    up = _up(nats, restarts=2)
    for _ in range(2):
        nats.proc = DeadProc()
        await up._check_bus()
        assert not up.stop.is_set()
    assert nats.starts == 2
    nats.proc = DeadProc()
    await up._check_bus()
    assert up.stop.is_set() and nats.starts == 2 and "more than --nats-restarts 2" in up.failure
    await up._check_bus()  # nothing more to do once it gave up (no process)
    assert nats.starts == 2


def _args(**kw) -> UpSpec:
    """up's own parser (so a new option of up has its default here), then ``kw``."""
    p = argparse.ArgumentParser()
    add_up_args(p)
    args = p.parse_args(["--shadow", "cache_aware", "--engines", "2", "--metrics-port", "-1", "--gateway-port", "0"])
    return up_spec(args, clock_epoch=0.0, **kw)


def test_every_child_gets_exactly_its_own_account(tmp_path):
    args = _args()
    names = {s.name for s in account_specs(args)}
    files = {n: tmp_path / f"{n}.json" for n in names | {"admin"}}
    children, urls = plan_children(args, "nats://x:1", tmp_path, tmp_path / "run.duckdb", files)
    assert {c.name for c in children} == names - {"operator"}
    for c in children:
        i = c.cmd.index("--nats-credentials")
        assert c.cmd[i + 1] == str(files[c.name]) and c.cmd.count("--nats-credentials") == 1
    assert urls["credentials"] == str(tmp_path)
    insecure, urls = plan_children(args, "nats://x:1", tmp_path, tmp_path / "run.duckdb", None)  # --insecure
    assert not any("--nats-credentials" in c.cmd for c in insecure) and "credentials" not in urls
    router = next(s for s in account_specs(args) if s.name == "router")
    assert router.components == ("router.evolving",)  # its anomalies' component, from the plug-in


def test_each_decision_service_writes_only_its_own_config_and_the_recorder_reads_them():
    p = "default"
    perms = {s.name: service_permissions(s, p) for s in [
        ServiceSpec("directory", "directory"), ServiceSpec("planner", "planner"), ServiceSpec("router", "router"),
        ServiceSpec("router", "shadow-x", shadow="x"), ServiceSpec("recorder", "recorder"),
        ServiceSpec("gateway", "gateway")]}
    own = {"directory": "config.directory", "planner": "config.planner", "router": "config.router",
           "shadow-x": "config.shadow.x"}
    for name, key in own.items():
        for other, okey in own.items():
            write = f"$O.{snapshot_bucket(p, okey)}.>"
            assert (write in perms[name].publish) == (other == name), (name, okey)
    recorder = perms["recorder"].publish
    for key in ("config.directory", "config.planner", "config.router"):
        bucket = snapshot_bucket(p, key)
        assert f"$JS.API.STREAM.INFO.OBJ_{bucket}" in recorder and f"$O.{bucket}.>" not in recorder
    assert not any("CONFIG" in s for s in perms["gateway"].publish)
    anomaly = "ei.default.anomaly.router_evolving"
    assert anomaly not in perms["router"].publish  # only once up names the policy
    named = service_permissions(ServiceSpec("router", "router", components=("router.evolving",)), p)
    assert anomaly in named.publish
