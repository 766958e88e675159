"""Synthetic cluster for planner tests and ``evolving bench planner``: a seeded generator of
the events a planner consumes, closed over the planner's switch orders.

Not a simulator: one sampled prefill and one sampled decode iteration per node and second,
durations from known ("true") eq. 1/eq. 2 models with multiplicative noise, and requests that
arrive, are routed and finish in the same instant. Enough to test what the planner infers from
the stream. Deterministic for a given seed (numpy ``default_rng``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from events.catalog import (
    Event,
    IterationDone,
    NodeHeartbeat,
    NodeRegistered,
    RequestFinished,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
    SwitchRole,
    Tick,
)
from services.cores.costmodel import DecodeModel, PrefillModel, prefill_A

TRUE_PREFILL = PrefillModel(c0=0.012, c1=3.5e-5, c2=1.2e-10, c3=2.5e-6)
TRUE_DECODE = DecodeModel(d0=0.011, d1=0.016, d2=3.5e-4, k=8, E=256)


@dataclass(frozen=True)
class Mix:
    """One stretch of workload: mean work per request and load."""

    duration_s: float
    t_uc: float = 500.0
    t_c: float = 20_000.0
    t_out: float = 2000.0
    arrivals_rps: float = 1.0
    q: float = 64.0  # requests in decode, whole cluster
    t_acc: float = 1.7
    rst_share: float = 0.1  # share of cached tokens restored from host
    prefill_queued: int = 0  # per prefill node; > 0: iterations are filled near the budget
    decode_kv_util: float = 0.5  # L1 used / capacity on decode nodes


@dataclass
class Scenario:
    n_nodes: int = 9
    mixes: list[Mix] = field(default_factory=list)
    seed: int = 0
    tick_s: float = 10.0
    noise: float = 0.05
    t_fwd: float = 2.0
    token_budget: int = 16384
    l1_capacity: int = 1_000_000
    heartbeat_s: float = 10.0
    ack_delay_s: float = 1.0
    prefill: PrefillModel = TRUE_PREFILL
    decode: DecodeModel = TRUE_DECODE


@dataclass
class Trace:
    inputs: list[Event] = field(default_factory=list)
    outputs: list[Event] = field(default_factory=list)

    def of_type(self, name: str) -> list[Event]:
        return [e for e in self.outputs if type(e).__name__ == name]


def node_ids(n: int) -> list[str]:
    width = max(2, len(str(n - 1)))
    return [f"n{i:0{width}d}" for i in range(n)]


def drive(planner, sc: Scenario) -> Trace:
    """Feed the scenario to ``planner`` second by second; switch orders are acknowledged
    (``RoleSwitched``) ``ack_delay_s`` later. Returns every input and output event."""
    rng = np.random.default_rng(sc.seed)
    nodes = node_ids(sc.n_nodes)
    role = {n: "collocated" for n in nodes}
    trace = Trace()
    pending: list[tuple[float, str, str]] = []
    rr = [0]

    def feed(ev: Event) -> None:
        trace.inputs.append(ev)
        for out in planner.apply(ev):
            trace.outputs.append(out)
            if isinstance(out, SwitchRole):
                pending.append((ev.ts + sc.ack_delay_s, out.node, out.to_role))

    for n in nodes:
        feed(
            NodeRegistered(
                ts=0.0,
                src="engine",
                node=n,
                role="collocated",
                prefill_token_budget=sc.token_budget,
                t_fwd=sc.t_fwd,
                l1_capacity_tokens=sc.l1_capacity,
            )
        )
    t0 = 0.0
    req = 0
    for mix in sc.mixes:
        for sec in range(int(mix.duration_s)):
            t = t0 + sec
            for due, n, r in [p for p in pending if p[0] <= t]:
                pending.remove((due, n, r))
                role[n] = r
                feed(RoleSwitched(ts=t, src="engine", node=n, role=r, duration_s=0.5))
            pre = [n for n in nodes if role[n] in ("prefill", "collocated")]
            dec = [n for n in nodes if role[n] in ("decode", "collocated")]
            for i in range(int(rng.poisson(mix.arrivals_rps))):
                ts = t + (i + 1) / 1000.0
                t_uc = int(mix.t_uc * rng.uniform(0.5, 1.5))
                t_c = int(mix.t_c * rng.uniform(0.5, 1.5))
                t_out = max(1, int(mix.t_out * rng.uniform(0.5, 1.5)))
                rid = f"r{req}"
                req += 1
                feed(
                    RequestSubmitted(
                        # open arrivals: each request its own branch (no agent cycles back: the
                        # planner's queueing prediction is the open M/G/c one)
                        ts=ts, src="gw", request=rid, branch=rid, prompt_tokens=t_uc + t_c, max_tokens=t_out
                    )
                )
                if pre and dec:
                    p, d = pre[rr[0] % len(pre)], dec[rr[0] % len(dec)]
                    rr[0] += 1
                    feed(
                        RouteDecided(
                            ts=ts,
                            src="router",
                            request=rid,
                            prefill_node=p,
                            decode_node=d,
                            t_c=t_c,
                            t_uc=t_uc,
                            policy="synthetic",
                        )
                    )
                    feed(RequestFinished(ts=ts, src="engine", request=rid, node=d, output_tokens=t_out))
            for n in pre:
                if mix.prefill_queued > 0:  # a queue waits: the scheduler fills the iteration
                    m = max(1, int(sc.token_budget * rng.uniform(0.7, 1.0) / max(1.0, mix.t_uc)))
                    uc = np.full(m, max(1, min(sc.token_budget // m, int(mix.t_uc))))
                else:
                    m = int(rng.integers(1, 5))
                    uc = np.minimum(
                        sc.token_budget // m, (mix.t_uc * rng.uniform(0.3, 2.0, m)).astype(int) + 1
                    )
                c = (mix.t_c * rng.uniform(0.0, 2.0, m)).astype(int)
                rst = (c * mix.rst_share * rng.uniform(0.5, 1.5, m)).astype(int)
                A = float(sum(prefill_A(float(u), float(cc)) for u, cc in zip(uc, c)))
                dur = sc.prefill.iteration_s(int(uc.sum()), A, int(rst.sum())) * (
                    1 + sc.noise * rng.uniform(-1, 1)
                )
                feed(
                    IterationDone(
                        ts=t + 0.5,
                        src="engine",
                        node=n,
                        phase="prefill",
                        duration_s=dur,
                        batch=m,
                        sum_t_uc=int(uc.sum()),
                        sum_A=A,
                        sum_t_rst=int(rst.sum()),
                        sum_t_c=int(c.sum()),
                        queued=mix.prefill_queued,
                    )
                )
            for n in dec:
                b = max(1, round(mix.q / len(dec) * rng.uniform(0.5, 1.5)))
                dur = sc.decode.iteration_s(b, sc.t_fwd) * (1 + sc.noise * rng.uniform(-1, 1))
                acc = round(b * mix.t_acc * rng.uniform(0.9, 1.1))
                feed(
                    IterationDone(
                        ts=t + 0.6,
                        src="engine",
                        node=n,
                        phase="decode",
                        duration_s=dur,
                        batch=b,
                        t_fwd=sc.t_fwd,
                        accepted_tokens=acc,
                    )
                )
            if sec % int(sc.heartbeat_s) == 0:
                for n in nodes:
                    is_dec = role[n] == "decode"
                    feed(
                        NodeHeartbeat(
                            ts=t + 0.7,
                            src="engine",
                            node=n,
                            role=role[n],
                            running=int(mix.q / max(1, len(dec))) if is_dec else 1,
                            queued=0 if is_dec else mix.prefill_queued,
                            l1_used_tokens=int(sc.l1_capacity * (mix.decode_kv_util if is_dec else 0.3)),
                        )
                    )
            if sec % int(sc.tick_s) == 0:
                feed(Tick(ts=t + 0.9, src="clock"))
        t0 += int(mix.duration_s)
    return trace
