"""The event authority (events/authority.py): the subject rule, the timestamp rule, and the
account permissions (services/adapters/bus/security.py) held to the same table."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.authority import (
    AUTHORITY,
    CLOCK_SETTERS,
    FAMILIES,
    FUTURE_BOUND_S,
    Admission,
    Refused,
    check_subject,
    check_ts,
)
from events.catalog import (
    AnomalyReported,
    BranchOpened,
    IterationDone,
    KvMoved,
    KvStored,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestSubmitted,
    RouteDecided,
    SwitchRole,
    Tick,
)
from events.subjects import subject_for
from services.adapters.bus.port import subject_matches
from services.adapters.bus.security import ServiceSpec, service_permissions
from services.cores.contract import Sequenced

P = "default"


def test_every_event_is_admitted_on_its_own_subject():
    evs = [BranchOpened(ts=1, branch="b1"), KvStored(ts=1, node="n0", tier="L1", blocks=[1]),
           KvMoved(ts=1, src_node="n1", dst_node="n0", blocks=[1]), NodeHeartbeat(ts=1, node="n0", role="prefill"),
           RouteDecided(ts=1, request="r", prefill_node="n0", decode_node="n1"),
           SwitchRole(ts=1, node="n1", to_role="prefill"), Tick(ts=1),
           AnomalyReported(ts=1, component="router", kind="x")]
    for ev in evs:
        assert check_subject(ev, subject_for(ev, P)) is None, ev
    shadow = RouteDecided(ts=1, request="r", prefill_node="n0", decode_node="n1", shadow=True)
    assert check_subject(shadow, subject_for(shadow, P, shadow="mine")) is None


@pytest.mark.parametrize(("event", "subject", "words"), [
    # the repros: a role switch, a removal and a tick on the gateway's subject
    (SwitchRole(ts=1, node="n1", to_role="prefill"), "ei.default.agent.forged", "agent family"),
    (NodeRemoved(ts=1, node="n0"), "ei.default.agent.forged", "agent family"),
    (Tick(ts=1), "ei.default.agent.forged", "agent family"),
    # engine n0's account: a switch of n1 on its own node subject, a removal of another node
    (SwitchRole(ts=1, node="n1", to_role="prefill"), "ei.default.node.n0", "node family"),
    (NodeRemoved(ts=1, node="n1"), "ei.default.node.n0", "'n1'"),
    (KvStored(ts=1, node="n1", tier="L1", blocks=[1]), "ei.default.kv.n0", "'n1'"),
    # a planner command addressed to another node's command subject
    (SwitchRole(ts=1, node="n1", to_role="prefill"), "ei.default.cmd.n0", "'n1'"),
    # the gateway opening a branch under another branch's subject
    (BranchOpened(ts=1, branch="b2"), "ei.default.agent.b1", "'b2'"),
    # a shadow decision on the acting route subject, and an acting one under shadow
    (RouteDecided(ts=1, request="r", prefill_node="a", decode_node="b", shadow=True), "ei.default.route", "shadow"),
    (RouteDecided(ts=1, request="r", prefill_node="a", decode_node="b"), "ei.default.shadow.x.routedecided",
     "shadow=true"),
    (Tick(ts=1), "ei.default.nonsense", "unknown family"),
    (Tick(ts=1), "eidlq.default.x", "not an event subject"),
])
def test_forgeries_are_refused(event, subject, words):
    why = check_subject(event, subject)
    assert why is not None and words in why, why


def test_admission_remembers_only_what_it_checked():
    """The subject verdicts an Admission remembers never admit a forgery: each one of
    the forgeries above is refused right after a twin on its own subject was admitted, by the
    same Admission (same type, same subject or same fields: never both)."""
    a = Admission()
    forgeries = [(KvStored(ts=1, node="n1", tier="L1", blocks=[1]), "ei.default.kv.n0"),
                 (BranchOpened(ts=1, branch="b2"), "ei.default.agent.b1"),
                 (SwitchRole(ts=1, node="n1", to_role="prefill"), "ei.default.cmd.n0"),
                 (RouteDecided(ts=1, request="r", prefill_node="a", decode_node="b", shadow=True), "ei.default.route")]
    for forged, subject in forgeries:
        twin = msgspec.structs.replace(forged, **{"node": "n0"} if hasattr(forged, "node") else
                                       {"branch": "b1"} if hasattr(forged, "branch") and not
                                       isinstance(forged, RouteDecided) else {"shadow": False})
        assert a.reason(twin, subject) is None, twin
        assert a.reason(twin, subject) is None  # remembered
        assert a.reason(forged, subject) is not None, forged
        own = subject_for(forged, P, shadow="x" if getattr(forged, "shadow", False) else None)
        assert a.reason(forged, own) is None  # and on its own subject it passes


def test_permissions_follow_the_table():
    """Every ``ei.<p>.<family>`` subject an account may publish on belongs to a family whose
    producers include its role, and every producer role may publish on its family."""
    specs = [ServiceSpec("directory", "directory"), ServiceSpec("planner", "planner"),
             ServiceSpec("router", "router"), ServiceSpec("router", "router-s", shadow="s"),
             ServiceSpec("recorder", "recorder"), ServiceSpec("gateway", "gateway"),
             ServiceSpec("engine", "engine-n0", node="n0"), ServiceSpec("operator", "operator")]
    may: dict[str, set[str]] = {}
    for spec in specs:
        perms = service_permissions(spec, P)
        fams = {s.split(".")[2] for s in perms.publish if s.startswith(f"ei.{P}.")}
        for fam in fams:
            assert fam in FAMILIES, (spec.role, fam)
            assert spec.role in FAMILIES[fam].producers, f"{spec.role} may publish on {fam}, the table says not"
        may.setdefault(spec.role, set()).update(fams)
    for fam in AUTHORITY:
        for role in fam.producers:
            assert fam.family in may[role], f"the table lets {role} publish on {fam.family}; its account may not"
    # an engine's account publishes about its own node only
    eng = service_permissions(ServiceSpec("engine", "engine-n0", node="n0"), P).publish
    assert subject_matches_any(eng, "ei.default.node.n0") and not subject_matches_any(eng, "ei.default.node.n1")
    assert not subject_matches_any(eng, "ei.default.cmd.n1") and not subject_matches_any(eng, "ei.default.clock")
    gw = service_permissions(ServiceSpec("gateway", "gateway"), P).publish
    assert not any(subject_matches_any(gw, s) for s in ("ei.default.cmd.n1", "ei.default.node.n0", "ei.default.clock"))


def subject_matches_any(patterns, subject: str) -> bool:
    return any(subject_matches(p, subject) for p in patterns)


def test_timestamps():
    assert check_ts(math.nan, 0) is not None and "finite" in check_ts(math.nan, 0)
    assert check_ts(math.inf, 100) is not None
    assert check_ts(-1.0, 0) is not None
    assert check_ts(1e12, 0) is None  # the first event sets the stream's time
    assert check_ts(100 + FUTURE_BOUND_S, 100) is None
    assert "ahead" in check_ts(100 + FUTURE_BOUND_S + 1, 100)
    assert check_ts(1.0, 1000.0) is None  # late is fine: a lagging publisher


def test_a_measured_quantity_must_be_finite():
    a = Admission()
    bad = IterationDone(ts=1.0, node="n0", phase="prefill", duration_s=math.nan)
    assert "duration_s" in a.reason(bad, "ei.default.node.n0")
    assert a.reason(IterationDone(ts=1.0, node="n0", phase="prefill", duration_s=0.5), "ei.default.node.n0") is None
    assert a.reason(RouteDecided(ts=1.0, request="r", prefill_node="a", decode_node="b",
                                 predicted_ttft_s=math.inf), "ei.default.route") is None  # a decision: verify's


def test_admission_clock_moves_only_with_admitted_events():
    a = Admission()
    assert a.reason(Tick(ts=1000.0), "ei.default.clock") is None
    assert a.reason(Tick(ts=1000.0 + 3600), "ei.default.agent.x") is not None  # the Tick(now+3600)
    assert a.reason(NodeHeartbeat(ts=1000.0 + 3600, node="n0", role="decode"), "ei.default.node.n0") is not None
    assert a.clock == 1000.0
    assert a.reason(SwitchRole(ts=5000.0, node="n1", to_role="prefill"), "ei.default.agent.x") is not None
    assert a.clock == 1000.0  # a refused event does not move the stream's time
    assert a.refused == 3


def test_a_silence_longer_than_the_bound_is_crossed_by_the_clock_or_a_registration():
    """A whole stack down for ten minutes: its first tick, or a node's registration, sets the time."""
    a = Admission()
    assert a.reason(NodeHeartbeat(ts=1000.0, node="n0", role="decode"), "ei.default.node.n0") is None
    later = 1000.0 + 600
    assert a.reason(NodeHeartbeat(ts=later, node="n0", role="decode"), "ei.default.node.n0") is not None
    assert a.reason(NodeRegistered(ts=later, node="n0", role="decode"), "ei.default.node.n0") is None
    assert a.reason(NodeHeartbeat(ts=later + 1, node="n0", role="decode"), "ei.default.node.n0") is None
    b = Admission(clock=1000.0)
    assert b.reason(Tick(ts=later), "ei.default.clock") is None and b.clock == later
    assert b.reason(Tick(ts=math.nan), "ei.default.clock") is not None  # still finite
    b = Admission.from_snapshot(a.snapshot())
    assert (b.clock, b.refused, b.future_bound_s) == (a.clock, a.refused, a.future_bound_s)


class _Count:
    name = "count"

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def apply(self, event):
        self.n += 1
        return []

    def snapshot(self) -> bytes:
        return str(self.n).encode()

    @classmethod
    def from_snapshot(cls, data: bytes):
        return cls(int(data))


def test_sequenced_refuses_and_moves_on_and_snapshots_the_clock():
    s = Sequenced(_Count())
    s.fold(1, Tick(ts=10.0), "ei.default.clock")
    with pytest.raises(Refused):
        s.fold(2, SwitchRole(ts=11.0, node="n1", to_role="prefill"), "ei.default.agent.x")
    assert s.applied_seq == 2 and s.core.n == 1
    assert s.fold(2, Tick(ts=12.0), "ei.default.clock") == [] and s.core.n == 1  # redelivery
    r = Sequenced.restore(s.snapshot(), _Count)
    assert r.admission.clock == 10.0 and r.applied_seq == 2
    with pytest.raises(Refused):
        r.fold(3, NodeHeartbeat(ts=10.0 + FUTURE_BOUND_S + 5, node="n0", role="decode"), "ei.default.node.n0")
    assert s.fold(4, RequestSubmitted(ts=1.0, request="q", branch="b"), None) == []  # trusted driver


# ---------------------------------------------------------------- properties
_nodes = st.sampled_from(["n0", "n1", "n2"])
_events = st.one_of(
    st.builds(lambda n, t: NodeHeartbeat(ts=t, node=n, role="decode"), _nodes, st.floats(0, 1e6)),
    st.builds(lambda n, t: NodeRemoved(ts=t, node=n), _nodes, st.floats(0, 1e6)),
    st.builds(lambda n, t: SwitchRole(ts=t, node=n, to_role="decode"), _nodes, st.floats(0, 1e6)),
    st.builds(lambda t: Tick(ts=t), st.floats(0, 1e6)),
    st.builds(lambda b, t: BranchOpened(ts=t, branch=b), st.sampled_from(["b1", "b2"]), st.floats(0, 1e6)),
)
_subjects = st.sampled_from(["ei.default.agent.b1", "ei.default.node.n0", "ei.default.node.n1", "ei.default.cmd.n1",
                             "ei.default.clock", "ei.default.route", "ei.default.kv.n0"])


@given(st.lists(st.tuples(_events, _subjects), max_size=40))
def test_admitted_means_on_its_own_subject_and_clock_is_bounded(stream):
    """An admitted event stands on the very subject subject_for gives it, never more than the
    bound ahead of every earlier admitted event (but the clock's setters); the clock never goes back; a replay of the same
    deliveries admits exactly the same ones."""
    a, b = Admission(), Admission()
    clock = 0.0
    for ev, subj in stream:
        why = a.reason(ev, subj)
        assert (why is None) == (b.reason(ev, subj) is None)
        if why is None:
            assert subject_for(ev, P) == subj
            assert clock == 0 or ev.ts <= clock + FUTURE_BOUND_S or isinstance(ev, CLOCK_SETTERS)
            clock = max(clock, ev.ts)
        assert a.clock == clock


def test_every_event_type_of_the_catalog_is_admitted_on_its_subject_and_has_one_family():
    """A new event type joins a family in events/subjects.py once; the table follows."""
    import typing

    from events.catalog import AnyEvent
    from services.drivers.chaos.hostile import forged_events

    evs = forged_events(1.0, "n1")
    assert {type(e) for e in evs} == set(typing.get_args(AnyEvent))
    for ev in evs:
        assert check_subject(ev, subject_for(ev, P)) is None, ev
        homes = [f.family for f in AUTHORITY if f.family != "shadow" and isinstance(ev, f.events)]
        assert len(homes) == 1, (type(ev).__name__, homes)
