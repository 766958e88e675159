"""Event authority: which producer may put which events, about which entity, on which subject.

NATS tells a consumer the subject a message came on, never who sent it: the ``src`` field is
written by the sender and proves nothing. What the server does enforce is *who may publish on
which subject* (services/adapters/bus/security.py generates each account's publish permissions).
So authority is a property of the subject, and this module closes the gap between the two:

* :data:`AUTHORITY` is THE table: one row per subject family, the event types that family
  carries, the roles whose accounts may publish on it (the permissions are checked against it by
  ``tests/unit/events/test_authority.py``) and the entity the subject's last token binds
  (a branch, a node, a component, a shadow router's name).
* :func:`check_subject` admits an event on a subject only when the subject is exactly the one
  :func:`events.subjects.subject_for` gives for it: the type belongs to the family and the
  entity it is about is the one in the subject. With the permissions this means: role commands
  (``SwitchRole``), plans and ticks only from the planner; routing decisions only from the
  router; KV and engine facts only about the publishing engine's own node; agent signals only
  from the gateway. A ``SwitchRole(n1)`` published on ``ei.<p>.agent.x`` (the gateway's subject)
  or on ``ei.<p>.node.n0`` (engine n0's) is refused, whatever its ``src`` says.
* :class:`Admission` adds the timestamp rule, the one that needs state: ``ts`` must be finite,
  not negative, and at most :data:`FUTURE_BOUND_S` ahead of the stream's time, the largest
  ``ts`` admitted so far at a lower sequence (an engine's heartbeat an hour ahead would keep a
  dead node alive for an hour). Only the future is bounded: a lagging engine's queued events are
  legitimately old. The stream's clock itself - the planner's ``Tick`` - and a node's own
  registration may move it further (:data:`CLOCK_SETTERS`): they are how time crosses a silence
  of the whole stream. A ``Tick(ts=now+3600)`` from any account but the planner's is refused by
  the subject rule; the planner's own clock is its authority, like its role commands.

Every consumer that folds the stream (the services' runner, the engines' worker view, the
gateway's watchers) and ``evolving verify`` apply the same :class:`Admission`, so a replay of the
log refuses exactly what the live services refused. A refused event is dead-lettered and
counted, never folded. The simulator publishes no subjects and is not checked.

The node family ``ei.<p>.node.<n>`` is shared: engine ``n`` publishes its own facts there and the
planner's liveness watcher publishes ``NodeRemoved``/``RequestFinished`` about ``n``. No subject
can tell those two apart, so an engine may still say of its *own* node what liveness says (that
it is gone, that its request failed): it cannot say anything about another node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from events.catalog import (
    Event,
    IterationDone,
    KvFetched,
    KvMoved,
    NodeHeartbeat,
    NodeRegistered,
    RoleSwitched,
    RouteDecided,
    Tick,
)
from events.subjects import (
    AGENT_EVENTS,
    ANOMALY_EVENTS,
    CLOCK_EVENTS,
    CMD_EVENTS,
    KV_EVENTS,
    NODE_EVENTS,
    PLAN_EVENTS,
    ROUTE_EVENTS,
    subject_for,
    token,
)

#: How far (seconds) an event's ``ts`` may run ahead of the stream's time. Hosts of one cluster
#: agree on the time to well under a second (NTP); a planner tick comes every second; a lagging
#: publisher makes events older, never newer. 300 s leaves room for a host whose clock is off by
#: minutes, and refuses the far-future forgeries that would expire every node at once.
FUTURE_BOUND_S = 300.0


@dataclass(frozen=True)
class Family:
    """One row of :data:`AUTHORITY`."""

    family: str  # the subject's third token: ei.<p>.<family>...
    subject: str  # the subject pattern, for the docs
    events: tuple[type[Event], ...]
    producers: tuple[str, ...]  # roles whose accounts may publish here (security.py ROLES)
    binds: str  # what the subject's entity token must equal ("" when the subject has none)
    note: str = ""


AUTHORITY: tuple[Family, ...] = (
    Family("agent", "ei.<p>.agent.<branch>", AGENT_EVENTS, ("gateway",), "the event's branch"),
    Family("kv", "ei.<p>.kv.<node>", KV_EVENTS, ("engine",),
           "the event's node (dst_node for KvMoved, KvFetched: the engine that received the blocks)",
           "engine <node> only"),
    Family("node", "ei.<p>.node.<node>", NODE_EVENTS, ("engine", "planner"), "the event's node",
           "engine <node> (its own facts); the planner's liveness watcher (NodeRemoved, RequestFinished)"),
    Family("route", "ei.<p>.route", ROUTE_EVENTS, ("router",), "",
           "the router in charge; RouteDecided.shadow must be false"),
    Family("plan", "ei.<p>.plan", PLAN_EVENTS, ("planner",), ""),
    Family("cmd", "ei.<p>.cmd.<node>", CMD_EVENTS, ("planner",), "the command's node"),
    Family("clock", "ei.<p>.clock", CLOCK_EVENTS, ("planner",), ""),
    Family("anomaly", "ei.<p>.anomaly.<component>", ANOMALY_EVENTS,
           ("directory", "planner", "router", "engine"), "the event's component",
           "each account only its own components"),
    Family("shadow", "ei.<p>.shadow.<name>.<type>", (*ROUTE_EVENTS, *ANOMALY_EVENTS), ("router",),
           "the shadow router's name (and the type's lower-case name)",
           "a router in shadow; RouteDecided.shadow must be true (nobody acts on it)"),
)

FAMILIES: dict[str, Family] = {f.family: f for f in AUTHORITY}


def family_of(subject: str) -> str | None:
    """``agent``, ``node``, ... for ``ei.<p>.<family>...``; None for a subject outside any stream."""
    parts = subject.split(".", 3)
    return parts[2] if len(parts) >= 3 and parts[0] == "ei" else None


def check_subject(event: Event, subject: str) -> str | None:
    """Why ``event`` may not stand on ``subject`` (None: it may). Pure."""
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != "ei":
        return f"subject {subject!r} is not an event subject (ei.<partition>.<family>...)"
    fam = FAMILIES.get(parts[2])
    name = type(event).__name__
    if fam is None:
        return f"subject {subject!r}: unknown family {parts[2]!r}"
    if not isinstance(event, fam.events):
        allowed = ", ".join(t.__name__ for t in fam.events)
        return (f"{name} may not be published on {subject!r}: the {fam.family} family carries {allowed} "
                f"(published by {' or '.join(fam.producers)})")
    partition = parts[1]
    if fam.family == "shadow":
        if len(parts) != 5:
            return f"shadow subject {subject!r} is not ei.<p>.shadow.<name>.<type>"
        want = subject_for(event, partition, shadow=parts[3])
        if isinstance(event, RouteDecided) and not event.shadow:
            return f"RouteDecided on the shadow subject {subject!r} must have shadow=true"
    else:
        want = subject_for(event, partition)
        if isinstance(event, RouteDecided) and event.shadow:
            return f"RouteDecided with shadow=true on {subject!r}: shadow decisions go under ei.<p>.shadow.<name>"
    if want != subject:
        return f"{name} about {_entity(event)!r} may not be published on {subject!r} (its subject is {want!r})"
    return None


def _entity(event: Event) -> str:
    for attr in ("dst_node", "node", "branch", "component"):
        if isinstance(event, (KvMoved, KvFetched)) and attr == "node":
            continue
        v = getattr(event, attr, None)
        if v is not None:
            return token(str(v))
    return type(event).__name__


#: Events that may move the stream's time forward by more than the bound: the planner's ``Tick``
#: (on ``ei.<p>.clock``, which only the planner may publish: the stream's clock by design) and a
#: node's ``NodeRegistered`` (only about the publishing engine itself). Without them nothing could
#: move the time across a silence of the whole stream longer than the bound - a stack restarted
#: on its stream after ten minutes down would refuse every event for good; with them the first
#: tick or registration after the silence sets the time and the rest follows within the bound.
CLOCK_SETTERS = (Tick, NodeRegistered)


def check_ts(ts: float, clock: float, future_bound_s: float = FUTURE_BOUND_S, sets_clock: bool = False) -> str | None:
    """Why ``ts`` is refused at stream time ``clock`` (None: admitted); ``sets_clock``: an event
    of :data:`CLOCK_SETTERS`, only checked to be finite and not negative. Pure."""
    if not math.isfinite(ts):
        return f"ts is not a finite number ({ts!r})"
    if ts < 0:
        return f"ts {ts!r} is negative"
    if not sets_clock and clock > 0 and ts > clock + future_bound_s:
        return (f"ts {ts:.3f} is {ts - clock:.1f} s ahead of the stream's time {clock:.3f} "
                f"(at most {future_bound_s:g} s)")
    return None


def _float_fields(t: type) -> tuple[str, ...]:
    info = msgspec.inspect.type_info(t)
    return tuple(f.name for f in info.fields if isinstance(f.type, msgspec.inspect.FloatType) and f.name != "ts")


#: The measured quantities of the facts engines report (an IterationDone's duration feeds the
#: planner's NNLS fit; a NaN there would poison every model): finite, like ``ts``. The decisions'
#: floats (predicted TTFTs, scores) are the cores' own output and are checked by ``verify``.
FACT_FLOATS: dict[type, tuple[str, ...]] = {
    t: f for t in (KvFetched, NodeRegistered, NodeHeartbeat, IterationDone, RoleSwitched) if (f := _float_fields(t))}


def check_floats(event: Event) -> str | None:
    """Why a fact's measured quantity is refused (None: every one is finite). Pure."""
    for name in FACT_FLOATS.get(type(event), ()):
        v = getattr(event, name)
        if not math.isfinite(v):
            return f"{type(event).__name__}.{name} is not a finite number ({v!r})"
    return None


class Refused(ValueError):
    """An event the authority rule does not admit; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Snap(msgspec.Struct, array_like=True):
    clock: float
    refused: int
    future_bound_s: float


#: Subject verdicts an :class:`Admission` remembers (about one per branch and node in flight).
_SUBJECT_MEMO = 65_536


class Admission:
    """The stateful admission check a consumer runs before folding each delivery: the subject
    rule (:func:`check_subject`) and the timestamp rule (:func:`check_ts`) against the stream's
    time, which only admitted events advance. Deterministic: same log, same refusals."""

    def __init__(self, future_bound_s: float = FUTURE_BOUND_S, clock: float = 0.0) -> None:
        self.future_bound_s = float(future_bound_s)
        self.clock = float(clock)
        self.refused = 0
        # (type, subject, the fields a subject is made of) that passed :func:`check_subject`:
        # a pure function of exactly these, so a hit skips rebuilding the subject (the check
        # was ~2 us of a live service's ~40 us per event). Bounded: cleared when full.
        self._subject_ok: set[tuple] = set()

    def reason(self, event: Event, subject: str | None) -> str | None:
        """Why ``event`` on ``subject`` is refused, or None after admitting it (``subject``
        None: a trusted in-process driver, only the timestamp is checked)."""
        why = check_ts(event.ts, self.clock, self.future_bound_s, isinstance(event, CLOCK_SETTERS))
        if why is None and type(event) in FACT_FLOATS:
            why = check_floats(event)
        if why is None and subject is not None:
            key = (type(event), subject, getattr(event, "branch", None), getattr(event, "node", None),
                   getattr(event, "dst_node", None), getattr(event, "component", None),
                   getattr(event, "shadow", None))
            if key not in self._subject_ok:
                why = check_subject(event, subject)
                if why is None:
                    if len(self._subject_ok) >= _SUBJECT_MEMO:
                        self._subject_ok.clear()
                    self._subject_ok.add(key)
        if why is not None:
            self.refused += 1
            return why
        self.clock = max(self.clock, event.ts)
        return None

    def admit(self, event: Event, subject: str | None) -> None:
        """:meth:`reason`, raising :class:`Refused`."""
        why = self.reason(event, subject)
        if why is not None:
            raise Refused(why)

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Snap(self.clock, self.refused, self.future_bound_s))

    @classmethod
    def from_snapshot(cls, data: bytes) -> Admission:
        s = msgspec.msgpack.decode(data, type=_Snap)
        a = cls(s.future_bound_s, s.clock)
        a.refused = s.refused
        return a
