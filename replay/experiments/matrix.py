"""The paper's evaluation matrix (METHOD.md §5, §6) as data: what each experiment runs.

Each experiment is a list of :class:`Run` descriptions (a stack and the flags ``evolving
compare`` takes); replay/experiments/run.py runs them, replay/experiments/plots.py reports
them, replay/experiments/cli.py is ``evolving experiments``. The tables below say what runs
(``Q(full, quick)``: the full matrix's value and the quick one's); :func:`matrix` only turns them
into runs, in the matrix's order (:data:`ORDER`). docs/experiments.md has the commands, the
claims and the measured figures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from engine.profiles import load_profile
from replay.sim.cli import DEFAULT_CALIBRATION
from services.cores.planner.evolving import EvolvingConfig

PRESSURE_PROFILE = "gb300-glm52-pressure"  # the regime map's near-capacity cell: 86% KV demand (deploy/profiles)
#: The recorded Claude Code sessions: the 100 calibration sessions (deploy/traces/calibration-100), and the 34
#: of them the README's demo replays (deploy/traces/calibration, "the bundled sessions").
CALIBRATION_FULL = DEFAULT_CALIBRATION
CALIBRATION_BUNDLED = Path(__file__).resolve().parents[2] / "deploy" / "traces" / "calibration"


def calibration_trace(tiny: bool = False) -> Path:
    """The calibration sessions the ``calib-126`` rows replay: the 100, or in the tests' tiny matrix the
    bundled 34."""
    return CALIBRATION_BUNDLED if tiny else CALIBRATION_FULL


SLO_TTFT_P95_S = 10.0  # open arrivals: the P95 TTFT a stack must keep (our choice, docs/experiments.md)


@dataclass
class Run:
    """One simulated run: ``stack`` (a ``get_stack`` spec) with ``argv`` (compare's flags)."""

    label: str
    stack: str
    argv: list[str]
    x: float | None = None  # the swept value (rate, capacity, tolerance), if any
    needs: str = ""  # set when a piece is missing: the row says "not available: needs ..."
    planner_args: dict = field(default_factory=dict)  # planner config overrides
    schedule: list[tuple[float, str]] | None = None  # (start s, mix) of a shifting composition


@dataclass
class Experiment:
    name: str
    title: str
    claim: str  # what METHOD.md reports, to read the table against
    runs: list[Run]
    kind: str = "table"  # table | sweep (rows per x) | curve (throughput vs TTFT)
    x_label: str = ""
    quick_note: str = ""  # how the quick rows differ beyond the window (said in the QUICK title)


class Q(NamedTuple):
    """A value of the full matrix and of the quick one."""

    full: Any
    quick: Any


#: Why some quick rows run on 3 nodes (docs/experiments.md): OSWorld-like requests carry ~1,000+
#: blocks each at ~50 req/s, and their cost grows faster than linearly with the cluster; a third of
#: the agents on a third of the nodes keeps the load per node, hence the regime. Measured, 2+2 min,
#: evolving: 128 agents on 9 nodes 45.6 req/s (5.1/node), P95 TTFT 4.28 s, KV demand 19.7%, idle
#: prefill 1.3%; 43 on 3 nodes 15.7 req/s (5.2/node), 4.18 s, 20.7%, 1.9%, for 10x less CPU.
QUICK_THIRD = "same load per node, static splits scaled (6P3D -> 2P1D)"

#: (warm-up, measured time) of every run; ``--window`` replaces it.
WINDOW = {"full": ("30m", "1h"), "quick": ("4m", "4m"), "tiny": ("60", "60")}
CORE = ["evolving", "dynamo", "arrow"]  # every stationary table: ours and the two baselines, then a static split

#: The experiments, in the matrix's order; ``cc-90`` and ``cc-108`` are in the full matrix only.
ORDER = ["calib-126", "cc-90", "cc-108", "cc-126", "kv-capacity", "putnam-224", "osworld-128", "ablation-4p5d",
         "start-split", "shifting", "open-arrivals", "objective"]
FULL_ONLY = {"cc-90", "cc-108"}

CC_CLAIM = ("M §5: vs Dynamo up to 2.7x throughput, P95 TTFT down up to 14x, +38% over the best static "
            "split; lost KV reuse down 81-95%")


@dataclass(frozen=True)
class Stationary:
    """Fixed concurrency: :data:`CORE` and the best static split (or ``quick_stacks`` in the quick
    matrix); ``third``: quick rows on a third of the cluster with a third of the agents (the same
    load per node; the static split scaled, 6P3D -> 2P1D), see :data:`QUICK_THIRD`."""

    workload: str
    agents: int
    static: str
    claim: str
    quick_stacks: list[str] | None = None
    third: bool = False
    statics: tuple[str, ...] = ()  # more static splits beside ``static`` (full matrix only)
    recorded: bool = False  # the calibration sessions at agent pace (:func:`calibration_trace`), not a generator
    profile: str | None = None


STATIONARY = {
    "calib-126": Stationary("calibration sessions", 126, "static:4P5D",
                            "at the pressure profile ours should lead every baseline on throughput, "
                            "P95 TTFT (several times lower than Dynamo's) and lost KV reuse (at most a fifth of "
                            "Dynamo's; M §5: 81-95% lower)",
                            quick_stacks=["evolving", "dynamo"], statics=("static:3P6D",), recorded=True,
                            profile=PRESSURE_PROFILE),
    # CC at 90/108/126 agents in the regime the paper ran (the pressure profile)
    "cc-90": Stationary("cc", 90, "static:4P5D", CC_CLAIM, profile=PRESSURE_PROFILE),
    "cc-108": Stationary("cc", 108, "static:4P5D", CC_CLAIM, profile=PRESSURE_PROFILE),
    "cc-126": Stationary("cc", 126, "static:4P5D", CC_CLAIM, profile=PRESSURE_PROFILE),
    "putnam-224": Stationary("putnam", 224, "static:2P7D",
                             "M §5/§6.1: decode-heavy; best static 2P7D; the planner keeps 1-2 prefill nodes",
                             quick_stacks=["evolving", "static:2P7D"]),
    "osworld-128": Stationary("osworld", 128, "static:6P3D",
                              "M §5: prefill-heavy; best static 6P3D (SGLang), 8P1D for symmetric engines",
                              quick_stacks=["evolving", "static:6P3D"], third=True),
}

#: GPU KV capacity per node swept (host 4 x GPU, METHOD's), beside the calibrated point: the named
#: profile itself (its own GPU and host KV: CC at 126 agents puts the paper's 86% demand on it).
#: The quick matrix adds Dynamo at the calibrated point only.
KV_CAPACITY = {
    "caps": Q([250_000, 500_000, 1_000_000, 2_000_000, 5_000_000], [5_000_000]),
    "stacks": Q(["evolving", "evolving+lru", "dynamo"], ["evolving", "evolving+lru"]),
    "agents": 126,
    "claim": "M §5: at 86% KV demand the gains come from which KV is kept; lost KV reuse down 81-95%",
    "x_label": "GPU KV tokens per node (M)",
}

#: Fixed 4P5D: one part of our stack swapped at a time (METHOD §2.3, §4.1, §4.4): (label, stack, in quick).
ABLATION = [
    ("ours (least-TTFT, async, count-aware)", "evolving-static:4P5D", True),
    ("router: cache-aware", "evolving-static:4P5D+cache_aware", True),
    ("router: load-balancing (Dynamo KV)", "evolving-static:4P5D+dynamo_kv", False),
    ("data plane: fetch at prefill start", "evolving-static:4P5D+at_start", True),
    ("data plane: node-local caches", "evolving-static:4P5D+local", False),
    ("eviction: LRU", "evolving-static:4P5D+lru", False),
    ("cache-aware + async fetch", "static:4P5D+async", True),
    ("cache-aware, node-local (SGLang PD)", "static:4P5D", False),
]
ABLATION_EXP = {
    "title": f"CC-like, 126 agents, fixed 4P5D, {PRESSURE_PROFILE}: one part swapped at a time",
    "claim": "M §2.3: cache-aware P95 TTFT 27-34 s, load-balancing 65 s, memory pool with fetch at start 95 s; "
             "LRU loses 34-46% of the reuse Dynamo loses",
}

START_SPLIT = {
    "starts": Q(["1P8D", "4P5D", "8P1D"], ["1P8D", "8P1D"]),
    "title": "CC-like, 126 agents: Evolving Infra started at different splits",
    "claim": "M §5: best static split for symmetric engines 3P6D; the planner should converge near it",
}

#: Shifting composition: Putnam -> mixed -> OSWorld (Kimi K2.6 profile, M §5), one phase each
#: after the warm-up (``--window``: its warm-up, and a third of its measured time per phase).
SHIFTING = {
    "mixes": ["putnam", "mixed", "osworld"],
    "phase_s": {"full": 3600.0, "quick": 180.0, "tiny": 20.0},
    "warmup_s": {"full": 1800.0, "quick": 240.0, "tiny": 60.0},
    "stacks": Q(["evolving", "dynamo", "arrow", "static:6P3D", "static:2P7D"], ["evolving", "static:2P1D"]),
    "agents_nodes": Q((160, "9"), (-(-160 // 3), "3")),
    "profile": "gb300-kimi-k26",
    "claim": "M §5: under a shifting composition 2.1x Dynamo and +28% over the best static split",
}

OPEN_ARRIVALS = {
    "rates": Q([1.0, 2.0, 3.0, 4.0, 6.0, 8.0], [2.0, 6.0]),
    "stacks": Q(["evolving", "dynamo", "arrow", "static:4P5D"], ["evolving", "static:4P5D"]),
    "claim": "M §6.2: at 0.75 agents/min one bad switch sent prefill queue P95 to 120-275 s",
    "x_label": "agents/min",
}

#: The planner's TTFT objective on Putnam-like at 256 agents: the default throughput tolerance
#: first (the table's ratios are against it), a throughput-only planner second, static splits last.
OBJECTIVE = {
    "tolerances": Q([0.0, 0.02, 0.10, 0.15, 0.25], [0.15]),
    "statics": Q(["static:1P8D", "static:2P7D", "static:3P6D"], ["static:1P8D", "static:2P7D"]),
    "agents": 256,
    "title": "Putnam-like, 256 agents: the planner's TTFT objective (throughput vs P95 TTFT)",
    "claim": "M §6.1: a throughput-only objective keeps 1-2 prefill nodes and P95 TTFT gets worse than Dynamo's",
}


# --------------------------------------------------------------------------- building the runs
def _third_split(stack: str) -> str:
    """A static split of 9 nodes as the same split of 3 (``static:6P3D`` -> ``static:2P1D``)."""
    m = re.fullmatch(r"static:(\d+)P(\d+)D", stack)
    if not m:
        return stack
    p, d = int(m.group(1)), int(m.group(2))
    if p % 3 or d % 3:
        raise ValueError(f"{stack}: not a split of 9 nodes that thirds keep")
    return f"static:{p // 3}P{d // 3}D"


def run_flags(workload: str | None, agents: int | None, warmup: str, duration: str, *extra: str) -> list[str]:
    out = ["--warmup", warmup, "--duration", duration, "--fast", "--no-progress"]
    if workload:
        out += ["--workload", workload]
    if agents is not None:
        out += ["--agents", str(agents)]
    return out + list(extra)


@dataclass(frozen=True)
class _Mode:
    """Which matrix: quick or full, tiny (tests), and the run window (warm-up, measured time)."""

    quick: bool
    tiny: bool
    window: tuple[float, float] | None

    @property
    def key(self) -> str:
        return "tiny" if self.tiny else "quick" if self.quick else "full"

    def pick(self, q: Q):
        return q.quick if self.quick else q.full

    def agents(self, n: int) -> int:
        """Tiny: a sixteenth of the agents (at least 4)."""
        return max(4, n // 16) if self.tiny else n

    def flags(self, workload: str | None, agents: int | None, *extra: str) -> list[str]:
        w, d = WINDOW[self.key] if self.window is None else (f"{self.window[0]:g}", f"{self.window[1]:g}")
        return run_flags(workload, agents, w, d, *extra)


def _stationary(m: _Mode, name: str) -> Experiment:
    e = STATIONARY[name]
    stacks = CORE + [e.static] + ([] if m.quick else list(e.statics))
    if m.quick and e.quick_stacks is not None:
        stacks = e.quick_stacks
    note, extra, n = "", (), e.agents
    workload: str | None = e.workload
    if e.recorded:
        workload, extra = None, ("--trace", str(calibration_trace(m.tiny)), "--pace", "agent")
    if e.profile:
        extra = (*extra, "--profile", e.profile)
    if m.quick and e.third:
        stacks = [_third_split(s) for s in stacks]
        n, extra = -(-e.agents // 3), ("--nodes", "3")
        note = f"{m.agents(n)} agents on 3 nodes, a third of {m.agents(e.agents)} on 9: {QUICK_THIRD}"
    title = (f"{e.workload} ({calibration_trace(m.tiny).name}), {e.agents} agents at agent pace, {e.profile}" if e.recorded
             else f"{e.workload}-like, {e.agents} agents, stationary" + (f", {e.profile}" if e.profile else ""))
    return Experiment(name, title, e.claim,
                      [Run(s, s, m.flags(workload, m.agents(n), *extra)) for s in stacks], quick_note=note)


def _kv_capacity(m: _Mode) -> Experiment:
    t, pp = KV_CAPACITY, load_profile(PRESSURE_PROFILE)
    points = sorted([(pp.l1_capacity_tokens, ["--profile", PRESSURE_PROFILE])]
                    + [(c, ["--kv-gpu-tokens", str(c), "--kv-host-tokens", str(4 * c)]) for c in m.pick(t["caps"])],
                    key=lambda p: p[0])
    stacks = m.pick(t["stacks"])
    return Experiment(
        "kv-capacity", f"CC-like, 126 agents: GPU KV capacity per node (host 4x GPU; {pp.l1_capacity_tokens / 1e6:g}M "
                       f"is {PRESSURE_PROFILE}, host {pp.l2_capacity_tokens / 1e6:g}M)", t["claim"],
        [Run(f"{s} @ {c / 1e6:g}M", s, m.flags("cc", m.agents(t["agents"]), *kv), x=c / 1e6)
         for c, kv in points for s in stacks + (["dynamo"] if m.quick and kv[0] == "--profile" else [])],
        kind="sweep", x_label=t["x_label"])


def _ablation(m: _Mode) -> Experiment:
    rows = [(label, spec) for label, spec, quick in ABLATION if quick or not m.quick]
    return Experiment("ablation-4p5d", ABLATION_EXP["title"], ABLATION_EXP["claim"],
                      [Run(label, spec, m.flags("cc", m.agents(126), "--profile", PRESSURE_PROFILE))
                       for label, spec in rows])


def _start_split(m: _Mode) -> Experiment:
    t = START_SPLIT
    return Experiment("start-split", t["title"], t["claim"],
                      [Run(f"start {s}", "evolving", m.flags("cc", m.agents(126), "--start", s))
                       for s in m.pick(t["starts"])])


def _shifting(m: _Mode) -> Experiment:
    t = SHIFTING
    phase, warm = t["phase_s"][m.key], t["warmup_s"][m.key]
    if m.window is not None:
        warm, phase = m.window[0], m.window[1] / 3
    sched = [(0.0 if i == 0 else warm + i * phase, mix) for i, mix in enumerate(t["mixes"])]
    agents, nodes = m.pick(t["agents_nodes"])
    flags = run_flags("putnam", m.agents(agents), f"{warm:.0f}", f"{3 * phase:.0f}", "--nodes", nodes,
                   "--profile", t["profile"])
    return Experiment(
        "shifting", f"shifting composition: Putnam -> mixed -> OSWorld, {phase / 60:.3g} min each", t["claim"],
        [Run(s, s, list(flags), schedule=list(sched)) for s in m.pick(t["stacks"])],
        quick_note=f"{m.agents(agents)} agents on 3 nodes, a third of {m.agents(160)} on 9: {QUICK_THIRD}"
        if m.quick else "")


def _open_arrivals(m: _Mode) -> Experiment:
    t = OPEN_ARRIVALS
    return Experiment(
        "open-arrivals", f"CC-like, open arrivals (agents/min), P95 TTFT SLO {SLO_TTFT_P95_S:g} s", t["claim"],
        [Run(f"{s} @ {r:g}/min", s, m.flags("cc", None, "--arrivals", f"{r:g}"), x=r)
         for r in m.pick(t["rates"]) for s in m.pick(t["stacks"])], kind="sweep", x_label=t["x_label"])


def _objective(m: _Mode) -> Experiment:
    t = OBJECTIVE
    flags = m.flags("putnam", m.agents(t["agents"]))
    default = EvolvingConfig().throughput_tolerance
    tols = [default] + [x for x in m.pick(t["tolerances"]) if x != default]
    runs = [Run(f"tolerance {x:.0%}" + (" (default)" if x == default else ""), "evolving", list(flags), x=x,
                planner_args={"ttft_objective": True, "throughput_tolerance": x}) for x in tols]
    runs.insert(1, Run("throughput only", "evolving", list(flags), x=-1.0, planner_args={"ttft_objective": False}))
    runs += [Run(s, s, list(flags)) for s in m.pick(t["statics"])]
    return Experiment("objective", t["title"], t["claim"], runs, kind="curve")


_BUILD = {"kv-capacity": _kv_capacity, "ablation-4p5d": _ablation, "start-split": _start_split,
          "shifting": _shifting, "open-arrivals": _open_arrivals, "objective": _objective}


def matrix(quick: bool, tiny: bool = False, window: tuple[float, float] | None = None) -> list[Experiment]:
    """The evaluation matrix. Quick: short runs, fewer rows (each experiment still runs).
    Tiny (tests only): the quick rows at 1 min + 1 min with a sixteenth of the agents.
    ``window``: every run's warm-up and measured time (shifting: 3 phases of a third of it)."""
    m = _Mode(quick or tiny, tiny, window)
    return [_stationary(m, name) if name in STATIONARY else _BUILD[name](m)
            for name in ORDER if not (m.quick and name in FULL_ONLY)]
