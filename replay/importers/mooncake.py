"""Importer for Mooncake-format request traces (one request per JSONL line).

A line is ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` with
``hash_ids`` one id per block of ``block_tokens`` (512) tokens, the last one covering the
partial tail block when ``input_length`` is not a multiple. There are no session ids.

Rules (stated in ``docs/traces.md`` too):

- Blocks: the ids of the ``input_length // block_tokens`` *full* blocks, namespaced with
  ``namespaced_hash("mooncake:<file stem>", id)``; the partial block's id is dropped (our
  format never hashes a partial block) and ``tail_tokens`` is the remainder.
- Sessions: a request *continues* a session when the full-block list of an earlier request of
  that session is a prefix of its own (it extends a whole earlier prompt, as the next turn of
  a chat does); the longest such earlier prompt wins, ties to the latest. Otherwise it starts a
  new session (a shared system prompt alone does not join two sessions: it stays cross-session
  reuse). Each session is one branch.
- Timing stays open-loop: ``Session.start_s`` = first arrival (s), each request
  ``at_s`` = arrival - session start. ``pause_s`` = gap since the previous arrival in the
  session (the source has no service times; the replay uses ``at_s``).
"""

from __future__ import annotations

import os
from pathlib import Path

from events.hashing import namespaced_hash
from replay.importers._common import ImportResult, Problems, json_lines
from replay.trace import Branch, End, Request, Session

MOONCAKE_BLOCK_TOKENS = 512


def _int_field(rec: dict, key: str, file: str, line: int, problems: Problems) -> int | None:
    v = rec.get(key)
    if v is None:
        problems.bad(file, line, key, "missing field")
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        problems.bad(file, line, key, f"must be a non-negative number, got {v!r}")
        return None
    return v  # type: ignore[return-value]


def import_mooncake(
    src: str | os.PathLike[str], skip_bad: bool = False, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> ImportResult:
    """Import a Mooncake JSONL file into sessions (see the module docstring for the rules)."""
    res = ImportResult()
    problems = Problems(skip_bad, res)
    file = str(src)
    stem = Path(src).stem
    ns = f"mooncake:{stem}"
    sessions: list[list[tuple[float, Request]]] = []
    by_prefix: dict[tuple[int, ...], int] = {}
    for lineno, rec in json_lines(src, problems):
        ts = _int_field(rec, "timestamp", file, lineno, problems)
        n_in = _int_field(rec, "input_length", file, lineno, problems) if ts is not None else None
        n_out = _int_field(rec, "output_length", file, lineno, problems) if n_in is not None else None
        if n_out is None or ts is None or n_in is None:
            continue
        ids = rec.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            problems.bad(file, lineno, "hash_ids", "missing or not a list of integers")
            continue
        n_full = int(n_in) // block_tokens
        if not n_full <= len(ids) <= n_full + 1:
            problems.bad(file, lineno, "hash_ids",
                         f"{len(ids)} ids for input_length={n_in} (expect {n_full} or {n_full + 1})")
            continue
        full = tuple(ids[:n_full])
        sid = None
        for k in range(len(full), 0, -1):
            sid = by_prefix.get(full[:k])
            if sid is not None:
                break
        if sid is None:
            sid = len(sessions)
            sessions.append([])
        req = Request(blocks=[namespaced_hash(ns, h) for h in full],
                      tail_tokens=int(n_in) - n_full * block_tokens,
                      output_tokens=int(n_out))
        sessions[sid].append((ts / 1000.0, req))
        if full:
            by_prefix[full] = sid
    width = max(5, len(str(len(sessions))))
    for k, reqs in enumerate(sessions):
        t0 = reqs[0][0]
        steps = []
        prev = t0
        for t, r in reqs:
            steps.append(Request(blocks=r.blocks, tail_tokens=r.tail_tokens,
                                 output_tokens=r.output_tokens, pause_s=max(0.0, t - prev),
                                 at_s=max(0.0, t - t0)))
            prev = t
        steps.append(End())
        res.sessions.append(Session(id=f"{stem}-{k:0{width}d}", block_tokens=block_tokens,
                                    source=f"mooncake:{Path(src).name}", start_s=t0,
                                    branches=[Branch(id="main", steps=steps)]))
    return res
