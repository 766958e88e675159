"""Seeded synthetic agent workloads: CC-like, Putnam-like, OSWorld-like sessions.

Pure and deterministic: ``generate(name, seed, agents)`` returns the same sessions for the
same arguments on every machine. Session ``k`` draws from its own stream
``Generator(PCG64([seed, k]))``, so asking for more agents never changes the first ones.
Block hashes come from ``events.hashing``: every workload has a system prompt shared by all of
its agents (one chained prefix, the realistic source of cross-agent reuse); after it, each
agent's blocks are salted by agent, branch and context version, so they never collide.

Two ways to run a workload (METHOD.md §5):
- **fixed concurrency**: sessions have ``start_s=None``; the driver keeps ``C`` sessions
  running and starts the next one when one finishes (:class:`AgentPool` does the bookkeeping);
- **open arrivals**: ``rate_per_min`` sets ``start_s`` by a Poisson process (exponential gaps).

Defaults, and where each comes from (W = the three kv-cache-tester Claude Code traces in
``tests/fixtures/traces``, M = METHOD.md):

CC-like (:class:`CcParams`)
  system_tokens 12,000 -- W: ``tool_tokens + system_tokens`` = 10.7k-15.5k.
  first prompt 1,500 tokens (lognormal, sigma 0.8) -- W: first request minus system, 1-4k.
  steps 20-60 main-thread requests -- W: 20 (0291), 55 (0202).
  tool result median 600 tokens, sigma 1.5 (heavy tail, cap 40k) -- W: median growth 300-500
  tokens per step, with file reads of 4k-58k.
  output median 200, sigma 1.0, cap 8k -- W: p50 155-269, p90 600-2,100.
  main-thread pause median 12 s, sigma 0.9 (mean ~18 s; with the sub-agents' 3 s pauses the
  mean over all requests lands at ~13-16 s) -- M §5: CC mean pause about 13-19 s.
  sub-agents: 3% chance per step, 1-3 in parallel, 4-10 requests each, 3 s pauses, 80% waited
  -- W: trace 0291 (2 Explore agents in 20 steps, 5 and 7 requests, think 3 s).
  compaction when the context passes 120k tokens, summary median 6k -- W: 0202 rewrote 71k to
  19k (12k of it system prompt); Claude Code compacts near its context limit.
Putnam-like (:class:`PutnamParams`): one long-reasoning branch per problem.
  system 2,000, problem 400 tokens; 6-16 requests; output median 6,000 (sigma 0.5, cap 32k),
  30% of it kept in context (reasoning dropped), Lean checker feedback median 800 tokens;
  pause median 9 s, sigma 0.4 (mean ~10 s) -- M §5: Putnam decode-heavy, pauses about 10 s.
OSWorld-like (:class:`OsworldParams`): a task is an orchestrator branch that spawns 2-4
  waited agents in parallel; each agent appends one screenshot (2,500 tokens) plus ~100 tokens
  of text per step for 10-30 steps, outputs median 120 tokens, pause median 1.1 s sigma 0.25
  (mean ~1.15 s) -- M §5: OSWorld prefill-heavy, multi-agent, pauses about 1-1.4 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from events.hashing import hash_block_tokens, namespace_root
from replay.trace import Branch, Compact, End, Request, Session, Spawn, Step

_U32 = 0xFFFFFFFF


class _Ctx:
    """A growing context: chained full blocks plus a partial tail, salted by owner/version."""

    __slots__ = ("blocks", "bt", "root", "salt", "tail")

    def __init__(self, bt: int, root: int, salt: int):
        self.bt, self.root, self.salt = bt, root, salt
        self.blocks: list[int] = []
        self.tail = 0

    def copy(self, salt: int) -> _Ctx:
        c = _Ctx(self.bt, self.root, salt)
        c.blocks, c.tail = list(self.blocks), self.tail
        return c

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.bt + self.tail

    def append(self, n: int) -> None:
        total = self.tail + int(n)
        for _ in range(total // self.bt):
            parent = self.blocks[-1] if self.blocks else self.root
            i = len(self.blocks)
            self.blocks.append(hash_block_tokens(parent, [self.salt & _U32, self.salt >> 32 & _U32, i]))
        self.tail = total % self.bt

    def request(self, output: int, pause_s: float) -> Request:
        return Request(blocks=list(self.blocks), tail_tokens=self.tail, output_tokens=int(output),
                       pause_s=round(float(pause_s), 3))


def _salt(*parts: object) -> int:
    return namespace_root("/".join(map(str, parts)))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, cap: float | None = None) -> float:
    v = float(rng.lognormal(np.log(median), sigma))
    return min(v, cap) if cap is not None else v


@dataclass(frozen=True)
class CcParams:
    block_tokens: int = 64
    system_tokens: int = 12_000
    first_prompt_median: float = 1_500
    steps: tuple[int, int] = (20, 60)
    tool_median: float = 600
    tool_sigma: float = 1.5
    tool_cap: float = 40_000
    output_median: float = 200
    output_sigma: float = 1.0
    output_cap: float = 8_000
    pause_median_s: float = 12.0
    pause_sigma: float = 0.9
    subagent_p: float = 0.03
    subagents_parallel: tuple[int, int] = (1, 3)
    subagent_steps: tuple[int, int] = (4, 10)
    subagent_system_tokens: int = 11_000
    subagent_pause_s: float = 3.0
    subagent_wait_p: float = 0.8
    subagent_result_median: float = 1_500
    compact_at_tokens: int = 120_000
    summary_median: float = 6_000


@dataclass(frozen=True)
class PutnamParams:
    block_tokens: int = 64
    system_tokens: int = 2_000
    problem_tokens: float = 400
    steps: tuple[int, int] = (6, 16)
    output_median: float = 6_000
    output_sigma: float = 0.5
    output_cap: float = 32_000
    kept_output_fraction: float = 0.3
    feedback_median: float = 800
    pause_median_s: float = 9.0
    pause_sigma: float = 0.4


@dataclass(frozen=True)
class OsworldParams:
    block_tokens: int = 64
    system_tokens: int = 3_000
    task_tokens: float = 300
    agents: tuple[int, int] = (2, 4)
    steps: tuple[int, int] = (10, 30)
    screenshot_tokens: int = 2_500
    text_tokens: float = 100
    output_median: float = 120
    output_sigma: float = 0.5
    output_cap: float = 1_000
    pause_median_s: float = 1.1
    pause_sigma: float = 0.25


def _randint(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def _system(workload: str, tokens: int, bt: int, who: str = "main") -> _Ctx:
    ctx = _Ctx(bt, namespace_root(f"{workload}/{who}-system"), _salt(workload, who, "system"))
    ctx.append(tokens)
    return ctx


def cc_session(sid: str, rng: np.random.Generator, p: CcParams = CcParams()) -> Session:
    bt = p.block_tokens
    system = _system("cc", p.system_tokens, bt)
    sub_system = _system("cc", p.subagent_system_tokens, bt, "subagent")
    version = 0
    ctx = system.copy(_salt(sid, "main", version))
    ctx.append(_lognormal(rng, p.first_prompt_median, 0.8, 20_000))
    steps: list[Step] = []
    children: list[Branch] = []
    n_steps = _randint(rng, p.steps)
    pause = 0.0
    for i in range(n_steps):
        out = _lognormal(rng, p.output_median, p.output_sigma, p.output_cap)
        steps.append(ctx.request(out, pause))
        ctx.append(out)
        pause = _lognormal(rng, p.pause_median_s, p.pause_sigma, 600)
        if i < n_steps - 1 and rng.random() < p.subagent_p:
            for _ in range(_randint(rng, p.subagents_parallel)):
                cid = f"agent{len(children) + 1}"
                sub = sub_system.copy(_salt(sid, cid, 0))
                sub.append(_lognormal(rng, 800, 0.6, 8_000))
                sub_steps: list[Step] = []
                sub_pause = 0.0
                for _j in range(_randint(rng, p.subagent_steps)):
                    o = _lognormal(rng, p.output_median, p.output_sigma, p.output_cap)
                    sub_steps.append(sub.request(o, sub_pause))
                    sub.append(o + _lognormal(rng, p.tool_median, p.tool_sigma, p.tool_cap))
                    sub_pause = _lognormal(rng, p.subagent_pause_s, 0.3, 60)
                sub_steps.append(End())
                children.append(Branch(id=cid, parent="main", mode="subagent", steps=sub_steps,
                                       label="Explore"))
                steps.append(Spawn(branch=cid, wait=bool(rng.random() < p.subagent_wait_p)))
                ctx.append(_lognormal(rng, p.subagent_result_median, 0.5, 10_000))
        else:
            ctx.append(_lognormal(rng, p.tool_median, p.tool_sigma, p.tool_cap))
        if ctx.tokens > p.compact_at_tokens and i < n_steps - 1:
            version += 1
            ctx = system.copy(_salt(sid, "main", version))
            ctx.append(_lognormal(rng, p.summary_median, 0.4, 20_000))
            steps.append(Compact(blocks=list(ctx.blocks)))
    steps.append(End())
    return Session(id=sid, block_tokens=bt, source="synthetic:cc",
                   branches=[Branch(id="main", steps=steps), *children])


def putnam_session(sid: str, rng: np.random.Generator, p: PutnamParams = PutnamParams()) -> Session:
    ctx = _system("putnam", p.system_tokens, p.block_tokens).copy(_salt(sid, "main", 0))
    ctx.append(_lognormal(rng, p.problem_tokens, 0.5, 4_000))
    steps: list[Step] = []
    pause = 0.0
    for _ in range(_randint(rng, p.steps)):
        out = _lognormal(rng, p.output_median, p.output_sigma, p.output_cap)
        steps.append(ctx.request(out, pause))
        ctx.append(out * p.kept_output_fraction + _lognormal(rng, p.feedback_median, 0.6, 8_000))
        pause = _lognormal(rng, p.pause_median_s, p.pause_sigma, 120)
    steps.append(End())
    return Session(id=sid, block_tokens=p.block_tokens, source="synthetic:putnam",
                   branches=[Branch(id="main", steps=steps)])


def osworld_session(sid: str, rng: np.random.Generator, p: OsworldParams = OsworldParams()) -> Session:
    system = _system("osworld", p.system_tokens, p.block_tokens)
    plan = system.copy(_salt(sid, "main", 0))
    plan.append(_lognormal(rng, p.task_tokens, 0.4, 3_000) + p.screenshot_tokens)
    out = _lognormal(rng, 300, 0.4, 2_000)
    steps: list[Step] = [plan.request(out, 0.0)]
    children: list[Branch] = []
    for a in range(_randint(rng, p.agents)):
        cid = f"agent{a + 1}"
        ctx = system.copy(_salt(sid, cid, 0))
        ctx.append(_lognormal(rng, p.task_tokens, 0.4, 3_000))
        sub: list[Step] = []
        pause = 0.0
        for _ in range(_randint(rng, p.steps)):
            ctx.append(p.screenshot_tokens + _lognormal(rng, p.text_tokens, 0.5, 1_000))
            o = _lognormal(rng, p.output_median, p.output_sigma, p.output_cap)
            sub.append(ctx.request(o, pause))
            ctx.append(o)
            pause = _lognormal(rng, p.pause_median_s, p.pause_sigma, 30)
        sub.append(End())
        children.append(Branch(id=cid, parent="main", mode="subagent", steps=sub, label="computer-use"))
        steps.append(Spawn(branch=cid, wait=True))
    plan.append(out + 200 * len(children))
    steps += [plan.request(_lognormal(rng, 200, 0.4, 2_000),
                           _lognormal(rng, p.pause_median_s, p.pause_sigma, 30)), End()]
    return Session(id=sid, block_tokens=p.block_tokens, source="synthetic:osworld",
                   branches=[Branch(id="main", steps=steps), *children])


@dataclass(frozen=True)
class Workload:
    make: Callable[..., Session]
    params: object
    default_agents: int  # METHOD.md §5: the lowest concurrency the paper ran
    note: str = ""


WORKLOADS: dict[str, Workload] = {
    "cc": Workload(cc_session, CcParams(), 90, "Claude Code: long growing contexts, sub-agents, compactions"),
    "putnam": Workload(putnam_session, PutnamParams(), 224, "PutnamBench: one decode-heavy branch per problem"),
    "osworld": Workload(osworld_session, OsworldParams(), 128, "OSWorld: screenshots, prefill-heavy, multi-agent"),
}


def generate(name: str, seed: int = 0, agents: int | None = None, rate_per_min: float | None = None,
             **overrides: object) -> list[Session]:
    """``agents`` sessions of workload ``name``; ``overrides`` replace parameter defaults.

    With ``rate_per_min`` the sessions arrive open-loop (``start_s`` from exponential gaps,
    first at 0); without, ``start_s`` is ``None`` (a fixed-concurrency pool).
    """
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    w = WORKLOADS[name]
    params = replace(w.params, **overrides) if overrides else w.params  # type: ignore[type-var]
    n = w.default_agents if agents is None else agents
    out = []
    for k in range(n):
        rng = np.random.Generator(np.random.PCG64([seed, k]))
        out.append(w.make(f"{name}-s{seed}-{k:05d}", rng, params))
    if rate_per_min is not None:
        if rate_per_min <= 0:
            raise ValueError("rate_per_min must be positive")
        gaps = np.random.Generator(np.random.PCG64([seed, 1 << 32])).exponential(60.0 / rate_per_min, n)
        starts = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else gaps
        out = [replace_start(s, round(float(t), 3)) for s, t in zip(out, starts)]
    return out


def replace_start(s: Session, start_s: float | None) -> Session:
    import msgspec

    return msgspec.structs.replace(s, start_s=start_s)


@dataclass
class AgentPool:
    """Fixed concurrency with finished agents replaced (pure bookkeeping for a driver).

    ``start()`` returns the first ``concurrency`` sessions; ``replace(done_id)`` returns the
    next session to start when ``done_id`` finished (``None`` when the list is exhausted).
    """

    sessions: list[Session]
    concurrency: int
    _next: int = 0
    running: set[str] = field(default_factory=set)

    def start(self) -> list[Session]:
        first = self.sessions[: self.concurrency]
        self._next = len(first)
        self.running = {s.id for s in first}
        return first

    def replace(self, done_id: str) -> Session | None:
        self.running.discard(done_id)
        if self._next >= len(self.sessions):
            return None
        s = self.sessions[self._next]
        self._next += 1
        self.running.add(s.id)
        return s
