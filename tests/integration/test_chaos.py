"""``evolving chaos``: the short suite runs over a real 3-server NATS cluster,
real service processes and a real DuckDB log, and must print an all-zero table; the accounting
that fills the table is checked on a stream with known losses and duplicates; and the two bus
faults the suite found stay fixed (an R1 client scaling an R3 stream down; an async publish
whose ack was lost with its server hanging the publisher)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from events.catalog import NodeHeartbeat, RequestSubmitted, RouteDecided
from services.adapters.bus import MSG_ID, Delivery, NatsBus
from services.adapters.bus.natsserver import NatsCluster
from services.drivers.chaos.accounting import ScenarioResult, account
from services.drivers.chaos.load import Load
from services.drivers.chaos.scenarios import scenarios
from services.drivers.chaos.supervisor import SERVICES, connect_when_ready
from services.drivers.chaos.tail import Published

REPO = Path(__file__).resolve().parents[2]
QUICK = {"steady-load", "kill-planner", "kill-router", "kill-nats-leader", "corrupt-planner-snapshot",
         "partition-engine", "duplicate-publish", "malformed-events"}


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process under ``root`` (nats-servers, services)."""
    parent: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            parent[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in out:
                try:
                    out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                frontier.append(child)
    return out


def _still_alive(seen: dict[int, str]) -> list[str]:
    alive = []
    for pid, cmd in seen.items():
        try:
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if now == cmd:  # the same process, not a reused pid
            alive.append(f"{pid}: {cmd}")
    return alive


class _Watch:
    """Collect the descendants of ``pid`` every 0.5 s while it runs."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.seen, self._stop = pid, {}, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for pid, cmd in _descendants(self.pid).items():
                # a zombie (killed, not yet reaped) reads an empty command line: keep what it ran
                # (CI: a worker's name was overwritten so, and the watch "saw" 3 of 4 workers)
                if cmd or pid not in self.seen:
                    self.seen[pid] = cmd

    def stop(self) -> dict[int, str]:
        self._stop.set()
        self._t.join()
        return self.seen


@pytest.mark.stack
def test_quick_suite_prints_an_all_zero_table_and_leaves_nothing_running(tmp_path):
    t0 = time.monotonic()
    # a session of its own: if it has to be killed, its nats-servers and services go with it
    proc = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "chaos", "--quick", "--json",
                             "--workdir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    watch = _Watch(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("evolving chaos --quick ran past 300 s")
    elapsed = time.monotonic() - t0
    children = watch.stop()
    assert stdout.strip(), stderr[-3000:]
    report = json.loads(stdout)
    rows = {r["name"]: r for r in report["scenarios"]}
    assert set(rows) == QUICK
    bad = {n: r for n, r in rows.items()
           if not r["survived"] or r["lost"] or r["hung"] or r["duplicated"] or r["diverged"]
           or r["recover_s"] is None}
    assert not bad, json.dumps(bad, indent=1)
    assert report["verify"]["ok"] and report["verify"]["divergences"] == 0, report["verify"]
    assert report["verify"]["reproduced"]["RouteDecided"] >= report["requests"] > 100
    assert report["unplanned_exits"] == []
    assert report["ok"] and proc.returncode == 0
    assert "rebuilt from 0" in rows["corrupt-planner-snapshot"]["detail"]
    assert "12/12 dead letters" in rows["malformed-events"]["detail"]
    assert "1 NodeRemoved" in rows["partition-engine"]["detail"]
    assert "stream still R3" in rows["kill-nats-leader"]["detail"]
    assert sum("nats-server" in c for c in children.values()) >= 3  # the watch saw the stack
    assert sum("services." in c for c in children.values()) >= 4
    assert not _still_alive(children), "a process of the chaos stack outlived the command"
    print(f"chaos --quick: {elapsed:.0f} s")


@pytest.mark.stack
def test_sigterm_mid_run_stops_the_whole_stack(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "services.drivers.cli", "chaos", "--only", "rewind-consumer",
                             "--workdir", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 150  # chaos itself waits up to 120 s for the services
        while not (tmp_path / "router.log").exists() or "service_caught_up" not in (tmp_path / "router.log").read_text():
            if proc.poll() is not None:  # it ended before the stack was up: say why
                raise AssertionError(f"chaos exited {proc.returncode} before the stack came up:\n"
                                     f"{proc.communicate()[1][-3000:]}")
            assert time.monotonic() < deadline, "the stack did not come up in 120 s"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        assert sum("nats-server" in c for c in children.values()) == 3, children
        assert sum("services." in c for c in children.values()) == 4, children
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # a second one while the stack stops (``timeout`` forwards its own beside the user's)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; the stack is stopped" in err
    assert not _still_alive(children)


def test_unknown_scenario_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "services.drivers.cli", "chaos", "--only", "kill-everything"], check=False,
                          cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert "unknown scenario(s) kill-everything" in proc.stderr and "kill-router" in proc.stderr


def test_every_service_and_snapshot_kind_has_a_scenario():
    names = {s.name for s in scenarios()}
    assert {f"kill-{k}" for k in SERVICES} <= names
    assert {"corrupt-directory-snapshot", "corrupt-planner-snapshot", "corrupt-router-snapshot"} <= names
    assert {"kill-nats-leader", "partition-engine", "duplicate-publish", "rewind-consumer",
            "malformed-events", "restart-all-nats", "kill-engine-prefill", "kill-engine-decode"} <= names
    assert {s.name for s in scenarios() if s.quick} | {"steady-load"} == QUICK


def _req(name: str) -> RequestSubmitted:
    return RequestSubmitted(ts=1.0, src="harness", request=name, branch="b", blocks=[1], prompt_tokens=74)


def _route(name: str, **kw) -> RouteDecided:
    return RouteDecided(ts=1.0, src="router", request=name, prefill_node="p0", decode_node="d0", **kw)


class _Load:
    def __init__(self, published):
        self.published = published


def test_accounting_counts_losses_duplicates_and_divergences_per_window():
    pubs = [Published(f"load:{i}", _req(f"r{i}"), i + 1, 0.0) for i in range(4)]
    pubs.append(Published("load:4", NodeHeartbeat(ts=1.0, src="harness", node="p0", role="prefill"), 0, 0.0))
    stream = [
        Delivery(1, "s", pubs[0].event, {MSG_ID: "load:0"}),
        Delivery(2, "s", pubs[1].event, {MSG_ID: "load:1"}),
        Delivery(3, "s", pubs[1].event, {MSG_ID: "load:1"}),  # stored twice
        Delivery(4, "s", pubs[2].event, {MSG_ID: "load:2"}),
        # load:3 (r3) and load:4 never reached the stream
        Delivery(5, "r", _route("r0"), {}),
        Delivery(6, "r", _route("r0"), {}),  # decided twice
        Delivery(7, "r", _route("r1", reroute=True), {}),  # a reroute is not a second decision
        Delivery(8, "r", _route("r1"), {}),
        Delivery(9, "r", _route("r2", shadow=True), {}),  # a shadow decision does not count: r2 undecided
    ]
    first = ScenarioResult("a", "x", survived=True, window=(0, 4), published=(0, 2))
    second = ScenarioResult("b", "y", survived=True, window=(4, 9), published=(2, 5))
    account([first, second], _Load(pubs), stream, recorded_seqs={1, 2, 3, 4, 5, 6, 7, 8}, divergence_seqs=[6, 9])
    assert first.counts == {"ids_missing": 0, "requests_undecided": 0, "not_recorded": 0, "ids_twice": 1,
                            "requests_decided_twice": 1}
    assert (first.lost, first.duplicated, first.diverged, first.all_zero) == (0, 2, 0, False)
    assert second.counts == {"ids_missing": 2, "requests_undecided": 2, "not_recorded": 1, "ids_twice": 0,
                             "requests_decided_twice": 0}
    assert (second.lost, second.duplicated, second.diverged) == (5, 0, 2)


def test_with_engines_a_decided_request_that_never_ends_is_hung_and_one_failed_with_an_error_is_not():
    from events.catalog import RequestFinished

    pubs = [Published(f"load:{i}", _req(f"r{i}"), i + 1, 0.0) for i in range(3)]
    stream = [Delivery(i + 1, "s", p.event, {MSG_ID: p.msg_id}) for i, p in enumerate(pubs)]
    stream += [Delivery(4 + i, "r", _route(f"r{i}"), {}) for i in range(3)]
    stream += [Delivery(7, "n", RequestFinished(ts=2.0, request="r0", node="d0"), {}),
               Delivery(8, "n", RequestFinished(ts=2.0, request="r1", node="d0", error="decode node d0 removed"), {})]
    res = ScenarioResult("k", "x", survived=True, window=(0, 8), published=(0, 3))
    account([res], _Load(pubs), stream, recorded_seqs=set(range(1, 9)), divergence_seqs=[], engines=True)
    assert (res.hung, res.counts["requests_unfinished"], res.counts["requests_failed"]) == (1, 1, 1)
    assert res.lost == 0 and not res.all_zero
    plain = ScenarioResult("k", "x", survived=True, window=(0, 8), published=(0, 3))
    account([plain], _Load(pubs), stream, recorded_seqs=set(range(1, 9)), divergence_seqs=[])
    assert plain.hung == 0 and plain.all_zero  # the load generator's nodes run nothing: no hang to count


def test_engine_scenarios_run_only_with_engines():
    from services.drivers.chaos.suite import select

    known = scenarios()
    engine_only = {s.name for s in known if s.engines_only}
    vllm_only = {s.name for s in known if s.vllm_only}
    assert vllm_only == {"kill-vllm-server", "cut-kv-events"}
    assert engine_only - vllm_only == {"kill-engine-prefill", "kill-engine-decode", "cut-kv-transfer", "restart-gateway"}
    assert not engine_only & {s.name for s in select(known)}
    assert engine_only - vllm_only <= {s.name for s in select(known, engines=True)}
    assert not vllm_only & {s.name for s in select(known, engines=True, backend="torch")}
    with pytest.raises(ValueError, match="run them with --engines"):
        select(known, only=["kill-engine-decode"])
    # --engines vllm: a worker killed, its server killed, its event socket cut (quick or not)
    for quick in (False, True):
        assert [s.name for s in select(known, quick=quick, engines=True, backend="vllm")] == [
            "kill-engine-decode", "kill-vllm-server", "cut-kv-events"]
    with pytest.raises(ValueError, match="run them with --engines vllm"):
        select(known, only=["cut-kv-events"], engines=True, backend="torch")


@pytest.mark.asyncio
async def test_a_client_with_default_settings_keeps_an_r3_stream_r3():
    with NatsCluster(3, name="r3keep") as cluster:
        admin = await connect_when_ready(cluster.url, "keep")
        plain = await NatsBus.connect(cluster.url, "keep")  # a service given only a URL
        try:
            info = await admin.js.stream_info(admin.stream)
            assert info.config.num_replicas == 3
            assert plain.settings.replicas == 3  # its snapshot buckets follow the stream
            await plain.put_snapshot("svc", b"x")
            assert await plain.get_snapshot("svc") == b"x"
            obs = await plain.js.stream_info("OBJ_EI_SNAP_KEEP_SVC")
            assert obs.config.num_replicas == 3
        finally:
            await plain.close()
            await admin.close()


class _StuckJs:
    """publish_async whose acks never come back (the server holding them died); publish works."""

    def __init__(self) -> None:
        self.sync_published: list[str] = []

    async def publish_async(self, subject, data, headers=None):
        return asyncio.get_running_loop().create_future()

    async def publish(self, subject, data, headers=None):
        self.sync_published.append(headers["Nats-Msg-Id"])

        class Ack:
            seq = len(self.sync_published)

        return Ack()


@pytest.mark.asyncio
async def test_publish_many_with_ids_retries_a_lost_ack_instead_of_hanging():
    from services.adapters.bus import StreamSettings

    js = _StuckJs()
    bus = NatsBus(nc=None, js=js, partition="p", settings=StreamSettings())
    bus.publish_timeout_s = 0.2
    events = [_req("a"), _req("b")]
    seqs = await asyncio.wait_for(bus.publish_many(events, msg_ids=["i1", "i2"]), 5)
    assert seqs == [1, 2] and js.sync_published == ["i1", "i2"]  # in order, with their ids
    with pytest.raises(TimeoutError):  # without ids a retry could store twice: the error surfaces
        await asyncio.wait_for(bus.publish_many(events), 5)


@pytest.mark.asyncio
async def test_load_registers_again_a_node_removed_while_it_was_not_silenced():
    from events.catalog import NodeRegistered, NodeRemoved
    from services.adapters.bus import InMemoryBus

    bus = InMemoryBus("p")
    load = Load(bus)
    for node, role in (("p0", "prefill"), ("d1", "decode")):
        await load.register(node, role)

    class _Tail:
        def __init__(self) -> None:
            self.deliveries: list = []

    load.tail = _Tail()
    removed = [NodeRemoved(ts=2.0, src="liveness", node=n, reason="heartbeat timeout") for n in ("p0", "d1")]
    seqs = [await bus.publish(ev) for ev in removed]
    load.silent.add("d1")  # d1's silence is the scenario's: it stays removed
    load.tail.deliveries = [Delivery(s, "x", ev, {}) for s, ev in zip(seqs, removed, strict=True)]
    await load.rejoin_removed()
    assert load.rejoins == ["p0"]
    again = [p.event for p in load.published[2:]]
    assert [(type(e), e.node) for e in again] == [(NodeRegistered, "p0")]
    await load.rejoin_removed()  # the same removal seen again: nothing more
    stale = Delivery(seqs[0] - 1, "x", removed[0], {})  # a removal older than the new registration
    load.tail.deliveries.append(stale)
    await load.rejoin_removed()
    assert load.rejoins == ["p0"] and len(load.published) == 3
