"""Importer for Dynamo's agentic Mooncake traces (one request per JSONL line, with a workflow DAG).

The row schema is Dynamo's ``AgenticMooncakeRow`` (``lib/data-gen/src/mooncake.rs`` in
ai-dynamo/dynamo), read by its replay in ``lib/mocker/src/loadgen/trace.rs``
(``AgenticTrace::from_agentic_mooncake``) and scheduled by ``lib/mocker/src/loadgen/driver.rs``;
Dynamo writes it from request traces in ``lib/data-gen/src/request_trace/agentic.rs``. Fields:

- ``request_id`` (required, unique): names the row. ``session_id``: the agent thread (a main
  agent or a sub-agent); absent: ``request_<line>`` (Dynamo's default), a thread of its own.
- ``input_length`` / ``output_length`` / ``hash_ids`` / ``timestamp`` (ms) / ``delay`` (ms), with
  Dynamo's aliases ``input_tokens``, ``output_tokens``, ``created_time``, ``delay_ms``;
  ``hash_ids`` has one id per block of ``block_tokens`` tokens, the last one covering the
  partial block (as in a Mooncake row). Without ``input_length`` the prompt is
  ``len(hash_ids) * block_tokens`` (Dynamo's rule).
- ``wait_for``: request ids whose responses must have finished before this row is ready; then
  the replay waits ``delay + tool_wait_ms``. A row with no ``wait_for`` starts at its
  ``timestamp`` (open loop; absent: 0).
- ``branches``: the first requests of the threads this row spawned (Dynamo's own replay does not
  read it; checked to be a list of strings, otherwise unused: the children are found through
  their ``wait_for``). ``prefix_reset``: the row starts a fresh context (Dynamo sets it on the
  first row of every thread). ``tool_wait_ms``: the part of the wait spent in tools.
  ``request_kind`` (``foreground``, ``agent``, ``background_agent``), ``tool_events``,
  ``priority``, ``strict_priority``, ``policy_class``, ``routing_constraints``,
  ``output_token_ids``: read past (not in our model; ``request_kind`` only settles a
  sub-agent's ``wait`` when its parent has no later request).

Mapping (also in ``docs/traces.md``):

- Each thread (``session_id``) is a branch, its rows in file order. A thread whose first row
  waits for a row ``R`` of another thread is a **child** of ``R``'s thread (the latest such row
  if several), opened right after ``R``: a ``spawn`` (mode ``subagent``) when that first row has
  ``prefix_reset: true``, else a ``fork`` (it continues the parent's context). A thread whose
  first row waits for no other thread is a **root**: one session per root with its descendants;
  ``Session.id`` = the root's ``session_id``, its branch ``main``; a child branch is named by its
  ``session_id`` without a leading ``<root session_id>/``.
- A child is **waited for** (``wait: true``) when the parent's next row after ``R`` waits for one
  of the child's rows; when the parent has no later row, unless the child's rows say
  ``request_kind: background_agent``. A wait on another thread's row that the tree cannot express
  (a join further down the parent, a cross-tree edge) is dropped and counted in a note.
- A row with ``wait_for`` is closed loop: ``pause_s = (delay + tool_wait_ms) / 1000``;
  ``pause_kind = "tool"`` when the row has ``tool_wait_ms``. The first row of a child: the same
  pause, counted from ``R``'s response (its ``spawn``/``fork`` has pause 0). A row without
  ``wait_for``: the first row of a root starts the session (``start_s = timestamp``; none:
  ``None``, a closed-loop pool; ``pause_s = delay`` if it has one: Dynamo's replay ignores a delay
  there); a later one is pinned to its arrival (``at_s``; open loop, as Dynamo replays it).
- ``prefix_reset: true`` on a later row of a thread: the harness rewrote the context: a
  ``compact`` with that row's full blocks before the request.
- Blocks: the first ``input_length // block_tokens`` ids, ``namespaced_hash("agentic:<file
  stem>", id)`` (one namespace per file: ids are shared by every thread of the file).

Bad rows (a missing or duplicate ``request_id``, a ``wait_for`` naming an unknown or a skipped
row, a dependency cycle, a bad number) are ``TraceFormatError`` naming file, line and field; with
``skip_bad`` they are skipped (and rows that wait for them, in turn).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from events.hashing import namespaced_hash
from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, Step, validate_session
from replay.traces.importers._common import ImportResult, Problems, json_lines
from replay.traces.importers.mooncake import MOONCAKE_BLOCK_TOKENS, field

AGENTIC_BLOCK_TOKENS = MOONCAKE_BLOCK_TOKENS


class _Row:
    __slots__ = ("delay", "full", "kind", "line", "n_in", "n_out", "reset", "rid", "sid", "t", "tool", "wait_for")

    def __init__(self, **kw: Any):
        for k, v in kw.items():
            setattr(self, k, v)


def _num(rec: dict, key: str, file: str, line: int, problems: Problems, *, required: bool = False,
         integer: bool = False) -> tuple[bool, float | None]:
    """(ok, value): ``value`` is None when absent; ``ok`` False after reporting a bad value."""
    v = field(rec, key)
    if v is None:
        if required:
            problems.bad(file, line, key, "missing field")
            return False, None
        return True, None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or v < 0:
        problems.bad(file, line, key, f"must be a non-negative {'integer' if integer else 'number'}, got {v!r}")
        return False, None
    return True, v


def _str_list(rec: dict, key: str, file: str, line: int, problems: Problems) -> list[str] | None:
    v = rec.get(key, [])
    if v is None:
        v = []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        problems.bad(file, line, key, "must be a list of request ids (strings)")
        return None
    return v


def _parse(src: str | os.PathLike[str], problems: Problems, block_tokens: int) -> list[_Row]:
    file = str(src)
    rows: list[_Row] = []
    seen: dict[str, int] = {}
    for lineno, rec in json_lines(src, problems):
        rid = rec.get("request_id")
        if not isinstance(rid, str) or not rid.strip():
            problems.bad(file, lineno, "request_id", "missing, empty or not a string")
            continue
        if rid in seen:
            problems.bad(file, lineno, "request_id", f"duplicates request_id {rid!r} of line {seen[rid]}")
            continue
        sid = rec.get("session_id")
        if sid is not None and not isinstance(sid, str):
            problems.bad(file, lineno, "session_id", f"must be a string, got {sid!r}")
            continue
        vals = {}
        ok = True
        for key, req, integer in (("output_length", True, True), ("input_length", False, True),
                                  ("timestamp", False, False), ("delay", False, False),
                                  ("tool_wait_ms", False, False)):
            ok, vals[key] = _num(rec, key, file, lineno, problems, required=req, integer=integer)
            if not ok:
                break
        if not ok:
            continue
        ids = rec.get("hash_ids")
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            problems.bad(file, lineno, "hash_ids", "missing or not a list of integers")
            continue
        n_in = int(vals["input_length"]) if vals["input_length"] is not None else len(ids) * block_tokens
        n_full = n_in // block_tokens
        if not n_full <= len(ids) <= n_full + 1:
            problems.bad(file, lineno, "hash_ids",
                         f"{len(ids)} ids for input_length={n_in} at {block_tokens}-token blocks "
                         f"(expect {n_full} or {n_full + 1})")
            continue
        wait_for = _str_list(rec, "wait_for", file, lineno, problems)
        if wait_for is None or _str_list(rec, "branches", file, lineno, problems) is None:
            continue
        if rid in wait_for:
            problems.bad(file, lineno, "wait_for", f"request {rid!r} cannot wait for itself")
            continue
        reset = rec.get("prefix_reset")
        if reset is not None and not isinstance(reset, bool):
            problems.bad(file, lineno, "prefix_reset", f"must be true or false, got {reset!r}")
            continue
        kind = rec.get("request_kind")
        seen[rid] = lineno
        t, delay, tool = vals["timestamp"], vals["delay"], vals["tool_wait_ms"]
        rows.append(_Row(rid=rid, sid=sid if sid is not None else f"request_{lineno}", line=lineno,
                         full=tuple(ids[:n_full]), n_in=n_in, n_out=int(vals["output_length"]),
                         t=None if t is None else t / 1000.0, delay=None if delay is None else delay / 1000.0,
                         tool=None if tool is None else tool / 1000.0, wait_for=list(dict.fromkeys(wait_for)),
                         reset=bool(reset), kind=kind if isinstance(kind, str) else ""))
    return _drop_dangling(rows, file, problems)


def _drop_dangling(rows: list[_Row], file: str, problems: Problems) -> list[_Row]:
    """Rows whose ``wait_for`` names no kept row, and rows on a dependency cycle, are bad."""
    while True:
        ids = {r.rid for r in rows}
        bad = [r for r in rows if any(d not in ids for d in r.wait_for)]
        if not bad:
            break
        for r in bad:
            missing = next(d for d in r.wait_for if d not in ids)
            problems.bad(file, r.line, "wait_for", f"waits for unknown or skipped request_id {missing!r}")
        gone = {id(r) for r in bad}
        rows = [r for r in rows if id(r) not in gone]
    by_id = {r.rid: r for r in rows}
    state: dict[str, int] = {}  # 1 visiting, 2 done
    on_cycle: set[str] = set()
    for start in rows:
        if start.rid in state:
            continue
        stack = [(start.rid, iter(start.wait_for))]
        state[start.rid] = 1
        while stack:
            rid, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[rid] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                on_cycle.update(x for x, _ in stack)
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(by_id[nxt].wait_for)))
    if on_cycle:
        for r in rows:
            if r.rid in on_cycle:
                problems.bad(file, r.line, "wait_for", f"request {r.rid!r} is on a dependency cycle")
        return _drop_dangling([r for r in rows if r.rid not in on_cycle], file, problems)
    return rows


def import_agentic_mooncake(src: str | os.PathLike[str], skip_bad: bool = False,
                            block_tokens: int = AGENTIC_BLOCK_TOKENS) -> ImportResult:
    """Import one agentic Mooncake JSONL file (module docstring for the rules)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    res = ImportResult()
    problems = Problems(skip_bad, res)
    file = str(src)
    ns = f"agentic:{Path(src).stem}"
    rows = _parse(src, problems, block_tokens)
    cache: dict[int, int] = {}

    def blocks_of(full: tuple[int, ...]) -> list[int]:
        return [cache[h] if h in cache else cache.setdefault(h, namespaced_hash(ns, h)) for h in full]

    threads: dict[str, list[_Row]] = {}
    for r in rows:
        threads.setdefault(r.sid, []).append(r)
    thread_of = {r.rid: r.sid for r in rows}
    line_of = {r.rid: r.line for r in rows}
    parent_row: dict[str, str] = {}  # child thread -> the parent's row it was opened after
    for sid, rs in threads.items():
        others = [d for d in rs[0].wait_for if thread_of[d] != sid]
        if others:
            parent_row[sid] = max(others, key=lambda d: line_of[d])
    children: dict[str, list[str]] = {}  # parent row -> child threads, by their first row's line
    for sid in sorted(parent_row, key=lambda s: threads[s][0].line):
        children.setdefault(parent_row[sid], []).append(sid)
    dropped = 0
    roots = [sid for sid in threads if sid not in parent_row]
    for root in sorted(roots, key=lambda s: threads[s][0].line):
        tree = [root]
        for sid in tree:  # breadth first: every thread of this root
            tree += [c for r in threads[sid] for c in children.get(r.rid, [])]
        names = _branch_names(root, tree)
        t0 = threads[root][0].t
        open_loop = any(not r.wait_for and r.t is not None for r in threads[root][1:])
        branches = []
        for sid in tree:
            steps: list[Step] = []
            rs = threads[sid]
            for i, r in enumerate(rs):
                first = i == 0
                if r.reset and not first:
                    steps.append(Compact(blocks=blocks_of(r.full)))
                at_s, kind = None, ""
                if r.wait_for:
                    pause = (r.delay or 0.0) + (r.tool or 0.0)
                    kind = "tool" if r.tool is not None else ""
                elif first and sid == root:
                    pause = (r.delay or 0.0) + (r.tool or 0.0)
                    kind = "tool" if r.tool is not None else ""
                    at_s = 0.0 if open_loop and t0 is not None else None
                else:
                    pause = 0.0
                    prev = next((x.t for x in reversed(rs[:i]) if x.t is not None), None)
                    if r.t is not None and prev is not None:
                        pause = max(0.0, r.t - prev)
                    at_s = max(0.0, (r.t or 0.0) - (t0 or 0.0))
                steps.append(Request(blocks=blocks_of(r.full), tail_tokens=r.n_in - len(r.full) * block_tokens,
                                     output_tokens=r.n_out, pause_s=pause, at_s=at_s, pause_kind=kind))
                nxt = rs[i + 1] if i + 1 < len(rs) else None
                for c in children.get(r.rid, []):
                    crow = threads[c]
                    mine = {x.rid for x in crow}
                    if nxt is not None:
                        wait = any(d in mine for d in nxt.wait_for)
                    else:
                        wait = not any(x.kind == "background_agent" for x in crow)
                    op = Spawn if crow[0].reset else Fork
                    steps.append(op(branch=names[c], wait=wait, pause_s=0.0))
                # waits this tree cannot express: on a thread that is not a child opened just before
                expressible = {thread_of[r.rid]} | set(children.get(rs[i - 1].rid, []) if i else [])
                if sid != root and first:
                    expressible.add(thread_of[parent_row[sid]])
                dropped += sum(1 for d in r.wait_for if thread_of[d] not in expressible)
            steps.append(End())
            parent = None if sid == root else names[thread_of[parent_row[sid]]]
            mode = "root" if sid == root else ("subagent" if rs[0].reset else "fork")
            branches.append(Branch(id=names[sid], parent=parent, mode=mode, steps=steps))  # type: ignore[arg-type]
        s = Session(id=root, block_tokens=block_tokens, source=f"agentic-mooncake:{Path(src).name}",
                    start_s=t0, branches=branches)
        errs = validate_session(s)
        if errs:
            problems.bad(file, threads[root][0].line, errs[0][0], f"session {root!r}: {errs[0][1]}")
            continue
        res.sessions.append(s)
    if dropped:
        res.notes.append(f"{dropped} wait_for dependenc{'y' if dropped == 1 else 'ies'} on another thread that the "
                         "session tree cannot express (a join after the request right after the spawn, or a "
                         "wait across sessions) dropped")
    return res


def _branch_names(root: str, tree: list[str]) -> dict[str, str]:
    """Branch ids: ``main`` for the root, a child's ``session_id`` without ``<root>/``; unique."""
    names = {root: "main"}
    used = {"main"}
    for sid in tree[1:]:
        name = sid.removeprefix(f"{root}/") or sid
        if name in used:
            name = sid
        k = 1
        while name in used:
            name, k = f"{sid}~{k}", k + 1
        names[sid] = name
        used.add(name)
    return names
