"""Static split: never switches (SGLang PD at a fixed split).

Pure state machine like ``EvolvingPlanner`` (no I/O, no clock); what it reproduces and where it is
our reading: docs/planner.md, "Baselines".
"""

from __future__ import annotations

from events.catalog import Event
from services.cores.planner.configured import BaselineConfig, BaselinePlanner, scale_split


class StaticConfig(BaselineConfig, kw_only=True, forbid_unknown_fields=True):
    name: str = "static"


class StaticPlanner(BaselinePlanner):
    Config = StaticConfig
    name = "static"

    def _on_tick(self, ts: float, k_end: int) -> list[Event]:
        N = len(self.st.nodes)
        ungated = None
        if N >= 2:  # a node joined after warm-up: toward the configured ratio
            ungated = self._ungated(ts, k_end, scale_split(self.cfg.initial, N), f"static {self.cfg.initial}")
        return ungated or [self._event(ts, k_end, reason="static: never switches")]
