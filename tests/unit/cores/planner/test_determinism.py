"""Same events -> same decisions, byte for byte; snapshots resume; the cores stay pure."""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

from events.catalog import ModelFitted, PlanEvaluated, RoleSwitchOrdered, SwitchRole
from events.codec import decode, encode, to_json
from services.cores.planner.arrow import ArrowPlanner
from services.cores.planner.dynamo import DynamoPlanner
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.static import StaticPlanner
from services.drivers.bench.synthetic import Mix, Scenario, drive

PURE = ["../costmodel.py", "evolving.py", "configured.py", "static.py", "load_signals.py", "dynamo.py", "arrow.py", "base.py", "window.py", "evaluate.py", "samples.py", "shift.py", "backlog.py"]
ALLOWED = {
    "__future__",
    "math",
    "re",
    "bisect",
    "dataclasses",
    "typing",
    "collections",
    "numpy",
    "scipy",
    "msgspec",
    "events",
    "services",
}
SCENARIO = Scenario(
    mixes=[Mix(900, t_uc=500, t_c=20_000, t_out=2000), Mix(1300, t_uc=8000, t_c=2000, t_out=100)]
)
DECISIONS = (ModelFitted, PlanEvaluated, RoleSwitchOrdered, SwitchRole)


@functools.cache
def trace_of(cls):
    return drive(cls(warmup_s=300), SCENARIO)


def wire(events) -> bytes:
    """The decisions as the stream carries them (and they survive decoding and JSON)."""
    out = []
    for e in events:
        if isinstance(e, DECISIONS):
            data = encode(e)
            assert decode(data) == e
            to_json(e)
            out.append(data)
    return b"".join(out)


@pytest.mark.parametrize("cls", [EvolvingPlanner, StaticPlanner, DynamoPlanner, ArrowPlanner])
def test_same_events_same_decisions_byte_equal(cls):
    first = trace_of(cls)
    assert any(isinstance(e, RoleSwitchOrdered) for e in first.outputs)
    again = cls(warmup_s=300)
    replayed = [out for ev in first.inputs for out in again.apply(ev)]
    assert wire(replayed) == wire(first.outputs)
    assert again.snapshot() == cls.from_snapshot(again.snapshot()).snapshot()


@pytest.mark.parametrize("cls", [EvolvingPlanner, DynamoPlanner, ArrowPlanner])
@pytest.mark.parametrize("cut", [150, 2000, 20_000])
def test_snapshot_then_tail_gives_the_same_decisions(cls, cut):
    trace = trace_of(cls)
    head, tail = trace.inputs[:cut], trace.inputs[cut:]
    a = cls(warmup_s=300)
    for ev in head:
        a.apply(ev)
    b = cls.from_snapshot(a.snapshot())
    assert b.snapshot() == a.snapshot()
    out_a = [o for ev in tail for o in a.apply(ev)]
    out_b = [o for ev in tail for o in b.apply(ev)]
    assert wire(out_a) == wire(out_b) and out_a
    assert a.snapshot() == b.snapshot()


def test_snapshot_refuses_another_planner():
    with pytest.raises(AssertionError, match="snapshot of EvolvingPlanner"):
        ArrowPlanner.from_snapshot(EvolvingPlanner().snapshot())


@pytest.mark.parametrize("module", PURE)
def test_cores_import_only_pure_modules(module):
    path = pathlib.Path(__file__).parents[4] / "services" / "cores" / "planner" / module
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert name.split(".")[0] in ALLOWED, f"{module} imports {name}"
            if name.startswith("services"):
                assert name in ("services.cores.contract", "services.cores.costmodel", "services.cores.numerics") \
                    or name.startswith("services.cores.planner."), \
                    f"{module}: {name}"
            assert name != "services.drivers.bench.synthetic", f"{module} imports the test generator"
