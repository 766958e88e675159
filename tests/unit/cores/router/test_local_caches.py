"""``shared_pool`` False (the data plane has node-local caches, stack part ``+local``): the
least-TTFT router prices a node with its own prefix only, since a block another node holds is
recomputed there, not fetched (found in the full-length 4P5D ablation, docs/experiments.md)."""

from __future__ import annotations

from engine.profiles import load_profile
from events.catalog import RouteDecided
from replay.sim.simulation import SimConfig
from replay.sim.stacks import get_stack
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s

BT = 64


def _route(router) -> dict[str, RouteDecided]:
    """p00 holds a 1,500-block prefix and has a 625-block request queued; p01 is idle; then a
    request of that prefix + 10 new blocks."""
    evs = s.register(2, 1) + [s.branch("b", 0.0)] + s.store("p00", s.blocks(0, 1_500), 0.5)
    evs.append(s.submit("mid", "b", s.blocks(10_000, 625), 1.0))
    evs.append(s.submit("r", "b", s.blocks(0, 1_500) + s.blocks(20_000, 10), 1.1))
    out = []
    for ev in evs:
        out.extend(router.apply(ev))
    return {e.request: e for e in out if isinstance(e, RouteDecided)}


def test_with_a_shared_pool_the_idle_node_fetches_the_prefix():
    rd = _route(LeastTtftRouter())
    assert rd["mid"].prefill_node == "p00"
    assert rd["r"].prefill_node == "p01"  # fetching 1,500 blocks beats waiting behind "mid"
    assert rd["r"].t_c == 1_500 * BT


def test_with_node_local_caches_the_holder_wins_and_the_idle_node_is_priced_as_recompute():
    rd = _route(LeastTtftRouter(shared_pool=False))
    assert rd["mid"].prefill_node == "p00"
    r = rd["r"]
    assert r.prefill_node == "p00"  # waiting behind "mid" beats recomputing 1,500 blocks on p01
    assert (r.t_c, r.t_uc) == (1_500 * BT, 10 * BT)
    by_node = {sc.node: sc for sc in r.scores}
    assert by_node["p01"].t_c == 0 and by_node["p00"].t_c == 1_500 * BT
    assert by_node["p01"].score > by_node["p00"].score


def test_the_local_part_tells_the_router_there_is_no_pool_and_other_stacks_are_unchanged():
    prof, cfg = load_profile("gb300-glm52"), SimConfig(nodes=9, warmup_s=60.0, duration_s=60.0)
    kw = {spec: get_stack(spec).core_config(prof, cfg)["router"]["kwargs"]
          for spec in ("evolving", "evolving+local", "evolving-static:4P5D+local", "evolving-localcache",
                       "evolving+at_start", "static:4P5D")}
    assert all(kw[k]["shared_pool"] is False for k in ("evolving+local", "evolving-static:4P5D+local",
                                                       "evolving-localcache"))
    # the stacks with a pool (and the cache-aware router) keep their configuration as it was
    assert all("shared_pool" not in kw[k] for k in ("evolving", "evolving+at_start", "static:4P5D"))
