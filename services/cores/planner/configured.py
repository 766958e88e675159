"""The shared base of the baseline planners: a configured split (``initial``, e.g. "6P3D",
scaled to the node count) ordered at warm-up end, newcomer placement and repair.

Pure state machine like ``EvolvingPlanner`` (no I/O, no clock); what it reproduces and where it is
our reading: docs/planner.md, "Baselines".
"""

from __future__ import annotations

import math
import re

from events.catalog import (
    Event,
    PlanEvaluated,
    Split,
)
from services.cores.planner.base import NEWCOMERS, REPAIR, BaseConfig, PlannerBase


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


class BaselinePlanner(PlannerBase):
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
