"""A fidelity run configures both sides from one stack: the torch engines serve their prefill
queue in arrival order, so the simulated nodes do too and the live router prices them so, for
every stack (the evolving stack's simulated short_first is a policy the live engines lack)."""

from __future__ import annotations

import pytest

from engine.profiles import load_profile
from replay.fidelity.live import up_args
from replay.fidelity.run import LIVE_PREFILL_ORDER, stack_of
from replay.sim.stacks import get_stack


@pytest.mark.parametrize("name", ["evolving", "dynamo", "static:1P1D"])
def test_both_sides_take_the_live_engines_prefill_order(name):
    st, cfg = stack_of(name, 2, 30.0)
    assert st.prefill_order == LIVE_PREFILL_ORDER == "fcfs"
    conf = st.core_config(load_profile("gb300-glm52"), cfg)
    args = up_args(conf, st, 2)
    routed = [a for a in args if a.startswith("--router-arg=prefill_order=")]
    assert routed in ([], ['--router-arg=prefill_order="fcfs"']), routed


def test_the_simulated_evolving_stack_alone_is_short_first():
    """What the override changes: without it the live router would price FCFS torch queues as
    short_first ones and the simulator would serve another order than the engines."""
    assert get_stack("evolving").prefill_order == "short_first"
    assert stack_of("evolving", 2, 30.0)[0].prefill_order == "fcfs"


def test_each_engine_gets_its_share_of_the_cores_and_the_environment_is_restored(monkeypatch):
    """Two torch engines on two cores get one thread each (the simulator's nodes never share a
    GPU; sharing cores made an iteration 1.35-1.55x slower while the other engine computed), and
    the setting is only in force while up starts."""
    import os

    from replay.fidelity.live import _environ, engine_env

    assert engine_env(2, 2) == {"OMP_NUM_THREADS": "1"}
    assert engine_env(2, 16) == {"OMP_NUM_THREADS": "8"}
    assert engine_env(4, 2) == {"OMP_NUM_THREADS": "1"}  # at least one
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with _environ({"OMP_NUM_THREADS": "1"}):
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "7"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with _environ({"OMP_NUM_THREADS": "1"}):
        pass
    assert "OMP_NUM_THREADS" not in os.environ
