"""``evolving calibrate`` and ``evolving fidelity``: their options, and the calls into
replay/fidelity/run.py (imported when a command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

#: the bundled real sessions (docs/traces.md, "Trace sets")
BUNDLED = Path(__file__).resolve().parents[2] / "deploy" / "traces" / "calibration"


def _calibrate(args: argparse.Namespace) -> int:
    from replay.fidelity.run import CalibrateSpec, cmd_calibrate  # lazy: evolving --help (DuckDB, numpy fits)
    from replay.sim.cli import from_flags  # lazy: with the command it serves

    return cmd_calibrate(from_flags(CalibrateSpec, args))


def _fidelity(args: argparse.Namespace) -> int:
    from replay.fidelity.run import (  # lazy: evolving --help (the live drivers, the simulator)
        FidelitySpec,
        cmd_fidelity,
    )
    from replay.sim.cli import from_flags  # lazy: with the command it serves

    return cmd_fidelity(from_flags(FidelitySpec, args))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit a simulator profile to a recorded live run (eq. 1 / eq. 2, NNLS)")
    p.add_argument("log", help="DuckDB log of a live run (evolving up's recorder)")
    p.add_argument("--out", required=True, help="profile TOML to write (give it to --profile)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--base", default="gb300-glm52",
                   help="profile whose numbers fill what the log cannot give (default gb300-glm52)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("fidelity", help="the same scaled real sessions live (torch engines) and simulated, per stack")
    p.add_argument("--trace", default=str(BUNDLED),
                   help="workload spec of the real sessions (default: the bundled sessions)")
    p.add_argument("--stacks", default="evolving,dynamo,static:1P1D")
    p.add_argument("--engines", type=int, default=2, help="torch engines (= simulated nodes) per stack")
    p.add_argument("--sessions", type=int, default=4, help="test sessions")
    p.add_argument("--calibration-sessions", type=int, default=4,
                   help="sessions before the test ones, used only for the calibration run")
    p.add_argument("--calibration-sweep", default="512,1024,2048,4096",
                   help="cold prompts of these lengths (tokens) served first in the calibration run, so that "
                        "eq. 1 is fitted over the range of chunks the test serves ('' for none)")
    p.add_argument("--concurrency", type=int, default=4, help="sessions at a time (agents)")
    p.add_argument("--turns", type=int, default=3, help="requests kept per session")
    p.add_argument("--token-scale", type=int, default=64, help="token lengths divided by this")
    p.add_argument("--output-scale", type=int, default=16, help="output lengths divided by this")
    p.add_argument("--max-output", type=int, default=16, help="at most this many output tokens")
    p.add_argument("--pause-scale", type=float, default=0.05, help="pauses (as agents take them) times this")
    p.add_argument("--warmup-s", type=float, default=30.0, help="planner warm-up, live (from up's start)")
    p.add_argument("--profile", default=None, help="skip calibration: this profile (a name or a TOML path)")
    p.add_argument("--calibration-log", default=None, help="calibrate from this live log instead of a new run")
    p.add_argument("--model", default=None, help="torch engines' checkpoint (default SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse-live", action="store_true",
                   help="where --out-dir already holds a stack's live log (or the calibration run's), use it "
                        "instead of serving again: the simulated side alone is rerun")
    p.add_argument("--out-dir", default=None, help="keep both logs of every stack here (default: a temp folder)")
    p.add_argument("--json", action="store_true", help='{"rows": [{"stack", "metric", "live", "sim"}], ...}')
    p.set_defaults(func=_fidelity)
