"""``evolving`` subcommands of the replay package.

``register(sub, bench)`` is called by ``services.drivers.cli``. It only calls one ``_register_*``
function per command group, so each group (``trace`` here; the simulator's ``replay``,
``compare``, ``sweep-static`` and ``bench sim``) lives in its own function:
add a ``_register_<group>(sub, bench)`` and one line to ``register``.

``evolving trace import FORMAT SRC -o OUT [--skip-bad] [--block-tokens N]``  -- convert a real log to sessions
``evolving trace export FORMAT SPEC -o OUT [--block-tokens N]`` -- sessions to Mooncake / agentic Mooncake JSONL
``evolving trace stats FILE... [--from FORMAT] [--json]`` -- counts, distributions, ideal hits
``evolving trace stats --compare A B [--markdown]`` -- two workloads side by side, KS distances
``evolving trace fit SRC -o PARAMS.json [--from FORMAT]`` -- fit the CC generator to sessions
``evolving trace generate WORKLOAD -o OUT [--seed N] [--agents N] [--rate R]`` -- synthetic

A *workload spec* (``--compare``, ``fit``, ``stats FILE...``, the simulator's ``--trace``,
``evolving drive``: one parser, ``replay/traces/importers/spec.py``) is a trace path (session JSONL,
kv-cache-tester JSON / ``.json.gz``, Mooncake JSONL, Claude Code transcripts, a file or a folder:
the format told by content), ``FORMAT:PATH`` to import with a named importer
(``mooncake:trace.jsonl``), or ``gen:NAME[:key=value]...`` for a generator, keys ``agents``
(default: the workload's), ``seed`` (0), ``params`` (a fit file, CC only) and ``pace``
(``recorded`` default, ``agent[:T[:H]]``, ``scale:X``), e.g. ``gen:cc:agents=126:seed=1``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import msgspec

from replay.fidelity.cli import register as register_fidelity
from replay.sim.cli import register_sim
from replay.traces.export import EXPORT_FORMATS, export_sessions
from replay.traces.format import TraceFormatError, save_sessions
from replay.traces.importers import BLOCK_TOKENS_FORMATS, FORMATS
from replay.traces.importers.spec import load_workload as read_workload
from replay.traces.importers.spec import skipped_lines
from replay.traces.stats import format_stats, trace_stats
from replay.traces.workloads import WORKLOADS, generate


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    _register_trace(sub)
    _register_sim(sub, bench)
    _register_fidelity(sub)


def _register_fidelity(sub: argparse._SubParsersAction) -> None:
    """``evolving calibrate`` and ``evolving fidelity`` (replay/fidelity/)."""
    register_fidelity(sub)


# --------------------------------------------------------------------------- trace
def _register_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="agent-session traces: import, statistics, synthetic workloads")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    p.set_defaults(func=lambda _a: (p.print_help(), 2)[1])

    imp = tsub.add_parser("import", help="convert a real agent log into the session format (JSONL)")
    imp.add_argument("format", choices=FORMATS, help="source format")
    imp.add_argument("src", help="source file or directory")
    imp.add_argument("-o", "--out", required=True, help="output JSONL file")
    imp.add_argument("--skip-bad", action="store_true", help="skip bad records and report them")
    imp.add_argument("--block-tokens", type=_positive, default=None,
                     help=f"block size of the hash_ids ({', '.join(BLOCK_TOKENS_FORMATS)} only; default 512)")
    imp.set_defaults(func=_cmd_import)

    exp = tsub.add_parser("export", help="write sessions as Mooncake or agentic Mooncake JSONL (Dynamo, aiperf, "
                                         "SGLang replay tools)")
    exp.add_argument("format", choices=EXPORT_FORMATS, help="target format")
    exp.add_argument("src", help="a workload spec: a trace path, FORMAT:PATH or gen:NAME[:k=v]...")
    exp.add_argument("-o", "--out", required=True, help="output JSONL file")
    exp.add_argument("--block-tokens", type=_positive, default=None,
                     help="re-cut every session to blocks of N tokens first (default: the sessions' own size)")
    exp.add_argument("--from", dest="fmt", choices=FORMATS, default=None, help="read SRC in this format")
    exp.add_argument("--skip-bad", action="store_true", help="skip bad records of SRC and report them")
    exp.set_defaults(func=_cmd_export)

    st = tsub.add_parser("stats", help="requests, branches, token/pause distributions, ideal hit rate")
    st.add_argument("files", nargs="*", help="session JSONL files or directories")
    st.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None,
                    help="two workload specs side by side with KS distances: a trace path, FORMAT:PATH, "
                         "or gen:NAME[:agents=N][:seed=S][:params=FILE][:pace=P]")
    st.add_argument("--markdown", action="store_true", help="with --compare: a Markdown table")
    st.add_argument("--from", dest="fmt", choices=FORMATS, default=None,
                    help="import FILES from this format on the fly instead of reading sessions")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--skip-bad", action="store_true", help="skip bad records and report them")
    st.set_defaults(func=_cmd_stats)

    fit = tsub.add_parser("fit", help="fit the CC generator's distributions to real sessions (writes a params file)")
    fit.add_argument("src", help="sessions: a trace path or FORMAT:PATH (as for --compare)")
    fit.add_argument("-o", "--out", required=True, help="params JSON (the generator loads replay/traces/cc_params.json)")
    fit.add_argument("--from", dest="fmt", choices=FORMATS, default=None, help="import SRC from this format")
    fit.add_argument("--check-agents", type=int, default=500,
                     help="generated sessions compared with the data for the fit quality (default 500)")
    fit.add_argument("--markdown", action="store_true", help="print the fit-quality table as Markdown")
    fit.set_defaults(func=_cmd_fit)

    gen = tsub.add_parser("generate", help="write a seeded synthetic workload")
    gen.add_argument("workload", choices=sorted(WORKLOADS))
    gen.add_argument("-o", "--out", required=True, help="output JSONL file")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--agents", type=int, default=None, help="number of sessions (agents)")
    gen.add_argument("--rate", type=float, default=None,
                     help="open arrivals: agents per minute (default: closed-loop pool, start_s=None)")
    gen.set_defaults(func=_cmd_generate)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _report_skipped(skipped: list) -> None:
    for line in skipped_lines(skipped):
        print(line, file=sys.stderr)


def _load(files: list[str], fmt: str | None, skip_bad: bool):
    sessions, skipped = [], []
    for f in files:  # each a workload spec (replay.traces.importers.spec), --from forcing the format
        w = read_workload(f, fmt, skip_bad=skip_bad, require_sessions=False)  # the caller says "no session"
        sessions += w.sessions
        skipped += w.skipped
    return sessions, skipped


def _cmd_import(args: argparse.Namespace) -> int:
    try:  # the shared loader: a folder's broken files are skipped and listed, the rest imported
        w = read_workload(args.src, args.format, skip_bad=args.skip_bad, require_sessions=False,
                          block_tokens=args.block_tokens)
    except (TraceFormatError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not w.sessions:  # never "wrote 0 sessions": an empty result is an error
        _report_skipped(w.skipped)
        print(f"error: {args.src}: no session imported", file=sys.stderr)
        return 1
    n = save_sessions(args.out, w.sessions)
    reqs = sum(1 for s in w.sessions for _ in s.requests())
    print(f"wrote {n} session(s), {reqs} request(s) to {args.out}")
    for note in w.notes:
        print(f"note: {note}")
    _report_skipped(w.skipped)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    try:
        w = read_workload(args.src, args.fmt, skip_bad=args.skip_bad, require_sessions=False)
        if not w.sessions:
            _report_skipped(w.skipped)
            print(f"error: {args.src}: no session to export", file=sys.stderr)
            return 1
        res = export_sessions(args.out, w.sessions, args.format, args.block_tokens)
    except (TraceFormatError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(res.rows)} {args.format} row(s) of {len(w.sessions)} session(s) to {args.out}; "
          f"hash_ids blocks of {res.block_tokens} tokens (give this block size to the replay tool, and "
          f"--block-tokens {res.block_tokens} to evolving trace import)")
    for note in w.notes + res.notes:
        print(f"note: {note}")
    _report_skipped(w.skipped)
    return 0


def load_workload(spec: str, fmt: str | None = None) -> tuple[list, str]:
    """Sessions of a workload spec (see the module docstring) and a label for it: the shared
    parser ``replay.traces.importers.spec.load_workload``. Raises ``ValueError``
    (``WorkloadSpecError``) / ``TraceFormatError`` / ``OSError`` with a one-line message."""
    w = read_workload(spec, fmt)
    _report_skipped(w.skipped)  # a folder's unreadable files: listed, the rest served
    return w.sessions, w.label


def _cmd_compare_workloads(args: argparse.Namespace) -> int:
    from replay.traces.fit import (  # lazy: start-up (evolving --help skips scipy.stats: +630 ms)
        compare,
        format_compare,
    )

    loaded = []
    for spec in args.compare:
        try:
            loaded.append(load_workload(spec, args.fmt))
        except (TraceFormatError, OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    (a, na), (b, nb) = loaded
    rows, rates = compare(a, b)
    print(format_compare(rows, rates, f"{na} ({len(a)} sessions)", f"{nb} ({len(b)} sessions)",
                         markdown=args.markdown))
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from replay.traces.fit import (  # lazy: start-up (evolving --help skips scipy.stats: +630 ms)
        compare,
        fit_cc,
        format_compare,
    )

    try:
        sessions, _ = load_workload(args.src, args.fmt)
    except (TraceFormatError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    params = fit_cc(sessions)
    gen = generate("cc", seed=0, agents=args.check_agents, params=params)
    rows, rates = compare(sessions, gen)
    doc = {"workload": "cc", "source": args.src, "sessions": len(sessions),
           "command": f"evolving trace fit {args.src} -o {args.out}",
           "params": params.to_json(),
           "fit": {"check": f"gen:cc:agents={args.check_agents}:seed=0",
                   "ks": {r.name: (None if r.ks is None else round(r.ks, 4)) for r in rows},
                   "rates": {k: [round(a, 5), round(b, 5)] for k, (a, b) in rates.items()}}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # a list on one line
    out.write_text(text + "\n")
    print(f"fitted the CC generator to {len(sessions)} session(s); wrote {out}")
    print(format_compare(rows, rates, f"data: {args.src}", f"generator: {doc['fit']['check']}",
                         markdown=args.markdown))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    if args.compare:
        return _cmd_compare_workloads(args)
    if not args.files:
        print("error: give FILE... or --compare A B", file=sys.stderr)
        return 2
    try:
        sessions, skipped = _load(args.files, args.fmt, args.skip_bad)
    except (TraceFormatError, OSError, ValueError) as exc:
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
    sessions = generate(args.workload, seed=args.seed, agents=args.agents, rate_per_min=args.rate)
    n = save_sessions(args.out, sessions)
    print(f"wrote {n} {args.workload} session(s) (seed {args.seed}) to {args.out}")
    return 0


# --------------------------------------------------------------------------- simulator
def _register_sim(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """``replay``, ``compare``, ``sweep-static``, ``sim-report`` and ``bench sim`` (see replay/sim/cli.py)."""
    register_sim(sub, bench)
