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


def _int_field(rec: dict, key: str, file: str, line: int, problems: Problems) -> int | None:
    v = rec.get(key)
    if v is None:
        problems.bad(file, line, key, "missing field")
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        problems.bad(file, line, key, f"must be a non-negative number, got {v!r}")
        return None
    return v  # type: ignore[return-value]


def _records(src: str | os.PathLike[str], problems: Problems,
             block_tokens: int) -> list[tuple[float, int, tuple[int, ...], int, int]]:
    """``(arrival s, line, full-block ids, input_length, output_length)`` of every good line."""
    file = str(src)
    out = []
    for lineno, rec in json_lines(src, problems):
        ts = _int_field(rec, "timestamp", file, lineno, problems)
        n_in = _int_field(rec, "input_length", file, lineno, problems) if ts is not None else None
        n_out = _int_field(rec, "output_length", file, lineno, problems) if n_in is not None else None
        if n_out is None or ts is None or n_in is None:
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
        out.append((ts / 1000.0, lineno, tuple(ids[:n_full]), int(n_in), int(n_out)))
    out.sort(key=lambda r: (r[0], r[1]))
    return out


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


def import_mooncake(
    src: str | os.PathLike[str], skip_bad: bool = False, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_gap_s: float = MAX_GAP_S,
) -> ImportResult:
    """Import a Mooncake JSONL file into sessions (see the module docstring for the rules)."""
    res = ImportResult()
    problems = Problems(skip_bad, res)
    stem = Path(src).stem
    ns = f"mooncake:{stem}"
    recs = _records(src, problems, block_tokens)
    groups = infer_sessions([(r[0], r[2]) for r in recs], max_gap_s)
    width = max(5, len(str(len(groups))))
    cache: dict[int, int] = {}
    for k, idx in enumerate(groups):
        t0 = recs[idx[0]][0]
        steps = []
        prev = t0
        for i in idx:
            t, _line, full, n_in, n_out = recs[i]
            blocks = [cache[h] if h in cache else cache.setdefault(h, namespaced_hash(ns, h)) for h in full]
            steps.append(Request(blocks=blocks, tail_tokens=n_in - len(full) * block_tokens,
                                 output_tokens=n_out, pause_s=max(0.0, t - prev), at_s=max(0.0, t - t0)))
            prev = t
        steps.append(End())
        res.sessions.append(Session(id=f"{stem}-{k:0{width}d}", block_tokens=block_tokens,
                                    source=f"mooncake:{Path(src).name}", start_s=t0,
                                    branches=[Branch(id="main", steps=steps)]))
    return res
