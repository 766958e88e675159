"""Export sessions to the peers' trace formats, so our workloads replay in their tools.

- ``mooncake``: Mooncake request JSONL, **cumulative**: each row is the request's whole prompt
  (``{"session_id", "timestamp" | "delay", "input_length", "output_length", "hash_ids"}``;
  Dynamo's ``MooncakeRow`` in ``lib/data-gen/src/mooncake.rs``, its replay's default
  ``--trace-format mooncake``; SGLang's bench reads rows this way too).
- ``mooncake-delta``: the same rows with a session's later turns carrying only their **new**
  input (:func:`delta_rows`): aiperf's ``mooncake_trace`` dataset and Dynamo's
  ``--trace-format mooncake-delta`` add the history (earlier prompts and responses) themselves.
- ``agentic-mooncake``: Dynamo's agentic Mooncake rows (``AgenticMooncakeRow``, same file): the
  session tree as a DAG of ``wait_for`` dependencies.

What each format keeps and loses is in ``docs/traces.md`` (§3, "Export"); the importers
(``replay.traces.importers.mooncake`` / ``.agentic``) read the files back, and
``tests/unit/replay/traces/test_export.py`` checks the round trip. Pure but for
:func:`export_sessions` writing the file.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from events.catalog import RequestSubmitted
from replay.traces.format import Compact, Fork, Request, Session, Spawn, reblock, session_events

EXPORT_FORMATS = ("mooncake", "mooncake-delta", "agentic-mooncake")


@dataclass
class ExportResult:
    rows: list[dict[str, Any]]
    block_tokens: int
    notes: list[str] = field(default_factory=list)
    #: per row of :func:`mooncake_rows`: how many leading ``hash_ids`` name full blocks (a last id
    #: past them is a partial tail's, fresh; re-cut sessions can have a tail of a whole block)
    full_ids: list[int] = field(default_factory=list)


class _Ids:
    """Compact ``hash_ids``: each distinct block hash gets the next integer (first appearance, the
    whole export: equal prefixes keep equal ids, as Dynamo's ``RollingHashIdMapper`` does); a
    partial tail block gets a fresh id of its own (it was never hashed: never a hit)."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def fresh(self) -> int:
        n = len(self.ids)
        self.ids[-1 - n] = n  # keys of fresh ids are negative: never a block hash
        return n

    def of(self, req: Request) -> list[int]:
        out = []
        for h in req.blocks:
            i = self.ids.get(h)
            if i is None:
                i = self.ids[h] = len(self.ids)
            out.append(i)
        if req.tail_tokens:
            out.append(self.fresh())
        return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 6)


def _same_block_size(sessions: list[Session], block_tokens: int | None) -> tuple[list[Session], int]:
    if block_tokens is not None:
        if block_tokens <= 0:
            raise ValueError(f"block size must be positive, got {block_tokens}")
        return [reblock(s, block_tokens) for s in sessions], block_tokens
    sizes = sorted({s.block_tokens for s in sessions})
    if len(sizes) > 1:
        raise ValueError(f"the sessions have block sizes {', '.join(map(str, sizes))}: give one (--block-tokens N) "
                         "to re-cut them all")
    return sessions, (sizes[0] if sizes else 512)


def _base(req: Request, ids: _Ids, bt: int) -> dict[str, Any]:
    return {"input_length": len(req.blocks) * bt + req.tail_tokens, "output_length": req.output_tokens,
            "hash_ids": ids.of(req)}


# --------------------------------------------------------------------------- Mooncake
def mooncake_rows(sessions: Iterable[Session], block_tokens: int | None = None) -> ExportResult:
    """One row per request; a session is one ``session_id`` (a chain of turns). A one-branch
    session keeps its steps' timing (first row: ``timestamp`` = start; a request with ``at_s``:
    its ``timestamp``; otherwise ``delay`` = ``pause_s``); a session with sub-agents or forks is
    serialized into one chain in the order an instant-response replay submits its requests
    (``delay`` = the gap between submissions)."""
    ss, bt = _same_block_size(list(sessions), block_tokens)
    ids = _Ids()
    rows: list[dict[str, Any]] = []
    full_ids: list[int] = []
    serialized = compacts = folded = 0
    for s in ss:
        compacts += sum(1 for b in s.branches for st in b.steps if isinstance(st, Compact))
        if len(s.branches) == 1:
            reqs = [st for st in s.branches[0].steps if isinstance(st, Request)]
            timing: list[tuple[float | None, float | None]] = []  # (timestamp s, delay s)
            for i, r in enumerate(reqs):
                if i == 0:
                    if r.pause_s and s.start_s is not None:
                        folded += 1
                    timing.append((None if s.start_s is None else s.start_s + (r.at_s or 0.0) + r.pause_s, None))
                elif r.at_s is not None:
                    timing.append(((s.start_s or 0.0) + r.at_s, None))
                else:
                    timing.append((None, r.pause_s))
        else:
            serialized += 1
            subs = [e for e in session_events(s, 0.0, t0=0.0) if isinstance(e, RequestSubmitted)]
            by_id = {f"{s.id}/{b.id}/{i}": st for b in s.branches for i, st in enumerate(b.steps)}
            reqs = [by_id[e.request] for e in subs]  # type: ignore[misc]
            timing = [((None if s.start_s is None else s.start_s + subs[0].ts), None)]
            timing += [(None, max(0.0, b.ts - a.ts)) for a, b in itertools.pairwise(subs)]
        for r, (ts, delay) in zip(reqs, timing, strict=True):
            row: dict[str, Any] = {"session_id": s.id}
            if ts is not None:
                row["timestamp"] = _ms(ts)
            if delay is not None:
                row["delay"] = _ms(delay)
            row.update(_base(r, ids, bt))
            rows.append(row)
            full_ids.append(len(r.blocks))
    notes = []
    if serialized:
        notes.append(f"{serialized} session(s) with sub-agents or forks serialized into one chain each (Mooncake "
                     "rows have no branches: use agentic-mooncake to keep them)")
    if compacts:
        notes.append(f"{compacts} compaction(s) not kept (the next prompt's hash_ids show the rewrite)")
    if folded:
        notes.append(f"{folded} first-request pause(s) folded into the session's timestamp")
    return ExportResult(rows, bt, notes, full_ids)


# --------------------------------------------------------------------------- Mooncake, deltas
def delta_rows(sessions: Iterable[Session], block_tokens: int | None = None) -> ExportResult:
    """:func:`mooncake_rows` in the delta convention. A session's first row is unchanged; a later
    row's ``input_length`` is what the turn adds after the previous prompt and its answer
    (``input_length - previous input_length - previous output_length``, at least 1: an agent's
    history often keeps less of an answer than was generated, its thinking dropped, and the
    replaying client appends the whole answer it got), its ``hash_ids`` the last
    ``ceil(new / block)`` ids of the whole prompt (the blocks the turn appends). A turn whose
    prompt does not start with the previous prompt's full blocks (a compaction, a serialized
    sub-agent) cannot be a delta: it starts a new ``session_id`` (``<id>#2``, ...) with its whole
    prompt. Notes count both."""
    res = mooncake_rows(sessions, block_tokens)
    bt = res.block_tokens
    out: list[dict[str, Any]] = []
    restarts = clamped = grown = 0
    prev: dict[str, tuple[dict[str, Any], int]] = {}  # session id -> its previous row, its full ids
    part: dict[str, int] = {}  # session id -> its current part (1, then 2 after a restart, ...)
    for row, n_full in zip(res.rows, res.full_ids, strict=True):
        sid, d = row["session_id"], dict(row)
        last, last_full = prev.get(sid, (None, 0))
        prev[sid] = (row, n_full)
        if last is not None:
            new = row["input_length"] - last["input_length"] - last["output_length"]
            # the previous prompt's full blocks but its last (a tail re-cut into a block of its own
            # is named apart from the same tokens inside a longer prompt): a tail's id is fresh
            full = last["hash_ids"][: max(0, last_full - 1)]
            if row["hash_ids"][: len(full)] == full:
                if new < 1:  # the history kept less of the answer than was generated (thinking dropped)
                    clamped, grown = clamped + 1, grown + 1 - new
                    new = 1
                n_ids = -(-new // bt)
                d["input_length"], d["hash_ids"] = new, row["hash_ids"][len(row["hash_ids"]) - n_ids:]
            else:
                restarts += 1
                part[sid] = part.get(sid, 1) + 1
                d.pop("delay", None)  # a session's first turn has no delay (Dynamo and aiperf refuse one)
        if part.get(sid, 1) > 1:
            d["session_id"] = f"{sid}#{part[sid]}"
        out.append(d)
    notes = list(res.notes)
    if clamped:
        notes.append(f"{clamped} turn(s) whose prompt kept less than the previous answer's output tokens sent as "
                     f"1 new token: a replay that appends the whole answer sends {grown} token(s) more in all")
    if restarts:
        notes.append(f"{restarts} turn(s) whose prompt does not extend the previous prompt and answer started a "
                     "new session_id (<id>#2, ...) with their whole prompt (a delta cannot shrink the history)")
    return ExportResult(out, bt, notes)


# --------------------------------------------------------------------------- agentic Mooncake
def _bfs(s: Session) -> list[str]:
    """Branch ids in the order their opening steps are met, breadth first from the root."""
    order = [s.branches[0].id]
    for bid in order:
        order += [st.branch for st in s.branch(bid).steps if isinstance(st, (Fork, Spawn))]
    return order


def agentic_rows(sessions: Iterable[Session], block_tokens: int | None = None) -> ExportResult:
    """One row per request (``request_id`` = ``<session>/<branch>/<step>``, the simulator's
    request id); each branch is a thread (``session_id`` = the session id for the root,
    ``<session>/<branch>`` for the others); forks and spawns become ``wait_for`` edges."""
    ss, bt = _same_block_size(list(sessions), block_tokens)
    ids = _Ids()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    leading = compact_lost = 0
    for s in ss:
        if s.id in seen:
            raise ValueError(f"two sessions are named {s.id!r}: request ids would clash")
        seen.add(s.id)
        root = s.branches[0].id
        # per child branch: (anchor row, pause offset from the anchor's response, waited, kind)
        opened: dict[str, tuple[str | None, float, bool]] = {}
        for bid in _bfs(s):
            b = s.branch(bid)
            thread = s.id if bid == root else f"{s.id}/{bid}"
            anchor, offset, waited = opened.get(bid, (None, 0.0, True))
            kind = "foreground" if bid == root else ("agent" if waited else "background_agent")
            prev_row: dict[str, Any] | None = None
            prev = anchor
            acc = offset
            joins: list[str] = []
            reset = b.mode != "fork"
            first = True
            for i, st in enumerate(b.steps):
                if isinstance(st, Compact):
                    if first:  # the first row's prefix_reset says root/sub-agent vs fork: not a compaction
                        compact_lost += 1
                    else:
                        reset = True
                    continue
                if isinstance(st, (Fork, Spawn)):
                    acc += st.pause_s
                    child = s.branch(st.branch)
                    reqs = [j for j, x in enumerate(child.steps) if isinstance(x, Request)]
                    if prev is None or first and bid != root:
                        leading += 1
                    opened[st.branch] = (prev, acc, st.wait)
                    if st.wait and prev is not None:
                        joins.append(f"{s.id}/{st.branch}/{reqs[-1]}")
                    if prev_row is not None:
                        prev_row.setdefault("branches", []).append(f"{s.id}/{st.branch}/{reqs[0]}")
                    continue
                if not isinstance(st, Request):
                    continue
                rid = f"{s.id}/{bid}/{i}"
                row: dict[str, Any] = {"request_id": rid, "session_id": thread}
                wait_for = ([prev] if prev is not None else []) + joins
                total = st.pause_s + (acc if not joins else 0.0)
                if bid == root and first:
                    if s.start_s is not None:
                        row["timestamp"] = _ms(s.start_s + (st.at_s or 0.0))
                    if st.pause_kind == "tool":
                        row["tool_wait_ms"] = _ms(st.pause_s)
                    elif st.pause_s:
                        row["delay"] = _ms(st.pause_s)  # Dynamo's replay starts it at the timestamp
                    wait_for = []
                elif bid == root and st.at_s is not None and not joins:
                    row["timestamp"] = _ms((s.start_s or 0.0) + st.at_s)
                    wait_for = []
                elif st.pause_kind == "tool":
                    row["delay"] = 0.0
                    row["tool_wait_ms"] = _ms(total)
                else:
                    row["delay"] = _ms(total)
                row.update(_base(st, ids, bt))
                if wait_for:
                    row["wait_for"] = wait_for
                row["prefix_reset"] = reset
                row["request_kind"] = kind
                rows.append(row)
                prev_row, prev, acc, joins, reset, first = row, rid, 0.0, [], False, False
            if reset and not first:
                compact_lost += 1  # a compaction after the branch's last request
    notes = []
    if leading:
        notes.append(f"{leading} fork/spawn step(s) before their branch's first request: the child waits on the "
                     "nearest earlier row (or none: it starts with the session)")
    if compact_lost:
        notes.append(f"{compact_lost} compaction(s) before a branch's first request or after its last one not kept")
    return ExportResult(rows, bt, notes)


def export_sessions(path: str | os.PathLike[str], sessions: Iterable[Session], fmt: str,
                    block_tokens: int | None = None) -> ExportResult:
    """Write ``sessions`` to ``path`` as JSONL in ``fmt`` (one of :data:`EXPORT_FORMATS`)."""
    if fmt == "mooncake":
        res = mooncake_rows(sessions, block_tokens)
    elif fmt == "mooncake-delta":
        res = delta_rows(sessions, block_tokens)
    elif fmt == "agentic-mooncake":
        res = agentic_rows(sessions, block_tokens)
    else:
        raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as fh:
        fh.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in res.rows)
    return res


__all__ = ["EXPORT_FORMATS", "ExportResult", "agentic_rows", "delta_rows", "export_sessions", "mooncake_rows"]
