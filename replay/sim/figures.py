"""Run metrics, computed from the event log alone (so a DuckDB log gives the same figures).

Measured window: requests *submitted* at or after the warm-up end; a request counts as done
when its ``RequestFinished`` is in the log. Throughput = requests finished inside the window /
window length.

- TTFT = FirstToken - RequestSubmitted; E2E = RequestFinished - RequestSubmitted;
  TPOT = (RequestFinished - FirstToken) / (output tokens - 1).
- Actual KV hit = ``RequestStarted(prefill).cached_tokens`` (what the engine reused: own GPU,
  own host, fetched). Ideal hit (METHOD.md §1): with an unlimited cache shared by every node and
  no switches, the longest prefix of the prompt's blocks that any earlier request's prompt held
  (earlier = submitted before, warm-up included), at most prompt - 1 tokens.
  Lost KV reuse = sum(max(0, ideal - actual)) / sum(ideal) over the window's requests.
- Prefill queue wait = prefill start - submission; the imbalance is the most-loaded prefill
  node's mean wait over the mean of the nodes' mean waits.
- Idle prefill GPU time = 1 - (prefill iteration time) / (time nodes spent in a prefill or
  collocated role), over the window; idle decode GPU time likewise for decode runs (weighed by
  their ``iterations``) over decode or collocated node time.
- KV demand = the distinct blocks the active branches' contexts reference
  (a branch is active from ``BranchOpened`` to ``BranchEnded``; its context is its latest
  prompt, or its compacted context after ``ContextCompacted``; forks share their parent's
  blocks, so they count once), in tokens. Peak and time-weighted mean over the window, each
  as a share of the cluster's GPU (L1) and host (L2) KV capacity (``NodeRegistered``).
- Splits: a node's role changes at its ``RoleSwitched``; a switch is a ``RoleSwitched`` that
  changed the role, leaving out the end of the warm-up (collocated -> first split); its time is
  ``duration_s`` (order to ack, drain included).
- The next turn's KV (docs/simulator.md "The next turn's KV"). A
  *continuation* is a request whose branch had an earlier request (warm-up included); its TTFT
  P50/P95 are over the window's continuations. Speculative prefill requests (id ending in
  ``SPEC_SUFFIX``, ``+specprefill``) are the stack's own traffic, not the agents': every other
  figure leaves them out (not submitted, not finished, not in the ideal cache), and their
  cost is counted apart: tokens they prefilled (``RequestStarted`` prompt - cached), fetched
  (``KvFetched``) and moved P->D (``KvMoved``). ``+prestage``'s traffic: the tokens its stage
  orders moved (``KvMoved`` with ``dst_phase=prefill``). Both over the window (by the event's
  ``ts``), in tokens; the staged share of continuations = continuations whose prefill started
  on the node their branch's last stage order or speculative prefill went to. These read the
  KV events, which a ``decisions`` log and ``sim-report`` (``METRIC_TYPES``) leave out: there
  they are 0 / nan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice

import numpy as np
from services.cores.directory._native import BlockCounts

from engine import _kvscan
from engine.kvpool import BlockSet, KvPool
from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    Event,
    FirstToken,
    IterationDone,
    KvFetched,
    KvMoved,
    KvStageOrdered,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
)
from replay.sim.nextturn import SPEC_SUFFIX, NextTurn


@dataclass
class RunMetrics:
    stack: str = ""
    window_s: float = 0.0
    submitted: int = 0
    finished: int = 0
    throughput_rps: float = 0.0
    ttft_mean_s: float = float("nan")
    ttft_p50_s: float = float("nan")
    ttft_p95_s: float = float("nan")
    ttft_p99_s: float = float("nan")  # the tail beyond P95
    ttft_max_s: float = float("nan")
    e2e_mean_s: float = float("nan")
    e2e_p95_s: float = float("nan")
    tpot_mean_ms: float = float("nan")
    kv_hit_actual: float = float("nan")
    kv_hit_ideal: float = float("nan")
    lost_kv_reuse: float = float("nan")
    uncached_tokens_per_req: float = float("nan")
    switches: int = 0
    switch_mean_s: float = float("nan")
    split_time_s: dict[str, float] = field(default_factory=dict)
    prefill_wait_mean_s: float = float("nan")
    prefill_wait_imbalance: float = float("nan")
    idle_prefill_frac: float = float("nan")
    idle_decode_frac: float = float("nan")
    prefill_nodes_mean: float = float("nan")  # prefill-capable nodes (prefill + collocated), time-weighted
    decode_nodes_mean: float = float("nan")  # decode-capable nodes (decode + collocated), time-weighted
    kv_demand_peak_tokens: float = float("nan")
    kv_demand_mean_tokens: float = float("nan")
    kv_gpu_capacity_tokens: int = 0
    kv_host_capacity_tokens: int = 0
    kv_demand_peak_gpu: float = float("nan")  # peak demand / GPU (L1) capacity of the cluster
    kv_demand_mean_gpu: float = float("nan")
    kv_demand_peak_host: float = float("nan")  # peak demand / host (L2) capacity of the cluster
    unfinished: int = 0
    # the next turn's KV (module docstring)
    continuations: int = 0
    ttft_cont_p50_s: float = float("nan")
    ttft_cont_p95_s: float = float("nan")
    staged_tokens: int = 0  # +prestage: tokens moved by stage orders inside the window
    stage_orders: int = 0
    spec_requests: int = 0  # +specprefill: speculative prefills submitted inside the window
    spec_prefilled_tokens: int = 0  # ... tokens they computed
    spec_moved_tokens: int = 0  # ... tokens they fetched or moved P->D
    next_turn_on_staged: float = float("nan")  # continuations prefilled where their KV was staged
    # a partitioned run: per partition, split_figures() of its nodes (replay/sim/partitioned.py)
    partitions: dict[str, dict] = field(default_factory=dict)
    # series for plots (not printed in the table)
    ttft_s: list[float] = field(default_factory=list, repr=False)
    e2e_s: list[float] = field(default_factory=list, repr=False)
    split_series: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = asdict(self)
        for k in ("ttft_s", "e2e_s", "split_series"):
            d.pop(k)
        return d


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def _change(changes: list, ts: float, roles: dict[str, str]) -> None:
    """Record the roles from ``ts`` on; changes at the same instant collapse into one."""
    if changes and changes[-1][0] == ts:
        changes[-1] = (ts, dict(roles))
    else:
        changes.append((ts, dict(roles)))


@dataclass
class _Fold:
    """What one pass over the log keeps: per-request times and the role changes."""

    warmup_s: float
    end_s: float
    submitted: int = 0  # submitted inside the measured window
    finished: int = 0  # of those, finished without error
    finished_in_window: int = 0  # any request finished between warm-up end and end
    seen: BlockSet = field(default_factory=BlockSet)  # every prompt block submitted so far (uint64 set: an OSWorld-like hour submits ~10M)
    last: dict[str, Sequence[int]] = field(default_factory=dict)  # branch -> its last prompt (all of it in seen)
    sub: dict[str, tuple[float, int, int, bool]] = field(default_factory=dict)  # ts, prompt, ideal, measured
    first: dict[str, float] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    cached: dict[str, int] = field(default_factory=dict)
    pstart: dict[str, tuple[float, str]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    split_changes: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    switch_durations: list[float] = field(default_factory=list)
    prefill_busy: float = 0.0
    decode_busy: float = 0.0
    l1_cap: dict[str, int] = field(default_factory=dict)
    l2_cap: dict[str, int] = field(default_factory=dict)
    demand: _Demand = field(default_factory=lambda: _Demand())
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    nt: NextTurn = field(default_factory=lambda: NextTurn())

    def submitted_ev(self, e: RequestSubmitted) -> None:
        if e.request.endswith(SPEC_SUFFIX):
            self.nt.spec_submitted(e, self)
            return
        self.nt.submitted(e, self)
        # the run seen before: the branch's last prompt is all in seen, so the part this one
        # shares with it is not probed again (compared in C: a prompt usually extends the last)
        prev = self.last.get(e.branch)
        start = _kvscan.common_prefix(prev, e.blocks) if prev is not None else 0
        n = KvPool.prefix_len(e.blocks, start, self.seen)
        ideal = min(n * e.block_tokens, max(0, e.prompt_tokens - 1))
        self.seen.update(islice(e.blocks, n, None))
        self.last[e.branch] = e.blocks
        measured = e.ts >= self.warmup_s
        self.sub[e.request] = (e.ts, e.prompt_tokens, ideal, measured)
        if measured:
            self.submitted += 1

    def started(self, e: RequestStarted) -> None:
        if e.phase == "prefill" and self.nt.started(e, self):
            self.cached[e.request] = e.cached_tokens
            self.pstart[e.request] = (e.ts, e.node)

    def first_token(self, e: FirstToken) -> None:
        self.first[e.request] = e.ts

    def finished_ev(self, e: RequestFinished) -> None:
        s = self.sub.get(e.request)
        if s is None and e.request.endswith(SPEC_SUFFIX):
            return
        self.done.add(e.request)
        if s is None or e.error:
            return
        if self.warmup_s <= e.ts <= self.end_s:
            self.finished_in_window += 1
        if not s[3]:
            return
        self.finished += 1
        self.e2e.append(e.ts - s[0])
        ft = self.first.get(e.request)
        if ft is not None:
            self.ttft.append(ft - s[0])
            if e.request in self.nt.cont:
                self.nt.ttft.append(ft - s[0])
            if e.output_tokens > 1:
                self.tpot.append((e.ts - ft) / (e.output_tokens - 1))

    def iteration(self, e: IterationDone) -> None:
        if e.ts >= self.warmup_s:
            busy = min(e.duration_s * e.iterations, e.ts - self.warmup_s)
            if e.phase == "prefill":
                self.prefill_busy += busy
            else:
                self.decode_busy += busy

    def registered(self, e: NodeRegistered) -> None:
        self.l1_cap[e.node], self.l2_cap[e.node] = e.l1_capacity_tokens, e.l2_capacity_tokens
        self.roles[e.node] = e.role
        _change(self.split_changes, e.ts, self.roles)

    def switched(self, e: RoleSwitched) -> None:
        if self.roles.get(e.node) == e.role:
            return
        if e.ts >= self.warmup_s and self.roles.get(e.node) != "collocated":  # not the warm-up's end
            self.switch_durations.append(e.duration_s)
        self.roles[e.node] = e.role
        _change(self.split_changes, e.ts, self.roles)


class _Demand:
    """Distinct blocks referenced by the active branches, over time (module docstring).

    Compiled tables (services/cores/directory/_native.pyx): each branch's distinct blocks are a
    ``BlockSet`` and the count of branches per block a ``BlockCounts``, so a request's context
    (~1,800 hashes on the calibration sessions) is counted in and out by C loops over its list
    instead of a Python set and a dict step per block (tests/unit/replay/sim/test_figures_demand.py
    holds it to the set-and-dict fold it replaced)."""

    def __init__(self) -> None:
        self.branch: dict[str, BlockSet] = {}
        self.ctx: dict[str, Sequence[int]] = {}  # the branch's last context, in order
        self.refs = BlockCounts()  # block -> active branches whose context holds it
        self.block_tokens = 64
        self.last_ts = 0.0
        self.area = 0.0  # token-seconds inside the window
        self.peak = 0

    def tokens(self) -> int:
        return len(self.refs) * self.block_tokens

    def _advance(self, ts: float, warmup_s: float, end_s: float) -> None:
        a, b = max(self.last_ts, warmup_s), min(ts, end_s)
        if b > a:
            self.area += self.tokens() * (b - a)
        if max(self.last_ts, warmup_s) <= min(ts, end_s):  # the value held inside the window
            self.peak = max(self.peak, self.tokens())
        self.last_ts = max(self.last_ts, ts)

    def set_context(self, branch: str, blocks, ts: float, warmup_s: float, end_s: float) -> None:
        self._advance(ts, warmup_s, end_s)
        old = self.branch.get(branch)
        prev = self.ctx.get(branch)
        if old is not None and prev is not None and len(blocks) >= len(prev) \
                and _kvscan.common_prefix(prev, blocks) == len(prev):
            # a continuation (the usual next request): only the appended blocks can be new
            added = _kvscan.missing_after(blocks, len(prev), old)
            old.update(added)
            new = old
        else:
            new = BlockSet()
            new.update(blocks)
            if old is None:
                added = _kvscan.missing_after(blocks, 0, _NO_BLOCKS)  # its distinct blocks
            else:
                added = _kvscan.missing_after(blocks, 0, old)
                self.refs.remove(_kvscan.missing_after(list(old), 0, new))  # the ones it no longer holds
        self.refs.add(added)
        self.branch[branch] = new
        self.ctx[branch] = blocks
        self._advance(ts, warmup_s, end_s)

    def end(self, branch: str, ts: float, warmup_s: float, end_s: float) -> None:
        if branch in self.branch:
            self.set_context(branch, (), ts, warmup_s, end_s)
            del self.branch[branch]
            del self.ctx[branch]


_NO_BLOCKS = BlockSet()


def _branch_context(f: _Fold, e) -> None:
    if type(e) is RequestSubmitted:
        f.demand.block_tokens = e.block_tokens
    f.demand.set_context(e.branch, e.blocks, e.ts, f.warmup_s, f.end_s)


def _submitted_and_context(f: _Fold, e: RequestSubmitted) -> None:
    f.submitted_ev(e)
    if not e.request.endswith(SPEC_SUFFIX):
        _branch_context(f, e)


def _branch_opened(f: _Fold, e: BranchOpened) -> None:
    if e.branch not in f.demand.branch:
        f.demand.set_context(e.branch, (), e.ts, f.warmup_s, f.end_s)


def _branch_ended(f: _Fold, e: BranchEnded) -> None:
    f.demand.end(e.branch, e.ts, f.warmup_s, f.end_s)
    f.last.pop(e.branch, None)


_STEPS = {
    RequestSubmitted: _submitted_and_context,
    ContextCompacted: _branch_context,
    BranchOpened: _branch_opened,
    BranchEnded: _branch_ended,
    RequestStarted: _Fold.started,
    FirstToken: _Fold.first_token,
    RequestFinished: _Fold.finished_ev,
    IterationDone: _Fold.iteration,
    NodeRegistered: _Fold.registered,
    RoleSwitched: _Fold.switched,
}


#: The event types the figures fold: a log may be read with ``read(types=METRIC_TYPES)``
#: (the KV and routing events, most of a log's bytes, are then not decoded).
METRIC_TYPES = frozenset(t.__name__ for t in _STEPS)
#: Folded too when the log has them (the next-turn traffic; not in ``METRIC_TYPES``, so a
#: ``decisions`` log and ``sim-report`` stay as they were)
_KV_STEPS = {
    KvMoved: lambda f, e: f.nt.moved(e, f),
    KvFetched: lambda f, e: f.nt.fetched(e, f),
    KvStageOrdered: lambda f, e: f.nt.stage_ordered(e, f),
}
_ALL_STEPS = {**_STEPS, **_KV_STEPS}


def _fold(log: Iterable[Event], warmup_s: float, end_s: float) -> _Fold:
    fold = MetricsFold(warmup_s, end_s)
    for e in log:
        fold(e)
    return fold.state


class MetricsFold:
    """:func:`compute_metrics` one event at a time, as a run emits them (``Simulation(observe=)``),
    so a run need not keep its whole log in memory for the figures: ``fold(e)`` per event in log
    order, then ``fold.metrics(stack)`` gives what ``compute_metrics(log, ...)`` gives."""

    __slots__ = ("_f", "_steps")

    def __init__(self, warmup_s: float, end_s: float) -> None:
        self._f = _Fold(warmup_s, end_s)
        self._steps = _ALL_STEPS

    def __call__(self, e: Event) -> None:
        step = self._steps.get(type(e))
        if step is not None:
            step(self._f, e)

    @property
    def state(self) -> _Fold:
        return self._f

    def metrics(self, stack: str = "") -> RunMetrics:
        return _metrics(self._f, stack)


def _next_turn(m: RunMetrics, f: _Fold) -> None:
    nt = f.nt
    m.continuations = len(nt.ttft)
    m.ttft_cont_p50_s, m.ttft_cont_p95_s = _pct(nt.ttft, 50), _pct(nt.ttft, 95)
    m.staged_tokens, m.stage_orders = nt.staged_tokens, nt.stage_orders
    m.spec_requests, m.spec_prefilled_tokens, m.spec_moved_tokens = nt.spec_requests, nt.spec_prefilled, nt.spec_moved
    if nt.judged:
        m.next_turn_on_staged = nt.on_staged / nt.judged


def _latencies(m: RunMetrics, f: _Fold) -> None:
    m.submitted, m.finished = f.submitted, f.finished
    m.unfinished = len(f.sub) - len(f.done)
    m.throughput_rps = f.finished_in_window / m.window_s if m.window_s > 0 else float("nan")
    m.ttft_mean_s, m.ttft_p50_s, m.ttft_p95_s = _mean(f.ttft), _pct(f.ttft, 50), _pct(f.ttft, 95)
    m.ttft_p99_s, m.ttft_max_s = _pct(f.ttft, 99), _pct(f.ttft, 100)
    m.e2e_mean_s, m.e2e_p95_s = _mean(f.e2e), _pct(f.e2e, 95)
    m.tpot_mean_ms = _mean(f.tpot) * 1e3
    m.ttft_s, m.e2e_s = f.ttft, f.e2e


def _kv_reuse_and_waits(m: RunMetrics, f: _Fold) -> None:
    """KV hit (actual, ideal, lost reuse) and prefill queue waits over the window's requests
    that started prefill."""
    tot_prompt = tot_ideal = tot_actual = lost = 0
    waits: dict[str, list[float]] = defaultdict(list)
    for r, (ts, prompt, ideal, measured) in f.sub.items():
        if not measured or r not in f.cached:
            continue
        act = f.cached[r]
        tot_prompt += prompt
        tot_ideal += ideal
        tot_actual += act
        lost += max(0, ideal - act)
        st, node = f.pstart[r]
        waits[node].append(st - ts)
    n_started = sum(len(v) for v in waits.values())
    if tot_prompt:
        m.kv_hit_actual = tot_actual / tot_prompt
        m.kv_hit_ideal = tot_ideal / tot_prompt
        m.uncached_tokens_per_req = (tot_prompt - tot_actual) / n_started
    m.lost_kv_reuse = lost / tot_ideal if tot_ideal else float("nan")
    allw = [w for v in waits.values() for w in v]
    m.prefill_wait_mean_s = _mean(allw)
    per_node = [float(np.mean(v)) for v in waits.values() if v]
    if per_node and np.mean(per_node) > 0:
        m.prefill_wait_imbalance = float(max(per_node) / np.mean(per_node))


def _splits(m: RunMetrics, f: _Fold) -> None:
    """Switch count and time, time in each split and idle prefill-capable node time."""
    m.switches = len(f.switch_durations)
    m.switch_mean_s = _mean(f.switch_durations)
    split_time: dict[str, float] = defaultdict(float)
    prefill_node_s = decode_node_s = 0.0
    series = []
    changes = f.split_changes
    for i, (ts, rl) in enumerate(changes):
        nxt = changes[i + 1][0] if i + 1 < len(changes) else f.end_s
        p = sum(1 for r in rl.values() if r == "prefill")
        d = sum(1 for r in rl.values() if r == "decode")
        c = sum(1 for r in rl.values() if r == "collocated")
        series.append((ts, p + c))
        a, b = max(ts, f.warmup_s), min(nxt, f.end_s)
        if b > a:
            label = f"{p}P{d}D" + (f"{c}C" if c else "")
            split_time[label] += b - a
            prefill_node_s += (p + c) * (b - a)
            decode_node_s += (d + c) * (b - a)
    m.split_time_s = dict(sorted(split_time.items(), key=lambda kv: -kv[1]))
    m.split_series = series
    window = max(0.0, f.end_s - f.warmup_s)
    m.prefill_nodes_mean = prefill_node_s / window if window else float("nan")
    m.decode_nodes_mean = decode_node_s / window if window else float("nan")
    if prefill_node_s > 0:
        m.idle_prefill_frac = max(0.0, 1.0 - f.prefill_busy / prefill_node_s)
    if decode_node_s > 0:
        m.idle_decode_frac = max(0.0, 1.0 - f.decode_busy / decode_node_s)


def _kv_demand(m: RunMetrics, f: _Fold) -> None:
    """Peak and mean KV demand of the active branches against the cluster's KV capacity."""
    d = f.demand
    d._advance(f.end_s, f.warmup_s, f.end_s)  # the demand holds until the end of the window
    if m.window_s <= 0:
        return
    m.kv_demand_peak_tokens = float(d.peak)
    m.kv_demand_mean_tokens = d.area / m.window_s
    m.kv_gpu_capacity_tokens = sum(f.l1_cap.values())
    m.kv_host_capacity_tokens = sum(f.l2_cap.values())
    if m.kv_gpu_capacity_tokens:
        m.kv_demand_peak_gpu = d.peak / m.kv_gpu_capacity_tokens
        m.kv_demand_mean_gpu = m.kv_demand_mean_tokens / m.kv_gpu_capacity_tokens
    if m.kv_host_capacity_tokens:
        m.kv_demand_peak_host = d.peak / m.kv_host_capacity_tokens


#: What :func:`split_figures` reads: no block lists, so a merged log's share of a partition is cheap.
SPLIT_TYPES = frozenset({"NodeRegistered", "RoleSwitched", "IterationDone", "RequestFinished"})


def split_figures(log: Iterable[Event], warmup_s: float, end_s: float) -> dict:
    """The split side of the figures from the nodes' events alone (``SPLIT_TYPES``; others are
    ignored): time in each split, mean prefill- and decode-capable nodes, idle GPU time, and
    requests finished without error inside the window per second. A partition's nodes' events
    give that partition's figures (per-partition splits drift apart: METHOD.md, deployment)."""
    f = _Fold(warmup_s, end_s)
    done = 0
    for e in log:
        if type(e) is RequestFinished:
            done += not e.error and warmup_s <= e.ts <= end_s
        elif type(e).__name__ in SPLIT_TYPES:
            _STEPS[type(e)](f, e)
    m = RunMetrics(window_s=end_s - warmup_s)
    _splits(m, f)
    return {"throughput_rps": done / m.window_s if m.window_s > 0 else float("nan"),
            "prefill_nodes_mean": m.prefill_nodes_mean, "decode_nodes_mean": m.decode_nodes_mean,
            "idle_prefill_frac": m.idle_prefill_frac, "idle_decode_frac": m.idle_decode_frac,
            "switches": m.switches, "split_time_s": m.split_time_s}


def compute_metrics(log: Iterable[Event], warmup_s: float, end_s: float, stack: str = "") -> RunMetrics:
    """One pass over ``log`` (see the module docstring for every definition), then the figures."""
    return _metrics(_fold(log, warmup_s, end_s), stack)


def _metrics(f: _Fold, stack: str) -> RunMetrics:
    m = RunMetrics(stack=stack, window_s=f.end_s - f.warmup_s)
    _latencies(m, f)
    _kv_reuse_and_waits(m, f)
    _splits(m, f)
    _kv_demand(m, f)
    _next_turn(m, f)
    return m
