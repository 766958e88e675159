"""Hardware/model profiles: the ground truth a simulated node runs on (deploy/profiles/*.toml).

Pure data: a profile fixes iteration-time coefficients (eq. 1 / eq. 2 of METHOD.md, plus a
small context term eq. 2 leaves out), noise, KV capacities, transfer and switch costs. Only
the simulated engine reads it; the planner and router learn the coefficients from events.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent.parent / "deploy" / "profiles"


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: str
    gpus_per_node: int
    block_tokens: int
    experts: int
    experts_per_token: int
    kv_bytes_per_token: int
    l1_capacity_tokens: int
    l2_capacity_tokens: int
    prefill_token_budget: int
    c0: float
    c1: float
    c2: float
    c3: float
    prefill_noise: float
    d0: float
    d1: float
    d2: float
    d_ctx: float
    t_fwd: float
    t_acc: float
    max_running: int
    decode_noise: float
    p2d_latency_s: float
    p2d_bandwidth_Bps: float
    fetch_latency_s: float
    fetch_bandwidth_Bps: float
    switch_in_place_s: float
    restart_s: float
    # [output] (optional): the live sim engine's output lengths, quantiles ``tokens_q`` at
    # probabilities ``tokens_p``; empty: engine/backends/sim/lengths.py's fitted default
    output_tokens_q: tuple[float, ...] = ()
    output_tokens_p: tuple[float, ...] = ()

    # ---- ground-truth timings (no noise; the node multiplies by its noise draw)
    def prefill_iteration_s(self, sum_t_uc: float, sum_A: float, sum_t_rst: float) -> float:
        return self.c0 + self.c1 * sum_t_uc + self.c2 * sum_A + self.c3 * sum_t_rst

    def phi(self, batch: float) -> float:
        if batch <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** (self.t_fwd * batch)

    def decode_iteration_s(self, batch: int, context_tokens: int = 0) -> float:
        return self.d0 + self.d1 * self.phi(batch) + self.d2 * batch + self.d_ctx * context_tokens

    def router_priors(self) -> dict[str, list[float]]:
        """This profile's eq. 1 / eq. 2 as a router's starting models (``prior_prefill``,
        ``prior_decode``: services/cores/router/state.py), until the planner's first fit."""
        return {"prior_prefill": [self.c0, self.c1, self.c2, self.c3],
                "prior_decode": [self.d0, self.d1, self.d2, self.d_ctx]}

    def p2d_transfer_s(self, tokens: int) -> float:
        return self.p2d_latency_s + tokens * self.kv_bytes_per_token / self.p2d_bandwidth_Bps

    def fetch_s(self, tokens: int) -> float:
        """Peer host memory -> own host -> GPU (broadcast), for ``tokens`` tokens of KV."""
        if tokens <= 0:
            return 0.0
        return self.fetch_latency_s + tokens * self.kv_bytes_per_token / self.fetch_bandwidth_Bps


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> Profile:
    """Load ``deploy/profiles/<name>.toml`` (or a path to a TOML file)."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.toml"
    if not p.exists():
        raise FileNotFoundError(f"no profile {name_or_path!r} (known: {', '.join(available_profiles())})")
    with open(p, "rb") as fh:
        d = tomllib.load(fh)
    pf, dc, kv, tr, sw, moe = d["prefill"], d["decode"], d["kv"], d["transfer"], d["switch"], d["moe"]
    out = d.get("output", {})
    prof = Profile(
        name=d["name"], model=d.get("model", ""), gpus_per_node=int(d.get("gpus_per_node", 4)),
        block_tokens=int(d.get("block_tokens", 64)),
        experts=int(moe["experts"]), experts_per_token=int(moe["experts_per_token"]),
        kv_bytes_per_token=int(kv["bytes_per_token"]),
        l1_capacity_tokens=int(kv["l1_capacity_tokens"]), l2_capacity_tokens=int(kv["l2_capacity_tokens"]),
        prefill_token_budget=int(pf["token_budget"]),
        c0=float(pf["c0"]), c1=float(pf["c1"]), c2=float(pf["c2"]), c3=float(pf["c3"]),
        prefill_noise=float(pf.get("noise", 0.0)),
        d0=float(dc["d0"]), d1=float(dc["d1"]), d2=float(dc["d2"]), d_ctx=float(dc.get("d_ctx", 0.0)),
        t_fwd=float(dc["t_fwd"]), t_acc=float(dc["t_acc"]), max_running=int(dc["max_running"]),
        decode_noise=float(dc.get("noise", 0.0)),
        p2d_latency_s=float(tr["p2d_latency_s"]), p2d_bandwidth_Bps=float(tr["p2d_bandwidth_Bps"]),
        fetch_latency_s=float(tr["fetch_latency_s"]), fetch_bandwidth_Bps=float(tr["fetch_bandwidth_Bps"]),
        switch_in_place_s=float(sw["in_place_s"]), restart_s=float(sw["restart_s"]),
        output_tokens_q=tuple(float(x) for x in out.get("tokens_q", ())),
        output_tokens_p=tuple(float(x) for x in out.get("tokens_p", ())),
    )
    if prof.output_tokens_q and (len(prof.output_tokens_q) < 2 or list(prof.output_tokens_q) != sorted(prof.output_tokens_q)
                                 or (prof.output_tokens_p and len(prof.output_tokens_p) != len(prof.output_tokens_q))):
        raise ValueError(f"profile {prof.name}: [output] tokens_q must be at least two increasing quantiles "
                         f"(and tokens_p, if given, one probability per quantile)")
    for f in ("c0", "c1", "c2", "c3", "d0", "d1", "d2"):
        v = getattr(prof, f)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"profile {prof.name}: {f} must be finite and >= 0, got {v}")
    return prof
