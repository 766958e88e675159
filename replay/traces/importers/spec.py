"""Workload specs: the one parser every command that takes a trace uses.

``evolving replay|compare|sweep-static --trace SPEC``, ``evolving trace stats FILE...`` and
``--compare A B``, ``evolving trace fit SRC`` and ``evolving drive SPEC`` all read a workload
through :func:`load_workload`. A spec is one of:

- ``FORMAT:PATH``: import ``PATH`` with a named importer, ``FORMAT`` one of
  ``replay.traces.importers.FORMATS`` (``weka``/``kv-cache-tester``, ``mooncake``, ``agentic-mooncake``, ``claude-code``) or
  ``sessions`` (our session JSONL), e.g. ``mooncake:trace.jsonl``.
- ``gen:NAME[:key=value]...``: a generator (``replay.traces.workloads``), keys ``agents`` (default:
  the workload's), ``seed`` (0), ``params`` (a fit file, CC only) and ``pace`` (``recorded``
  default, ``agent[:T[:H]]``, ``scale:X``), e.g. ``gen:cc:agents=126:seed=1``.
- ``PATH``: a file or folder whose format is **detected from its content** (the first file of a
  folder, gunzipped if need be): a line with ``format_version`` is session JSONL, a document with
  ``hash_id_scope``/``requests`` is kv-cache-tester JSON, a line with ``request_id``,
  ``hash_ids`` and one of ``wait_for``/``prefix_reset``/``tool_wait_ms``/``branches`` is an agentic
  Mooncake trace, a line with ``input_length`` and ``hash_ids`` is a Mooncake request trace, a line with ``sessionId``/``parentUuid`` is a raw
  Claude Code transcript. Content with none of these falls back on the name (``.jsonl``: session
  JSONL; ``.json``/``.json.gz``: kv-cache-tester), so a broken file gets the error of the format
  its name claims.

**Folders are read leniently** (:func:`load_workload`): every file of a folder is read on its
own, and a file that cannot be read (empty, binary, gzip where text is expected, truncated or
broken JSON, a bad record without ``skip_bad``) is skipped and listed in
:attr:`Workload.skipped` (``FILE:LINE: FIELD: reason``) while the other files are served; with
``skip_bad`` bad records are skipped one by one instead. (Claude Code transcript folders are one
unit, sub-agent files joining their session: only empty and binary files are skipped there.) A
single file stays strict, and a workload with no session left is a :class:`WorkloadSpecError`.
Commands print :func:`skipped_lines`.

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
from replay.traces.importers import BLOCK_TOKENS_FORMATS, FORMATS, get_importer
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


_AGENTIC_KEYS = ('"wait_for"', '"prefix_reset"', '"tool_wait_ms"', '"branches"')


def _told(first: str) -> str | None:
    if '"format_version"' in first:
        return SESSIONS
    if '"hash_id_scope"' in first or ('"requests"' in first and first.startswith("{")):
        return "weka"
    if '"request_id"' in first and '"hash_ids"' in first and any(k in first for k in _AGENTIC_KEYS):
        return "agentic-mooncake"
    if ('"input_length"' in first or '"input_tokens"' in first) and '"hash_ids"' in first:
        return "mooncake"
    if '"sessionId"' in first or '"parentUuid"' in first:
        return "claude-code"
    return None


def _candidates(p: Path, first: Path, limit: int = 64) -> list[Path]:
    if not p.is_dir():
        return [first]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_TRACE_SUFFIXES))
    top = [f for f in files if f.parent == p]
    return [first] + [f for f in (top or files) if f != first][: limit - 1]


def detect_format(path: str | Path) -> str:
    """The format of a trace file or folder, told by its content (module docstring); raises
    :class:`WorkloadSpecError` when the path does not exist or a folder holds no trace file."""
    p = Path(path)
    if not p.exists():
        raise WorkloadSpecError(f"{p}: no such file or directory (a trace path, FORMAT:PATH or gen:NAME)")
    f = _first_file(p)
    if f is None:
        raise WorkloadSpecError(f"{p}: no trace file (*.jsonl, *.json, *.json.gz) in this folder")
    for cand in _candidates(p, f):  # the first file whose content tells (a broken one does not)
        told = _told(_head(cand).lstrip()[:4096])
        if told is not None:
            return told
    if p.is_dir():  # by the names: session JSONL files, else kv-cache-tester documents
        return SESSIONS if any(p.glob("*.jsonl")) else "weka"
    return "weka" if f.name.endswith((".json", ".json.gz")) else SESSIONS


# --------------------------------------------------------------------------- loading
def load_workload(spec: str, fmt: str | None = None, *, skip_bad: bool = False,
                  require_sessions: bool = True, block_tokens: int | None = None) -> Workload:
    """The sessions of a workload spec. Raises :class:`WorkloadSpecError` (a bad spec, an unknown
    format, a missing path, no session) or the importer's ``TraceFormatError`` (``FILE:LINE:
    FIELD: message``; with ``skip_bad`` bad records are skipped and listed instead), each one line.
    A folder is read leniently (module docstring): its unreadable files are skipped and listed in
    ``skipped``. ``require_sessions=False``: a workload with no session is returned (the caller
    reports it). ``block_tokens``: the block size of a Mooncake / agentic Mooncake trace's
    ``hash_ids`` (default 512)."""
    s = parse_spec(spec, fmt)
    if s.kind == "gen":
        return _generate(s)
    use = s.fmt or detect_format(s.path)
    if not Path(s.path).exists():
        raise WorkloadSpecError(f"{s.path}: no such file or directory")
    if block_tokens is not None and use not in BLOCK_TOKENS_FORMATS:
        raise WorkloadSpecError(f"{s.path}: a block size is only given for {' and '.join(BLOCK_TOKENS_FORMATS)} "
                                f"traces ({use} files carry their own)")
    w = Workload([], s.text, use)
    p = Path(s.path)
    if p.is_dir() and use != "claude-code":
        files = folder_files(use, p)
        if not files:
            raise WorkloadSpecError(f"{p}: no {use} trace file in this folder")
        for f in files:
            try:
                part = _load_file(use, f, skip_bad, block_tokens)
            except TraceFormatError as exc:
                why = exc.message if exc.field == "(file)" else f"{exc.message} (file skipped)"
                w.skipped.append(TraceFormatError(exc.file, exc.line, exc.field, why))
                continue
            except (OSError, UnicodeDecodeError) as exc:
                w.skipped.append(TraceFormatError(str(f), 0, "(file)", f"cannot read: {exc} (file skipped)"))
                continue
            w.sessions += part.sessions
            w.skipped += part.skipped
            w.notes += part.notes
    elif use == "claude-code":
        res = get_importer(use)(s.path, skip_bad=skip_bad, skip_bad_files=p.is_dir())
        w.sessions, w.skipped, w.notes = res.sessions, res.skipped, res.notes
    else:
        part = _load_file(use, p, skip_bad, block_tokens)
        w.sessions, w.skipped, w.notes = part.sessions, part.skipped, part.notes
    if not w.sessions and require_sessions:
        raise WorkloadSpecError(f"{s.path}: no session ({use} format"
                                + (f"; {len(w.skipped)} bad file(s)/record(s) skipped, first: {w.skipped[0]}"
                                   if w.skipped else "") + ")")
    return w


def folder_files(fmt: str, folder: Path) -> list[Path]:
    """The trace files of a folder that ``fmt`` reads, sorted by name: session JSONL ``*.jsonl`` /
    ``*.json``; kv-cache-tester ``*.json`` / ``*.json.gz``; (agentic) Mooncake ``*.jsonl``."""
    suffixes = {SESSIONS: (".jsonl", ".json"), "weka": (".json", ".json.gz"),
                "kv-cache-tester": (".json", ".json.gz")}.get(fmt, (".jsonl",))
    return sorted((f for f in folder.iterdir() if f.is_file() and f.name.endswith(suffixes)), key=lambda f: f.name)


def _load_file(use: str, f: Path, skip_bad: bool, block_tokens: int | None) -> Workload:
    w = Workload([], str(f), use)
    try:
        if use == SESSIONS:
            w.sessions = load_sessions(f, w.skipped if skip_bad else None)
            return w
        kw = {"block_tokens": block_tokens} if block_tokens is not None else {}
        res = get_importer(use)(f, skip_bad=skip_bad, **kw)
    except RecursionError:  # the depth checks before decoding should make this unreachable
        raise TraceFormatError(str(f), 0, "(json)", "nested too deeply to read (Python's recursion "
                                                     "limit)") from None
    w.sessions, w.skipped, w.notes = res.sessions, res.skipped, res.notes
    return w


def skipped_lines(skipped: list[TraceFormatError]) -> list[str]:
    """What a command prints about the skipped files and records (stderr), one per line."""
    if not skipped:
        return []
    files = sum(1 for e in skipped if e.field == "(file)" or e.message.endswith("(file skipped)"))
    head = (f"skipped {files} bad file(s) and {len(skipped) - files} bad record(s)" if files
            else f"skipped {len(skipped)} bad record(s)")
    return [f"{head} (the rest is served):", *(f"  {e}" for e in skipped)]


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


__all__ = ["SESSIONS", "Spec", "Workload", "WorkloadSpecError", "detect_format", "folder_files", "formats",
           "load_workload", "parse_spec", "skipped_lines"]
