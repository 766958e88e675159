"""Liveness under load, on a real ``evolving up --engines 4``: real Claude Code
sessions through the gateway, the same load twice on one stack, while two busy loops
(``python -c 'while True: pass'``) compete for the CPU. Nothing may be lost and no engine removed.

The full load (marker ``load``, not in the default suite: ``pytest -m load``) is the issue's:
the first 30 sessions of ``../shared/traces/weka-claude-code-calibration`` that fit the
gateway's context, each cut to its first 8 requests (226 requests, 19.1 M prompt tokens), or of
the bundled ``deploy/traces/calibration`` where that folder is absent (223 requests), 30 at a
time. The short one (marker ``load`` too, since its busy loops slow the
default suite's other worker) is 6 bundled sessions x 4 requests, 6 at a time, on engines
whose model clock runs 5x the wall clock, pauses / 1000 (about 25 s).
services/drivers/soak/agents.py runs them (``evolving soak --trace``); docs/live.md, "Liveness",
has the figures."""

from __future__ import annotations

import pytest

from services.drivers.soak.agents import AgentLoadConfig, run_agents
from services.drivers.up.testing import REPO

SHARED = REPO / "deploy" / "traces" / "calibration-100"  # the 100 calibration sessions
BUNDLED = REPO / "deploy" / "traces" / "calibration"


def _check(rep: dict, requests: int) -> None:
    assert rep["load"]["requests"] == requests
    assert rep["removals"] == 0, rep["liveness"]["removal_reasons"]
    assert rep["lost"] == 0 and rep["liveness"]["log_errors"] == 0, (rep["repeats"], rep["liveness"]["log_error_reasons"])
    assert [r["requests_ok"] >= requests for r in rep["repeats"]] == [True, True]
    assert rep["stack"]["up_rc"] == 0
    eng = rep["engines"]["all"]
    assert eng["beats"] > 0 and eng["failed"] == 0


@pytest.mark.load
async def test_the_agent_load_twice_under_cpu_contention_loses_nothing_and_removes_no_engine(tmp_path):
    trace = SHARED if SHARED.is_dir() else BUNDLED
    rep = await run_agents(AgentLoadConfig(run_dir=tmp_path / "run", trace=str(trace), sessions=30, turns=8,
                                           concurrency=30, speedup=100.0, repeat=2, busy=2,
                                           up_args=["--metrics-port", "-1"]), say=lambda _: None)
    _check(rep, 226 if trace == SHARED else 223)


@pytest.mark.load  # its two busy loops take both cores for a minute: the default suite's other worker too
async def test_a_short_agent_load_twice_under_cpu_contention_loses_nothing(tmp_path):
    # the engines' model clock 5x the wall clock (`up --time-scale 5`: the liveness timeout scales with
    # it) and the sessions' pauses / 1000: about 25 s here
    rep = await run_agents(AgentLoadConfig(run_dir=tmp_path / "run", trace=str(BUNDLED), sessions=6, turns=4,
                                           concurrency=6, speedup=1000.0, repeat=2, busy=2,
                                           up_args=["--metrics-port", "-1", "--time-scale", "5"]), say=lambda _: None)
    _check(rep, 24)
