"""``evolving bench router``: decision time of a router against baselines, side by side in one run.

The stream (per cluster size): ``prefill`` prefill nodes and ``prefill // 2`` decode nodes;
``agents`` branches, each with a context of ``prompt_blocks - new_blocks`` blocks stored (L1 and
L2) on one prefill node (round robin over agents). Every request of an agent is that context
plus ``new_blocks`` fresh blocks (a ``prompt_blocks``-block prompt, 1,000 by default). After
each decision the request's lifecycle is fed back (start, first token, finish, its blocks
stored on the chosen prefill node, the agent's context grows by the new blocks, trimmed to
the prompt size) once ``inflight`` decisions per prefill node are outstanding, so queues stay
at a realistic depth. Only ``apply(RequestSubmitted)`` is timed: the fold of the submission,
the decision and the router's own commit of it. Each router runs the same request sequence;
routers alternate over ``repeats`` rounds and each keeps its best round (least p50).

Two times per decision: ``apply`` (everything the router does for the submission: its
state and embedded directory fold the submission and then its own decision; ``decisions/s``,
``p50``, ``p99``) and ``decide`` (the choice alone: directory lookup, per-node scores, fetch
plan, the ``RouteDecided``). Figures are CPU time (``time.thread_time``): on a shared machine
wall-clock percentiles mostly measure preemption by other processes (a 4 ms scheduler slice
lands on any 1 % of decisions). Wall-clock p50/p99 are printed beside them.
"""

from __future__ import annotations

import gc
import time
from collections import deque

from events.catalog import (
    BranchOpened,
    Event,
    FirstToken,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.plugins import load_router

BLOCK_TOKENS = 64


def _setup(prefill: int, agents: int, context_blocks: int) -> tuple[list[Event], list[list[int]]]:
    decode = max(1, prefill // 2)
    evs: list[Event] = [NodeRegistered(ts=0.0, node=f"p{i:02d}", role="prefill") for i in range(prefill)]
    evs += [NodeRegistered(ts=0.0, node=f"d{i:02d}", role="decode") for i in range(decode)]
    contexts = []
    for a in range(agents):
        ctx = list(range((a + 1) << 32, ((a + 1) << 32) + context_blocks))
        contexts.append(ctx)
        evs.append(BranchOpened(ts=0.0, branch=f"a{a}"))
        node = f"p{a % prefill:02d}"
        evs.append(KvStored(ts=0.0, node=node, tier="L1", blocks=ctx, write_through=True))  # L1 and L2
    return evs, contexts


#: Named configurations usable as baselines: ``evolving-full`` is our router scoring every
#: prefill node (no candidate pruning), i.e. the decision path before the router pruned candidates.
ALIASES = {"evolving-full": "evolving:full_scoring_max_nodes=1000000000"}


def make_router(spec: str):
    """A router from ``name`` or ``name:key=value+key=value`` (numbers parsed as such)."""
    spec = ALIASES.get(spec, spec)
    name, _, rest = spec.partition(":")
    kw: dict = {}
    for item in filter(None, rest.split("+")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bench router: bad parameter {item!r} in {spec!r} (want key=value)")
        try:
            kw[key] = int(value)
        except ValueError:
            try:
                kw[key] = float(value)
            except ValueError:
                kw[key] = value
    return load_router(name)(block_tokens=BLOCK_TOKENS, **kw)


def _run_one(name: str, prefill: int, requests: int, agents: int, prompt_blocks: int, new_blocks: int,
             inflight: int) -> tuple[list[float], list[float], list[float]]:
    router = make_router(name)
    decide_cpu: list[float] = []
    inner = router.decide

    def timed_decide(*args, **kw):  # the decision alone: lookup, scores, RouteDecided
        c0 = time.thread_time()
        rd = inner(*args, **kw)
        decide_cpu.append(time.thread_time() - c0)
        return rd

    router.decide = timed_decide
    setup, contexts = _setup(prefill, agents, prompt_blocks - new_blocks)
    for ev in setup:
        router.apply(ev)
    outstanding: deque[RouteDecided] = deque()
    times: list[float] = []
    cpu: list[float] = []
    fresh = 1 << 60
    ts = 1.0
    gc.collect()
    gc.disable()
    try:
        for i in range(requests):
            a = i % agents
            new = list(range(fresh, fresh + new_blocks))
            fresh += new_blocks
            blocks = contexts[a] + new
            ev = RequestSubmitted(ts=ts, request=f"r{i}", branch=f"a{a}", blocks=blocks,
                                  prompt_tokens=len(blocks) * BLOCK_TOKENS, max_tokens=256,
                                  block_tokens=BLOCK_TOKENS)
            c0, t0 = time.thread_time(), time.perf_counter()
            out = router.apply(ev)
            t1, c1 = time.perf_counter(), time.thread_time()
            times.append(t1 - t0)
            cpu.append(c1 - c0)
            rd = next(o for o in out if isinstance(o, RouteDecided))
            outstanding.append(rd)
            contexts[a] = blocks[len(blocks) - (prompt_blocks - new_blocks):]
            ts += 0.001
            while len(outstanding) > inflight * prefill:
                done = outstanding.popleft()
                for fin in (
                    RequestStarted(ts=ts, request=done.request, node=done.prefill_node, phase="prefill"),
                    KvStored(ts=ts, node=done.prefill_node, tier="L2", blocks=blocks[-new_blocks:],
                             request=done.request),
                    FirstToken(ts=ts, request=done.request, node=done.prefill_node),
                    RequestFinished(ts=ts, request=done.request, node=done.decode_node, output_tokens=256),
                ):
                    router.apply(fin)
    finally:
        gc.enable()
    return times, cpu, decide_cpu


def _pct(srt: list[float], q: float) -> float:
    return srt[min(len(srt) - 1, int(len(srt) * q))] * 1e3


def _figures(wall: list[float], cpu: list[float], decide: list[float]) -> dict[str, float]:
    w, c, d = sorted(wall), sorted(cpu), sorted(decide)
    return {
        "decide_p50_ms": _pct(d, 0.5),
        "decide_p99_ms": _pct(d, 0.99),
        "decisions": len(w),
        "decisions_per_s": len(c) / sum(c),
        "p50_ms": _pct(c, 0.5),
        "p99_ms": _pct(c, 0.99),
        "max_ms": c[-1] * 1e3,
        "wall_decisions_per_s": len(w) / sum(w),
        "wall_p50_ms": _pct(w, 0.5),
        "wall_p99_ms": _pct(w, 0.99),
    }


def run(router: str = "evolving", baselines: tuple[str, ...] = ("evolving-full", "round_robin", "cache_aware"),
        sizes: tuple[int, ...] = (9, 64), requests: int = 1500, agents: int = 48, prompt_blocks: int = 1000,
        new_blocks: int = 100, inflight: int = 3, repeats: int = 3) -> dict:
    names = (router, *baselines)
    result: dict = {"router": router, "baselines": list(baselines), "prompt_blocks": prompt_blocks,
                    "requests": requests, "agents": agents, "repeats": repeats, "sizes": {}}
    for size in sizes:
        best: dict[str, dict[str, float]] = {}
        for _ in range(repeats):
            for name in names:
                fig = _figures(*_run_one(name, size, requests, agents, prompt_blocks, new_blocks, inflight))
                if name not in best or fig["p50_ms"] < best[name]["p50_ms"]:
                    best[name] = fig
        entry = {"prefill_nodes": size, "decode_nodes": max(1, size // 2), "routers": best, "ratios": {}}
        for b in baselines:
            entry["ratios"][b] = {
                "p50": best[router]["p50_ms"] / best[b]["p50_ms"],
                "p99": best[router]["p99_ms"] / best[b]["p99_ms"],
                "decisions_per_s": best[router]["decisions_per_s"] / best[b]["decisions_per_s"],
                "decide_p99": best[router]["decide_p99_ms"] / best[b]["decide_p99_ms"],
            }
        result["sizes"][str(size)] = entry
    return result


def format_report(result: dict) -> str:
    head = (f"router bench: {result['prompt_blocks']}-block prompts, {result['requests']} decisions per run, "
            f"best of {result['repeats']} alternating runs; CPU time (thread), wall time beside")
    lines = [head]
    for size, entry in result["sizes"].items():
        lines.append(f"\n{size} prefill + {entry['decode_nodes']} decode nodes")
        lines.append(f"  {'router':<14}{'decisions/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
                     f"{'decide p50':>11}{'decide p99':>11}{'wall p50':>9}{'wall p99':>9}")
        for name, fig in entry["routers"].items():
            lines.append(f"  {name:<14}{fig['decisions_per_s']:>12.0f}{fig['p50_ms']:>9.3f}"
                         f"{fig['p99_ms']:>9.3f}{fig['max_ms']:>9.3f}{fig['decide_p50_ms']:>11.3f}"
                         f"{fig['decide_p99_ms']:>11.3f}{fig['wall_p50_ms']:>9.3f}{fig['wall_p99_ms']:>9.3f}")
        for b, ratio in entry["ratios"].items():
            lines.append(f"  {result['router']} / {b}: p50 x{ratio['p50']:.2f}, p99 x{ratio['p99']:.2f}, "
                         f"decisions/s x{ratio['decisions_per_s']:.2f}, decide p99 x{ratio['decide_p99']:.2f}")
    return "\n".join(lines)
