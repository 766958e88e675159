"""Importer for Mooncake-format request traces (one request per JSONL line).

A line is ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` with
``hash_ids`` one id per block of ``block_tokens`` (512) tokens, the last one covering the
partial tail block when ``input_length`` is not a multiple. There are no session ids.

Rules (stated in ``docs/traces.md`` too):

- Blocks: the ids of the ``input_length // block_tokens`` *full* blocks, namespaced with
  ``namespaced_hash("mooncake:<file stem>", id)``; the partial block's id is dropped (our
  format never hashes a partial block) and ``tail_tokens`` is the remainder. Sessions keep
  ``block_tokens = 512``: the simulator re-cuts them to its own block size
  (``replay.traces.format.reblock``), so every token is charged as the trace says.
- **Sessions are inferred** (requests are read in arrival order, ties in file order). A
  request ``R`` continues session ``S`` when all of these hold for ``S``'s *last* request
  ``L`` (a session is a chain of turns, one in flight at a time):

  1. ``L``'s full blocks are a **proper prefix** of ``R``'s (``R`` extends the whole previous
     prompt by at least one full block, as the next chat turn appends the answer and new
     input). An identical prompt is not a next turn: it is another user of the same content.
  2. ``L``'s last block is **extended by one block only** across the whole file (its fan-out
     is 1). A prefix that different requests extend differently (a system prompt, a shared
     document) is cross-session reuse, not one conversation's history.
  3. ``R`` arrives after ``L`` and at most ``max_gap_s`` (default 1,800 s, the usual idle
     timeout of a session) later.

  Among several such sessions the longest ``L`` wins, ties to the latest arrival. Otherwise
  ``R`` starts a new session. Each session is one branch. The shared prefix of requests that
  did not join stays visible as cross-session prefix reuse (same block hashes).
- Timing stays open-loop: ``Session.start_s`` = first arrival (s), each request
  ``at_s`` = arrival - session start. ``pause_s`` = gap since the previous arrival in the
  session (the source has no service times; the replay uses ``at_s``).

**Rows with a ``session_id``** (Dynamo's and aiperf's multi-turn Mooncake rows; Dynamo:
``lib/data-gen/src/mooncake.rs``, ``MooncakeRow``, read by ``lib/mocker/src/loadgen/trace.rs``,
``Trace::from_mooncake``) are not inferred: rows sharing a ``session_id`` are the turns of one
session, in file order (session id = ``session_id``, one branch ``main``). The first turn
arrives at its ``timestamp`` (``start_s``; none: ``start_s = None``, a closed-loop pool); a
later turn with ``delay`` (ms) is closed loop (``pause_s = delay``, after the previous
response); a later turn with only a ``timestamp`` keeps its arrival (``at_s``, ``pause_s`` the
gap since the previous arrival); neither: ``pause_s = 0``. A ``delay`` on a first turn is a bad
record (Dynamo refuses it too). Rows without ``session_id`` in the same file are inferred as
above. The upstream aliases ``input_tokens``, ``output_tokens``, ``created_time``, ``delay_ms``
are read when the canonical field is absent. ``block_tokens`` (``--block-tokens``) is the
block size of ``hash_ids`` (default 512).

**The delta convention** (``mooncake-delta``: aiperf's ``mooncake_trace`` multi-turn rows,
Dynamo's ``--trace-format mooncake-delta``; :func:`import_mooncake_delta`): a session's later
row gives only the turn's new input; the prompt is the previous prompt, the previous answer
(``output_length`` tokens) and the new input. Its full blocks are the previous prompt's, then
fresh ids (history no other request shares: the answer and the realignment), then the row's
full-block ``hash_ids``, so every turn extends the last and the lengths add up exactly.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from pathlib import Path

from events.hashing import namespaced_hash
from replay.traces.format import Branch, End, Request, Session
from replay.traces.importers._common import ImportResult, Problems, json_lines

MOONCAKE_BLOCK_TOKENS = 512
MAX_GAP_S = 1800.0


#: Upstream Mooncake field names Dynamo accepts on input (``MooncakeRow``'s serde aliases).
ALIASES = {"input_length": "input_tokens", "output_length": "output_tokens", "timestamp": "created_time",
           "delay": "delay_ms"}


def field(rec: dict, key: str):
    """``rec[key]``, or its upstream alias (:data:`ALIASES`) when the canonical name is absent."""
    if key in rec or key not in ALIASES:
        return rec.get(key)
    return rec.get(ALIASES[key])


def _int_field(rec: dict, key: str, file: str, line: int, problems: Problems, *,
               required: bool = True) -> int | None:
    v = field(rec, key)
    if v is None:
        if required:
            problems.bad(file, line, key, "missing field")
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        problems.bad(file, line, key, f"must be a non-negative number, got {v!r}")
        return None
    return v  # type: ignore[return-value]


class _Row:
    """One good line: arrival (s) or ``None``, line, full-block ids, lengths, session id, delay (s)."""

    __slots__ = ("delay", "full", "line", "n_in", "n_out", "sid", "t")

    def __init__(self, t, line, full, n_in, n_out, sid=None, delay=None):
        self.t, self.line, self.full, self.n_in, self.n_out, self.sid, self.delay = (
            t, line, full, n_in, n_out, sid, delay)


def _rows(src: str | os.PathLike[str], problems: Problems, block_tokens: int) -> list[_Row]:
    """Every good line of the file, in file order."""
    file = str(src)
    out = []
    for lineno, rec in json_lines(src, problems):
        sid = rec.get("session_id")
        if sid is not None and not isinstance(sid, str):
            problems.bad(file, lineno, "session_id", f"must be a string, got {sid!r}")
            continue
        ts = _int_field(rec, "timestamp", file, lineno, problems, required=sid is None)
        if ts is None and (sid is None or field(rec, "timestamp") is not None):
            continue
        n_in = _int_field(rec, "input_length", file, lineno, problems)
        n_out = _int_field(rec, "output_length", file, lineno, problems) if n_in is not None else None
        if n_out is None or n_in is None:
            continue
        delay = None
        if sid is not None and field(rec, "delay") is not None:
            delay = _int_field(rec, "delay", file, lineno, problems)
            if delay is None:
                continue
        ids = rec.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            problems.bad(file, lineno, "hash_ids", "missing or not a list of integers")
            continue
        n_full = int(n_in) // block_tokens
        if not n_full <= len(ids) <= n_full + 1:
            problems.bad(file, lineno, "hash_ids",
                         f"{len(ids)} ids for input_length={n_in} (expect {n_full} or {n_full + 1})")
            continue
        out.append(_Row(None if ts is None else ts / 1000.0, lineno, tuple(ids[:n_full]), int(n_in), int(n_out),
                        sid, None if delay is None else delay / 1000.0))
    return out


def _records(src: str | os.PathLike[str], problems: Problems,
             block_tokens: int) -> list[tuple[float, int, tuple[int, ...], int, int]]:
    """``(arrival s, line, full-block ids, input_length, output_length)`` of every good line."""
    out = [(r.t, r.line, r.full, r.n_in, r.n_out) for r in _rows(src, problems, block_tokens)]
    out.sort(key=lambda r: (r[0], r[1]))
    return out  # type: ignore[return-value]


def infer_sessions(recs: list[tuple[float, tuple[int, ...]]], max_gap_s: float = MAX_GAP_S) -> list[list[int]]:
    """Group requests ``(arrival s, full-block ids)`` (sorted by arrival) into sessions by the
    rules of the module docstring; returns the request indices of each session, in order."""
    successors: dict[int, set[int]] = defaultdict(set)
    for _t, ids in recs:
        for a, b in itertools.pairwise(ids):
            successors[a].add(b)
    sessions: list[list[int]] = []
    tips: dict[int, list[int]] = defaultdict(list)  # last block of a session's last prompt -> sessions
    for i, (t, ids) in enumerate(recs):
        best: tuple[int, float, int] | None = None  # (tip length, tip arrival, session)
        for k in range(len(ids) - 1, 0, -1):  # proper prefixes, longest first
            if len(successors[ids[k - 1]]) != 1:
                continue
            for sid in tips.get(ids[k - 1], ()):
                j = sessions[sid][-1]
                tip_t, tip = recs[j]
                if len(tip) == k and tip == ids[:k] and tip_t < t <= tip_t + max_gap_s:
                    cand = (k, tip_t, sid)
                    if best is None or cand[:2] > best[:2]:
                        best = cand
            if best is not None:
                break
        if best is None:
            sid = len(sessions)
            sessions.append([i])
        else:
            sid = best[2]
            old = recs[sessions[sid][-1]][1]
            tips[old[-1]].remove(sid)
            sessions[sid].append(i)
        if ids:
            tips[ids[-1]].append(sid)
    return sessions


def _accumulate(rows: list[_Row], block_tokens: int) -> list[_Row]:
    """Delta rows (module docstring) as cumulative ones; rows without a session id unchanged.
    History blocks get negative ids (a trace's own ids are what it wrote: never negative here)."""
    last: dict[str, _Row] = {}
    fresh = itertools.count(1)
    out = []
    for r in rows:
        prev = last.get(r.sid) if r.sid is not None else None
        if prev is not None:
            n_in = prev.n_in + prev.n_out + r.n_in
            need = n_in // block_tokens - len(prev.full)
            own = r.full[len(r.full) - need:] if 0 < need <= len(r.full) else r.full if need > 0 else ()
            full = prev.full + tuple(-next(fresh) for _ in range(need - len(own))) + own
            r = _Row(r.t, r.line, full, n_in, r.n_out, r.sid, r.delay)
        if r.sid is not None:
            last[r.sid] = r
        out.append(r)
    return out


def import_mooncake_delta(
    src: str | os.PathLike[str], skip_bad: bool = False, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_gap_s: float = MAX_GAP_S,
) -> ImportResult:
    """Import Mooncake rows written in the delta convention (module docstring)."""
    return import_mooncake(src, skip_bad, block_tokens, max_gap_s, delta=True)


def import_mooncake(
    src: str | os.PathLike[str], skip_bad: bool = False, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_gap_s: float = MAX_GAP_S, delta: bool = False,
) -> ImportResult:
    """Import a Mooncake JSONL file into sessions (see the module docstring for the rules);
    ``delta``: its session rows give each later turn's new input only."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    res = ImportResult()
    problems = Problems(skip_bad, res)
    stem = Path(src).stem
    ns = f"mooncake:{stem}"
    rows = _rows(src, problems, block_tokens)
    if delta:
        rows = _accumulate(rows, block_tokens)
    cache: dict[int, int] = {}

    def blocks_of(full: tuple[int, ...]) -> list[int]:
        return [cache[h] if h in cache else cache.setdefault(h, namespaced_hash(ns, h)) for h in full]

    unlabelled = sorted((r for r in rows if r.sid is None), key=lambda r: (r.t, r.line))
    recs = [(r.t, r.line, r.full, r.n_in, r.n_out) for r in unlabelled]
    groups = infer_sessions([(r[0], r[2]) for r in recs], max_gap_s)
    width = max(5, len(str(len(groups))))
    for k, idx in enumerate(groups):
        t0 = recs[idx[0]][0]
        steps = []
        prev = t0
        for i in idx:
            t, _line, full, n_in, n_out = recs[i]
            steps.append(Request(blocks=blocks_of(full), tail_tokens=n_in - len(full) * block_tokens,
                                 output_tokens=n_out, pause_s=max(0.0, t - prev), at_s=max(0.0, t - t0)))
            prev = t
        steps.append(End())
        res.sessions.append(Session(id=f"{stem}-{k:0{width}d}", block_tokens=block_tokens,
                                    source=f"mooncake:{Path(src).name}", start_s=t0,
                                    branches=[Branch(id="main", steps=steps)]))
    labelled: dict[str, list[_Row]] = {}
    for r in rows:
        if r.sid is not None:
            labelled.setdefault(r.sid, []).append(r)
    for sid, turns in labelled.items():
        if turns[0].delay:
            problems.bad(str(src), turns[0].line, "delay",
                         f"the first turn of session {sid!r} cannot have a delay (it starts at its timestamp)")
            turns = turns[1:]
            if not turns:
                continue
        s = _labelled_session(sid, turns, blocks_of, block_tokens, f"mooncake:{Path(src).name}")
        res.sessions.append(s)
    return res


def _labelled_session(sid: str, turns: list[_Row], blocks_of, block_tokens: int, source: str) -> Session:
    """The turns of one ``session_id`` (module docstring): the first at its timestamp, later ones
    closed loop after ``delay``, or open loop at their ``timestamp`` when they have no delay."""
    t0 = turns[0].t
    open_loop = any(r.delay is None and r.t is not None for r in turns[1:])
    steps: list = []
    prev_t = t0
    for i, r in enumerate(turns):
        at_s = pause = None
        if i == 0:
            pause, at_s = 0.0, (0.0 if open_loop and t0 is not None else None)
        elif r.delay is not None:
            pause = r.delay
        elif r.t is not None:
            at_s = max(0.0, r.t - (t0 or 0.0))
            pause = max(0.0, r.t - prev_t) if prev_t is not None else 0.0
        else:
            pause = 0.0
        if r.t is not None:
            prev_t = r.t
        steps.append(Request(blocks=blocks_of(r.full), tail_tokens=r.n_in - len(r.full) * block_tokens,
                             output_tokens=r.n_out, pause_s=pause, at_s=at_s))
    steps.append(End())
    return Session(id=sid, block_tokens=block_tokens, source=source, start_s=t0,
                   branches=[Branch(id="main", steps=steps)])
