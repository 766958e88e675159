"""Tiny deterministic cores for testing verify (no dependency on the real router/planner),
and a driver that produces a log the way live adapters would."""

from __future__ import annotations

from collections import Counter, deque

from events.catalog import (
    Event,
    NodeRegistered,
    PlanEvaluated,
    RequestFinished,
    RequestSubmitted,
    RoleSwitchOrdered,
    RouteDecided,
    Split,
    SwitchRole,
    Tick,
)
from events.subjects import subject_for


class FakeRouter:
    """Least-loaded over registered nodes (ties to the smallest id). Applies its own decision
    when it emits it and ignores the echo, as the contract says a router in charge does."""

    def __init__(self, name: str = "fake", shadow: bool = False) -> None:
        self.name, self.shadow = name, shadow
        self.load: Counter = Counter()
        self.nodes: list[str] = []

    def apply(self, ev: Event) -> list[Event]:
        match ev:
            case NodeRegistered(node=node):
                self.nodes = sorted({*self.nodes, node})
            case RequestSubmitted() if self.nodes:
                node = min(self.nodes, key=lambda n: (self.load[n], n))
                self.load[node] += 1
                return [RouteDecided(ts=ev.ts, request=ev.request, prefill_node=node, decode_node=node,
                                     t_uc=ev.prompt_tokens, policy=self.name, shadow=self.shadow)]
            case RequestFinished(node=node):
                self.load[node] -= 1
        return []

    def snapshot(self) -> bytes:
        return b""


class FakePlanner:
    """On each Tick: one PlanEvaluated; when a window saw ``switch_at`` requests or more, a
    RoleSwitchOrdered and its SwitchRole command for the smallest registered node."""

    name = "fake_planner"

    def __init__(self, switch_at: int = 3) -> None:
        self.switch_at = switch_at
        self.window_start = 0.0
        self.seen = 0
        self.nodes: list[str] = []
        self.roles: dict[str, str] = {}

    def apply(self, ev: Event) -> list[Event]:
        match ev:
            case NodeRegistered(node=node, role=role):
                self.nodes = sorted({*self.nodes, node})
                self.roles[node] = role
            case RequestSubmitted():
                self.seen += 1
            case RoleSwitchOrdered(node=node, to_role=role):
                self.roles[node] = role
            case Tick(ts=ts):
                out: list[Event] = [PlanEvaluated(ts=ts, window_start=self.window_start, window_end=ts,
                                                  current=Split(prefill=1, decode=1), reason=f"{self.seen} req",
                                                  planner=self.name)]
                if self.seen >= self.switch_at and self.nodes:
                    node = self.nodes[0]
                    to = "decode" if self.roles[node] == "prefill" else "prefill"
                    out += [RoleSwitchOrdered(ts=ts, node=node, from_role=self.roles[node], to_role=to),
                            SwitchRole(ts=ts, node=node, to_role=to)]
                self.window_start, self.seen = ts, 0
                return out
        return []

    def snapshot(self) -> bytes:
        return b""


class Exploding:
    def __init__(self, at_type: str = "Tick") -> None:
        self.at_type = at_type

    def apply(self, ev: Event) -> list[Event]:
        if type(ev).__name__ == self.at_type:
            raise RuntimeError("invariant broken")
        return []

    def snapshot(self) -> bytes:
        return b""


def inputs(n_requests: int = 12) -> list[Event]:
    evs: list[Event] = [NodeRegistered(ts=0.0, node="n2", role="prefill"),
                        NodeRegistered(ts=0.0, node="n1", role="decode")]
    for i in range(n_requests):
        t = 1.0 + i
        evs.append(RequestSubmitted(ts=t, request=f"r{i}", branch="b", prompt_tokens=100 + i))
        if i % 3 == 2:
            evs.append(RequestFinished(ts=t + 0.5, request=f"r{i - 1}", node="n1" if i % 2 else "n2"))
        if i % 4 == 3:
            evs.append(Tick(ts=t + 0.9))
    return evs


def live_log(events: list, cores: list, delay: int = 0, src: str = "", *,
             authority: bool = False) -> list[tuple[int, str, Event]]:
    """The stream live adapters would produce: every event is folded by every core in stream
    order, and what a core emits is published ``delay`` stream positions later. An item of
    ``events`` may be ``(subject, event)``: published on that subject, not its own (a forgery).
    ``authority``: the cores fold only what the event authority admits (events/authority.py),
    as the live services do; the refused events stay on the stream."""
    from events.authority import Admission

    admission = Admission()
    stream: list[tuple[str, Event]] = []
    outbox: deque = deque()
    todo = deque(events)
    while todo or outbox:
        if outbox and (outbox[0][0] <= len(stream) or not todo):
            ev = outbox.popleft()[1]
        else:
            ev = todo.popleft()
        subject, ev = ev if isinstance(ev, tuple) else (subject_for(ev), ev)
        stream.append((subject, ev))
        if authority and admission.reason(ev, subject) is not None:
            continue
        for core in cores:
            for out in core.apply(ev):
                if src:
                    import msgspec

                    out = msgspec.structs.replace(out, src=src)
                outbox.append((len(stream) + delay, out))
    return [(i + 1, subject, e) for i, (subject, e) in enumerate(stream)]
