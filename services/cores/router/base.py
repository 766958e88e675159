"""The router protocol and the event plumbing every router shares. Pure: no I/O, no clock.

A router folds the stream (``apply(event) -> list[Event]``) and answers each
``RequestSubmitted`` with one ``RouteDecided``. :class:`RouterBase` does everything but the
choice of the prefill node:

- **State.** A :class:`~services.cores.router.state.ClusterState` (nodes, roles, queues) and an
  embedded :class:`~services.cores.directory.core.DirectoryCore` (where KV lives), both folded from
  the same events; never a call to another service. The directory's own anomalies are dropped
  here (the directory service reports them).
- **Own decisions.** A router in charge applies its ``RouteDecided`` to its state and directory
  when it emits it and ignores the echo from the stream (same policy name, not shadow). A router
  in shadow (``shadow=True``) applies nothing of its own: its state follows the acting
  (non-shadow) decisions, so it sees the real cluster. Shadow decisions of other routers change
  nothing.
- **Switches and removals.** When a node stops taking a phase (``RoleSwitchOrdered``,
  ``NodeRemoved``), its queued requests of that phase are re-decided among the other nodes of
  the phase and emitted with ``reroute=True``; running requests finish in place. A removed
  node's running prefills are re-decided too (the prefill is lost with it, and nothing had
  reached the client), and a prefill elsewhere that was to decode on it gets a decode-only
  re-route.
- **Cold start.** A request of an unknown branch or with no blocks still gets a decision, and
  an ``AnomalyReported`` (counted in :attr:`anomalies`). With no prefill node at all, the
  request waits (``no_prefill_node``) and is decided when a node becomes available.
- **Decode node.** A request prefilled on a *collocated* node (warm-up) decodes on that same
  node (no KV transfer; warm-up fits both phases on every node). Otherwise the decode node is
  chosen by :meth:`choose_decode`: round robin over the sorted decode nodes for the baselines;
  :class:`~services.cores.router.least_ttft.LeastTtftRouter` overrides it.
- **Ties** always break on the sorted node id.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import msgspec

from events.catalog import (
    AnomalyReported,
    BranchEnded,
    BranchOpened,
    Event,
    FetchStep,
    NodeRegistered,
    NodeRemoved,
    NodeScore,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from services.cores.directory.core import DirectoryCore
from services.cores.directory.lookup import Lookup
from services.cores.router.state import PENDING, PREFILLING, QUEUED, ClusterState, RequestState, StateSnapshot

_ENC = msgspec.msgpack.Encoder(order="deterministic")


@runtime_checkable
class Router(Protocol):
    """What the router service drives: fold events, decide, snapshot. Found by name through
    the entry-point group ``evolving.routers`` (see :mod:`services.adapters.plugins`) and constructed as
    ``cls(**config)`` with at least ``name``, ``shadow`` and ``block_tokens``."""

    name: str
    shadow: bool

    def apply(self, event: Event) -> list[Event]: ...

    def snapshot(self) -> bytes: ...


class Choice(msgspec.Struct, kw_only=True):
    """A prefill choice: the node, the prompt split at that node, the fetch plan, the
    predicted TTFT and every candidate's score."""

    node: str
    t_c: int
    t_uc: int
    predicted_ttft_s: float
    scores: list[NodeScore]
    fetch_plan: list[FetchStep] = []


class _Snapshot(msgspec.Struct, kw_only=True):
    config: dict[str, Any]
    state: StateSnapshot
    directory: bytes
    branches: list[str]
    rr_decode: int
    decisions: int
    extra: bytes = b""


class RouterBase:
    """Shared fold, echo handling, re-routing and snapshot; subclasses choose the prefill node."""

    #: Policy name used when none is configured (written in ``RouteDecided.policy``).
    default_name: ClassVar[str] = "router"
    #: Router-specific parameters and their defaults (constructor keywords).
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str | None = None, shadow: bool = False, block_tokens: int = 64,
                 prior_prefill: list[float] | None = None, prior_decode: list[float] | None = None,
                 **params: Any) -> None:
        """``prior_prefill`` / ``prior_decode``: the deployment profile's eq. 1 / eq. 2
        coefficients, every node's model until its first ``ModelFitted`` (state.py); None, the
        built-in priors."""
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown parameter(s) {unknown}; "
                            f"known: {sorted(self.defaults)}")
        self.name = name or self.default_name
        self.shadow = bool(shadow)
        self.block_tokens = int(block_tokens)
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.params: dict[str, Any] = {**self.defaults, **params}
        for key, value in self.params.items():
            setattr(self, key, value)
        self.priors = {k: [float(c) for c in v] for k, v in
                       (("prior_prefill", prior_prefill), ("prior_decode", prior_decode)) if v}
        self.state = ClusterState(prior_prefill, prior_decode)
        self.directory = DirectoryCore()
        self.branches: set[str] = set()
        self.rr_decode = 0
        self.decisions = 0

    # ------------------------------------------------------------------ protocol
    @property
    def anomalies(self) -> dict[str, int]:
        return self.state.anomalies

    def apply(self, event: Event) -> list[Event]:
        if isinstance(event, RouteDecided):
            if event.shadow or (not self.shadow and event.policy == self.name):
                return []  # someone's shadow decision, or the echo of our own
            self._fold_acting(event)
            return []
        if not isinstance(event, RequestSubmitted):  # a submission is folded after its lookup
            self.directory.apply(event)
        displaced = self.state.apply(event)
        out: list[Event] = []
        match event:
            case RequestSubmitted():
                out.extend(self._route_new(event))
            case BranchOpened():
                self.branches.add(event.branch)
            case BranchEnded():
                self.branches.discard(event.branch)
                self.on_branch_ended(event.branch)
        self.on_event(event)
        if displaced:
            out.extend(self._reroute(displaced, event.ts))
        if isinstance(event, NodeRemoved):
            self.state.forget_removed(event.node)
            self.on_node_removed(event.node)
        if self.state.unrouted and isinstance(event, (NodeRegistered, RoleSwitched)):
            out.extend(self._drain(event.ts))
        return out

    def snapshot(self) -> bytes:
        snap = _Snapshot(
            config={"name": self.name, "shadow": self.shadow, "block_tokens": self.block_tokens, **self.priors,
                    **self.params},
            state=self.state.to_snapshot(), directory=self.directory.snapshot(),
            branches=sorted(self.branches), rr_decode=self.rr_decode, decisions=self.decisions,
            extra=self.extra_snapshot(),
        )
        return _ENC.encode(snap)

    @classmethod
    def from_snapshot(cls, data: bytes) -> Self:
        snap = msgspec.msgpack.decode(data, type=_Snapshot)
        router = cls(**snap.config)
        router.state = ClusterState.from_snapshot(snap.state)
        router.directory = DirectoryCore.from_snapshot(snap.directory)
        router.branches = set(snap.branches)
        router.rr_decode, router.decisions = snap.rr_decode, snap.decisions
        router.restore_extra(snap.extra)
        return router

    # ------------------------------------------------------------------ hooks for subclasses
    def choose_prefill(self, r: RequestState, candidates: list[str], lookup: Lookup | None,
                       now: float) -> Choice:
        raise NotImplementedError

    def choose_decode(self, r: RequestState, candidates: list[str], now: float) -> str:
        """Round robin over the sorted decode nodes (the baselines' rule)."""
        node = candidates[self.rr_decode % len(candidates)]
        self.rr_decode += 1
        return node

    def on_acting(self, rd: RouteDecided, r: RequestState | None) -> None:
        """An acting decision (ours or another router's) was folded."""

    def on_event(self, event: Event) -> None:
        """Any non-RouteDecided event was folded."""

    def on_branch_ended(self, branch: str) -> None: ...

    def on_node_removed(self, node: str) -> None: ...

    def extra_snapshot(self) -> bytes:
        return b""

    def restore_extra(self, data: bytes) -> None: ...

    # ------------------------------------------------------------------ shared estimates
    def prompt_tokens(self, r: RequestState) -> int:
        return r.prompt_tokens if r.prompt_tokens > 0 else len(r.blocks) * self.block_tokens

    def local_estimate(self, node: str, r: RequestState, lookup: Lookup | None, now: float
                       ) -> tuple[int, int, float, float]:
        """``(t_c, t_uc, wait_s, predicted_ttft_s)`` on ``node`` using only its own KV (L1 or
        L2, no fetch from peers): what a baseline's choice costs under our model."""
        bt, prompt = self.block_tokens, self.prompt_tokens(r)
        m = lookup.per_node.get(node) if lookup is not None else None
        local, l1 = (m.local_blocks, m.l1_blocks) if m is not None else (0, 0)
        t_c = min(local * bt, prompt)
        t_rst = min((local - l1) * bt, t_c)
        ns = self.state.nodes[node]
        service = self.state.prefill_model(node).request_s(prompt - t_c, t_c, t_rst, ns.token_budget)
        wait = self.state.wait_s(node, now)
        return t_c, prompt - t_c, wait, wait + service

    # ------------------------------------------------------------------ decisions
    def decide(self, r: RequestState, now: float, reroute: bool = False) -> RouteDecided | None:
        """The decision for ``r`` at time ``now`` (not applied). ``None``: no prefill node."""
        candidates = self.state.eligible("prefill")
        if not candidates:
            return None
        lookup = self.directory.lookup(r.blocks, r.branch or None) if r.blocks else None
        choice = self.choose_prefill(r, candidates, lookup, now)
        decode = self._decode_for(r, choice.node, now, keep=r.decode_node if reroute else None)
        return RouteDecided(
            ts=now, src=self.name, request=r.request, prefill_node=choice.node, decode_node=decode,
            t_c=choice.t_c, t_uc=choice.t_uc, fetch_plan=choice.fetch_plan,
            predicted_ttft_s=choice.predicted_ttft_s, policy=self.name, scores=choice.scores,
            reroute=reroute, branch=r.branch or None, shadow=self.shadow,
        )

    def _decode_for(self, r: RequestState, prefill: str, now: float, keep: str | None) -> str:
        ns = self.state.nodes[prefill]
        if "decode" in ns.phases():
            return prefill  # collocated: both phases on one node
        candidates = self.state.eligible("decode")
        if keep is not None and keep in candidates:
            return keep
        if not candidates:
            self._anomaly_count("no_decode_node")
            return prefill
        return self.choose_decode(r, candidates, now)

    def _anomaly_count(self, kind: str) -> None:
        self.state.count(kind)

    def _anomaly(self, kind: str, ref: str, now: float, detail: str = "") -> AnomalyReported:
        self.state.count(kind)
        return AnomalyReported(ts=now, src=self.name, component=f"router.{self.name}", kind=kind,
                               ref=ref, detail=detail)

    def _commit(self, rd: RouteDecided) -> None:
        """A router in charge applies its own decision at once (the echo is ignored)."""
        self.decisions += 1
        if not self.shadow:
            self._fold_acting(rd)

    def _fold_acting(self, rd: RouteDecided) -> None:
        self.directory.apply(rd)
        self.state.assign(rd)
        self.on_acting(rd, self.state.requests.get(rd.request))

    def _route_new(self, ev: RequestSubmitted) -> list[Event]:
        out: list[Event] = []
        r = self.state.requests.get(ev.request)
        if r is None or r.phase != PENDING or r.prefill_node is not None or r.blocks is not ev.blocks:
            self.directory.apply(ev)
            return out  # duplicate submission (counted by the state)
        if ev.branch not in self.branches:
            out.append(self._anomaly("unknown_branch", ev.request, ev.ts, f"branch {ev.branch!r} never opened"))
        if not ev.blocks:
            out.append(self._anomaly("no_blocks", ev.request, ev.ts, "no full block: cold start"))
        elif ev.block_tokens != self.block_tokens:
            out.append(self._anomaly("block_tokens_mismatch", ev.request, ev.ts,
                                     f"request blocks of {ev.block_tokens} tokens, router {self.block_tokens}"))
        # KV locations do not depend on the submission, so the lookup runs first and the
        # directory's fold of the submission reuses its scan (DirectoryCore caches it)
        rd = self.decide(r, ev.ts)
        self.directory.apply(ev)
        if rd is None:
            self.state.unrouted.append(r.request)
            out.append(self._anomaly("no_prefill_node", ev.request, ev.ts, "waits for a prefill node"))
            return out
        out.append(rd)
        self._commit(rd)
        return out

    def _reroute(self, displaced: list[str], now: float) -> list[Event]:
        out: list[Event] = []
        prefill_ok = set(self.state.eligible("prefill"))
        for rid in displaced:
            r = self.state.requests.get(rid)
            if r is None or r.phase not in (QUEUED, PREFILLING):
                continue
            if r.phase == PREFILLING:  # prefill running on a live node: only its decode node moves
                if r.decode_started or r.prefill_node not in prefill_ok:
                    continue
                rd = self._decode_only(r, now)
            elif r.prefill_node in prefill_ok:
                rd = self._decode_only(r, now)
            else:
                rd = self.decide(r, now, reroute=True)
            if rd is None:
                self.state.unroute(rid)
                out.append(self._anomaly("no_prefill_node", rid, now, "displaced; waits for a prefill node"))
                continue
            out.append(rd)
            self._commit(rd)
        return out

    def _decode_only(self, r: RequestState, now: float) -> RouteDecided:
        """Move only the decode assignment of a queued request (its prefill node stays)."""
        decode = self._decode_for(r, r.prefill_node, now, keep=None)
        return RouteDecided(
            ts=now, src=self.name, request=r.request, prefill_node=r.prefill_node, decode_node=decode,
            t_c=r.t_c, t_uc=r.t_uc, policy=self.name, reroute=True, branch=r.branch or None,
            shadow=self.shadow,
        )

    def _drain(self, now: float) -> list[Event]:
        out: list[Event] = []
        for rid in list(self.state.unrouted):
            r = self.state.requests.get(rid)
            if r is None:
                self.state.unrouted.remove(rid)
                continue
            rd = self.decide(r, now, reroute=r.decided)
            if rd is None:
                break
            self.state.unrouted.remove(rid)  # a shadow router decides it once too
            out.append(rd)
            self._commit(rd)
        return out


# --------------------------------------------------------------------------- shared by the baselines
def local_choice(router: RouterBase, node: str, r: RequestState, lookup: Lookup | None, now: float,
                  scores: list[NodeScore]) -> Choice:
    t_c, t_uc, _, ttft = router.local_estimate(node, r, lookup, now)
    return Choice(node=node, t_c=t_c, t_uc=t_uc, predicted_ttft_s=ttft, scores=scores)


def node_score(router: RouterBase, node: str, value: float, r: RequestState, lookup: Lookup | None,
           now: float) -> NodeScore:
    m = lookup.per_node.get(node) if lookup is not None else None
    t_c = min((m.local_blocks if m else 0) * router.block_tokens, router.prompt_tokens(r))
    return NodeScore(node=node, score=float(value), t_c=t_c, queue_s=router.state.wait_s(node, now))
