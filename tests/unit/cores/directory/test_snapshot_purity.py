"""Snapshot round trip, determinism of folds, and the core's imports (purity)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    KvEvicted,
    KvMoved,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from services.cores.contract import Core, Sequenced
from services.cores.directory import CountAwareEviction, DirectoryCore, LruEviction


def history() -> list:
    """A small but complete history: every rule fires at least once, plus anomalies."""
    ev = [NodeRegistered(ts=0.0, node=n, role=r) for n, r in
          (("p1", "prefill"), ("p0", "prefill"), ("d0", "decode"), ("c0", "collocated"))]
    ev += [BranchOpened(ts=0.0, branch="root")]
    t = 1.0
    for i in range(6):
        blocks = list(range(100, 100 + 3 * (i + 1)))
        req = f"r{i}"
        p = ("p0", "p1", "c0")[i % 3]
        ev += [
            RequestSubmitted(ts=t, request=req, branch="root", blocks=blocks),
            RouteDecided(ts=t, request=req, prefill_node=p, decode_node="d0"),
            RequestStarted(ts=t, request=req, node=p, phase="prefill"),
            KvStored(ts=t, node=p, tier="L1", blocks=blocks, request=req),
            KvStored(ts=t, node=p, tier="L2", blocks=blocks, request=req),
            KvMoved(ts=t + 0.5, src_node=p, dst_node="d0", blocks=blocks, request=req),
        ]
        if i % 2:
            ev.append(RequestFinished(ts=t + 1, request=req, node="d0"))
        t += 10.0
    ev += [
        BranchOpened(ts=t, branch="fork", parent="root", mode="fork"),
        BranchOpened(ts=t, branch="sub", parent="root", mode="subagent"),
        RequestSubmitted(ts=t, request="s1", branch="sub", blocks=[900, 901]),
        RouteDecided(ts=t, request="s1", prefill_node="p1", decode_node="d0"),
        KvStored(ts=t, node="p1", tier="L2", blocks=[900, 901], request="s1"),
        ContextCompacted(ts=t + 1, branch="root", version=1, blocks=[500]),
        KvEvicted(ts=t + 2, node="p0", tier="L1", blocks=[100, 101, 999]),
        RoleSwitched(ts=t + 3, node="d0", role="prefill"),
        BranchEnded(ts=t + 4, branch="sub"),
        BranchEnded(ts=t + 5, branch="nobody"),
    ]
    return ev


def fold(events, core=None):
    core = core or DirectoryCore()
    out = []
    for e in events:
        out.extend(core.apply(e))
    return core, out


def test_is_a_core():
    assert isinstance(DirectoryCore(), Core)


def test_two_folds_give_byte_equal_snapshots():
    a, out_a = fold(history())
    b, out_b = fold(history())
    assert a.snapshot() == b.snapshot()
    assert out_a == out_b and len(out_a) >= 2


@pytest.mark.parametrize("cut", [0, 7, 20, 33, 45])
def test_snapshot_restore_gives_same_state_and_same_future(cut):
    ev = history()
    a, _ = fold(ev[:cut])
    b = DirectoryCore.from_snapshot(a.snapshot())
    assert b.snapshot() == a.snapshot()
    _, out_a = fold(ev[cut:], a)
    _, out_b = fold(ev[cut:], b)
    assert out_a == out_b
    assert a.snapshot() == b.snapshot()
    probe = [100, 101, 102, 103, 104, 105, 106]
    assert a.lookup(probe).per_node == b.lookup(probe).per_node
    for node in ("p0", "p1", "d0", "c0"):
        for tier in ("L1", "L2"):
            for pol in (CountAwareEviction(), LruEviction()):
                assert pol.order(a, node, tier) == pol.order(b, node, tier)
        assert a.pinned(node) == b.pinned(node)
    assert a.anomalies() == b.anomalies()


def test_sequenced_redelivery_is_a_no_op_and_snapshot_carries_the_position():
    ev = history()
    s = Sequenced(DirectoryCore())
    for i, e in enumerate(ev, 1):
        s.fold(i, e)
    before = s.snapshot()
    s.fold(3, ev[2])  # redelivered
    assert s.snapshot() == before and s.skipped == 1
    r = Sequenced.restore(before, DirectoryCore)
    assert r.applied_seq == len(ev) and r.core.snapshot() == s.core.snapshot()


def test_snapshot_refuses_another_version():
    import msgspec

    data = msgspec.msgpack.decode(DirectoryCore().snapshot())
    data[0] = 99
    with pytest.raises(ValueError, match="snapshot version"):
        DirectoryCore.from_snapshot(msgspec.msgpack.encode(data))


PKG = Path(__file__).resolve().parents[4] / "services" / "cores" / "directory"
PURE = ["core.py", "lookup.py", "eviction.py", "table.py"]
FORBIDDEN = {"asyncio", "nats", "duckdb", "time", "random", "uuid", "structlog", "socket", "os"}
ALLOWED_THIRD_PARTY = {"numpy", "msgspec", "events"}
ALLOWED_SERVICES = {"services.cores.contract", "services.cores.directory", "services.cores.directory.core",
                    "services.cores.directory.lookup", "services.cores.directory.eviction",
                    "services.cores.directory.table", "services.cores.directory._native"}


@pytest.mark.parametrize("module", PURE)
def test_core_imports_only_stdlib_numpy_msgspec_events(module):
    tree = ast.parse((PKG / module).read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    assert names, "the parser found no imports at all"
    for name in names:
        root = name.split(".")[0]
        assert root not in FORBIDDEN, f"{module} imports {name}"
        if root == "services":
            assert name in ALLOWED_SERVICES, f"{module} imports {name}"
        else:
            assert root in ALLOWED_THIRD_PARTY or root in sys.stdlib_module_names or root == "__future__", (
                f"{module} imports {name}")


def test_compiled_modules_import_only_c_and_numpy():
    """The compiled parts of the core (``*.pyx``) stay pure too: the Python C API, libc
    and numpy, nothing that does I/O or reads a clock."""
    pyx = sorted(PKG.glob("*.pyx"))
    assert pyx, "no compiled module found"
    allowed = {"cpython", "libc", "numpy"}
    for path in pyx:
        text = path.read_text()
        names = re.findall(r"^\s*(?:from\s+(\S+)\s+c?import|c?import\s+(\S+))", text, flags=re.MULTILINE)
        assert names, f"{path.name}: the parser found no imports at all"
        for a, b in names:
            root = (a or b).split(".")[0]
            assert root in allowed, f"{path.name} imports {a or b}"
        assert not re.search(r"\b(fopen|open|time|clock|rand|getenv|printf)\s*\(", text), path.name
