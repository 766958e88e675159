"""What a simulated run is made of: :class:`SimSpec`, the typed value a command's flags become
at its entry point (replay/sim/cli.py :func:`~replay.sim.cli.sim_spec`), and what is read from
it: the session source, the run configuration and the profile with the KV flags applied.

Shared by the commands (replay/sim/cli.py), one run (replay/sim/runs.py), the partitioned run
(replay/sim/partitioned.py) and the experiments (replay/experiments/run.py). Nothing here sees
argparse's ``Namespace`` (docs/architecture.md, "Options are parsed once").
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.profiles import load_profile
from replay.sim.simulation import SessionSource, SimConfig
from replay.traces.format import TraceFormatError
from replay.traces.importers.spec import WorkloadSpecError, load_workload, skipped_lines
from replay.traces.pacing import pace_session, parse_pace
from replay.traces.workloads import WORKLOADS

#: Bundled real Claude Code sessions (kv-cache-tester, Apache-2.0): the default trace.
#: The default trace: the 3 test-fixture sessions (not "the bundled sessions": those are the 34 of
#: deploy/traces/calibration that the README's demo replays; docs/traces.md, "Trace sets").
FIXTURE_TRACE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "traces" / "weka-claude-code"
WORKLOAD_PROFILE = {"cc": "gb300-glm52", "putnam": "gb300-glm52", "osworld": "gb300-kimi-k26"}


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """One simulated run's options, named as their flags (``add_run_args`` and ``_add_log_level``
    of replay/sim/cli.py); durations in seconds. A variant of a run is ``dataclasses.replace``."""

    nodes: int = 9
    duration: float = 3600.0  # simulated seconds measured, after the warm-up
    warmup: float = 1800.0  # simulated seconds before the measurement window
    seed: int = 0
    agents: int | None = None  # closed loop: this many agents (None: the workload's default)
    arrivals: float | None = None  # open loop: agents per minute (wins over agents)
    workload: str | None = None  # "cc", "putnam", "osworld": a generator instead of a trace
    trace: str | None = None  # a workload spec (None: the test-fixture sessions)
    pace: str | None = None  # client pauses (None: recorded for a trace, agent for a workload)
    profile: str | None = None  # None: the workload's profile
    kv_gpu_tokens: int | None = None  # per-node L1 capacity replacing the profile's
    kv_host_tokens: int | None = None  # per-node L2 capacity replacing the profile's
    fast: bool = False  # no separate directory core
    two_directories: bool = False  # bench sim's baseline: the router and the directory fold apart
    start: str | None = None  # the split every node serves from t=0
    partitions: int = 1  # > 1: one process per partition (replay/sim/partitioned.py)
    jobs: int | None = None  # processes at a time (None: the cores available)
    log_level: str | None = None  # None: "full"
    log_format: str | None = None  # None: the current columnar format
    log_sync: bool = False  # write the log in the simulating thread (bench sim's baseline row)
    log_batch: int | None = None  # events per log batch (None: replay/sim/simlog.py's BATCH)


def parse_duration(text: str) -> float:
    """``1h``, ``30m``, ``90s``, ``1h30m`` or plain seconds."""
    t = str(text).strip().lower()
    try:
        return float(t)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", t)
    if not parts or "".join(a + b for a, b in parts) != t.replace(" ", ""):
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use like 1h, 30m, 90s, 1h30m")
    return sum(float(v) * {"h": 3600, "m": 60, "s": 1}[u] for v, u in parts)


def profile_name(spec: SimSpec) -> str:
    if spec.profile:
        return spec.profile
    return WORKLOAD_PROFILE.get(spec.workload or "cc", "gb300-glm52")


def run_profile(spec: SimSpec):
    """The run's profile: ``--profile`` (or the workload's) with ``--kv-gpu-tokens`` /
    ``--kv-host-tokens`` replacing its per-node KV capacities."""
    prof = load_profile(profile_name(spec))
    gpu, host = spec.kv_gpu_tokens, spec.kv_host_tokens
    if gpu is not None:
        prof = replace(prof, l1_capacity_tokens=int(gpu))
    if host is not None:
        prof = replace(prof, l2_capacity_tokens=int(host))
    return prof


def load_trace(spec: str | Path) -> list:
    """Sessions of a workload spec, read by the parser every trace-taking command shares
    (``replay.traces.importers.spec``): a trace path (format told by content), ``FORMAT:PATH`` (e.g.
    ``mooncake:trace.jsonl``) or ``gen:NAME[:key=value]...``. Raises ``WorkloadSpecError`` /
    ``TraceFormatError`` with a one-line message (file and line for a broken record)."""
    return load_workload(str(spec)).sessions


def session_source(spec: SimSpec) -> tuple[SessionSource, str]:
    synthetic = bool(spec.workload)
    # --pace default (docs/traces.md, pacing): a trace as recorded, a generator as autonomous agents
    pace = parse_pace(spec.pace or ("agent" if synthetic else "recorded"))
    if synthetic:
        w = WORKLOADS[spec.workload]

        def make(k: int, _w=w, _seed=spec.seed, _name=spec.workload):
            rng = np.random.Generator(np.random.PCG64([_seed, k]))
            return pace_session(_w.make(f"{_name}-s{_seed}-{k:05d}", rng, _w.params), pace)

        return SessionSource(make=make), f"{spec.workload}-like (seed {spec.seed}, pace {pace})"
    path = spec.trace or FIXTURE_TRACE
    try:  # a folder's unreadable files are skipped and listed on stderr; the rest is served
        w = load_workload(str(path), require_sessions=False)
    except (WorkloadSpecError, TraceFormatError, OSError) as exc:  # one line, not a traceback
        raise SystemExit(f"error: {exc}") from None  # each names the spec, or the file and line
    for line in skipped_lines(w.skipped):
        print(line, file=sys.stderr)
    if not w.sessions:
        raise SystemExit(f"error: {path}: no session" + (f" ({len(w.skipped)} bad file(s)/record(s) skipped)"
                                                          if w.skipped else ""))
    sessions = [pace_session(s, pace) for s in w.sessions]
    return SessionSource(sessions), f"{len(sessions)} sessions from {path}" + (
        f" (pace {pace})" if pace.mode != "recorded" else "")


def sim_config(spec: SimSpec) -> SimConfig:
    agents = spec.agents
    if agents is None and spec.arrivals is None:
        agents = WORKLOADS[spec.workload].default_agents if spec.workload else 126
    return SimConfig(nodes=spec.nodes, duration_s=spec.duration, warmup_s=spec.warmup, seed=spec.seed,
                     agents=None if spec.arrivals else agents, arrivals_per_min=spec.arrivals,
                     directory_core=not spec.fast,
                     share_directory=not spec.two_directories)  # bench sim's baseline
