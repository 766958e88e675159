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
