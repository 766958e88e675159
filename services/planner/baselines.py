"""Baseline planners behind the planner interface (METHOD.md §2 and §5), for comparison.

Pure state machines like ``EvolvingPlanner``: no I/O, no clock; they share its event folding,
warm-up, model fitting and ``ModelFitted`` publication (so a router in charge gets coefficients
whichever planner runs), and differ only in how they pick a split. Each starts from a
configured split (``initial``, e.g. "6P3D", scaled to the node count) ordered at warm-up end.
What each reproduces, and where it is our reading, is in docs/planner.md.

- ``StaticPlanner``: never switches (SGLang PD at a fixed split).
- ``DynamoPlanner``: every ``window_s`` (its adjustment interval) compares the interval's mean
  prefill queue per prefill node and mean decode KV utilisation (L1 used / capacity) with
  thresholds and moves one node, by restart; no decision while a switch is in progress.
- ``ArrowPlanner``: every ``window_s`` predicts prefill time from total input length (cached
  prefix counted as new work) and decode time from output length, and flips as many nodes as
  needed to match the ratio of the two loads, in place but dropping the node's KV.
"""

from __future__ import annotations

import math
import re

from events.catalog import Event, NodeHeartbeat, PlanEvaluated, Split
from events.ids import SwitchMechanism
from services.planner.base import NEWCOMERS, REPAIR, BaseConfig, PlannerBase
from services.planner.window import SliceStats


def parse_split(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", text, flags=re.IGNORECASE)
    assert m, f"a split is written like '6P3D', got {text!r}"
    return int(m.group(1)), int(m.group(2))


def scale_split(text: str, n: int) -> int:
    """Prefill nodes of split ``text`` scaled to ``n`` nodes (rounded half up, 1..n-1)."""
    p, d = parse_split(text)
    return min(max(1, math.floor(n * p / max(1, p + d) + 0.5)), max(1, n - 1))


class BaselineConfig(BaseConfig, kw_only=True, forbid_unknown_fields=True):
    initial: str = "6P3D"


class _Baseline(PlannerBase):
    Config = BaselineConfig

    def _event(self, ts: float, k_end: int, **kw) -> PlanEvaluated:
        cfg = self.cfg
        return PlanEvaluated(
            ts=ts,
            src=self.name,
            window_start=(k_end - cfg.slices) * cfg.slice_s,
            window_end=k_end * cfg.slice_s,
            current=self.current_split(),
            planner=self.name,
            **kw,
        )

    def _switch_to(self, ts: float, k_end: int, P: int, reason: str) -> list[Event]:
        N = len(self.st.nodes)
        chosen = Split(prefill=P, decode=N - P)
        return [
            self._event(ts, k_end, chosen=chosen, reason=reason),
            *self.order(self.nodes_to_switch(P), ts, reason),
        ]

    def _on_warmup_end(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        return self._switch_to(
            ts, k_end, scale_split(self.cfg.initial, N), f"initial split {self.cfg.initial}"
        )

    def _ungated(self, ts: float, k_end: int, target_prefill: int, why: str) -> list[Event] | None:
        """The NEWCOMERS placement (toward ``target_prefill`` prefill nodes, moving no assigned
        node) or the 0P/0D REPAIR (one node) when the guard state asks for one; None when the
        planner's own rule decides."""
        path = self.guard()
        if path == NEWCOMERS:
            chosen, reason, orders = self.place_newcomers(ts, target_prefill, why)
        elif path == REPAIR:
            chosen, reason, orders = self.repair(ts)
        else:
            return None
        return [self._event(ts, k_end, chosen=chosen, reason=reason), *orders]


class StaticConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "static"


class StaticPlanner(_Baseline):
    Config = StaticConfig
    name = "static"

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        ungated = None
        if N >= 2:  # a node joined after warm-up: toward the configured ratio
            ungated = self._ungated(ts, k_end, scale_split(self.cfg.initial, N), f"static {self.cfg.initial}")
        return ungated or [self._event(ts, k_end, reason="static: never switches")]


class DynamoConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "dynamo"
    window_s: float = 60.0
    slices: int = 2
    mechanism: SwitchMechanism = "restart"
    prefill_queue_up: float = 5.0  # queued requests per prefill node
    prefill_queue_down: float = 0.2
    decode_kv_up: float = 0.9  # L1 used / capacity on decode nodes
    decode_kv_down: float = 0.5


class DynamoPlanner(_Baseline):
    Config = DynamoConfig
    name = "dynamo"

    def apply(self, event: Event) -> list[Event]:
        out = super().apply(event)
        if isinstance(event, NodeHeartbeat) and event.node in self.st.nodes:
            n, x = self.st.nodes[event.node], self.st.extra
            if n.target == "prefill":
                x["pq_sum"] = x.get("pq_sum", 0.0) + event.queued
                x["pq_n"] = x.get("pq_n", 0.0) + 1
            elif n.target == "decode" and n.l1_capacity > 0:
                x["kv_sum"] = x.get("kv_sum", 0.0) + event.l1_used_tokens / n.l1_capacity
                x["kv_n"] = x.get("kv_n", 0.0) + 1
        return out

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        cfg, x = self.cfg, self.st.extra
        queue = x.get("pq_sum", 0.0) / x["pq_n"] if x.get("pq_n") else 0.0
        kv = x.get("kv_sum", 0.0) / x["kv_n"] if x.get("kv_n") else 0.0
        self.st.extra = {}
        cur = self.current_split()
        N = len(self.st.nodes)
        signals = f"prefill queue {queue:.2f}/node, decode kv {kv:.2f}"
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        # a node joined after warm-up: it serves decode, the prefill count stays
        ungated = self._ungated(ts, k_end, cur.prefill, "dynamo: the prefill count stays")
        if ungated:
            return ungated
        if any(n.ordered for n in self.st.nodes.values()):
            return [self._event(ts, k_end, reason=f"switch in progress; {signals}")]
        want_d = 1 if kv > cfg.decode_kv_up else (-1 if kv < cfg.decode_kv_down else 0)
        want_p = 1 if queue > cfg.prefill_queue_up else (-1 if queue < cfg.prefill_queue_down else 0)
        # a fixed cluster: scaling one phase up takes a node from the other; decode first when
        # both ask (KV exhaustion preempts running requests)
        if want_d > 0 or (want_p < 0 and want_d == 0):
            P = cur.prefill - 1
        elif want_p > 0 or (want_d < 0 and want_p == 0):
            P = cur.prefill + 1
        else:
            return [self._event(ts, k_end, reason=f"within thresholds; {signals}")]
        if not 1 <= P <= N - 1:
            return [self._event(ts, k_end, reason=f"at the limit; {signals}")]
        return self._switch_to(
            ts, k_end, P, f"one node toward {'decode' if P < cur.prefill else 'prefill'}; {signals}"
        )


class ArrowConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "arrow"
    window_s: float = 60.0
    slices: int = 2
    mechanism: SwitchMechanism = "in_place_drop_kv"


class ArrowPlanner(_Baseline):
    Config = ArrowConfig
    name = "arrow"

    def predicted_prefill_s(self, stats: SliceStats) -> float:
        """Node-seconds of prefill Arrow predicts for the requests submitted in ``stats``: the
        whole prompt counted as new tokens (no cached prefix), eq. 1 with t_c = 0, averaged
        over the nodes' fitted models."""
        models = [self.prefill_model(n) for n in sorted(self.st.nodes)] or [self.prefill_model("")]
        c = [sum(m.coefficients[i] for m in models) / len(models) for i in range(4)]
        budget = sum(n.token_budget for n in self.st.nodes.values()) / max(1, len(self.st.nodes)) or 16384
        return c[0] * stats.sum_prompt / budget + c[1] * stats.sum_prompt + c[2] * stats.sum_prompt_A

    def predicted_decode_s(self, stats: SliceStats) -> float:
        """Node-seconds of decode for the requests finished in ``stats`` at the interval's mean
        decode batch per node."""
        if stats.finished == 0:
            return 0.0
        B = stats.dec_batch / stats.dec_iters if stats.dec_iters else 1.0
        t_acc = stats.dec_accepted / stats.dec_batch if stats.dec_batch else 1.0
        t_fwd = stats.dec_fwd / stats.dec_batch if stats.dec_batch else 1.0
        models = [self.decode_model(n) for n in sorted(self.st.nodes)] or [self.decode_model("")]
        per_iter = sum(m.iteration_s(B, t_fwd) for m in models) / len(models)
        iters = stats.sum_t_out / max(1e-3, t_acc)
        return iters * per_iter / max(1.0, B)

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        if N < 2:
            return [self._event(ts, k_end, reason=f"{N} node(s): nothing to split")]
        stats = SliceStats()
        for s in self.window_slices(k_end):
            stats.add(s)
        pre, dec = self.predicted_prefill_s(stats), self.predicted_decode_s(stats)
        cur = self.current_split()
        if pre + dec <= 0:
            ungated = self._ungated(ts, k_end, scale_split(self.cfg.initial, N), f"arrow {self.cfg.initial}")
            return ungated or [self._event(ts, k_end, reason="no load in the interval")]
        P = min(max(1, math.floor(N * pre / (pre + dec) + 0.5)), N - 1)
        why = f"predicted prefill {pre:.1f} node-s vs decode {dec:.1f} node-s"
        # newcomers are placed toward the predicted ratio, an emptied side gets one node; the
        # next interval's re-plan moves the rest
        ungated = self._ungated(ts, k_end, P, f"arrow toward {P}P{N - P}D; {why}")
        if ungated:
            return ungated
        if P == cur.prefill:
            return [self._event(ts, k_end, reason=f"balanced; {why}")]
        return self._switch_to(ts, k_end, P, f"re-plan to {P}P{N - P}D; {why}")
