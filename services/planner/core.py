"""The Evolving Infra planner (METHOD.md §4.3): switch the prefill/decode split only when sure.

Pure state machine: no I/O, no clock, no randomness; time is ``event.ts`` and windows close on
``Tick`` events. See docs/planner.md for the formulas, units and every assumption.

At the end of each window (``window_s``, cut into ``slices`` slices), for every candidate split
P prefill / N-P decode nodes (P = 1..N-1):

- per slice s: Theta_s(P) = min(sum mu_P, sum mu_D) (eq. 5) at that slice's ``w_bar``/``q_bar``;
- gain_s(P) = Theta_s(P) - Theta_s(current) (eq. 6); mean gain and SE = std(ddof=1)/sqrt(n);
- a candidate passes when mean gain > 2 SE (and > 0); the largest passing gain wins;
- no switch within ``cooldown_s`` of the last one.

Beyond the paper (both on by default, both off = the paper exactly):

- ``slo_guard``: a passing candidate is vetoed when its predicted P95 prefill-queue wait or P95
  TTFT exceeds the SLO and is worse than the current split's (§6 limit 2);
- ``ttft_objective``: among the passing candidates and the current split, those within
  ``throughput_tolerance`` of the best predicted throughput, take the lowest predicted P95
  TTFT if it beats the throughput-best one by ``ttft_min_improvement_s`` (§6 limit 1).
"""

from __future__ import annotations

import math

import numpy as np

from events.catalog import Candidate, Event, PlanEvaluated, Split
from services.planner.base import BaseConfig, PlannerBase
from services.planner.evaluate import (
    NodeArrays,
    WorkArrays,
    erlang_c_wait_p95,
    prefill_latency_s,
    theta,
)
from services.planner.window import SliceStats, Work, work_of


class EvolvingConfig(BaseConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "evolving"
    slo_guard: bool = True
    slo_prefill_queue_p95_s: float = 30.0
    slo_ttft_p95_s: float = 60.0
    ttft_objective: bool = True
    throughput_tolerance: float = 0.05
    ttft_min_improvement_s: float = 1.0  # trade throughput only for at least this much P95 TTFT


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
    ) -> None:
        self.P = P_values
        self.theta_mean = theta_mean
        self.gain = gain
        self.se = se
        self.wait95 = wait95
        self.ttft95 = ttft95
        self.n_slices = n_slices


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
            coef_d=np.array([self.decode_model(n).coefficients for n in seq], dtype=float).reshape(-1, 3),
            cap=np.array([max(1, nodes[n].max_running) for n in seq], dtype=float),
            kv_tokens=np.array([max(0, nodes[n].l1_capacity) for n in seq], dtype=float),
            k=self.cfg.k,
            E=self.cfg.E,
        )

    def works(self, k_end: int) -> list[Work]:
        """``w_bar`` of each non-empty slice of the window ending at slice ``k_end``."""
        slices = self.window_slices(k_end)
        window = SliceStats()
        for s in slices:
            window.add(s)
        fwd = [n.t_fwd for n in self.st.nodes.values()]
        default_t_fwd = sum(fwd) / len(fwd) if fwd else 1.0
        return [work_of(s, window, self.cfg.slice_s, default_t_fwd) for s in slices if not s.empty()]

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, seq: list[str], works: list[Work], current_P: int | None) -> Evaluation:
        arrays = self.node_arrays(seq)
        w = WorkArrays.of(works)
        th, sumP, _ = theta(arrays, w)
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
        # queueing prediction at the window's mean work and arrival rate
        lam = float(w.arrivals_rps.mean())
        mu_node = sumP.mean(axis=1) / P_values
        wait95 = erlang_c_wait_p95(lam, mu_node, P_values, self.cfg.window_s)
        cum_coef = np.cumsum(arrays.coef_p, axis=0)[: N - 1] / P_values[:, None]
        cum_fill = np.cumsum(arrays.fill)[: N - 1] / P_values
        service = prefill_latency_s(
            cum_coef, cum_fill, float(w.t_uc.mean()), float(w.A.mean()), float(w.t_rst.mean())
        )
        return Evaluation(P_values, theta_mean, gain, se, wait95, wait95 + service, n)

    def _veto(self, ev: Evaluation, i: int, cur: int | None) -> str:
        cfg = self.cfg
        if not cfg.slo_guard:
            return ""
        # against the current split (a split already breaking the SLO may be improved on);
        # with no current split (warm-up end) against the SLO alone
        cur_wait = ev.wait95[cur] if cur is not None else -math.inf
        cur_ttft = ev.ttft95[cur] if cur is not None else -math.inf
        if ev.wait95[i] > cfg.slo_prefill_queue_p95_s and ev.wait95[i] > cur_wait:
            return (
                f"slo: predicted prefill queue p95 {ev.wait95[i]:.1f} s > {cfg.slo_prefill_queue_p95_s:g} s"
            )
        if ev.ttft95[i] > cfg.slo_ttft_p95_s and ev.ttft95[i] > cur_ttft:
            return f"slo: predicted ttft p95 {ev.ttft95[i]:.1f} s > {cfg.slo_ttft_p95_s:g} s"
        return ""

    def decide(
        self, ev: Evaluation, current_P: int | None, cooling: str
    ) -> tuple[int | None, list[Candidate], str]:
        """(chosen P or None, candidates, reason)."""
        cfg = self.cfg
        cur = current_P - 1 if current_P is not None and 1 <= current_P <= len(ev.P) else None
        initial = cur is None
        cands: list[Candidate] = []
        eligible: list[int] = []
        passed_any = False
        for i, P in enumerate(ev.P.tolist()):
            passed = bool(initial or (ev.gain[i] > 2.0 * ev.se[i] and ev.gain[i] > 0.0))
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
                    veto=veto,
                )
            )
        if initial and not eligible:  # every split breaks the SLO: take the least bad TTFT
            i = min(range(len(ev.P)), key=lambda i: (ev.ttft95[i], -ev.theta_mean[i], i))
            return int(ev.P[i]), cands, "initial split: every split breaks the SLO, lowest predicted ttft p95"
        if not eligible:
            why = "vetoed by the SLO guard" if passed_any else "no candidate's mean gain exceeds 2 SE"
            return None, cands, why
        if cooling:
            return None, cands, cooling
        best = max(eligible, key=lambda i: (ev.gain[i], -abs(i - (cur if cur is not None else i)), -i))
        reason = (
            f"initial split: max predicted throughput {ev.theta_mean[best]:.3f} req/s"
            if initial
            else f"mean gain {ev.gain[best]:.3f} req/s > 2 SE ({2 * ev.se[best]:.3f})"
        )
        if cfg.ttft_objective:
            pool = eligible + ([cur] if cur is not None else [])
            top = max(ev.theta_mean[i] for i in eligible)
            near = [i for i in pool if ev.theta_mean[i] >= (1.0 - cfg.throughput_tolerance) * top]
            pick = min(near, key=lambda i: (ev.ttft95[i], -ev.gain[i], i))
            if pick != best and ev.ttft95[pick] <= ev.ttft95[best] - cfg.ttft_min_improvement_s:
                if pick == cur:
                    return (
                        None,
                        cands,
                        (
                            f"ttft objective: current split within {cfg.throughput_tolerance:.0%} of "
                            f"the best throughput with lower predicted ttft p95 "
                            f"({ev.ttft95[pick]:.2f} s vs {ev.ttft95[best]:.2f} s)"
                        ),
                    )
                reason += (
                    f"; ttft objective: {ev.P[pick]}P within {cfg.throughput_tolerance:.0%} of the best "
                    f"throughput, predicted ttft p95 {ev.ttft95[pick]:.2f} s vs {ev.ttft95[best]:.2f} s"
                )
                best = pick
        return int(ev.P[best]), cands, reason

    # ------------------------------------------------------------------ window ends
    def _plan(self, ts: float, k_end: int, initial: bool) -> list[Event]:
        cfg = self.cfg
        st = self.st
        current = self.current_split()
        has_colloc = current.prefill + current.decode < len(st.nodes)
        initial = initial or has_colloc or current.prefill == 0 or current.decode == 0
        window_start, window_end = (k_end - cfg.slices) * cfg.slice_s, k_end * cfg.slice_s
        base = {
            "ts": ts,
            "src": self.name,
            "window_start": window_start,
            "window_end": window_end,
            "current": current,
            "planner": self.name,
        }
        N = len(st.nodes)
        if N < 2:
            return [PlanEvaluated(**base, reason=f"{N} node(s): nothing to split")]
        works = self.works(k_end)
        if len(works) < (1 if initial else 2):
            if not initial:
                return [PlanEvaluated(**base, reason=f"insufficient data: {len(works)} non-empty slice(s)")]
            P = max(1, N // 2)
            return [
                PlanEvaluated(
                    **base,
                    chosen=Split(prefill=P, decode=N - P),
                    reason="initial split without data: half of the nodes prefill",
                ),
                *self.order(self.nodes_to_switch(P), ts, "initial split without data"),
            ]
        seq = self.assignment_order()
        cur_P = None if initial else current.prefill
        ev = self.evaluate(seq, works, cur_P)
        cooling = ""
        if not initial and st.last_switch_at is not None and ts - st.last_switch_at < cfg.cooldown_s:
            cooling = f"cooldown: last switch {ts - st.last_switch_at:.0f} s ago < {cfg.cooldown_s:g} s"
        P, cands, reason = self.decide(ev, cur_P, cooling)
        chosen = Split(prefill=P, decode=N - P) if P is not None else None
        out: list[Event] = [PlanEvaluated(**base, candidates=cands, chosen=chosen, reason=reason)]
        if P is not None:
            out += self.order(self.nodes_to_switch(P), ts, reason)
        return out

    def _on_warmup_end(self, ts: float, k_end: int) -> list[Event]:
        return self._plan(ts, k_end, initial=True)

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        return self._plan(ts, k_end, initial=False)


def _f(x: float) -> float:
    """A finite float for the event (msgpack carries inf, JSON does not)."""
    x = float(x)
    return x if math.isfinite(x) else 1e300
