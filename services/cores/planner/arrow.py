"""Arrow's adaptive instance scheduling (arXiv 2505.11916), as we read it.

Pure state machine like ``EvolvingPlanner`` (no I/O, no clock); what it reproduces and where it is
our reading: docs/planner.md, "Baselines".
"""

from __future__ import annotations

import math

from events.catalog import Event
from events.ids import SwitchMechanism
from services.cores.planner.configured import BaselineConfig
from services.cores.planner.load_signals import LoadTrackingPlanner
from services.cores.planner.window import SliceStats


# --------------------------------------------------------------------------- Arrow
class ArrowConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "arrow"
    window_s: float = 10.0  # how often the instance scheduler looks (our choice)
    slices: int = 2
    mechanism: SwitchMechanism = "in_place_drop_kv"
    ttft_slo_s: float = 5.0
    tpot_slo_s: float = 0.05


class ArrowPlanner(LoadTrackingPlanner):
    """Arrow's adaptive instance scheduling (Wu et al., arXiv 2505.11916), as we read it.

    Every ``window_s``: the predicted TTFT of a new request is the best prefill node's
    queued prompts plus the mean prompt, costed from *total input length* (eq. 1 with
    t_c = 0: cached prefix counted as new work, METHOD §2.2); the decode TPOT is the
    interval's measured decode seconds per output token. Predicted TTFT over ``ttft_slo_s``
    flips one decode node to prefill if the remaining decode nodes keep TPOT within
    ``tpot_slo_s`` (TPOT x D/(D-1)); TPOT over the SLO flips one prefill node to decode if
    the remaining prefill nodes keep the predicted TTFT within its SLO. Flips are in place
    and drop the node's KV; no cooldown (Arrow reacts at once: the paper's 34 switches).
    """

    Config = ArrowConfig
    name = "arrow"

    def _cost(self, tokens: float, pairs: float) -> float:
        """Node-seconds eq. 1 charges ``tokens`` new tokens with ``pairs`` query-key pairs,
        averaged over the nodes' fitted models."""
        models = [self.prefill_model(n) for n in sorted(self.st.nodes)] or [self.prefill_model("")]
        c = [sum(m.coefficients[i] for m in models) / len(models) for i in range(4)]
        budget = sum(n.token_budget for n in self.st.nodes.values()) / max(1, len(self.st.nodes)) or 16384
        return c[0] * math.ceil(max(1.0, tokens) / budget) + c[1] * tokens + c[2] * pairs

    def predicted_prefill_s(self, stats: SliceStats) -> float:
        """Node-seconds of prefill Arrow predicts for the requests submitted in ``stats``:
        the whole prompt counted as new tokens (t_c = 0)."""
        return self._cost(stats.sum_prompt, stats.sum_prompt_A)

    def predicted_ttft_s(self, k_end: int, extra_share: float = 1.0) -> float | None:
        """Predicted TTFT of the interval's mean request on the best prefill node, its queue
        scaled by ``extra_share`` (P/(P-1) if a prefill node left). None without prompts."""
        pre = self.serving("prefill")
        stats = SliceStats()
        for s in self.window_slices(k_end):
            stats.add(s)
        n_sub = stats.submitted
        if not pre or n_sub == 0:
            return None
        mean_prompt = stats.sum_prompt / n_sub
        own = self._cost(mean_prompt, mean_prompt * (mean_prompt + 1) / 2)
        waits = [
            self._cost(self.mean_signal("qtot", n) * extra_share, self.mean_signal("qpairs", n) * extra_share)
            if self.mean_signal("qtot", n) > 0
            else 0.0
            for n in pre
        ]
        return min(waits) + own

    def _decide(self, ts: float, k_end: int) -> list[Event]:
        cfg = self.cfg
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        cur = self.current_split()
        ungated = self._ungated(ts, k_end, max(1, cur.prefill), "arrow: the prefill count stays")
        if ungated:
            return ungated
        P, D = cur.prefill, cur.decode
        ttft = self.predicted_ttft_s(k_end)
        tpot = self.interval_tpot_s()
        sig = (
            f"predicted ttft {'-' if ttft is None else f'{ttft:.2f}'} s (slo {cfg.ttft_slo_s:g}), "
            f"tpot {'-' if tpot is None else f'{1000 * tpot:.1f}'} ms (slo {1000 * cfg.tpot_slo_s:g})"
        )
        if ttft is not None and ttft > cfg.ttft_slo_s and D > 1:
            if tpot is None or tpot * D / (D - 1) <= cfg.tpot_slo_s:
                return self._one_node(ts, k_end, "prefill", f"ttft over slo; {sig}")
            return [self._event(ts, k_end, reason=f"ttft over slo, no decode node to spare; {sig}")]
        if tpot is not None and tpot > cfg.tpot_slo_s and P > 1:
            after = self.predicted_ttft_s(k_end, P / (P - 1))
            if after is None or after <= cfg.ttft_slo_s:
                return self._one_node(ts, k_end, "decode", f"tpot over slo; {sig}")
            return [self._event(ts, k_end, reason=f"tpot over slo, no prefill node to spare; {sig}")]
        return [self._event(ts, k_end, reason=f"within slo; {sig}")]
