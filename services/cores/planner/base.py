"""What every planner shares: the node registry, warm-up, online model fitting, per-slice
workload statistics and the ordering of role switches. Pure: no I/O, no clock, no randomness.

A concrete planner subclasses :class:`PlannerBase` and implements ``_on_warmup_end`` and
``_on_tick`` (both return the events to emit). Time is only ever ``event.ts``.

Warm-up starts at the first event the planner applies and ends at the first ``Tick`` with
``ts >= start + warmup_s``. During warm-up every ``IterationDone`` becomes one fitting sample
of its node and phase: a collocated engine reports one ``IterationDone`` per phase it ran in an
iteration, each timing only that phase's part, so a prefill report is a sample of eq. 1 and a
decode report a sample of eq. 2 (a report with no work of its phase is skipped). Every
``fit_interval_s`` of warm-up, and once more at its end, each node's models are refitted and
published (``ModelFitted``); at the end they are frozen. A node without enough samples of its
own uses the pool of all nodes' samples, then the prior.
"""

from __future__ import annotations

import math
from typing import ClassVar

import msgspec
import numpy as np

from events.catalog import (
    BranchEnded,
    Event,
    IterationDone,
    ModelFitted,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
    Split,
    SwitchRole,
    Tick,
)
from events.ids import SwitchMechanism
from services.cores.costmodel import (
    DEFAULT_E,
    DEFAULT_K,
    PRIOR_DECODE,
    PRIOR_PREFILL,
    DecodeModel,
    PrefillModel,
    fit_decode,
    fit_prefill,
)
from services.cores.planner.samples import Samples, packed_msgpack, width_of
from services.cores.planner.window import SliceStats

#: The planners' snapshot encoder (sorted keys, so equal histories give equal bytes).
SNAPSHOT_ENCODER = msgspec.msgpack.Encoder(order="sorted")

# The paths a window-end decision takes, each named by the start of ``PlanEvaluated.reason``
# (and of the orders' reason). Only GATED may move a node that already serves a role without
# an SE test; INITIAL runs once, at warm-up end. See ``PlannerBase.guard``.
INITIAL = "initial split"  # warm-up end: every node gets a role (no current split to compare)
NEWCOMERS = "place newcomers"  # only nodes without a prefill/decode role get one; nothing else moves
REPAIR = "repair"  # every node on one side (0P or 0D): exactly one node moves to the other
GATED = "gated"  # the mean-gain > 2 SE switch with its cooldown (any other reason)
# out of a split that breaks the TTFT SLO, at no predicted throughput loss beyond the tolerance
# (EvolvingPlanner with the TTFT objective; cooldown applies, no 2-SE test)
SLO_ESCAPE = "slo escape"
UNGATED_PATHS = (INITIAL, NEWCOMERS, REPAIR, SLO_ESCAPE)
# between window ends, at a slice end where a change-point test says the mix shifted
# (EvolvingPlanner): the 2-SE test (or the SLO escape) over the recent slices, cooldown
# applies; the event carries the test (``PlanEvaluated.shift``)
SHIFT = "shift"


def plan_path(reason: str) -> str:
    """The path a ``PlanEvaluated`` (or ``RoleSwitchOrdered``) took, read from its reason."""
    if reason.startswith(SHIFT + " "):
        return SHIFT
    return next((p for p in UNGATED_PATHS if reason.startswith(p)), GATED)


class BaseConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "planner"
    window_s: float = 600.0
    slices: int = 10
    cooldown_s: float = 120.0
    warmup_s: float = 1800.0
    fit_interval_s: float = 60.0
    max_samples: int = 4096  # per node and phase; older samples are thinned 2:1 beyond it
    mechanism: SwitchMechanism = "in_place"
    k: int = DEFAULT_K
    E: int = DEFAULT_E
    prior_prefill: list[float] = msgspec.field(default_factory=lambda: PRIOR_PREFILL.coefficients)
    prior_decode: list[float] = msgspec.field(default_factory=lambda: PRIOR_DECODE.coefficients)

    @property
    def slice_s(self) -> float:
        return self.window_s / self.slices


class NodeInfo(msgspec.Struct, kw_only=True):
    role: str
    token_budget: int = 16384
    t_fwd: float = 1.0
    max_running: int = 256
    l1_capacity: int = 0
    running: int = 0
    queued: int = 0
    l1_used: int = 0
    l2_used: int = 0
    ordered: str = ""  # role ordered and not yet acknowledged
    # new tokens per prefill iteration while a queue waited (the node's achievable fill),
    # since the last window end; restore share and t_acc are re-measured per slice
    fill_iters: int = 0
    fill_t_uc: float = 0.0

    @property
    def target(self) -> str:
        return self.ordered or self.role


class FitState(msgspec.Struct, kw_only=True):
    coefficients: list[float] = []
    samples: int = 0
    mape: float = 0.0
    status: str = "not fitted yet"


class PlannerState(msgspec.Struct, kw_only=True):
    started_at: float | None = None
    frozen: bool = False
    last_fit_at: float | None = None
    last_switch_at: float | None = None
    next_window_k: int | None = None  # slice index at which the current window ends
    slice_k: int | None = None  # slice index of the last slice-end check (``_on_slice``)
    nodes: dict[str, NodeInfo] = {}
    # "node|phase" -> rows; in the snapshot only (a live core packs them: PlannerBase._samples)
    samples: dict[str, list[list[float]]] = {}
    fits: dict[str, FitState] = {}  # "node|phase" and "*|phase" (pool)
    slices: dict[int, SliceStats] = {}
    extra: dict[str, float] = {}  # planner-specific scalars
    # branch -> ts of its last RequestSubmitted (the agents' cycle time; pruned at window ends)
    last_submit: dict[str, float] = {}
    # request -> [slice index, t_uc, t_c, route ts in ms] of its acting route, until its prefill
    # starts: the slice's work is then corrected to what the engine found cached
    # (SliceStats.on_started) and the start's slice counts the wait (SliceStats.on_wait)
    routed_work: dict[str, list[int]] = {}


class _Snapshot(msgspec.Struct):
    cls: str
    config: bytes
    state: PlannerState  # with ``slices`` empty: they travel in ``slices`` (int keys, sorted)
    slices: list[tuple[int, SliceStats]] = []


class PlannerBase:
    """Shared folding of events; subclasses decide."""

    Config: ClassVar[type[BaseConfig]] = BaseConfig
    name: str = "planner"

    def __init__(self, **config) -> None:
        self.cfg = msgspec.convert(config, self.Config)
        assert self.cfg.slices >= 2 and self.cfg.window_s > 0, "a window needs at least two slices"
        self.name = self.cfg.name
        self.st = PlannerState()
        # warm-up fitting samples, "node|phase" -> its rows packed in a float64 array: up to
        # max_samples rows per key; a row as a list of Python floats costs ~130-185 bytes (the
        # warm-up store is the planner's largest state), packed 24-32
        self._samples: dict[str, Samples] = {}

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> bytes:
        samples = {k: msgspec.Raw(packed_msgpack(rows)) for k, rows in self._samples.items()}
        state = msgspec.structs.replace(self.st, slices={}, samples=samples)
        slices = sorted(self.st.slices.items())
        return SNAPSHOT_ENCODER.encode(_Snapshot(type(self).__name__, SNAPSHOT_ENCODER.encode(self.cfg), state, slices))

    @classmethod
    def from_snapshot(cls, data: bytes):
        snap = msgspec.msgpack.decode(data, type=_Snapshot)
        assert snap.cls == cls.__name__, f"snapshot of {snap.cls} restored as {cls.__name__}"
        self = cls(**msgspec.to_builtins(msgspec.msgpack.decode(snap.config)))
        self.st = snap.state
        self.st.slices = dict(snap.slices)
        self._samples = {k: Samples.of(rows, width_of(k)) for k, rows in self.st.samples.items()}
        self.st.samples = {}
        return self

    # ------------------------------------------------------------------ folding
    def apply(self, event: Event) -> list[Event]:
        """Fold one event into the state; a ``Tick`` may return events to emit."""
        if self.st.started_at is None:
            self.st.started_at = event.ts
        match event:  # the most frequent first: a class pattern is an isinstance check, in order
            case IterationDone():
                self._on_iteration(event)
            case NodeHeartbeat():
                self._fold_heartbeat(event)
            case RequestSubmitted():
                self._fold_submitted(event)
            case RouteDecided():
                self._fold_routed(event)
            case RequestStarted():
                self._fold_started(event)
            case RequestFinished():
                self._fold_finished(event)
            case BranchEnded():
                self._fold_branch_ended(event)
            case Tick():
                return self._tick(event.ts)
            case NodeRegistered():
                self._fold_registered(event)
            case RoleSwitched():
                self._fold_switched(event)
            case NodeRemoved():
                self._fold_removed(event)
        return []

    def _fold_registered(self, ev: NodeRegistered) -> None:
        self.st.nodes[ev.node] = NodeInfo(
            role=ev.role,
            token_budget=ev.prefill_token_budget,
            t_fwd=ev.t_fwd,
            max_running=ev.max_running_requests,
            l1_capacity=ev.l1_capacity_tokens,
        )

    def _fold_switched(self, ev: RoleSwitched) -> None:
        n = self.st.nodes.get(ev.node)
        if n is not None:
            n.role = ev.role
            n.ordered = ""
            if ev.kv_dropped:
                n.l1_used = 0

    def _fold_removed(self, ev: NodeRemoved) -> None:
        self.st.nodes.pop(ev.node, None)

    def _fold_heartbeat(self, ev: NodeHeartbeat) -> None:
        n = self.st.nodes.get(ev.node)
        if n is not None:
            n.running, n.queued = ev.running, ev.queued
            n.l1_used, n.l2_used = ev.l1_used_tokens, ev.l2_used_tokens

    def _fold_submitted(self, ev: RequestSubmitted) -> None:
        s = self._slice(ev.ts)
        s.on_submit(ev.prompt_tokens, ev.expected_output_tokens())  # osl hint, else max_tokens
        if ev.branch:
            prev = self.st.last_submit.get(ev.branch)
            if prev is not None and ev.ts >= prev:
                s.on_cycle(ev.ts - prev)
            self.st.last_submit[ev.branch] = ev.ts

    def _fold_branch_ended(self, ev: BranchEnded) -> None:
        self.st.last_submit.pop(ev.branch, None)

    def _fold_routed(self, ev: RouteDecided) -> None:
        if not ev.shadow and not ev.reroute:
            k = math.floor(ev.ts / self.cfg.slice_s)
            self._slice(ev.ts).on_route(ev.t_uc, ev.t_c)
            # the route's time in ms: the request's prefill-queue wait when its prefill starts
            self.st.routed_work[ev.request] = [k, int(ev.t_uc), int(ev.t_c), math.floor(ev.ts * 1000.0)]

    def _fold_started(self, ev: RequestStarted) -> None:
        if ev.phase != "prefill":
            return
        w = self.st.routed_work.pop(ev.request, None)
        if w is None:
            return
        k, t_uc, t_c = w[:3]
        if len(w) > 3:  # (a snapshot taken before route times were kept has none)
            self._slice(ev.ts).on_wait(ev.ts - w[3] / 1000.0)
        s = self.st.slices.get(k)  # gone once its window closed: the route's figures were used
        if s is not None:
            prompt = t_uc + t_c
            found = min(max(0, int(ev.cached_tokens)), prompt)
            s.on_started((t_uc, t_c), (prompt - found, found))

    def _fold_finished(self, ev: RequestFinished) -> None:
        self.st.routed_work.pop(ev.request, None)
        if not ev.error:
            self._slice(ev.ts).on_finish(ev.output_tokens)

    def _slice(self, ts: float) -> SliceStats:
        k = math.floor(ts / self.cfg.slice_s)
        s = self.st.slices.get(k)
        if s is None:
            s = self.st.slices[k] = SliceStats()
        return s

    def _on_iteration(self, ev: IterationDone) -> None:
        """One iteration report: the slice's workload statistics and, during warm-up, one
        fitting sample of its node and phase (reports without work of their phase are skipped)."""
        if ev.duration_s <= 0 or not math.isfinite(ev.duration_s):
            return
        row = self._prefill_sample(ev) if ev.phase == "prefill" else self._decode_sample(ev)
        if row is None or self.st.frozen:
            return
        key = f"{ev.node}|{ev.phase}"
        rows = self._samples.get(key)
        if rows is None:
            rows = self._samples[key] = Samples(len(row))
        rows.append(row)
        if rows.n > self.cfg.max_samples:
            rows.thin()

    def _prefill_sample(self, ev: IterationDone) -> list[float] | None:
        if ev.sum_t_uc <= 0 and ev.sum_A <= 0 and ev.sum_t_rst <= 0:
            return None
        self._slice(ev.ts).on_prefill(
            ev.sum_t_uc, ev.sum_t_c, ev.sum_t_rst, ev.queued, ev.duration_s, ev.iterations
        )
        n = self.st.nodes.get(ev.node)
        if n is not None and ev.queued > 0:
            n.fill_iters += max(1, ev.iterations)
            n.fill_t_uc += ev.sum_t_uc * max(1, ev.iterations)
        return [float(ev.sum_t_uc), float(ev.sum_A), float(ev.sum_t_rst), ev.duration_s]

    def _decode_sample(self, ev: IterationDone) -> list[float] | None:
        if ev.batch <= 0:
            return None
        self._slice(ev.ts).on_decode(
            ev.node, ev.batch, ev.accepted_tokens, ev.t_fwd, ev.queued, ev.duration_s, ev.iterations
        )
        # the context the batch attends over (engines report it as a decode's sum_t_c)
        return [float(ev.batch), ev.t_fwd, float(ev.sum_t_c), ev.duration_s]

    # ------------------------------------------------------------------ fitting
    def _fit_all(self) -> list[Event]:
        out: list[Event] = []
        pool: dict[str, list[np.ndarray]] = {"prefill": [], "decode": []}
        for key in sorted(self._samples):
            node, phase = key.split("|")
            rows = self._samples[key].view()
            pool[phase].append(rows)
            fit = self._fit(phase, rows)
            prev = self.st.fits.get(key)
            self.st.fits[key] = FitState(
                coefficients=fit.coefficients, samples=fit.samples, mape=fit.mape, status=fit.status
            )
            if fit.fitted and (prev is None or prev.coefficients != fit.coefficients):
                out.append(
                    ModelFitted(
                        ts=0.0,
                        src=self.name,
                        node=node,
                        phase=phase,  # ts set by caller
                        coefficients=fit.coefficients,
                        samples=fit.samples,
                        mape=fit.mape,
                    )
                )
        for phase, parts in pool.items():
            rows = np.concatenate(parts) if parts else []
            stride = max(1, len(rows) // (4 * self.cfg.max_samples))  # bound the pooled fit's size
            fit = self._fit(phase, rows[::stride])
            self.st.fits[f"*|{phase}"] = FitState(
                coefficients=fit.coefficients, samples=fit.samples, mape=fit.mape, status=fit.status
            )
        return out

    def _fit(self, phase: str, rows: list[list[float]]):
        if phase == "prefill":
            return fit_prefill(rows, prior=PrefillModel(*self.cfg.prior_prefill))
        return fit_decode(rows, k=self.cfg.k, E=self.cfg.E,
                          prior=DecodeModel.of(self.cfg.prior_decode, self.cfg.k, self.cfg.E))

    def _coefficients(self, node: str, phase: str) -> list[float]:
        for key in (f"{node}|{phase}", f"*|{phase}"):
            f = self.st.fits.get(key)
            if f is not None and f.coefficients:
                return f.coefficients
        return self.cfg.prior_prefill if phase == "prefill" else self.cfg.prior_decode

    def prefill_model(self, node: str) -> PrefillModel:
        return PrefillModel(*self._coefficients(node, "prefill"))

    def decode_model(self, node: str) -> DecodeModel:
        return DecodeModel.of(self._coefficients(node, "decode"), self.cfg.k, self.cfg.E)

    def fit_status(self, node: str, phase: str) -> str:
        f = self.st.fits.get(f"{node}|{phase}")
        return f.status if f is not None else "not fitted yet: no samples"

    # ------------------------------------------------------------------ ticks and windows
    def in_warmup(self) -> bool:
        return not self.st.frozen

    def _tick(self, ts: float) -> list[Event]:
        return self._warmup_tick(ts) if not self.st.frozen else self._window_tick(ts)

    def _warmup_tick(self, ts: float) -> list[Event]:
        """Refit every ``fit_interval_s``; at the end of warm-up refit once more, freeze the
        models and let the planner pick its first split."""
        st, cfg = self.st, self.cfg
        out: list[Event] = []
        start = st.started_at if st.started_at is not None else ts
        ending = ts >= start + cfg.warmup_s
        if ending or st.last_fit_at is None or ts >= st.last_fit_at + cfg.fit_interval_s:
            st.last_fit_at = ts
            out += [msgspec.structs.replace(e, ts=ts) for e in self._fit_all()]
        if not ending:
            return out
        st.frozen = True
        st.samples = {}
        self._samples = {}
        k_end = math.floor(ts / cfg.slice_s)
        out += self._on_warmup_end(ts, k_end)
        self._close_window(k_end)
        return out

    def _window_tick(self, ts: float) -> list[Event]:
        """After warm-up: decide once per window, at the first tick past its end; at the first
        tick of any other slice, ``_on_slice`` may decide early (the shift path)."""
        k_now = math.floor(ts / self.cfg.slice_s)
        if self.st.next_window_k is None:
            return []
        if k_now < self.st.next_window_k:
            if self.st.slice_k is not None and k_now <= self.st.slice_k:
                return []
            self.st.slice_k = k_now
            return self._on_slice(ts, k_now)
        k_end = k_now  # a late tick evaluates the latest complete window
        out = self._on_tick(ts, k_end)
        self._close_window(k_end)
        return out

    def _on_slice(self, ts: float, k_now: int) -> list[Event]:
        """A slice ended between window ends (slices ``< k_now`` are complete): no decision
        unless a planner overrides this."""
        return []

    def slices_kept(self) -> int:
        """Closed slices kept back at a window end (a sliding window for ``_on_slice``)."""
        return 0

    def window_slices(self, k_end: int) -> list[SliceStats]:
        """The ``slices`` slices before slice index ``k_end`` (empty ones included)."""
        return [self.st.slices.get(k) or SliceStats() for k in range(k_end - self.cfg.slices, k_end)]

    def _close_window(self, k_end: int) -> None:
        self.st.next_window_k = k_end + self.cfg.slices
        self.st.slice_k = k_end
        keep_from = k_end - self.slices_kept()
        for old in [i for i in self.st.slices if i < keep_from]:
            del self.st.slices[old]
        horizon = (k_end - self.cfg.slices) * self.cfg.slice_s  # a branch silent for a window
        for b in [b for b, t in self.st.last_submit.items() if t < horizon]:
            del self.st.last_submit[b]
        for r in [r for r, w in self.st.routed_work.items() if w[0] < k_end]:  # its slice is gone
            del self.st.routed_work[r]
        for n in self.st.nodes.values():
            n.fill_iters, n.fill_t_uc = 0, 0.0

    def prefill_fill(self) -> dict[str, float]:
        """New tokens per prefill iteration each node achieves, re-measured every window from
        its iterations that ran while requests queued (the scheduler could fill them); a node
        without such iterations takes the cluster's measured fill, else its token budget.
        Always within [1, token budget]."""
        nodes = self.st.nodes
        its = sum(n.fill_iters for n in nodes.values())
        cluster = sum(n.fill_t_uc for n in nodes.values()) / its if its else None
        out = {}
        for name in sorted(nodes):
            n = nodes[name]
            fill = n.fill_t_uc / n.fill_iters if n.fill_iters else (cluster or n.token_budget)
            out[name] = float(min(max(1.0, fill), max(1, n.token_budget)))
        return out

    def _on_warmup_end(self, ts: float, k_end: int) -> list[Event]:
        raise NotImplementedError

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        raise NotImplementedError

    # ------------------------------------------------------------------ splits and switches
    def live_nodes(self) -> list[str]:
        return sorted(self.st.nodes)

    def current_split(self) -> Split:
        roles = [n.target for n in self.st.nodes.values()]
        return Split(prefill=roles.count("prefill"), decode=roles.count("decode"))

    def newcomers(self) -> list[str]:
        """Nodes without a prefill or decode role (ordered roles count): registered after
        warm-up, or re-registered as ``collocated`` after an engine restart."""
        return [n for n in sorted(self.st.nodes) if self.st.nodes[n].target not in ("prefill", "decode")]

    def guard(self) -> str:
        """The guard state of a window-end decision after warm-up (named after Dynamo's
        planner state machine, which keeps "scaling in progress" apart from its decisions):
        ``NEWCOMERS`` when some node has no role, else ``REPAIR`` when one side is empty,
        else ``GATED``. Never ``INITIAL``: that is the warm-up end's alone."""
        if self.newcomers():
            return NEWCOMERS
        split = self.current_split()
        if split.prefill == 0 or split.decode == 0:
            return REPAIR
        return GATED

    def newcomer_range(self) -> tuple[int, int]:
        """(lo, hi): the prefill counts reachable by giving roles to the newcomers alone,
        each phase keeping a node (non-empty for 2 nodes or more)."""
        split, N = self.current_split(), len(self.st.nodes)
        return max(1, split.prefill), min(N - 1, N - split.decode)

    def placement(self, target_prefill: int) -> tuple[int, list[tuple[str, str]]]:
        """(P, moves) that place the newcomers as close to ``target_prefill`` prefill nodes as
        they can without moving an assigned node."""
        lo, hi = self.newcomer_range()
        P = min(max(target_prefill, lo), hi)
        moves = self.nodes_to_switch(P)
        assert all(self.st.nodes[n].target not in ("prefill", "decode") for n, _ in moves)
        return P, moves

    def repair_move(self) -> tuple[str, str, str]:
        """(node, from_role, to_role): the one node of a 0P or 0D split (no newcomers) that
        moves to the empty side, the one that loses least by switching."""
        split = self.current_split()
        to_role, from_role = ("prefill", "decode") if split.prefill == 0 else ("decode", "prefill")
        nodes = self.st.nodes
        side = [n for n in sorted(nodes) if nodes[n].target == from_role]
        return min(side, key=lambda n: self.switch_loss(n, to_role)), from_role, to_role

    def place_newcomers(self, ts: float, target_prefill: int, why: str) -> tuple[Split, str, list[Event]]:
        """(chosen split, reason, orders) of the NEWCOMERS path: the nodes without a role get
        one, as close to ``target_prefill`` prefill nodes as that reaches; no other node moves
        and no cooldown starts."""
        names = ",".join(self.newcomers())
        P, moves = self.placement(target_prefill)
        reason = f"{NEWCOMERS} {names}: {why}"
        N = len(self.st.nodes)
        return Split(prefill=P, decode=N - P), reason, self.order(moves, ts, reason, cooldown=False)

    def repair(self, ts: float) -> tuple[Split, str, list[Event]]:
        """(chosen split, reason, orders) of the REPAIR path: every node is on one side and the
        cluster serves nothing, so exactly one node (the least-loss one) moves to the other
        side, without the SE test or the cooldown; later windows decide the rest."""
        node, from_role, to_role = self.repair_move()
        split = self.current_split()
        d = 1 if to_role == "prefill" else -1
        chosen = Split(prefill=split.prefill + d, decode=split.decode - d)
        reason = f"{REPAIR} {split.prefill}P{split.decode}D: {node} {from_role} -> {to_role} (least loss)"
        return chosen, reason, self.order([(node, to_role)], ts, reason)

    def switch_loss(self, node: str, to_role: str) -> tuple:
        """Ordering key of the loss of switching ``node`` to ``to_role``: fewest running
        requests first, then least KV the new role cannot use (a node that becomes a prefill
        node resets its decode KV; a prefill node that becomes a decode node keeps its KV;
        restart or drop mechanisms lose all of it), then fewest queued requests, then id."""
        n = self.st.nodes[node]
        if self.cfg.mechanism == "in_place":
            lost = n.l1_used if to_role == "prefill" and n.target != "prefill" else 0
        else:
            lost = n.l1_used + n.l2_used
        return (n.running, lost, n.queued, node)

    def nodes_to_switch(self, target_prefill: int) -> list[tuple[str, str]]:
        """(node, to_role) pairs that turn the current split into ``target_prefill`` prefill
        nodes; collocated nodes are always assigned, the rest chosen by least loss."""
        nodes = self.st.nodes
        colloc = [n for n in sorted(nodes) if nodes[n].target not in ("prefill", "decode")]
        pre = [n for n in sorted(nodes) if nodes[n].target == "prefill"]
        dec = [n for n in sorted(nodes) if nodes[n].target == "decode"]
        moves: list[tuple[str, str]] = []
        need = target_prefill - len(pre)
        # collocated nodes: lightest-loss ones become prefill first, the rest decode
        colloc.sort(key=lambda n: self.switch_loss(n, "prefill"))
        take = max(0, min(need, len(colloc)))
        moves += [(n, "prefill") for n in colloc[:take]]
        moves += [(n, "decode") for n in colloc[take:]]
        need -= take
        if need > 0:
            dec.sort(key=lambda n: self.switch_loss(n, "prefill"))
            moves += [(n, "prefill") for n in dec[:need]]
        elif need < 0:
            pre.sort(key=lambda n: self.switch_loss(n, "decode"))
            moves += [(n, "decode") for n in pre[:-need]]
        return sorted(moves)

    def order(
        self, moves: list[tuple[str, str]], ts: float, reason: str, cooldown: bool = True
    ) -> list[Event]:
        """The orders for ``moves``; with ``cooldown`` they start a new cooldown (placing
        newcomers moves no serving node and does not)."""
        out: list[Event] = []
        for node, to_role in moves:
            n = self.st.nodes[node]
            out.append(
                RoleSwitchOrdered(
                    ts=ts,
                    src=self.name,
                    node=node,
                    from_role=n.target,
                    to_role=to_role,
                    mechanism=self.cfg.mechanism,
                    reason=reason,
                )
            )
            out.append(
                SwitchRole(ts=ts, src=self.name, node=node, to_role=to_role, mechanism=self.cfg.mechanism)
            )
            n.ordered = to_role if to_role != n.role else ""
        if moves and cooldown:
            self.st.last_switch_at = ts
        return out
