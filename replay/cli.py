"""``evolving`` subcommands of the replay package.

``register(sub, bench)`` is called by ``services.cli``. It only calls one ``_register_*``
function per command group, so each group (``trace`` here; the simulator's ``replay``,
``compare``, ``sweep-static`` and ``bench sim``) lives in its own function:
add a ``_register_<group>(sub, bench)`` and one line to ``register``.

``evolving trace import FORMAT SRC -o OUT [--skip-bad]``  -- convert a real log to sessions
``evolving trace stats FILE... [--from FORMAT] [--json]`` -- counts, distributions, ideal hits
``evolving trace generate WORKLOAD -o OUT [--seed N] [--agents N] [--rate R]`` -- synthetic
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    _register_trace(sub)
    _register_sim(sub, bench)


# --------------------------------------------------------------------------- trace
def _register_trace(sub: argparse._SubParsersAction) -> None:
    from replay.importers import FORMATS

    p = sub.add_parser("trace", help="agent-session traces: import, statistics, synthetic workloads")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])

    imp = tsub.add_parser("import", help="convert a real agent log into the session format (JSONL)")
    imp.add_argument("format", choices=FORMATS, help="source format")
    imp.add_argument("src", help="source file or directory")
    imp.add_argument("-o", "--out", required=True, help="output JSONL file")
    imp.add_argument("--skip-bad", action="store_true", help="skip bad records and report them")
    imp.set_defaults(func=_cmd_import)

    st = tsub.add_parser("stats", help="requests, branches, token/pause distributions, ideal hit rate")
    st.add_argument("files", nargs="+", help="session JSONL files or directories")
    st.add_argument("--from", dest="fmt", choices=FORMATS, default=None,
                    help="import FILES from this format on the fly instead of reading sessions")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--skip-bad", action="store_true", help="skip bad records and report them")
    st.set_defaults(func=_cmd_stats)

    from replay.workloads import WORKLOADS

    gen = tsub.add_parser("generate", help="write a seeded synthetic workload")
    gen.add_argument("workload", choices=sorted(WORKLOADS))
    gen.add_argument("-o", "--out", required=True, help="output JSONL file")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--agents", type=int, default=None, help="number of sessions (agents)")
    gen.add_argument("--rate", type=float, default=None,
                     help="open arrivals: agents per minute (default: closed-loop pool, start_s=None)")
    gen.set_defaults(func=_cmd_generate)


def _report_skipped(skipped: list) -> None:
    if skipped:
        print(f"skipped {len(skipped)} bad record(s):", file=sys.stderr)
        for e in skipped:
            print(f"  {e}", file=sys.stderr)


def _load(files: list[str], fmt: str | None, skip_bad: bool):
    from replay.importers import get_importer
    from replay.trace import TraceFormatError, load_sessions

    sessions, skipped = [], []
    for f in files:
        if fmt:
            res = get_importer(fmt)(f, skip_bad=skip_bad)
            sessions += res.sessions
            skipped += res.skipped
        else:
            errs: list[TraceFormatError] = []
            sessions += load_sessions(f, errs if skip_bad else None)
            skipped += errs
    return sessions, skipped


def _cmd_import(args: argparse.Namespace) -> int:
    from replay.importers import get_importer
    from replay.trace import TraceFormatError, save_sessions

    try:
        res = get_importer(args.format)(args.src, skip_bad=args.skip_bad)
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not res.sessions:  # never "wrote 0 sessions": an empty result is an error
        _report_skipped(res.skipped)
        print(f"error: {args.src}: no session imported", file=sys.stderr)
        return 1
    n = save_sessions(args.out, res.sessions)
    reqs = sum(1 for s in res.sessions for _ in s.requests())
    print(f"wrote {n} session(s), {reqs} request(s) to {args.out}")
    for note in res.notes:
        print(f"note: {note}")
    _report_skipped(res.skipped)
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    import msgspec

    from replay.stats import format_stats, trace_stats
    from replay.trace import TraceFormatError

    try:
        sessions, skipped = _load(args.files, args.fmt, args.skip_bad)
    except (TraceFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not sessions:
        _report_skipped(skipped)
        print(f"error: {', '.join(args.files)}: no session", file=sys.stderr)
        return 1
    st = trace_stats(sessions)
    if args.json:
        print(msgspec.json.encode(st).decode())
    else:
        print(format_stats(st, ", ".join(Path(f).name for f in args.files)))
    _report_skipped(skipped)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from replay.trace import save_sessions
    from replay.workloads import generate

    sessions = generate(args.workload, seed=args.seed, agents=args.agents, rate_per_min=args.rate)
    n = save_sessions(args.out, sessions)
    print(f"wrote {n} {args.workload} session(s) (seed {args.seed}) to {args.out}")
    return 0


# --------------------------------------------------------------------------- simulator
def _register_sim(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """``replay``, ``compare``, ``sweep-static`` and ``bench sim`` (see replay/sim_cli.py)."""
    from replay.sim_cli import register_sim

    register_sim(sub, bench)
