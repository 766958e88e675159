"""Plug-ins: entry-point discovery of an external router; shadow routers change nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from events.catalog import RouteDecided
from events.subjects import subject_for
from services.adapters.plugins import PluginNotFound, available, load_router
from services.cores.router.base import Router
from services.cores.router.cache_aware import CacheAwareRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "plugin_pkg"
BUILTIN = {"evolving", "cache_aware", "sticky", "round_robin", "least_loaded", "dynamo_kv"}


@pytest.fixture
def ext_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE))
    yield
    sys.modules.pop("ext_router_pkg", None)


def test_builtin_routers_are_registered_by_name():
    names = set(available("evolving.routers"))
    assert BUILTIN <= names
    for name in sorted(BUILTIN):
        router = load_router(name)()
        assert isinstance(router, Router)
        assert router.name == name


def test_external_plugin_is_found_and_routes(ext_on_path):
    cls = load_router("ext_last_node")
    assert cls.__module__ == "ext_router_pkg"
    router = cls(name="mine", shadow=False, block_tokens=64)
    evs = s.register(3, 1) + [s.branch("b", 0.0), s.submit("x", "b", s.blocks(1, 3), 1.0)]
    rd = [o for e in evs for o in router.apply(e) if isinstance(o, RouteDecided)]
    assert [(d.prefill_node, d.policy) for d in rd] == [("p02", "mine")]


def test_unknown_plugin_names_the_installed_ones():
    with pytest.raises(PluginNotFound, match="evolving"):
        load_router("no_such_router")


def test_unknown_parameter_is_refused():
    with pytest.raises(TypeError, match="cache_threshold"):
        LeastTtftRouter(cache_threshold=0.5)


def _stream():
    evs = s.register(3, 2) + [s.branch("hot", 0.0)]
    evs += s.store("p00", s.blocks(1, 100), 0.5)
    evs += [s.submit(f"r{i}", "hot", s.blocks(1, 100) + s.blocks(1_000 * (i + 1), 5), 1.0 + i * 0.01)
            for i in range(6)]
    return evs


def test_shadow_router_publishes_on_its_subject_and_changes_nothing():
    acting = LeastTtftRouter()
    shadow = CacheAwareRouter(name="ca_shadow", shadow=True)
    acting_out, shadow_out = [], []
    for ev in _stream():
        a = acting.apply(ev)
        acting_out += a
        shadow_out += shadow.apply(ev)
        for o in a:  # the stream carries the acting router's decisions to the shadow
            if isinstance(o, RouteDecided):
                shadow_out += shadow.apply(o)
        before = acting.snapshot()
        for o in list(shadow_out):
            if isinstance(o, RouteDecided):
                assert acting.apply(o) == []  # a shadow decision changes nothing
        assert acting.snapshot() == before
    sd = [o for o in shadow_out if isinstance(o, RouteDecided)]
    assert len(sd) == 6
    assert all(d.shadow and d.policy == "ca_shadow" for d in sd)
    assert {subject_for(d, "default", shadow="ca_shadow") for d in sd} == {"ei.default.shadow.ca_shadow.routedecided"}
    ad = [o for o in acting_out if isinstance(o, RouteDecided)]
    assert all(not d.shadow and subject_for(d) == "ei.default.route" for d in ad)
    # the shadow's queues follow the acting decisions, not its own
    assert {n: ns.prefill_queue for n, ns in shadow.state.nodes.items()} == \
        {n: ns.prefill_queue for n, ns in acting.state.nodes.items()}
    # and its own choices differ: it would have piled on the holder
    assert [d.prefill_node for d in sd] == ["p00"] * 6
    assert len({d.prefill_node for d in ad}) > 1


def test_acting_router_ignores_its_echo():
    r = LeastTtftRouter()
    out = [o for ev in _stream() for o in r.apply(ev)]
    snap = r.snapshot()
    for o in out:
        if isinstance(o, RouteDecided):
            assert r.apply(o) == []
    assert r.snapshot() == snap
