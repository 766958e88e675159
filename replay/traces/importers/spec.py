"""Workload specs: the one parser every command that takes a trace uses.

``evolving replay|compare|sweep-static --trace SPEC``, ``evolving trace stats FILE...`` and
``--compare A B``, ``evolving trace fit SRC`` and ``evolving drive SPEC`` all read a workload
through :func:`load_workload`. A spec is one of:

- ``FORMAT:PATH``: import ``PATH`` with a named importer, ``FORMAT`` one of
  ``replay.traces.importers.FORMATS`` (``weka``/``kv-cache-tester``, ``mooncake``, ``claude-code``) or
  ``sessions`` (our session JSONL), e.g. ``mooncake:trace.jsonl``.
- ``gen:NAME[:key=value]...``: a generator (``replay.traces.workloads``), keys ``agents`` (default:
  the workload's), ``seed`` (0), ``params`` (a fit file, CC only) and ``pace`` (``recorded``
  default, ``agent[:T[:H]]``, ``scale:X``), e.g. ``gen:cc:agents=126:seed=1``.
- ``PATH``: a file or folder whose format is **detected from its content** (the first file of a
  folder, gunzipped if need be): a line with ``format_version`` is session JSONL, a document with
  ``hash_id_scope``/``requests`` is kv-cache-tester JSON, a line with ``input_length`` and
  ``hash_ids`` is a Mooncake request trace, a line with ``sessionId``/``parentUuid`` is a raw
  Claude Code transcript. Content with none of these falls back on the name (``.jsonl``: session
  JSONL; ``.json``/``.json.gz``: kv-cache-tester), so a broken file gets the error of the format
  its name claims.

``HEAD:REST`` where ``HEAD`` looks like a format name (letters, digits, ``-``, ``_``) but is none,
and ``HEAD:REST`` is not itself an existing path, is refused in one line
(:class:`WorkloadSpecError`): ``unknown trace format 'foo' in 'foo:x.jsonl'; known: ...``. A bad
record raises the importer's ``TraceFormatError`` (``FILE:LINE: FIELD: message``); with
``skip_bad`` it is collected in :attr:`Workload.skipped` instead. Pure parsing lives in
:func:`parse_spec` (no I/O but the existence test of the whole spec as a path).
"""

from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from replay.traces.format import Session, TraceFormatError, load_sessions
from replay.traces.importers import FORMATS, get_importer
from replay.traces.pacing import pace_sessions, parse_pace
from replay.traces.workloads import WORKLOADS, generate, load_cc_params

#: The explicit name of our own session JSONL format in a ``FORMAT:PATH`` spec.
SESSIONS = "sessions"
_FORMAT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_TRACE_SUFFIXES = (".jsonl", ".json", ".json.gz")


class WorkloadSpecError(ValueError):
    """A workload spec that cannot be read: the message is one line naming the spec."""


@dataclass(frozen=True)
class Spec:
    """A parsed workload spec: ``kind`` is ``gen`` (``name``, ``options``) or ``file``
    (``fmt``: a format name, or ``None`` to detect it from the content; ``path``)."""

    text: str
    kind: str
    fmt: str | None = None
    path: str = ""
    name: str = ""
    options: tuple[tuple[str, str], ...] = ()


@dataclass
class Workload:
    sessions: list[Session]
    label: str
    fmt: str  # the format read ("gen:NAME" for a generator)
    skipped: list[TraceFormatError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def formats() -> tuple[str, ...]:
    return (SESSIONS, *FORMATS)


def parse_spec(spec: str, fmt: str | None = None) -> Spec:
    """Parse ``spec`` (see the module docstring); ``fmt`` (a ``--from`` option) forces the format
    of a plain path. Raises :class:`WorkloadSpecError` with a one-line message."""
    text = str(spec)
    if not text.strip():
        raise WorkloadSpecError("empty workload spec: give a trace path, FORMAT:PATH or gen:NAME")
    known = formats()
    if fmt is not None and fmt not in known:
        raise WorkloadSpecError(f"unknown trace format {fmt!r}; known: {', '.join(known)}")
    if text.startswith("gen:"):
        return _parse_gen(text)
    head, colon, rest = text.partition(":")
    if colon and head in known and not Path(text).exists():
        if fmt is not None and fmt != head:
            raise WorkloadSpecError(f"workload spec {text!r} says format {head!r} but --from says {fmt!r}")
        if not rest:
            raise WorkloadSpecError(f"workload spec {text!r}: no path after {head}:")
        return Spec(text, "file", head, rest)
    if colon and _FORMAT_NAME.fullmatch(head) and len(head) > 1 and not Path(text).exists():
        raise WorkloadSpecError(f"unknown trace format {head!r} in {text!r}; known: {', '.join(known)} "
                                "(or gen:NAME for a generator)")
    return Spec(text, "file", fmt, text)


def _parse_gen(text: str) -> Spec:
    parts: list[str] = []
    for item in text.split(":")[1:]:  # "pace=scale:2": a part without "=" continues the previous
        if parts and "=" not in item and "=" in parts[-1]:
            parts[-1] += ":" + item
        else:
            parts.append(item)
    if not parts or parts[0] not in WORKLOADS:
        raise WorkloadSpecError(f"bad workload spec {text!r}: gen:NAME with NAME one of {', '.join(sorted(WORKLOADS))}")
    opts: dict[str, str] = {}
    for item in parts[1:]:
        key, eq, val = item.partition("=")
        if not eq or key not in ("agents", "seed", "params", "pace"):
            raise WorkloadSpecError(f"bad workload spec {text!r}: {item!r} is not agents=N, seed=S, params=FILE "
                                    "or pace=P")
        opts[key] = val
    try:
        for key in ("agents", "seed"):
            if key in opts:
                int(opts[key])
    except ValueError:
        raise WorkloadSpecError(f"bad workload spec {text!r}: agents and seed are integers") from None
    if "params" in opts and parts[0] != "cc":
        raise WorkloadSpecError(f"bad workload spec {text!r}: params= is for gen:cc only")
    if "pace" in opts:
        try:
            parse_pace(opts["pace"])
        except ValueError as exc:
            raise WorkloadSpecError(f"bad workload spec {text!r}: {exc}") from None
    return Spec(text, "gen", name=parts[0], options=tuple(opts.items()))


# --------------------------------------------------------------------------- detection
def _first_file(path: Path) -> Path | None:
    if not path.is_dir():
        return path
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name.endswith(_TRACE_SUFFIXES))
    top = [f for f in files if f.parent == path]
    return (top or files or [None])[0]


def _head(f: Path, n: int = 65536) -> str:
    with open(f, "rb") as fh:
        raw = fh.read(n)
    if raw.startswith(b"\x1f\x8b"):
        try:
            with gzip.open(f, "rb") as g:
                raw = g.read(n)
        except (OSError, EOFError, zlib.error):
            return ""
    return raw.decode("utf-8", errors="replace")


def detect_format(path: str | Path) -> str:
    """The format of a trace file or folder, told by its content (module docstring); raises
    :class:`WorkloadSpecError` when the path does not exist or a folder holds no trace file."""
    p = Path(path)
    if not p.exists():
        raise WorkloadSpecError(f"{p}: no such file or directory (a trace path, FORMAT:PATH or gen:NAME)")
    f = _first_file(p)
    if f is None:
        raise WorkloadSpecError(f"{p}: no trace file (*.jsonl, *.json, *.json.gz) in this folder")
    first = _head(f).lstrip()[:4096]
    if '"format_version"' in first:
        return SESSIONS
    if '"hash_id_scope"' in first or ('"requests"' in first and first.startswith("{")):
        return "weka"
    if '"input_length"' in first and '"hash_ids"' in first:
        return "mooncake"
    if '"sessionId"' in first or '"parentUuid"' in first:
        return "claude-code"
    if p.is_dir():  # by the names: session JSONL files, else kv-cache-tester documents
        return SESSIONS if any(p.glob("*.jsonl")) else "weka"
    return "weka" if f.name.endswith((".json", ".json.gz")) else SESSIONS


# --------------------------------------------------------------------------- loading
def load_workload(spec: str, fmt: str | None = None, *, skip_bad: bool = False,
                  require_sessions: bool = True) -> Workload:
    """The sessions of a workload spec. Raises :class:`WorkloadSpecError` (a bad spec, an unknown
    format, a missing path, no session) or the importer's ``TraceFormatError`` (``FILE:LINE:
    FIELD: message``; with ``skip_bad`` bad records are skipped and listed instead), each one line.
    ``require_sessions=False``: a workload with no session is returned (the caller reports it)."""
    s = parse_spec(spec, fmt)
    if s.kind == "gen":
        return _generate(s)
    use = s.fmt or detect_format(s.path)
    if not Path(s.path).exists():
        raise WorkloadSpecError(f"{s.path}: no such file or directory")
    w = Workload([], s.text, use)
    if use == SESSIONS:
        w.sessions = load_sessions(s.path, w.skipped if skip_bad else None)
    else:
        res = get_importer(use)(s.path, skip_bad=skip_bad)
        w.sessions, w.skipped, w.notes = res.sessions, res.skipped, res.notes
    if not w.sessions and require_sessions:
        raise WorkloadSpecError(f"{s.path}: no session ({use} format"
                                + (f"; {len(w.skipped)} bad record(s) skipped, first: {w.skipped[0]}" if w.skipped
                                   else "") + ")")
    return w


def _generate(s: Spec) -> Workload:
    opts = dict(s.options)
    params = None
    if "params" in opts:
        if not Path(opts["params"]).is_file():
            raise WorkloadSpecError(f"bad workload spec {s.text!r}: no params file {opts['params']!r}")
        params = load_cc_params(opts["params"])
    agents = int(opts["agents"]) if "agents" in opts else None
    sessions = generate(s.name, seed=int(opts.get("seed", 0)), agents=agents, params=params)
    if "pace" in opts:
        sessions = pace_sessions(sessions, opts["pace"])
    return Workload(sessions, s.text, f"gen:{s.name}")


__all__ = ["SESSIONS", "Spec", "Workload", "WorkloadSpecError", "detect_format", "formats", "load_workload",
           "parse_spec"]
