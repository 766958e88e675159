"""Dynamo's load-based planner (``components/src/dynamo/planner/core/load_scaling.py``, easy mode) on a fixed cluster.

Pure state machine like ``EvolvingPlanner`` (no I/O, no clock); what it reproduces and where it is
our reading: docs/planner.md, "Baselines".
"""

from __future__ import annotations

from typing import Literal

from events.catalog import Event
from events.ids import SwitchMechanism
from services.cores.planner.configured import BaselineConfig
from services.cores.planner.load_signals import LoadTrackingPlanner

# --------------------------------------------------------------------------- Dynamo
#: Dynamo planner's "easy mode" static thresholds (components/src/dynamo/planner/core/
#: load_scaling.py): prefill on queued prefill tokens / context length, decode on KV
#: utilisation (scheduled + queued decode KV) / max KV tokens. (up, down) per target.
DYNAMO_THRESHOLDS: dict[str, dict[str, tuple[float, float]]] = {
    "throughput": {"prefill": (1.0, 0.1), "decode": (1.0, 0.6)},
    "latency": {"prefill": (0.1, 0.0), "decode": (0.4, 0.1)},
}


class DynamoConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "dynamo"
    window_s: float = 5.0  # Dynamo's load_adjustment_interval (s)
    slices: int = 2
    mechanism: SwitchMechanism = "restart"
    optimization_target: Literal["throughput", "latency"] = "throughput"  # Dynamo's default
    context_length: int = 200_000  # the served model's context length (prefill ratio denominator)
    min_endpoint: int = 1  # Dynamo's min_endpoint, per phase


class DynamoPlanner(LoadTrackingPlanner):
    """Dynamo's load-based planner in disaggregated mode on a fixed cluster.

    Every ``window_s`` (Dynamo's ``load_adjustment_interval``, 5 s), unless a switch is in
    progress (Dynamo observes only while scaling): prefill asks +1 when ANY prefill node's
    mean queued new prefill tokens / ``context_length`` reaches the up threshold, -1 when ALL
    are under the down threshold (latency target: all queues empty); decode asks +1 when ANY
    decode node's KV utilisation (its running and waiting requests' KV / GPU KV capacity)
    exceeds the up threshold, -1 when ALL are under the down threshold. A fixed cluster is
    Dynamo at a full GPU budget (min = max = N): a scale-up is admitted only as an opposing
    rebalance (one phase +1 while the other asks -1), so a node moves, by restart, only then.
    """

    Config = DynamoConfig
    name = "dynamo"

    def wants(self) -> tuple[int, int, str]:
        """(prefill want, decode want, signals): each -1, 0 or +1."""
        cfg = self.cfg
        th = DYNAMO_THRESHOLDS[cfg.optimization_target]
        pre, dec = self.serving("prefill"), self.serving("decode")
        ratios = [self.mean_signal("qnew", n) / max(1, cfg.context_length) for n in pre]
        utils = [
            self.mean_signal("kv", n) / self.st.nodes[n].l1_capacity
            for n in dec
            if self.st.nodes[n].l1_capacity > 0
        ]
        p_up, p_down = th["prefill"]
        d_up, d_down = th["decode"]
        want_p = 0
        if ratios and max(ratios) >= p_up:
            want_p = 1
        elif (
            len(pre) > cfg.min_endpoint
            and ratios
            and all((r <= p_down if cfg.optimization_target == "latency" else r < p_down) for r in ratios)
        ):
            want_p = -1
        want_d = 0
        if utils and max(utils) > d_up:
            want_d = 1
        elif len(dec) > cfg.min_endpoint and utils and all(u < d_down for u in utils):
            want_d = -1
        sig = (
            f"prefill queue/ctx max {max(ratios, default=0.0):.3f} (up {p_up:g}, down {p_down:g}), "
            f"decode kv util max {max(utils, default=0.0):.2f} min {min(utils, default=0.0):.2f} "
            f"(up {d_up:g}, down {d_down:g})"
        )
        return want_p, want_d, sig

    def _decide(self, ts: float, k_end: int) -> list[Event]:
        cur = self.current_split()
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        # a node joined after warm-up: it serves decode, the prefill count stays
        ungated = self._ungated(ts, k_end, cur.prefill, "dynamo: the prefill count stays")
        if ungated:
            return ungated
        want_p, want_d, sig = self.wants()
        if any(n.ordered for n in self.st.nodes.values()):
            return [self._event(ts, k_end, reason=f"switch in progress, observing only; {sig}")]
        if want_p > 0 and want_d < 0:
            return self._one_node(ts, k_end, "prefill", f"prefill +1, decode -1; {sig}")
        if want_d > 0 and want_p < 0:
            return self._one_node(ts, k_end, "decode", f"decode +1, prefill -1; {sig}")
        if want_p > 0 or want_d > 0:
            return [self._event(ts, k_end, reason=f"held by the full GPU budget (no donor); {sig}")]
        return [self._event(ts, k_end, reason=f"no scale-up; {sig}")]
