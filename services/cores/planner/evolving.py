"""The Evolving Infra planner (METHOD.md §4.3): switch the prefill/decode split only when sure.

Pure state machine: no I/O, no clock, no randomness; time is ``event.ts`` and windows close on
``Tick`` events. See docs/planner.md for the formulas, units and every assumption.

At the end of each window (``window_s``, cut into ``slices`` slices), for every candidate split
P prefill / N-P decode nodes (P = 1..N-1):

- per slice s: Theta_s(P) = min(sum mu_P, sum mu_D) (eq. 5) at that slice's ``w_bar``/``q_bar``;
- gain_s(P) = Theta_s(P) - Theta_s(current) (eq. 6); mean gain and SE = std(ddof=1)/sqrt(n);
- a candidate passes when mean gain > 2 SE (and > 0); the largest passing gain wins;
- no switch within ``cooldown_s`` of the last one.

That is the GATED path. A window end takes it only when every node has a role and both
sides are staffed; the guard state (``PlannerBase.guard``) sends it elsewhere otherwise, and
``PlanEvaluated.reason`` starts with the path's name (``base.plan_path`` reads it back):

- ``initial split`` (warm-up end only): the same 2-SE test against a reference split (the
  current one when the nodes started at a split, ``--start``; else ``initial``, else half of
  the nodes prefill): the reference is kept unless a candidate's mean gain over it exceeds
  2 SE; every node without a role gets one;
- ``place newcomers``: nodes without a role (joined, or re-registered as ``collocated`` after
  an engine restart) get one at the best split they can reach; no assigned node moves, no SE
  test, no cooldown (and it starts none);
- ``repair``: every node on one side (0P or 0D), none without a role: exactly one node moves.

Between window ends (``shift_path``, on by default): at every slice end the
change-point test of ``shift.py`` compares the last ``shift_slices`` slices of the sliding
window with the slices before them, on each candidate's per-slice gain and on the measured
prefill queue. When one has shifted, the ``shift`` path decides as the gated one does (mean gain
> 2 SE, SLO guard, TTFT objective, SLO escape, cooldown) over the recent slices alone, and the
``PlanEvaluated`` carries the test (``shift``). No shift: nothing is emitted.

The measured backlog (``measured_backlog``, on by default; ``backlog.py``): on
the gated and the shift paths, when a prefill queue waited in each of the last ``shift_slices``
slices, the SLO guard, the TTFT objective and the SLO escape read, per candidate, the larger of
the predicted P95 TTFT and the one the measured backlog implies; the escape's throughput
tolerance counts the queued requests in the decode population, and it moves at once to at
least the prefill count that drains the backlog within ``slo_ttft_p95_s`` (when one qualifies)
instead of one node per decision. The 2-SE rule of the gated path and the cooldown are
unchanged; ``PlanEvaluated.backlog`` carries the measurement.

The projected backlog (``backlog_projection_s``, 300 s by default): when the
queue is rising (``queue_rising``), the SLO escape also fires on the current split's P95 TTFT
with the backlog grown at its measured rate for that long, and the SLO guard vetoes a
candidate with fewer prefill nodes whose deficit would grow the backlog past the SLO over it.

Beyond the paper (both on by default, both off = the paper exactly):

- ``slo_guard``: a passing candidate is vetoed when its predicted P95 prefill-queue wait or P95
  TTFT exceeds the SLO and is worse than the current split's (§6 limit 2);
- ``ttft_objective``: among the passing candidates and the current split, those within
  ``throughput_tolerance`` of the best predicted throughput, take the lowest predicted P95
  TTFT if it beats the throughput-best one by ``ttft_min_improvement_s`` (§6 limit 1).
"""

from __future__ import annotations

import dataclasses
import math
import re

import msgspec
import numpy as np

import services.cores.numerics as nm
import services.cores.planner.backlog as bl
from events.catalog import Backlog, Candidate, Event, PlanEvaluated, ShiftTest, Split
from services.cores.planner.base import (
    GATED,
    INITIAL,
    NEWCOMERS,
    REPAIR,
    SHIFT,
    SLO_ESCAPE,
    BaseConfig,
    PlannerBase,
)
from services.cores.planner.evaluate import NodeArrays, WorkArrays, queue_prediction, theta
from services.cores.planner.shift import change_point, passed, strongest, why
from services.cores.planner.window import SliceStats, Work, work_of


class EvolvingConfig(BaseConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "evolving"
    slo_guard: bool = True
    slo_prefill_queue_p95_s: float = 30.0
    slo_ttft_p95_s: float = 15.0  # the trade-off curve (docs/planner.md)
    ttft_objective: bool = True
    throughput_tolerance: float = 0.05
    ttft_min_improvement_s: float = 1.0  # trade throughput only for at least this much P95 TTFT
    # the warm-up-end reference split when the nodes warm up collocated ("" = half prefill)
    initial: str = ""
    # the shift path: a change-point test at every slice end between window
    # ends; the recent part of the sliding window is the last ``shift_slices`` slices
    shift_path: bool = True
    shift_slices: int = 3
    # the measured backlog (backlog.py): over the last ``shift_slices`` slices,
    # when a prefill queue waited in each, the SLO guard, the TTFT objective and the SLO escape
    # read the measured wait beside the predicted one, and the escape moves at least to the
    # prefill count that drains the backlog within ``slo_ttft_p95_s``
    measured_backlog: bool = True
    # the projected backlog: when the queue rose in each recent slice and its
    # rise passes the change-point test, the SLO escape also fires when the backlog grown at
    # its measured rate for this long breaks the SLO at the current split (0: off). The time a
    # move takes: the shifting experiment's log measured 288.5 s from order to switch (nodes
    # draining their decodes), and the escape waits for the next shift or window end after it
    backlog_projection_s: float = 300.0
    # the closed-loop bound (evaluate.closed_loop_bound): where the arrivals are a closed loop
    # of agents (a measured branch cycle), a split's throughput is also at most what the
    # agents bring at it, so a faster decode counts as the shorter cycle it gives, not as the
    # rate the measured decode population would complete at. Applied after the warm-up end
    # (the gated and shift paths, newcomers and repairs), when every node serves prefill or
    # decode (a decode side was measured); the warm-up-end decision keeps eq. 5 as it is
    closed_loop_bound: bool = True


class Evaluation:
    """Every candidate's figures for one window (arrays indexed by P - 1)."""

    def __init__(
        self,
        P_values: np.ndarray,
        theta_mean: np.ndarray,
        gain: np.ndarray,
        se: np.ndarray,
        wait95: np.ndarray,
        ttft95: np.ndarray,
        n_slices: int,
        backlog: Backlog | None = None,
        measured_ttft95: np.ndarray | None = None,
        theta_backlog: np.ndarray | None = None,
        projected: tuple[float, Backlog] | None = None,
        guard_ttft: np.ndarray | None = None,
    ) -> None:
        self.P = P_values
        self.theta_mean = theta_mean
        self.gain = gain
        self.se = se
        self.wait95 = wait95
        # the model's prediction; the decision reads ``ttft`` (with a measured backlog: the
        # larger of it and the backlog's wait plus the predicted latency)
        self.ttft95 = ttft95
        self.n_slices = n_slices
        self.backlog = backlog
        self.measured_ttft95 = measured_ttft95
        self.ttft = ttft95 if measured_ttft95 is None else measured_ttft95
        # throughput with the queued requests counted in the decode population (they are
        # deferred decode work in a closed loop); the escape's tolerance reads it
        self.theta_backlog = theta_mean if theta_backlog is None else theta_backlog
        # (the current split's P95 TTFT once the backlog grew for ``backlog_projection_s``, that
        # backlog) when the queue is rising; only the SLO escape's trigger reads it
        self.projected = projected
        # what the SLO guard reads: ``ttft``, for a candidate with fewer prefill nodes than the
        # current split the larger of it and its P95 TTFT once its deficit grew the backlog
        self.guard_ttft = self.ttft if guard_ttft is None else guard_ttft


class EvolvingPlanner(PlannerBase):
    Config = EvolvingConfig
    name = "evolving"

    # ------------------------------------------------------------------ inputs
    def assignment_order(self) -> list[str]:
        """``seq``: candidate P takes ``seq[:P]`` as prefill nodes. Current prefill nodes come
        first, the one that loses least by switching to decode last; then collocated and decode
        nodes, the one that loses least by switching to prefill first (see ``nodes_to_switch``)."""
        nodes = self.st.nodes
        pre = sorted(
            (n for n in nodes if nodes[n].target == "prefill"), key=lambda n: self.switch_loss(n, "decode")
        )
        col = sorted(
            (n for n in nodes if nodes[n].target not in ("prefill", "decode")),
            key=lambda n: self.switch_loss(n, "prefill"),
        )
        dec = sorted(
            (n for n in nodes if nodes[n].target == "decode"), key=lambda n: self.switch_loss(n, "prefill")
        )
        return pre[::-1] + col + dec

    def node_arrays(self, seq: list[str]) -> NodeArrays:
        nodes = self.st.nodes
        fill = self.prefill_fill()
        return NodeArrays(
            coef_p=np.array([self.prefill_model(n).coefficients for n in seq], dtype=float).reshape(-1, 4),
            fill=np.array([fill[n] for n in seq], dtype=float),
            coef_d=np.array([self.decode_model(n).coefficients for n in seq], dtype=float).reshape(-1, 4),
            cap=np.array([max(1, nodes[n].max_running) for n in seq], dtype=float),
            kv_tokens=np.array([max(0, nodes[n].l1_capacity) for n in seq], dtype=float),
            k=self.cfg.k,
            E=self.cfg.E,
        )

    def works(self, k_end: int) -> list[Work]:
        """``w_bar`` of each non-empty slice of the window ending at slice ``k_end``."""
        return self.works_of(self.window_slices(k_end))

    def works_of(self, slices: list[SliceStats]) -> list[Work]:
        """``w_bar`` of each non-empty slice of ``slices`` (a mean a slice lacks: theirs)."""
        window = SliceStats()
        for s in slices:
            window.add(s)
        fwd = [n.t_fwd for n in self.st.nodes.values()]
        default_t_fwd = sum(fwd) / len(fwd) if fwd else 1.0
        return [work_of(s, window, self.cfg.slice_s, default_t_fwd) for s in slices if not s.empty()]

    # ------------------------------------------------------------------ evaluation
    def serving_split(self, window_start: float) -> int | None:
        """Prefill nodes of the split every node served throughout the window (no node without
        a role, none ordered to switch, no switch since the window started), else ``None``: the
        split whose measured prefill queue calibrates the queueing prediction."""
        st = self.st
        if st.last_switch_at is not None and st.last_switch_at >= window_start:
            return None
        if any(n.ordered or n.role not in ("prefill", "decode") for n in st.nodes.values()):
            return None
        P = sum(n.role == "prefill" for n in st.nodes.values())
        return P if 1 <= P < len(st.nodes) else None

    def closed_loop(self) -> bool:
        """Whether eq. 5 is bounded by the closed loop's arrivals now (``closed_loop_bound``):
        configured, and every node serves prefill or decode (after a collocated warm-up no
        decode side was measured, so there is no time in decode to replace)."""
        nodes = self.st.nodes.values()
        return self.cfg.closed_loop_bound and bool(nodes) and all(n.role in ("prefill", "decode") for n in nodes)

    def evaluate(
        self,
        seq: list[str],
        works: list[Work],
        current_P: int | None,
        serving_P: int | None = None,
        backlog: Backlog | None = None,
        rising: bool = False,
        closed_loop: bool | None = None,
    ) -> Evaluation:
        """Every candidate's figures over ``works``; ``closed_loop``: whether eq. 5 is bounded by
        the closed loop's arrivals (None: ``self.closed_loop()``)."""
        arrays = self.node_arrays(seq)
        w = WorkArrays.of(works)
        closed = self.closed_loop() if closed_loop is None else closed_loop
        th, _, _ = theta(arrays, w, closed)
        N = len(seq)
        P_values = np.arange(1, N)
        n = th.shape[1]
        theta_mean = th.mean(axis=1)
        if current_P is not None and 1 <= current_P <= N - 1:
            gains = th - th[current_P - 1][None, :]
            gain = gains.mean(axis=1)
            se = gains.std(axis=1, ddof=1) / math.sqrt(n) if n > 1 else np.full(N - 1, np.inf)
        else:
            gain = theta_mean.copy()
            se = np.zeros(N - 1)
        # queueing prediction at the window's request-weighted work and mean arrival rate
        wait95, ttft95 = queue_prediction(arrays, w, self.cfg.window_s, serving_P)
        if backlog is None:
            return Evaluation(P_values, theta_mean, gain, se, wait95, ttft95, n)
        # the measured backlog beside the prediction: the P95 wait it implies at each candidate
        # (the current split, when it is the split served: at least the P95 wait measured),
        # plus the predicted prefill latency; the larger of that and the prediction decides
        waits = np.array([bl.fluid_wait_s(backlog, int(P)) for P in P_values])
        if current_P is not None and serving_P == current_P and 1 <= current_P <= N - 1:
            waits[current_P - 1] = max(waits[current_P - 1], backlog.wait_p95_s)
        measured = np.maximum(ttft95, waits + (ttft95 - wait95))
        deferred = WorkArrays.of([dataclasses.replace(x, q=x.q + x.prefill_queue) for x in works])
        th_b, _, _ = theta(arrays, deferred, closed)
        projected, guard = None, measured
        move_s = self.cfg.backlog_projection_s
        if move_s > 0.0 and current_P is not None and 1 <= current_P <= N - 1:
            short = np.array([
                bl.deficit_wait_s(backlog, int(P), move_s) if P < current_P else 0.0 for P in P_values
            ])
            guard = np.maximum(measured, short + (ttft95 - wait95))
        if rising and move_s > 0.0 and backlog.growth_rps > 0.0 and current_P is not None and 1 <= current_P <= N - 1:
            c = current_P - 1
            grown = bl.projected(backlog, move_s)
            wait = max(waits[c], bl.fluid_wait_s(grown, current_P))
            projected = (float(max(ttft95[c], wait + ttft95[c] - wait95[c])), grown)
        return Evaluation(
            P_values, theta_mean, gain, se, wait95, ttft95, n, backlog, measured, th_b.mean(axis=1), projected,
            guard,
        )

    def measure_backlog(self, slices: list[SliceStats]) -> Backlog | None:
        """The backlog of the recent ``slices`` (``backlog.measure``), when configured."""
        cfg = self.cfg
        if not cfg.measured_backlog:
            return None
        return bl.measure(slices, cfg.slice_s, cfg.slo_ttft_p95_s, len(self.st.nodes))

    def _veto(self, ev: Evaluation, i: int, cur: int | None) -> str:
        cfg = self.cfg
        if not cfg.slo_guard:
            return ""
        # against the current split (a split already breaking the SLO may be improved on);
        # with no current split (warm-up end) against the SLO alone
        cur_wait = ev.wait95[cur] if cur is not None else -math.inf
        cur_ttft = ev.ttft[cur] if cur is not None else -math.inf
        if ev.wait95[i] > cfg.slo_prefill_queue_p95_s and ev.wait95[i] > cur_wait:
            return (
                f"slo: predicted prefill queue p95 {ev.wait95[i]:.1f} s > {cfg.slo_prefill_queue_p95_s:g} s"
            )
        if ev.ttft[i] > cfg.slo_ttft_p95_s and ev.ttft[i] > cur_ttft:
            what = "predicted" if ev.measured_ttft95 is None else "predicted/measured"
            return f"slo: {what} ttft p95 {ev.ttft[i]:.1f} s > {cfg.slo_ttft_p95_s:g} s"
        if ev.guard_ttft[i] > cfg.slo_ttft_p95_s and ev.guard_ttft[i] > cur_ttft:
            return (
                f"slo: projected ttft p95 {ev.guard_ttft[i]:.1f} s > {cfg.slo_ttft_p95_s:g} s once "
                f"{ev.P[i]}P's deficit grew the backlog for {cfg.backlog_projection_s:g} s"
            )
        return ""

    def decide(
        self,
        ev: Evaluation,
        current_P: int | None,
        cooling: str,
        allowed: tuple[int, int] | None = None,
        label: str = INITIAL,
    ) -> tuple[int | None, list[Candidate], str]:
        """(chosen P or None, candidates, reason). With no current split (``current_P`` None:
        the initial split or a newcomers' placement) every candidate passes the SE test and
        ``label`` starts the reason; ``allowed`` = (lo, hi) limits the choice to those
        prefill counts (a placement cannot move an assigned node)."""
        cur = current_P - 1 if current_P is not None and 1 <= current_P <= len(ev.P) else None
        cands, eligible, passed_any = self._candidates(ev, cur, allowed)
        if cur is None and not eligible:  # every split breaks the SLO: take the least bad TTFT
            pool = [i for i in range(len(ev.P)) if _within(int(ev.P[i]), allowed)]
            i = min(pool, key=lambda i: (ev.ttft[i], -ev.theta_mean[i], i))
            return int(ev.P[i]), cands, f"{label}: every split breaks the SLO, lowest predicted ttft p95"
        if not eligible:
            why = "vetoed by the SLO guard" if passed_any else "no candidate's mean gain exceeds 2 SE"
            escape = self._slo_escape(ev, cur, allowed)
            if escape is not None and not cooling:
                return int(ev.P[escape]), cands, f"{SLO_ESCAPE}: {self._escape_why(ev, cur, escape)} ({why})"
            return None, cands, why
        if cooling:
            return None, cands, cooling
        best = max(eligible, key=lambda i: (ev.gain[i], -abs(i - (cur if cur is not None else i)), -i))
        reason = (
            f"{label}: max predicted throughput {ev.theta_mean[best]:.3f} req/s"
            if cur is None
            else f"mean gain {ev.gain[best]:.3f} req/s > 2 SE ({2 * ev.se[best]:.3f})"
        )
        if not self.cfg.ttft_objective:
            return int(ev.P[best]), cands, reason
        return self._ttft_objective(ev, eligible, cur, best, cands, reason)

    def _slo_escape(self, ev: Evaluation, cur: int | None, allowed: tuple[int, int] | None) -> int | None:
        """With the TTFT objective on and the current split's P95 TTFT (predicted, or measured
        when a backlog was: ``Evaluation.ttft``) above ``slo_ttft_p95_s``: the candidate whose
        throughput is within ``throughput_tolerance`` of the current split's and whose P95 TTFT
        meets the SLO (the highest throughput among them), else the one with the lowest P95
        TTFT, if it beats the current split's by ``ttft_min_improvement_s``; ``None`` otherwise.
        The 2-SE test asks for certainty of a throughput gain; a split breaking the SLO needs
        none to be left for one that meets it at the same throughput.

        With a measured backlog the throughput is the one with the queued
        requests counted in decode (``theta_backlog``), and when the backlog needs more prefill
        nodes than the current split has (``Backlog.need_prefill``) only candidates with at
        least that many are taken, if any qualifies: one move sized to drain it, not one node
        per decision. With a rising backlog (``Evaluation.projected``) the escape also fires
        when the current split's P95 TTFT projected ``backlog_projection_s`` on breaks the SLO
        (before the measured one does); the move is chosen and sized as without it."""
        cfg = self.cfg
        if not cfg.ttft_objective or cur is None:
            return None
        if ev.ttft[cur] <= cfg.slo_ttft_p95_s and (ev.projected is None or ev.projected[0] <= cfg.slo_ttft_p95_s):
            return None
        theta = ev.theta_backlog
        floor = (1.0 - cfg.throughput_tolerance) * theta[cur]
        pool = [
            i for i in range(len(ev.P))
            if i != cur and _within(int(ev.P[i]), allowed) and theta[i] >= floor
            and ev.ttft[i] <= ev.ttft[cur] - cfg.ttft_min_improvement_s
        ]
        b = ev.backlog
        if b is not None and b.need_prefill > ev.P[cur]:
            pool = [i for i in pool if ev.P[i] >= b.need_prefill] or pool
        meets = [i for i in pool if ev.ttft[i] <= cfg.slo_ttft_p95_s]
        if meets:
            return max(meets, key=lambda i: (theta[i], -ev.ttft[i], -abs(i - cur)))
        return min(pool, key=lambda i: (ev.ttft[i], -theta[i])) if pool else None

    def _escape_why(self, ev: Evaluation, cur: int, i: int) -> str:
        if ev.backlog is None:
            return (
                f"current split's predicted ttft p95 {ev.ttft95[cur]:.1f} s > {self.cfg.slo_ttft_p95_s:g} s; "
                f"{ev.P[i]}P predicts {ev.ttft95[i]:.1f} s at {ev.theta_mean[i]:.3f} req/s "
                f"(current {ev.theta_mean[cur]:.3f}, tolerance {self.cfg.throughput_tolerance:.0%})"
            )
        slo = self.cfg.slo_ttft_p95_s
        if ev.ttft[cur] > slo or ev.projected is None:
            now = f"current split's ttft p95 {ev.ttft[cur]:.1f} s (predicted {ev.ttft95[cur]:.1f} s) > {slo:g} s"
        else:
            ttft, grown = ev.projected
            now = (
                f"current split's ttft p95 {ev.ttft[cur]:.1f} s (predicted {ev.ttft95[cur]:.1f} s), projected "
                f"{ttft:.1f} s > {slo:g} s once the rising backlog grows {self.cfg.backlog_projection_s:g} s more "
                f"(to {grown.last_queue:.0f} requests)"
            )
        return (
            f"{now}; {bl.why(ev.backlog)}; {ev.P[i]}P: {ev.ttft[i]:.1f} s "
            f"(predicted {ev.ttft95[i]:.1f} s) at {ev.theta_backlog[i]:.3f} req/s with the queue in "
            f"decode (current {ev.theta_backlog[cur]:.3f}, tolerance {self.cfg.throughput_tolerance:.0%})"
        )

    def _candidates(
        self, ev: Evaluation, cur: int | None, allowed: tuple[int, int] | None
    ) -> tuple[list[Candidate], list[int], bool]:
        """Every candidate's figures and verdict; the indices of the eligible ones (passed,
        not vetoed, not the current split); whether any passed before the SLO guard."""
        cands: list[Candidate] = []
        eligible: list[int] = []
        passed_any = False
        for i, P in enumerate(ev.P.tolist()):
            reachable = _within(P, allowed)
            passed = bool(cur is None or (ev.gain[i] > 2.0 * ev.se[i] and ev.gain[i] > 0.0)) and reachable
            veto = self._veto(ev, i, cur) if passed and i != cur else ""
            passed_any |= passed and i != cur
            if passed and not veto and i != cur:
                eligible.append(i)
            cands.append(
                Candidate(
                    split=Split(prefill=P, decode=len(ev.P) + 1 - P),
                    mean_gain=_f(ev.gain[i]),
                    se=_f(ev.se[i]),
                    throughput=_f(ev.theta_mean[i]),
                    predicted_ttft_p95_s=_f(ev.ttft95[i]),
                    passed=passed and not veto,
                    veto=veto if reachable else "would move an assigned node",
                    measured_ttft_p95_s=(
                        msgspec.UNSET if ev.measured_ttft95 is None else _f(ev.measured_ttft95[i])
                    ),
                    throughput_with_queue=(
                        msgspec.UNSET if ev.backlog is None else _f(ev.theta_backlog[i])
                    ),
                )
            )
        return cands, eligible, passed_any

    def _ttft_objective(
        self,
        ev: Evaluation,
        eligible: list[int],
        cur: int | None,
        best: int,
        cands: list[Candidate],
        reason: str,
    ) -> tuple[int | None, list[Candidate], str]:
        """Among the eligible candidates and the current split within ``throughput_tolerance``
        of the best throughput, the lowest predicted P95 TTFT, if it beats ``best`` by at
        least ``ttft_min_improvement_s``."""
        cfg = self.cfg
        pool = eligible + ([cur] if cur is not None else [])
        top = max(ev.theta_mean[i] for i in eligible)
        near = [i for i in pool if ev.theta_mean[i] >= (1.0 - cfg.throughput_tolerance) * top]
        pick = min(near, key=lambda i: (ev.ttft[i], -ev.gain[i], i))
        if not (pick != best and ev.ttft[pick] <= ev.ttft[best] - cfg.ttft_min_improvement_s):
            return int(ev.P[best]), cands, reason
        if pick == cur:
            return (
                None,
                cands,
                (
                    f"ttft objective: current split within {cfg.throughput_tolerance:.0%} of "
                    f"the best throughput with lower predicted ttft p95 "
                    f"({ev.ttft[pick]:.2f} s vs {ev.ttft[best]:.2f} s)"
                ),
            )
        reason += (
            f"; ttft objective: {ev.P[pick]}P within {cfg.throughput_tolerance:.0%} of the best "
            f"throughput, predicted ttft p95 {ev.ttft[pick]:.2f} s vs {ev.ttft[best]:.2f} s"
        )
        return int(ev.P[pick]), cands, reason

    # ------------------------------------------------------------------ window ends
    def _plan(self, ts: float, k_end: int, warmup_end: bool) -> list[Event]:
        """One window-end decision down the path its guard state names (base.py)."""
        cfg = self.cfg
        base = {
            "ts": ts,
            "src": self.name,
            "window_start": (k_end - cfg.slices) * cfg.slice_s,
            "window_end": k_end * cfg.slice_s,
            "current": self.current_split(),
            "planner": self.name,
        }
        N = len(self.st.nodes)
        if N < 2:
            return [PlanEvaluated(**base, reason=f"{N} node(s): nothing to split")]
        path = INITIAL if warmup_end else self.guard()
        if path == INITIAL:
            return self._initial(ts, k_end, base)
        if path == NEWCOMERS:
            return self._newcomers(ts, k_end, base)
        if path == REPAIR:
            return self._repair(ts, base)
        return self._gated(ts, k_end, base)

    def reference_split(self) -> int:
        """Prefill nodes of the split the warm-up-end decision is SE-gated against: the current
        split when every node already serves a role and both sides are staffed (the nodes
        started at a split), else the configured ``initial`` split scaled to the node count,
        else half of the nodes (at least one of each)."""
        N = len(self.st.nodes)
        split = self.current_split()
        if not self.newcomers() and split.prefill >= 1 and split.decode >= 1:
            return split.prefill
        if self.cfg.initial:
            m = re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", self.cfg.initial, flags=re.IGNORECASE)
            assert m, f"initial split is written like '4P5D', got {self.cfg.initial!r}"
            p, d = int(m.group(1)), int(m.group(2))
            return min(max(1, math.floor(N * p / max(1, p + d) + 0.5)), N - 1)
        return min(max(1, N // 2), N - 1)

    def _initial(self, ts: float, k_end: int, base: dict) -> list[Event]:
        """INITIAL (warm-up end): the 2-SE test of METHOD.md §4.3 against the reference split
        (``reference_split``): a candidate replaces it only when its mean gain over it exceeds
        twice its standard error (largest passing gain; SLO guard and TTFT objective as on the
        gated path; no cooldown yet). Every node without a role gets one; with fewer than two
        non-empty slices (no SE) the reference is taken."""
        N = len(self.st.nodes)
        ref = self.reference_split()
        ref_name = f"{ref}P{N - ref}D"
        works = self.works(k_end)
        if len(works) < 2:
            reason = f"{INITIAL} without data: reference {ref_name} ({len(works)} non-empty slice(s), the SE needs 2)"
            return [
                PlanEvaluated(**base, chosen=Split(prefill=ref, decode=N - ref), reason=reason),
                *self.order(self.nodes_to_switch(ref), ts, reason),
            ]
        # eq. 5 as METHOD.md writes it: the closed-loop bound starts after the warm-up end
        ev = self.evaluate(self.assignment_order(), works, ref, self.serving_split(base["window_start"]),
                           closed_loop=False)
        P, cands, why = self.decide(ev, ref, "")
        if P is None and self.serving_split(base["window_start"]) is None:
            P, tie = self._initial_ttft(ev, ref)
            if P is not None:
                why = f"{why}; {tie}"
        if P is None:
            P, reason = ref, f"{INITIAL}: reference {ref_name} kept: {why}"
        else:
            reason = f"{INITIAL}: {why} over reference {ref_name}"
        chosen = Split(prefill=P, decode=N - P)
        return [
            PlanEvaluated(**base, candidates=cands, chosen=chosen, reason=reason),
            *self.order(self.nodes_to_switch(P), ts, reason),
        ]

    def _initial_ttft(self, ev: Evaluation, ref: int) -> tuple[int | None, str]:
        """The TTFT objective at a warm-up end where no candidate's throughput gain passed the
        2-SE test and the nodes warmed up collocated: the reference was never served, every
        node takes a role now whichever split is chosen, so it holds no incumbency; the 2-SE
        test says no candidate is surely faster, not that the reference is better. Among the
        reference and the candidates not vetoed whose predicted throughput is within
        ``throughput_tolerance`` of the reference's, the lowest predicted P95 TTFT is taken
        when it beats the reference's by ``ttft_min_improvement_s`` (as ``_ttft_objective``
        does among passing candidates; METHOD.md §6 limit 1). (P or None, why)."""
        cfg = self.cfg
        if not cfg.ttft_objective:
            return None, ""
        r = ref - 1
        floor = (1.0 - cfg.throughput_tolerance) * ev.theta_mean[r]
        near = [i for i in range(len(ev.P)) if i != r and ev.theta_mean[i] >= floor and not self._veto(ev, i, r)]
        if not near:
            return None, ""
        pick = min(near, key=lambda i: (ev.ttft[i], -ev.theta_mean[i], abs(i - r), i))
        if ev.ttft[pick] > ev.ttft[r] - cfg.ttft_min_improvement_s:
            return None, ""
        return int(ev.P[pick]), (
            f"ttft objective: {ev.P[pick]}P within {cfg.throughput_tolerance:.0%} of the reference's predicted "
            f"throughput ({ev.theta_mean[pick]:.3f} vs {ev.theta_mean[r]:.3f} req/s), predicted ttft p95 "
            f"{ev.ttft[pick]:.2f} s vs {ev.ttft[r]:.2f} s"
        )

    def _newcomers(self, ts: float, k_end: int, base: dict) -> list[Event]:
        """NEWCOMERS: only the nodes without a role get one, at the best split they can reach
        (a node without a role serves nothing, so no SE test and no cooldown; a placement
        starts none). Assigned nodes wait for the gated path."""
        works = self.works(k_end)
        if not works:
            chosen, reason, orders = self.place_newcomers(ts, *self._current_share())
            return [PlanEvaluated(**base, chosen=chosen, reason=reason), *orders]
        label = f"{NEWCOMERS} {','.join(self.newcomers())} (assigned nodes stay)"
        ev = self.evaluate(self.assignment_order(), works, None)
        P, cands, reason = self.decide(ev, None, "", allowed=self.newcomer_range(), label=label)
        assert P is not None
        N = len(self.st.nodes)
        return [
            PlanEvaluated(**base, candidates=cands, chosen=Split(prefill=P, decode=N - P), reason=reason),
            *self.order(self.placement(P)[1], ts, reason, cooldown=False),
        ]

    def _current_share(self) -> tuple[int, str]:
        """Prefill nodes out of all at the assigned nodes' prefill share (half without any)."""
        split, N = self.current_split(), len(self.st.nodes)
        assigned = split.prefill + split.decode
        if not assigned:
            return N // 2, "no data in the window, half of the nodes prefill"
        return math.floor(
            N * split.prefill / assigned + 0.5
        ), "no data in the window, the prefill share stays"

    def _repair(self, ts: float, base: dict) -> list[Event]:
        chosen, reason, orders = self.repair(ts)
        return [PlanEvaluated(**base, chosen=chosen, reason=reason), *orders]

    def _gated(self, ts: float, k_end: int, base: dict) -> list[Event]:
        """Switch to the candidate whose mean gain over the current split exceeds 2 SE, not
        within ``cooldown_s`` of the last switch."""
        st, cfg = self.st, self.cfg
        works = self.works(k_end)
        if len(works) < 2:
            return [PlanEvaluated(**base, reason=f"insufficient data: {len(works)} non-empty slice(s)")]
        current = base["current"]
        backlog = self.measure_backlog(self.window_slices(k_end)[-cfg.shift_slices:])
        ev = self.evaluate(
            self.assignment_order(), works, current.prefill, self.serving_split(base["window_start"]), backlog,
            rising=backlog is not None and self.queue_rising(k_end),
        )
        cooling = ""
        if st.last_switch_at is not None and ts - st.last_switch_at < cfg.cooldown_s:
            cooling = f"cooldown: last switch {ts - st.last_switch_at:.0f} s ago < {cfg.cooldown_s:g} s"
        P, cands, reason = self.decide(ev, current.prefill, cooling)
        N = len(st.nodes)
        chosen = Split(prefill=P, decode=N - P) if P is not None else None
        out: list[Event] = [PlanEvaluated(
            **base, candidates=cands, chosen=chosen, reason=reason, backlog=backlog or msgspec.UNSET
        )]
        if P is not None:
            out += self.order(self.nodes_to_switch(P), ts, reason)
        return out

    # ------------------------------------------------------------------ the shift path
    def slices_kept(self) -> int:
        return self.cfg.slices if self.cfg.shift_path else 0

    def sliding(self, k_now: int) -> tuple[list[SliceStats], list[SliceStats]]:
        """(older, recent) slices of the sliding window of ``slices`` slices ending at slice
        ``k_now``, those before the warm-up end read as empty: collocated serving and the
        agents' first minutes are no mix to compare with (at the demo's 5-min warm-up end they
        read as a shift)."""
        cfg = self.cfg
        first = int(self.st.extra.get("shift_from_k", k_now - cfg.slices))
        slices = [s if k >= first else SliceStats()
                  for k, s in zip(range(k_now - cfg.slices, k_now), self.window_slices(k_now), strict=True)]
        cut = cfg.slices - cfg.shift_slices
        return slices[:cut], slices[cut:]

    def queue_rising(self, k_now: int) -> bool:
        """The prefill queue rose in each recent slice (non-empty ones, their mean queue), the
        last one's is above every older slice's (a new high in the sliding window, not a return
        to a level seen before) and the rise of its recent mean over the older one passes the
        change-point test (> 2 SE): a backlog growing steadily, not noise. Gates the projected
        backlog."""
        older_s, recent_s = self.sliding(k_now)
        older, recent = self.works_of(older_s), self.works_of(recent_s)
        t = change_point("prefill queue", [w.prefill_queue for w in older], [w.prefill_queue for w in recent])
        q = [w.prefill_queue for w in recent]
        return (
            t is not None and passed(t) and all(q[j + 1] > q[j] for j in range(len(q) - 1))
            and all(w.prefill_queue < q[-1] for w in older)
        )

    def shift_test(self, k_now: int) -> tuple[ShiftTest | None, list[Work], list[SliceStats]]:
        """(the strongest passing change-point test or None, the recent slices' works, the
        recent slices) over the sliding window of ``slices`` slices ending at slice ``k_now``."""
        older_s, recent_s = self.sliding(k_now)
        older, recent = self.works_of(older_s), self.works_of(recent_s)
        if len(older) < 2 or len(recent) < 2:
            return None, recent, recent_s
        cur = self.current_split().prefill - 1
        th, _, _ = theta(self.node_arrays(self.assignment_order()), WorkArrays.of(older + recent), self.closed_loop())
        gains = th - th[cur][None, :]
        n = len(older)
        tests = [
            change_point(f"gain {i + 1}P", gains[i, :n].tolist(), gains[i, n:].tolist())
            for i in range(th.shape[0])
            if i != cur and nm.total(gains[i, n:]) > 0.0  # the shift favours P
        ]
        tests.append(change_point(
            "prefill queue", [w.prefill_queue for w in older], [w.prefill_queue for w in recent]
        ))
        return strongest([t for t in tests if t is not None]), recent, recent_s

    def _on_slice(self, ts: float, k_now: int) -> list[Event]:
        """SHIFT: at a slice end between window ends, when the mix shifted (``shift_test``),
        the gated decision over the recent slices alone (cooldown applies)."""
        cfg, st = self.cfg, self.st
        N = len(st.nodes)
        if not cfg.shift_path or N < 2 or self.guard() != GATED:
            return []
        shift, recent, recent_slices = self.shift_test(k_now)
        if shift is None:
            return []
        current = self.current_split()
        start = (k_now - cfg.shift_slices) * cfg.slice_s
        backlog = self.measure_backlog(recent_slices)
        ev = self.evaluate(
            self.assignment_order(), recent, current.prefill, self.serving_split(start), backlog,
            rising=backlog is not None and self.queue_rising(k_now),
        )
        cooling = ""
        if st.last_switch_at is not None and ts - st.last_switch_at < cfg.cooldown_s:
            cooling = f"cooldown: last switch {ts - st.last_switch_at:.0f} s ago < {cfg.cooldown_s:g} s"
        P, cands, decided = self.decide(ev, current.prefill, cooling)
        reason = f"{SHIFT} ({why(shift)}): {decided}"
        chosen = Split(prefill=P, decode=N - P) if P is not None else None
        out: list[Event] = [PlanEvaluated(
            ts=ts, src=self.name, window_start=start, window_end=k_now * cfg.slice_s, current=current,
            candidates=cands, chosen=chosen, reason=reason, planner=self.name, shift=shift,
            backlog=backlog or msgspec.UNSET,
        )]
        if P is not None:
            out += self.order(self.nodes_to_switch(P), ts, reason)
        return out

    def _on_warmup_end(self, ts: float, k_end: int) -> list[Event]:
        self.st.extra["shift_from_k"] = float(k_end)
        return self._plan(ts, k_end, warmup_end=True)

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        return self._plan(ts, k_end, warmup_end=False)


def _within(P: int, allowed: tuple[int, int] | None) -> bool:
    return allowed is None or allowed[0] <= P <= allowed[1]


def _f(x: float) -> float:
    """A finite float for the event (msgpack carries inf, JSON does not)."""
    x = float(x)
    return x if math.isfinite(x) else 1e300
