"""The cluster as a router sees it: nodes, roles, queues and running batches, folded from events.

Pure: no I/O, no clock (time is the events' ``ts``), no randomness. Every router (ours and the
baselines) embeds one :class:`ClusterState`, so they all see the same cluster.

What is folded, and from which event:

==========================  ==================================================================
event                       effect
==========================  ==================================================================
NodeRegistered              node joins (or re-joins) with its role, token budget, ``t_fwd`` and
                            whether it can take in fetched KV (``fetch_in``: False when it
                            declares a GPU tier and no host tier)
NodeRemoved                 node leaves; its queued and prefilling requests are *displaced*
                            (to re-route), and so are prefills elsewhere that were to decode there
RoleSwitchOrdered           node is *switching*: it keeps serving only the phases its old and
                            new role share (an ``in_place`` switch to prefill takes prefills
                            at once); queued work of the phases it drops is displaced
RoleSwitched                the new role is active
ModelFitted                 that node's eq. 1 / eq. 2 coefficients replace the priors
RequestSubmitted            request known (blocks kept until its prefill starts)
RouteDecided (acting)       request queued on its prefill node, assigned to its decode node
RequestStarted(prefill)     request leaves the queue and joins the running batch
RequestStarted(decode)      request runs on its decode node
FirstToken                  prefill done: leaves the running batch
RequestFinished             request forgotten everywhere
IterationDone(decode)       tokens accepted per request-iteration (``t_acc``) of that node
==========================  ==================================================================

Remaining time of the running batch (``T_rem`` of eq. 7): running prefill requests are taken
to run one after another from their ``RequestStarted.ts``, each for its predicted service time
(eq. 1 at the node's model); ``busy_until`` is the predicted end of the last one and
``T_rem = busy_until - now`` where *now* is the ``ts`` of the event being decided. A batch
that overruns its prediction is still busy: it is expected to run past its predicted end as long
again as it already has (``T_rem = now - busy_until``, the overrun so far: the median remaining
time when nothing is known of the error's scale but that it is at least this large). Counting it
as ending now (the rule before) made a node deep in a prefill its model under-predicted 100x (the
built-in prior before the first fit: 0.14 s predicted, 13-19 s taken on a CPU engine) look idle,
and ties broke by timing. The node's ``busy_until`` snaps back to the event time once the last
running request has its first token.

Before a node's first ``ModelFitted`` its eq. 1 / eq. 2 coefficients are the deployment's
profile when one is given (``prior_prefill`` / ``prior_decode``: the engines' declared or
calibrated iteration times, as Dynamo's planner starts from its pre-deployment profiling), else
the built-in GB300 priors of services/cores/costmodel.py.

A queued request's predicted service is computed from its ``RouteDecided`` (``t_c``, ``t_uc``)
with the node's current model, so a router in shadow, which only sees the acting router's
events, predicts the same queue as the router in charge.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from events.catalog import (
    Event,
    FirstToken,
    IterationDone,
    ModelFitted,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
)
from services.cores.costmodel import PRIOR_DECODE, PRIOR_PREFILL, DecodeModel, PrefillModel

#: Phases each role serves. A collocated node (warm-up) serves both.
ROLE_PHASES: dict[str, frozenset[str]] = {
    "prefill": frozenset({"prefill"}),
    "decode": frozenset({"decode"}),
    "collocated": frozenset({"prefill", "decode"}),
}

_PREFILL_ONLY = ROLE_PHASES["prefill"]

# Request lifecycle as the router tracks it.
PENDING = "pending"  # submitted, not routed (no decision yet, or no node could take it)
QUEUED = "queued"  # routed, prefill not started
PREFILLING = "prefilling"  # in the running prefill batch
DECODING = "decoding"  # first token out; decoding until RequestFinished


class NodeState(msgspec.Struct, kw_only=True):
    node: str
    role: str
    switching_to: str | None = None
    switch_mechanism: str = "in_place"  # of the switch in progress (meaningless when not switching)
    token_budget: int = 16384
    t_fwd: float = 1.0
    # The node can take in KV fetched from a peer. An asynchronous fetch lands in the node's own
    # host memory and then its GPU (METHOD §4.1: peer L2 -> own L2 -> GPU), so a node that
    # registers a GPU tier and no host tier (``l1_capacity_tokens > 0``, ``l2_capacity_tokens
    # == 0``: Dynamo's mocker, ``bench dynamo --host-kv-tokens 0``) recomputes what it would
    # fetch. True when the node declared neither (the event's defaults: unknown).
    fetch_in: bool = True
    prefill_coef: list[float] | None = None  # None: PRIOR_PREFILL
    decode_coef: list[float] | None = None  # None: PRIOR_DECODE
    prefill_queue: list[str] = []  # FIFO of request ids routed here, prefill not started
    queue_s: float = 0.0  # sum of the queued requests' predicted service times
    prefill_running: list[str] = []  # started, no first token yet, in start order
    busy_until: float = 0.0  # predicted end of the running prefill batch (absolute ts)
    decode_assigned: list[str] = []  # requests whose decode runs here, not finished
    decode_tokens: int = 0  # sum of expected output tokens (osl, else max_tokens) of decode_assigned
    accepted_tokens: int = 0  # decode tokens accepted, summed over iterations
    request_iterations: int = 0  # sum of batch sizes over decode iterations

    def phases(self) -> frozenset[str]:
        """Phases the node takes new work for now: a switching node only those it keeps, except
        that an in-place switch *to prefill* takes prefills from the order on (METHOD §4.1: a
        role change only changes which requests the router sends; its running decodes finish in
        place, carried along its prefill iterations by the engine)."""
        own = ROLE_PHASES.get(self.role, frozenset())
        if self.switching_to is None:
            return own
        kept = own & ROLE_PHASES.get(self.switching_to, frozenset())
        if self.switching_to == "prefill" and self.switch_mechanism == "in_place":
            return kept | _PREFILL_ONLY
        return kept

    def t_acc(self) -> float:
        """Tokens accepted per request per decode iteration (1.0 until measured)."""
        if self.request_iterations <= 0 or self.accepted_tokens <= 0:
            return 1.0
        return self.accepted_tokens / self.request_iterations


class RequestState(msgspec.Struct, kw_only=True):
    request: str
    branch: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0  # expected output tokens: the osl hint if sent (<= max_tokens), else max_tokens
    blocks: list[int] = []  # kept while the request may still be (re-)routed
    submitted_ts: float = 0.0
    phase: str = PENDING
    prefill_node: str | None = None
    decode_node: str | None = None
    t_c: int = 0
    t_uc: int = 0
    service_s: float = 0.0  # predicted prefill service on prefill_node
    queued_ts: float = 0.0  # when it joined prefill_node's queue (its acting RouteDecided)
    started_ts: float = 0.0  # when its prefill started (RequestStarted)
    decode_started: bool = False
    decided: bool = False  # an acting decision placed it once (a later one is a re-route)


class StateSnapshot(msgspec.Struct, kw_only=True):
    nodes: list[NodeState]
    requests: list[RequestState]
    unrouted: list[str]
    anomalies: dict[str, int]
    prior_prefill: list[float] | None = None  # None: PRIOR_PREFILL
    prior_decode: list[float] | None = None  # None: PRIOR_DECODE


class ClusterState:
    """Nodes, roles, queues and running batches. ``apply`` returns the ids of requests the
    event *displaced* (queued on a node that stopped taking their phase), for re-routing."""

    def __init__(self, prior_prefill: Sequence[float] | None = None,
                 prior_decode: Sequence[float] | None = None) -> None:
        """``prior_prefill`` (``[c0, c1, c2, c3]``) and ``prior_decode`` (``[d0, d1, d2]`` or with
        ``d3``): every node's model until its first ``ModelFitted`` (module docstring)."""
        self.prior_prefill = [float(c) for c in prior_prefill] if prior_prefill else None
        self.prior_decode = [float(c) for c in prior_decode] if prior_decode else None
        self._prior_p = PrefillModel(*self.prior_prefill) if self.prior_prefill else PRIOR_PREFILL
        self._prior_d = (DecodeModel.of(self.prior_decode, PRIOR_DECODE.k, PRIOR_DECODE.E) if self.prior_decode
                         else PRIOR_DECODE)
        self.nodes: dict[str, NodeState] = {}
        self.requests: dict[str, RequestState] = {}
        self.unrouted: list[str] = []  # FIFO of PENDING requests no node could take yet
        self.anomalies: dict[str, int] = {}
        self._prefill_models: dict[str, PrefillModel] = {}
        self._decode_models: dict[str, DecodeModel] = {}
        self._eligible: dict[str, list[str]] | None = None

    # ------------------------------------------------------------------ queries
    def eligible(self, phase: str) -> list[str]:
        """Sorted ids of the nodes that take new work of ``phase`` now."""
        if self._eligible is None:
            self._eligible = {
                p: sorted(n for n, s in self.nodes.items() if p in s.phases()) for p in ("prefill", "decode")
            }
        return self._eligible[phase]

    def prefill_model(self, node: str) -> PrefillModel:
        m = self._prefill_models.get(node)
        if m is None:
            coef = self.nodes[node].prefill_coef if node in self.nodes else None
            m = PrefillModel(*coef) if coef else self._prior_p
            self._prefill_models[node] = m
        return m

    def decode_model(self, node: str) -> DecodeModel:
        m = self._decode_models.get(node)
        if m is None:
            coef = self.nodes[node].decode_coef if node in self.nodes else None
            m = DecodeModel.of(coef, PRIOR_DECODE.k, PRIOR_DECODE.E) if coef else self._prior_d
            self._decode_models[node] = m
        return m

    def remaining_s(self, node: str, now: float) -> float:
        """``T_rem``: predicted remaining time of the prefill batch running on ``node``; past its
        predicted end, the overrun so far (module docstring)."""
        ns = self.nodes[node]
        if not ns.prefill_running:
            return 0.0
        return abs(ns.busy_until - now)

    def wait_s(self, node: str, now: float) -> float:
        """Expected wait before a request routed now starts prefill: ``T_rem + sum(queue)``."""
        return self.remaining_s(node, now) + self.nodes[node].queue_s

    def outstanding_prefill(self, node: str) -> int:
        ns = self.nodes[node]
        return len(ns.prefill_queue) + len(ns.prefill_running)

    def count(self, kind: str) -> None:
        self.anomalies[kind] = self.anomalies.get(kind, 0) + 1

    # ------------------------------------------------------------------ fold
    def apply(self, event: Event) -> list[str]:
        """Fold one event (a ``RouteDecided`` only if it is an acting decision: the caller
        filters shadow decisions). Returns displaced request ids, in a deterministic order."""
        match event:
            case RequestSubmitted():
                self._submitted(event)
            case RouteDecided():
                self.assign(event)
            case RequestStarted():
                self._started(event)
            case FirstToken():
                self._first_token(event)
            case RequestFinished():
                self._finished(event)
            case IterationDone():
                if event.phase == "decode" and event.node in self.nodes and event.batch > 0:
                    ns = self.nodes[event.node]
                    # an aggregated event stands for ``iterations`` iterations, each accepting
                    # ``accepted_tokens`` (catalog): weigh both sums by it
                    n_iter = max(1, getattr(event, "iterations", 1))
                    ns.accepted_tokens += event.accepted_tokens * n_iter
                    ns.request_iterations += event.batch * n_iter
            case NodeRegistered():
                return self._registered(event)
            case RoleSwitchOrdered():
                return self._switch_ordered(event)
            case RoleSwitched():
                ns = self.nodes.get(event.node)
                if ns is not None:
                    before = ns.phases()
                    ns.role, ns.switching_to = event.role, None
                    self._eligible = None
                    return self._displaced(ns, before - ns.phases())  # a switch nobody ordered
            case NodeRemoved():
                return self._removed(event)
            case ModelFitted():
                self._model_fitted(event)
        return []

    def _submitted(self, ev: RequestSubmitted) -> None:
        if ev.request in self.requests:
            self.count("duplicate_request")
            return
        self.requests[ev.request] = RequestState(
            request=ev.request, branch=ev.branch, prompt_tokens=ev.prompt_tokens,
            max_tokens=ev.expected_output_tokens(), blocks=ev.blocks, submitted_ts=ev.ts,
        )

    def assign(self, rd: RouteDecided) -> None:
        """Apply an acting routing decision (first decision or re-route)."""
        r = self.requests.get(rd.request)
        if r is None:  # decided before we saw it (we started mid-stream): track what we can
            r = RequestState(request=rd.request, branch=rd.branch or "", prompt_tokens=rd.t_c + rd.t_uc,
                             submitted_ts=rd.ts)
            self.requests[rd.request] = r
        if r.phase in (PREFILLING, DECODING):
            # prefill already started: only a not-yet-started decode assignment may move
            if not r.decode_started and rd.decode_node != r.decode_node:
                self._set_decode(r, rd.decode_node)
            else:
                self.count("route_after_start")
            return
        if r.phase == PENDING and rd.request in self.unrouted:
            self.unrouted.remove(rd.request)
        r.decided = True
        ns = self.nodes.get(rd.prefill_node)
        if r.phase == QUEUED and r.prefill_node == rd.prefill_node and ns is not None:
            # same prefill node (a decode-only re-route): keep the queue position
            old = r.service_s
            r.t_c, r.t_uc = rd.t_c, rd.t_uc
            r.service_s = self.prefill_model(rd.prefill_node).request_s(rd.t_uc, rd.t_c, 0, ns.token_budget)
            ns.queue_s += r.service_s - old
            self._set_decode(r, rd.decode_node)
            return
        self._dequeue(r)
        r.t_c, r.t_uc, r.prefill_node = rd.t_c, rd.t_uc, rd.prefill_node
        r.phase = QUEUED
        ns = self.nodes.get(rd.prefill_node)
        if ns is None:
            self.count("route_to_unknown_node")
            r.service_s = 0.0
        else:
            r.service_s = self.prefill_model(rd.prefill_node).request_s(rd.t_uc, rd.t_c, 0, ns.token_budget)
            r.queued_ts = rd.ts
            ns.prefill_queue.append(r.request)
            ns.queue_s += r.service_s
        self._set_decode(r, rd.decode_node)

    def unroute(self, request: str) -> None:
        """Take a queued request off its node: it waits (``unrouted``) for a prefill node."""
        r = self.requests.get(request)
        if r is None or r.phase != QUEUED:
            return
        self._dequeue(r)
        self._set_decode(r, None)
        r.phase, r.prefill_node = PENDING, None
        self.unrouted.append(request)

    def _dequeue(self, r: RequestState) -> None:
        if r.phase != QUEUED or r.prefill_node is None:
            return
        ns = self.nodes.get(r.prefill_node)
        if ns is not None and r.request in ns.prefill_queue:
            ns.prefill_queue.remove(r.request)
            ns.queue_s = max(0.0, ns.queue_s - r.service_s) if ns.prefill_queue else 0.0

    def _set_decode(self, r: RequestState, node: str | None) -> None:
        if r.decode_node is not None and r.decode_node in self.nodes:
            old = self.nodes[r.decode_node]
            if r.request in old.decode_assigned:
                old.decode_assigned.remove(r.request)
                old.decode_tokens -= r.max_tokens
        r.decode_node = node
        if node is not None and node in self.nodes:
            ns = self.nodes[node]
            ns.decode_assigned.append(r.request)
            ns.decode_tokens += r.max_tokens

    def _started(self, ev: RequestStarted) -> None:
        r = self.requests.get(ev.request)
        if r is None:
            self.count("unknown_request")
            return
        if ev.phase == "decode":
            if r.decode_node != ev.node:
                self._set_decode(r, ev.node)
            r.decode_started = True
            return
        if r.phase == PREFILLING:
            return  # duplicate start
        self._dequeue(r)
        if r.phase == PENDING and r.request in self.unrouted:
            self.unrouted.remove(r.request)
        ns = self.nodes.get(ev.node)
        if r.prefill_node != ev.node:  # the engine started it elsewhere: trust the engine
            r.prefill_node = ev.node
            if ns is not None:
                r.service_s = self.prefill_model(ev.node).request_s(r.t_uc, r.t_c, 0, ns.token_budget)
        r.phase = PREFILLING
        r.started_ts = ev.ts
        r.blocks = []  # no longer routable: free the block list
        if ns is None:
            self.count("unknown_node")
            return
        start = max(ev.ts, ns.busy_until) if ns.prefill_running else ev.ts
        ns.busy_until = start + r.service_s
        ns.prefill_running.append(r.request)

    def _end_prefill(self, r: RequestState, ts: float) -> None:
        ns = self.nodes.get(r.prefill_node) if r.prefill_node else None
        if ns is not None and r.request in ns.prefill_running:
            ns.prefill_running.remove(r.request)
            if not ns.prefill_running:
                ns.busy_until = ts

    def _first_token(self, ev: FirstToken) -> None:
        r = self.requests.get(ev.request)
        if r is None:
            self.count("unknown_request")
            return
        if r.phase == QUEUED:  # start event missed: leave the queue
            self._dequeue(r)
        self._end_prefill(r, ev.ts)
        r.phase = DECODING
        r.blocks = []

    def _finished(self, ev: RequestFinished) -> None:
        r = self.requests.pop(ev.request, None)
        if r is None:
            self.count("unknown_request")
            return
        if r.phase == QUEUED:
            self._dequeue(r)
        elif r.phase == PENDING and r.request in self.unrouted:
            self.unrouted.remove(r.request)
        self._end_prefill(r, ev.ts)
        self._set_decode(r, None)

    def _registered(self, ev: NodeRegistered) -> list[str]:
        ns = self.nodes.get(ev.node)
        self._eligible = None
        if ns is None:
            self.nodes[ev.node] = NodeState(node=ev.node, role=ev.role, token_budget=ev.prefill_token_budget,
                                            t_fwd=ev.t_fwd, fetch_in=_fetch_in(ev))
            return []
        # re-registration (an engine restarted, possibly in another role: a restart switch)
        before = ns.phases()
        ns.role, ns.switching_to = ev.role, None
        ns.token_budget, ns.t_fwd, ns.fetch_in = ev.prefill_token_budget, ev.t_fwd, _fetch_in(ev)
        return self._displaced(ns, before - ns.phases())

    def _displaced(self, ns: NodeState, dropped: frozenset[str]) -> list[str]:
        out: list[str] = []
        if "prefill" in dropped:
            out.extend(ns.prefill_queue)
        if "decode" in dropped:
            for rid in ns.decode_assigned:
                r = self.requests[rid]
                if r.phase == QUEUED and rid not in out:  # prefill not started: decode may move
                    out.append(rid)
        return out

    def _switch_ordered(self, ev: RoleSwitchOrdered) -> list[str]:
        ns = self.nodes.get(ev.node)
        if ns is None:
            self.count("unknown_node")
            return []
        before = ns.phases()
        ns.switching_to = ev.to_role
        ns.switch_mechanism = ev.mechanism
        self._eligible = None
        return self._displaced(ns, before - ns.phases())

    def _removed(self, ev: NodeRemoved) -> list[str]:
        ns = self.nodes.get(ev.node)
        if ns is None:
            return []
        displaced = self._displaced(ns, frozenset({"prefill", "decode"}))
        # a prefill running there is lost with the node (no first token yet, so nothing reached
        # the client): it is prefilled again elsewhere, as a queued request is
        for rid in ns.prefill_running:
            r = self.requests.get(rid)
            if r is not None and r.phase == PREFILLING and r.prefill_node == ev.node and rid not in displaced:
                r.phase = QUEUED
                displaced.append(rid)
        ns.prefill_running = []
        # a prefill running elsewhere whose decode node this was: its decode moves (a decode past
        # its first token is lost with the node: the liveness watcher fails it, RequestFinished)
        for rid in ns.decode_assigned:
            r = self.requests.get(rid)
            if r is not None and r.phase == PREFILLING and not r.decode_started and rid not in displaced:
                displaced.append(rid)
        ns.switching_to = None
        ns.role = "removed"
        self._eligible = None
        self._prefill_models.pop(ev.node, None)
        self._decode_models.pop(ev.node, None)
        return displaced

    def forget_removed(self, node: str) -> None:
        """Drop a removed node once its displaced requests were re-routed."""
        ns = self.nodes.get(node)
        if ns is None or ns.role != "removed":
            return
        for rid in list(ns.prefill_queue):
            r = self.requests.get(rid)
            if r is not None and r.prefill_node == node and r.phase == QUEUED:
                r.phase, r.prefill_node = PENDING, None
                self.unrouted.append(rid)
        for rid in ns.decode_assigned:
            r = self.requests.get(rid)
            if r is not None:
                r.decode_node = None
        del self.nodes[node]
        self._eligible = None

    def _model_fitted(self, ev: ModelFitted) -> None:
        ns = self.nodes.get(ev.node)
        if ns is None or not ev.coefficients:
            return
        if ev.phase == "prefill" and len(ev.coefficients) == 4:
            ns.prefill_coef = [float(c) for c in ev.coefficients]
            self._prefill_models.pop(ev.node, None)
            model = self.prefill_model(ev.node)
            total = 0.0
            for rid in ns.prefill_queue:  # re-predict the queue with the fitted model
                r = self.requests[rid]
                r.service_s = model.request_s(r.t_uc, r.t_c, 0, ns.token_budget)
                total += r.service_s
            ns.queue_s = total
        elif ev.phase == "decode" and len(ev.coefficients) in (3, 4):  # [d0, d1, d2] or with d3 (sum_ctx)
            ns.decode_coef = [float(c) for c in ev.coefficients]
            self._decode_models.pop(ev.node, None)
        else:
            self.count("bad_model")

    # ------------------------------------------------------------------ snapshot
    def to_snapshot(self) -> StateSnapshot:
        return StateSnapshot(
            nodes=[self.nodes[k] for k in sorted(self.nodes)],
            requests=[self.requests[k] for k in sorted(self.requests)],
            unrouted=list(self.unrouted),
            anomalies=dict(sorted(self.anomalies.items())),
            prior_prefill=self.prior_prefill, prior_decode=self.prior_decode,
        )

    @classmethod
    def from_snapshot(cls, snap: StateSnapshot) -> ClusterState:
        st = cls(snap.prior_prefill, snap.prior_decode)
        st.nodes = {n.node: n for n in snap.nodes}
        st.requests = {r.request: r for r in snap.requests}
        st.unrouted = list(snap.unrouted)
        st.anomalies = dict(snap.anomalies)
        return st


def _fetch_in(ev: NodeRegistered) -> bool:
    """Whether a registering node can take in fetched KV (``NodeState.fetch_in``)."""
    return not (ev.l1_capacity_tokens > 0 and ev.l2_capacity_tokens <= 0)


def queued_ids(state: ClusterState, nodes: Iterable[str]) -> list[str]:
    """All queued request ids on ``nodes``, node by node in queue order (for tests and tools)."""
    return [rid for n in nodes for rid in state.nodes[n].prefill_queue]
