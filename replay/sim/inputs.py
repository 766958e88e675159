"""What a simulated run is made of, read from its command-line flags (``argparse`` namespaces):
the session source, the run configuration and the profile with the KV flags applied.

Shared by the commands (replay/sim/cli.py), one run (replay/sim/runs.py), the partitioned run
(replay/sim/partitioned.py) and the experiments (replay/experiments/run.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
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


def profile_name(args) -> str:
    if args.profile:
        return args.profile
    return WORKLOAD_PROFILE.get(getattr(args, "workload", None) or "cc", "gb300-glm52")


def run_profile(args):
    """The run's profile: ``--profile`` (or the workload's) with ``--kv-gpu-tokens`` /
    ``--kv-host-tokens`` replacing its per-node KV capacities."""
    prof = load_profile(profile_name(args))
    gpu, host = getattr(args, "kv_gpu_tokens", None), getattr(args, "kv_host_tokens", None)
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


def session_source(args) -> tuple[SessionSource, str]:
    synthetic = bool(getattr(args, "workload", None))
    # --pace default (docs/traces.md, pacing): a trace as recorded, a generator as autonomous agents
    pace = parse_pace(getattr(args, "pace", None) or ("agent" if synthetic else "recorded"))
    if synthetic:
        w = WORKLOADS[args.workload]

        def make(k: int, _w=w, _seed=args.seed, _name=args.workload):
            rng = np.random.Generator(np.random.PCG64([_seed, k]))
            return pace_session(_w.make(f"{_name}-s{_seed}-{k:05d}", rng, _w.params), pace)

        return SessionSource(make=make), f"{args.workload}-like (seed {args.seed}, pace {pace})"
    path = args.trace or FIXTURE_TRACE
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


def sim_config(args) -> SimConfig:
    agents = args.agents
    if agents is None and args.arrivals is None:
        agents = WORKLOADS[args.workload].default_agents if getattr(args, "workload", None) else 126
    return SimConfig(nodes=args.nodes, duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
                     agents=None if args.arrivals else agents, arrivals_per_min=args.arrivals,
                     directory_core=not args.fast,
                     share_directory=not getattr(args, "two_directories", False))  # bench sim's baseline
