"""``evolving bench live``'s in-process router figure: the wall time and the CPU time of each
measured decision, side by side (services/drivers/up/bench.py, ``_router_core_ms``)."""

from __future__ import annotations

import time

from events.catalog import RequestSubmitted
from services.drivers.bench import harness
from services.drivers.up import bench


def _stream(n: int) -> list:
    evs = list(harness.nodes(4, 4))
    for b in range(3):
        evs += harness.branch_events(b, 0, prefix="lat")
    for i in range(n):
        evs.append(RequestSubmitted(ts=float(i), src="bench", request=f"req/{i}", branch=f"lat{i % 3}",
                                    blocks=list(range(i % 3 * 1000, i % 3 * 1000 + 4 * (i // 3 + 1))),
                                    prompt_tokens=600, max_tokens=8))
    evs.append(RequestSubmitted(ts=0.0, src="bench", request="warm/0", branch="lat0", blocks=[1],
                                prompt_tokens=64, max_tokens=8))  # not a measured request
    return evs


def test_each_measured_decision_has_a_wall_and_a_cpu_time():
    wall, cpu = bench._router_core_ms(_stream(30), "evolving")
    assert len(wall) == len(cpu) == 30
    assert all(w > 0 and c >= 0 for w, c in zip(wall, cpu, strict=True))


def test_time_off_the_cpu_shows_in_the_wall_time_only(monkeypatch):
    class Sleepy:  # a router that waits (as a descheduled process does) instead of working
        def apply(self, event):
            time.sleep(0.002)
            return []

    monkeypatch.setattr(bench, "load_router", lambda name: Sleepy)
    wall, cpu = bench._router_core_ms(_stream(5), "sleepy")
    assert min(wall) >= 2.0 and max(cpu) < 1.0
