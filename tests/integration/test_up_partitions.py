"""End to end: ``evolving up --partitions 2`` on the session's nats-server: two sets of cores, two
streams, two recorders, the engines split, one gateway. Sessions (with forks) sent over HTTP all
complete; each session's events are only in its root's partition, served by that partition's
engines; each partition's log holds its stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.cores.partitions import partition_names, session_index
from services.drivers.up.testing import stop_up, wait_ready_file

REPO = Path(__file__).resolve().parents[2]




def _post(url: str, body: dict, headers: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read().decode(errors='replace')}") from None


@pytest.mark.stack
def test_up_two_partitions_keeps_every_session_in_its_partition(nats_url, partition, tmp_path):
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    names = partition_names(2, partition)
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--partitions", "2", "--run-dir", str(run_dir), "--engines", "4", "--gateway-port", "0",
         "--ready-file", str(ready), "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    roots = [f"s{i}-{partition}" for i in range(8)]
    try:
        urls = wait_ready_file(ready, up, 120)
        assert urls["partitions"] == {names[0]: ["n0", "n1"], names[1]: ["n2", "n3"]}
        gw = urls["gateway"]
        for root in roots:
            want = urls["partitions"][names[session_index(root, 2)]]
            for branch, parent in ((root, None), (f"{root}.fork", root)):
                h = {"x-branch-id": branch, **({"x-parent-branch-id": parent, "x-branch-mode": "fork"}
                                              if parent else {})}
                for turn in range(2):
                    # ignore_eos: the sim engine may end a turn early (its drawn length; request ids are random)
                    body = _post(gw, {"prompt": f"{root} says hello " * (20 + 10 * turn), "max_tokens": 8,
                                      "ignore_eos": True}, h)
                    assert body["usage"]["completion_tokens"] == 8
                    # served by an engine of the session's partition
                    assert body["evolving"]["prefill_node"] in want and body["evolving"]["decode_node"] in want
            for branch in (f"{root}.fork", root):
                _post(gw, {"prompt": "x", "max_tokens": 0}, {"x-branch-id": branch, "x-branch-end": "true"})
    finally:
        stop_up(up, 90)

    async def heads() -> list[int]:
        out = []
        for name in names:
            bus = await NatsBus.connect(nats_url, name)
            try:
                out.append(await bus.last_seq())
            finally:
                await bus.close()
        return out

    stream_heads = asyncio.run(heads())
    where: dict[str, set[str]] = {}
    for name, head in zip(names, stream_heads, strict=True):
        db = run_dir / f"run.{name}.duckdb"
        with DuckDbEventLog(db, read_only=True) as log:
            assert log.last_seq() == head > 0  # the partition's recorder holds its whole stream
            assert log.run_config()["live"]["partition"] == name
            subjects = {s for (s,) in log.con.execute("SELECT DISTINCT subject FROM events").fetchall()}
            assert all(s.startswith(f"ei.{name}.") for s in subjects), subjects
            branches = {b for (b,) in log.con.execute(
                "SELECT DISTINCT payload->>'$.branch' FROM events WHERE type IN "
                "('BranchOpened', 'RequestSubmitted', 'BranchEnded')").fetchall()}
            for b in branches:
                where.setdefault(b.split(".")[0], set()).add(name)
            submitted = {r for (r,) in log.con.execute(
                "SELECT payload->>'$.request' FROM events WHERE type = 'RequestSubmitted'").fetchall()}
            finished = {r for (r,) in log.con.execute(
                "SELECT payload->>'$.request' FROM events WHERE type = 'RequestFinished' "
                "AND coalesce(payload->>'$.error', '') = ''").fetchall()}
            assert submitted and submitted == finished  # every request of the partition was served
            nodes = {n for (n,) in log.con.execute(
                "SELECT DISTINCT payload->>'$.node' FROM events WHERE type = 'NodeRegistered'").fetchall()}
            assert nodes == set(urls["partitions"][name])
    assert set(where) == set(roots)
    for root, parts in where.items():
        assert parts == {names[session_index(root, 2)]}, (root, parts)  # nothing of a session elsewhere
    assert len(set().union(*where.values())) == 2  # both partitions served sessions
