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

Defaults, and where each comes from (docs/traces.md §4 has the tables; M = METHOD.md):

CC-like (:class:`CcParams`, :func:`cc_session`): **fitted** to 100 real Claude Code sessions by
  ``evolving trace fit deploy/traces/calibration-100 -o replay/traces/cc_params.json``
  (``replay.traces.fit``); ``WORKLOADS["cc"]`` loads that file. Distributions are quantile functions
  (:class:`Quantiles`); the dataclass defaults are priors used only where the file is silent.
  Requests carry ``pause_kind`` (tool / human) so ``replay.traces.pacing`` can replay them as agents.
Putnam-like (:class:`PutnamParams`): one long-reasoning branch per problem.
  system 2,000, problem 400 tokens; 6-16 requests; output median 4,000 (sigma 0.5, cap 32k),
  the whole response kept in context, Lean checker feedback median 800 tokens; pause median
  9 s, sigma 0.4 (mean ~10 s) -- M §5: Putnam decode-heavy, pauses about 10 s, best static
  split 2P7D (output median and kept share calibrated to it in the simulator).
OSWorld-like (:class:`OsworldParams`): a task is an orchestrator branch that spawns 2-4
  waited agents in parallel; each agent appends one screenshot (2,500 tokens) plus ~100 tokens
  of text per step for 10-30 steps, outputs median 120 tokens, pause median 1.1 s sigma 0.25
  (mean ~1.15 s) -- M §5: OSWorld prefill-heavy, multi-agent, pauses about 1-1.4 s.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property, lru_cache
from pathlib import Path

import msgspec
import numpy as np

from events.hashing import namespace_root
from replay.traces._chain import salted_chain
from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, Step


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
        # block i's tokens are [salt & U32, salt >> 32 & U32, i], chained from the last block
        # (events.hashing.salted_chain hashes exactly as hash_block_tokens would, ~5x faster;
        # replay/traces/_chain.pyx is the same chain compiled, the generators' main cost before)
        total = self.tail + int(n)
        blocks = self.blocks
        blocks += salted_chain(blocks[-1] if blocks else self.root, self.salt, len(blocks), total // self.bt)
        self.tail = total % self.bt

    def request(self, output: float, pause_s: float, pause_kind: str = "tool") -> Request:
        return Request(blocks=list(self.blocks), tail_tokens=self.tail, output_tokens=int(output),
                       pause_s=round(float(pause_s), 3), pause_kind=pause_kind)  # type: ignore[arg-type]


def _salt(*parts: object) -> int:
    return namespace_root("/".join(map(str, parts)))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, cap: float | None = None) -> float:
    v = float(rng.lognormal(np.log(median), sigma))
    return min(v, cap) if cap is not None else v


@dataclass(frozen=True)
class LogNormal:
    """A clipped lognormal with an atom at 0: with probability ``zero_p`` the draw is 0, else
    ``exp(N(log median, sigma))`` clipped to ``[lo, hi]`` (rounded when ``integer``)."""

    median: float
    sigma: float
    lo: float = 0.0
    hi: float = float("inf")
    zero_p: float = 0.0
    integer: bool = False

    def draw(self, rng: np.random.Generator) -> float:
        if self.zero_p and rng.random() < self.zero_p:
            return 0.0
        v = min(max(float(rng.lognormal(self._log_median, self.sigma)), self.lo), self.hi)
        return float(round(v)) if self.integer else v

    @cached_property
    def _log_median(self) -> np.float64:  # computed once (the same np.log value as per draw)
        return np.log(self.median)

    @classmethod
    def fit(cls, values: Sequence[float], integer: bool = False) -> LogNormal:
        """Maximum likelihood on the log of the positive values; ``zero_p`` = share of values <= 0;
        clipped to the observed positive range."""
        a = np.asarray(values, dtype=float)
        pos = a[a > 0]
        if len(pos) < 2:
            raise ValueError("a lognormal fit needs at least two positive values")
        logs = np.log(pos)
        return cls(median=_sig(float(np.exp(logs.mean()))), sigma=_sig(float(logs.std())),
                   lo=_sig(float(pos.min())), hi=_sig(float(pos.max())),
                   zero_p=_sig(float(1 - len(pos) / len(a))), integer=integer)


@dataclass(frozen=True)
class Quantiles:
    """An empirical distribution: quantiles ``q`` at probabilities ``p`` (increasing from 0 to 1;
    empty = evenly spaced). A draw takes ``u ~ U(0, 1)`` and interpolates between the two
    neighbouring quantiles, log-linearly when both are positive (heavy tails), else linearly;
    rounded when ``integer``. The fit is the sample quantiles (``numpy.quantile``, linear)."""

    q: tuple[float, ...]
    p: tuple[float, ...] = ()
    integer: bool = False

    def draw(self, rng: np.random.Generator) -> float:
        return self.at(float(rng.random()))

    def at(self, u: float) -> float:
        # The probabilities and the quantiles' logs are computed once (_table); bisect_right on
        # the sorted probabilities is np.searchsorted(side="right"), and the arithmetic is the
        # same float64 operations in the same order, so every draw is bit-identical to the
        # per-draw numpy version (tests/unit/replay/traces/test_workloads.py pins it).
        probs, logs = self._table
        q = self.q
        u = min(max(u, 0.0), 1.0)
        i = min(max(bisect_right(probs, u) - 1, 0), len(q) - 2)
        span = probs[i + 1] - probs[i]
        f = (u - probs[i]) / span if span > 0 else 0.0
        a, b = q[i], q[i + 1]
        if a > 0 and b > 0:
            la = logs[i]
            v = float(np.exp(la + f * (logs[i + 1] - la)))
        else:
            v = a + f * (b - a)
        return float(round(v)) if self.integer else v

    @cached_property
    def _table(self) -> tuple[list[float], list]:
        """The probabilities (``p``, or evenly spaced) and ``np.log`` of each positive quantile."""
        probs = [float(x) for x in (self.p or np.linspace(0, 1, len(self.q)))]
        logs = [np.log(x) if x > 0 else None for x in self.q]
        return probs, logs

    @property
    def median(self) -> float:
        return self.at(0.5)

    @classmethod
    def fit(cls, values: Sequence[float], points: int = 101, integer: bool = False) -> Quantiles:
        """Up to 1,000 samples: ``min(points, n)`` evenly spaced quantiles. More: percentiles 1-99
        plus 0, 0.1, 0.5, 99.5, 99.9 and 100, so a lone outlier (the max) carries 0.1% of the
        mass, not 1%."""
        a = np.asarray(values, dtype=float)
        if len(a) < 2:
            raise ValueError("a quantile fit needs at least two values")
        if len(a) >= 1000:
            probs = np.concatenate([[0, 0.001, 0.005], np.linspace(0.01, 0.99, 99), [0.995, 0.999, 1]])
        else:
            probs = np.linspace(0, 1, min(points, len(a)))
        q = tuple(_sig(float(v)) for v in np.quantile(a, probs))
        p = () if len(a) < 1000 else tuple(_sig(float(x)) for x in probs)
        return cls(q=q, p=p, integer=integer)


@dataclass(frozen=True)
class Beta:
    """A Beta(a, b) on [0, 1]."""

    a: float
    b: float

    def draw(self, rng: np.random.Generator) -> float:
        return float(rng.beta(self.a, self.b))

    @classmethod
    def fit(cls, values: Sequence[float]) -> Beta:
        """Method of moments (values clipped to [0.001, 0.999])."""
        x = np.clip(np.asarray(values, dtype=float), 1e-3, 1 - 1e-3)
        m, v = float(x.mean()), float(x.var())
        k = m * (1 - m) / v - 1 if v > 0 else 100.0
        return cls(a=_sig(max(1e-3, m * k)), b=_sig(max(1e-3, (1 - m) * k)))


def _sig(v: float, digits: int = 5) -> float:
    """Round to ``digits`` significant digits (stable JSON, readable docs)."""
    return float(f"{v:.{digits}g}")


Dist = LogNormal | Quantiles | Beta


@dataclass(frozen=True)
class CcParams:
    """CC-like sessions. The defaults below are priors used only where ``cc_params.json`` (the
    fitted values, written by ``evolving trace fit``) has no value; ``WORKLOADS["cc"]`` loads
    the file. Token counts are tokens, pauses seconds; rates are per main-thread request."""

    block_tokens: int = 64
    system_tokens: int = 12_000  # shared by every agent (kv-cache-tester: tool + system 10.7k-15.5k)
    subagent_system_tokens: int = 8_000
    main_requests: Dist = LogNormal(50, 1.0, 1, 1_000, integer=True)
    first_prompt: Dist = LogNormal(22_000, 0.6, 13_000, 200_000, integer=True)
    long_first_prompt: Dist = LogNormal(200_000, 0.6, 13_000, 450_000, integer=True)
    growth: Dist = LogNormal(700, 1.3, 1, 100_000, integer=True)
    output: Dist = LogNormal(230, 1.1, 1, 16_000, integer=True)
    tool_pause_s: Dist = LogNormal(10, 1.3, 0.5, 3_600)
    human_pause_s: Dist = LogNormal(150, 2.0, 1, 70_000)
    human_p: float = 0.11
    subagent_p: float = 0.002
    subagents_per_group: float = 1.5
    subagent_wait_p: float = 0.8
    subagent_requests: Dist = LogNormal(15, 0.8, 1, 200, integer=True)
    subagent_first_prompt: Dist = LogNormal(10_000, 0.3, 5_000, 40_000, integer=True)
    subagent_growth: Dist = LogNormal(1_000, 1.0, 1, 40_000, integer=True)
    compact_trigger: Dist = LogNormal(150_000, 0.1, 30_000, 180_000, integer=True)
    compact_summary: Dist = LogNormal(35_000, 0.3, 12_000, 70_000, integer=True)
    long_context_p: float = 0.1
    context_cap: int = 560_000
    resume_p: float = 0.02
    resume_kept: Dist = Beta(2.0, 1.0)
    resume_ratio: Dist = LogNormal(1.0, 0.2, 0.3, 3.0)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CcParams:
        """From :meth:`to_json` output; missing fields keep the defaults, unknown ones are an error."""
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(d) - set(kinds)
        if unknown:
            raise ValueError(f"unknown CC parameter(s): {', '.join(sorted(unknown))}")
        vals: dict[str, object] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                if "q" in v:
                    vals[k] = Quantiles(q=tuple(v["q"]), p=tuple(v.get("p", ())), integer=bool(v.get("integer", False)))
                else:
                    vals[k] = (Beta if set(v) == {"a", "b"} else LogNormal)(**v)
            else:
                vals[k] = v
        return replace(cls(), **vals)


#: The fitted CC parameters: written by ``evolving trace fit <calibration sessions> -o <this file>``.
CC_PARAMS_FILE = Path(__file__).with_name("cc_params.json")


def load_cc_params(path: str | Path = CC_PARAMS_FILE) -> CcParams:
    """``CcParams`` from a fit file (``{"params": {...}, ...}``); the priors if ``path`` is absent."""
    p = Path(path)
    if not p.exists():
        return CcParams()
    try:
        doc = json.loads(p.read_text())
        return CcParams.from_json(doc.get("params", doc))
    except (ValueError, TypeError, AttributeError) as exc:  # one line naming the file
        raise ValueError(f"{p}: not a CC parameter file ({exc}); rewrite it with `evolving trace fit`") from None


@dataclass(frozen=True)
class PutnamParams:
    """Putnam-like sessions (docs/traces.md §4 names the source of each value). Output median and
    kept fraction are calibrated so the best static split on 9 nodes at 224 agents is 2P7D
    (METHOD.md §5): with 6,000-token outputs of which 30% stayed in context, prefill work was so
    small that 1P8D won every comparison."""

    block_tokens: int = 64
    system_tokens: int = 2_000
    problem_tokens: float = 400
    steps: tuple[int, int] = (6, 16)
    output_median: float = 4_000
    output_sigma: float = 0.5
    output_cap: float = 32_000
    kept_output_fraction: float = 1.0  # the whole response stays in context, reasoning included
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
    """The shared system prompt's context (a fresh object; its blocks are hashed once per process)."""
    root, salt, blocks, tail = _system_blocks(workload, tokens, bt, who)
    ctx = _Ctx(bt, root, salt)
    ctx.blocks, ctx.tail = list(blocks), tail
    return ctx


@lru_cache(maxsize=64)
def _system_blocks(workload: str, tokens: int, bt: int, who: str) -> tuple[int, int, tuple[int, ...], int]:
    ctx = _Ctx(bt, namespace_root(f"{workload}/{who}-system"), _salt(workload, who, "system"))
    ctx.append(tokens)
    return ctx.root, ctx.salt, tuple(ctx.blocks), ctx.tail


def cc_session(sid: str, rng: np.random.Generator, p: CcParams | None = None) -> Session:
    """One Claude-Code-like session (see ``CcParams`` and docs/traces.md §4 for the model).

    Main thread: ``main_requests`` requests; the first prompt is ``first_prompt`` tokens (the
    shared system prompt, then the agent's own); each turn the context grows by ``growth``
    tokens, unless the prompt just served passed the session's compaction trigger (drawn once
    per session; a ``long_context_p`` session starts from ``long_first_prompt``, never compacts
    and stops growing at ``context_cap``): then the
    context is rewritten to a ``compact_summary``-token summary (version + 1). Before each next
    request: a human pause (probability ``human_p``) or a tool pause; with probability
    ``subagent_p`` a group of sub-agents (geometric size, mean ``subagents_per_group``) is
    spawned, each waited for with probability ``subagent_wait_p``; with probability
    ``resume_p`` the branch is resumed at an older prefix (``resume_kept`` of its blocks; the
    rest of the context rewritten so the prompt is ``resume_ratio`` times the last one): it
    forks ``main~k`` which carries on after a human pause, and ends.
    """
    p = p or WORKLOADS["cc"].params  # type: ignore[assignment]
    assert isinstance(p, CcParams)
    bt = p.block_tokens
    system = _system("cc", p.system_tokens, bt)
    sub_system = _system("cc", p.subagent_system_tokens, bt, "subagent")
    n_main = max(1, int(p.main_requests.draw(rng)))
    long_ctx = bool(rng.random() < p.long_context_p)
    limit = p.compact_trigger.draw(rng)
    bid, version, resumes = "main", 0, 0
    ctx = system.copy(_salt(sid, bid, version))
    # at least one block of its own after the shared system prompt (the user's first message)
    ctx.append(max(float(bt), (p.long_first_prompt if long_ctx else p.first_prompt).draw(rng) - p.system_tokens))
    branches: list[Branch] = []
    children: list[Branch] = []
    steps: list[Step] = []
    pause, kind = 0.0, "human"
    for i in range(n_main):
        steps.append(ctx.request(p.output.draw(rng), pause, kind))
        if i == n_main - 1:
            break
        human = bool(rng.random() < p.human_p)
        pause = (p.human_pause_s if human else p.tool_pause_s).draw(rng)
        kind = "human" if human else "tool"
        if rng.random() < p.subagent_p:
            for _ in range(int(rng.geometric(1.0 / max(1.0, p.subagents_per_group)))):
                cid = f"agent{len(children) + 1}"
                children.append(_cc_subagent(sid, cid, bid, sub_system, rng, p))
                steps.append(Spawn(branch=cid, wait=bool(rng.random() < p.subagent_wait_p)))
        if rng.random() < p.resume_p:
            resumes += 1
            child = f"main~{resumes}"
            keep = int(len(ctx.blocks) * p.resume_kept.draw(rng))
            size = min(ctx.tokens * p.resume_ratio.draw(rng), p.context_cap)
            steps += [Fork(branch=child, wait=False), End()]
            branches.append(Branch(id=bid, parent=branches[-1].id if branches else None,
                                   mode="fork" if branches else "root", steps=steps,
                                   label="resume" if branches else ""))
            nxt = ctx.copy(_salt(sid, child, version))
            nxt.blocks, nxt.tail = nxt.blocks[:keep], 0
            nxt.append(max(0.0, size - nxt.tokens))  # the rewritten rest of the context
            ctx, bid, steps = nxt, child, []
            pause, kind = p.human_pause_s.draw(rng), "human"
        if long_ctx:  # a 1M-token window: no auto-compaction, the context stays under the cap
            ctx.append(min(p.growth.draw(rng), max(0, p.context_cap - ctx.tokens)))
        elif ctx.tokens > limit:
            version += 1
            # a summary is at most half the context it replaces (the importer's compaction rule)
            summary = min(p.compact_summary.draw(rng), 0.5 * ctx.tokens)
            ctx = system.copy(_salt(sid, bid, version))
            ctx.append(max(0.0, summary - p.system_tokens))
            steps.append(Compact(blocks=list(ctx.blocks)))
        else:
            ctx.append(p.growth.draw(rng))
    steps.append(End())
    branches.append(Branch(id=bid, parent=branches[-1].id if branches else None,
                           mode="fork" if branches else "root", steps=steps, label="resume" if branches else ""))
    # sub-agents name the branch that spawned them; list every child after its parent
    ordered: list[Branch] = []
    for b in branches:
        ordered.append(b)
        ordered += [c for c in children if c.parent == b.id]
    return Session(id=sid, block_tokens=bt, source="synthetic:cc", branches=ordered)


def _cc_subagent(sid: str, cid: str, parent: str, sub_system: _Ctx, rng: np.random.Generator,
                 p: CcParams) -> Branch:
    sub = sub_system.copy(_salt(sid, cid, 0))
    sub.append(max(float(p.block_tokens), p.subagent_first_prompt.draw(rng) - p.subagent_system_tokens))
    steps: list[Step] = []
    pause = 0.0
    n = max(1, int(p.subagent_requests.draw(rng)))
    for j in range(n):
        steps.append(sub.request(p.output.draw(rng), pause, "tool"))
        if j < n - 1:
            sub.append(p.subagent_growth.draw(rng))
            pause = p.tool_pause_s.draw(rng)
    steps.append(End())
    return Branch(id=cid, parent=parent, mode="subagent", steps=steps, label="Explore")


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
    "cc": Workload(cc_session, load_cc_params(), 90, "Claude Code: long growing contexts, sub-agents, compactions"),
    "putnam": Workload(putnam_session, PutnamParams(), 224, "PutnamBench: one decode-heavy branch per problem"),
    "osworld": Workload(osworld_session, OsworldParams(), 128, "OSWorld: screenshots, prefill-heavy, multi-agent"),
}


def generate(name: str, seed: int = 0, agents: int | None = None, rate_per_min: float | None = None,
             params: object | None = None, **overrides: object) -> list[Session]:
    """``agents`` sessions of workload ``name``; ``params`` replaces the workload's parameters
    (e.g. ``load_cc_params(file)``), ``overrides`` replace single fields.

    With ``rate_per_min`` the sessions arrive open-loop (``start_s`` from exponential gaps,
    first at 0); without, ``start_s`` is ``None`` (a fixed-concurrency pool).
    """
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    w = WORKLOADS[name]
    base = w.params if params is None else params
    params = replace(base, **overrides) if overrides else base  # type: ignore[type-var]
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
