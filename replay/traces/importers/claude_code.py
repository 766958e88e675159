"""Importer for raw Claude Code transcripts (``~/.claude/projects/<project>/*.jsonl``).

A transcript is JSONL, one record per line. Records used (field names as Claude Code writes
them): ``type`` (``user`` / ``assistant`` / ``system``; others such as ``summary`` or
``file-history-snapshot`` are ignored), ``uuid``, ``parentUuid`` (the message DAG),
``sessionId``, ``timestamp`` (ISO 8601), ``isSidechain`` and ``agentId`` (sub-agent messages,
inline or in ``<session>/subagents/agent-<id>.jsonl``), ``message`` (``role``, ``content``
as a string or a list of ``text`` / ``thinking`` / ``tool_use`` / ``tool_result`` blocks,
and for the assistant ``id``, ``model``, ``usage`` with ``input_tokens``,
``cache_creation_input_tokens``, ``cache_read_input_tokens``, ``output_tokens``), and
``subtype: "compact_boundary"`` (system) / ``isCompactSummary`` (the summary user message).

Rules (also in ``docs/traces.md``):

- **One request per API response.** Claude Code writes one record per content block of a
  response, all sharing ``message.id``: they are counted once (``output_tokens`` = the largest
  value among them). ``<synthetic>`` responses (no API call) are skipped.
- **Prompt.** The request's context is the chain of ``user`` / ``assistant`` records from its
  first record's parent up to the root (``parentUuid``). A compaction boundary has no parent,
  so after one the chain starts at the boundary.
- **Approximate tokenisation** (no tokenizer weights offline; ``Session.approximate = True``):
  each record is rendered as ``"\\n\\n<role>: " + text`` (text of every block; ``tool_use`` as
  its name and JSON input), the chain's UTF-8 bytes are cut into 4-byte tokens (a trailing
  partial token is dropped), which keeps prefixes stable: a context that extends another has
  the same tokens, hence the same block hashes. The system prompt and tool definitions are not
  in the transcript: a *hidden prefix* of ``H`` tokens (a fixed sequence per model, so agents
  of one model share it) is prepended, ``H`` = the thread's first real prompt (``input_tokens
  + cache_creation_input_tokens + cache_read_input_tokens``) minus its visible tokens.
  Blocks are ``block_hashes(tokens, 64, root=namespace_root("claude-code:<model>"))``.
  ``ImportResult.notes`` reports the mean gap between approximate and real prompt lengths.
- **Threads.** ``isSidechain: false`` is branch ``main``; sidechain records are grouped by
  ``agentId`` into branch ``agent-<agentId>`` (mode ``subagent``; without ``agentId``, by the
  first 8 characters of their chain root's uuid), spawned from the main thread at its first
  request's submit time (nested sub-agents are attached to the main thread too). The parent waits for it when its next request was submitted
  after the sub-agent's last response (0.5 s tolerance).
- **Timing.** A request is submitted at the timestamp of its first record's parent (the user
  or tool-result message it answers) and finished at the latest timestamp of its records;
  ``pause_s`` = submit - previous finish in the branch (``>= 0``).
- **Compaction**: the first request whose chain contains a ``compact_boundary`` not seen
  before gets a ``Compact`` (with that request's blocks) before it. **Resume** ("redo from
  here"): a request whose chain does not contain the previous request's response forks a
  child branch ``<branch>~<n>`` that carries on, and the old branch ends.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from events.hashing import block_hashes, namespace_root
from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, Step
from replay.traces.importers._common import ImportResult, Problems, json_lines

BLOCK_TOKENS = 64
BYTES_PER_TOKEN = 4
WAIT_TOLERANCE_S = 0.5
_U32 = 0xFFFFFFFF


@dataclass
class _Rec:
    data: dict[str, Any]
    file: str
    line: int
    ts: float


@dataclass
class _Call:
    """One API request: the records of one ``message.id``."""

    key: str
    recs: list[_Rec] = field(default_factory=list)

    @property
    def first(self) -> _Rec:
        return self.recs[0]


def _parse_ts(v: Any) -> float:
    if not isinstance(v, str):
        raise ValueError("missing or not a string")  # noqa: TRY004 (reported as a format error)
    return datetime.fromisoformat(v).timestamp()


def _render(rec: dict[str, Any]) -> str:
    msg = rec.get("message") or {}
    role = msg.get("role") or rec.get("type")
    content = msg.get("content", "")
    return f"\n\n{role}: " + _text(content)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for b in content:
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            parts.append(str(b.get("text", "")))
        elif kind == "thinking":
            parts.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            parts.append(f"{b.get('name', '')} {json.dumps(b.get('input', {}), sort_keys=True)}")
        elif kind == "tool_result":
            parts.append(_text(b.get("content", "")))
        else:
            parts.append(f"[{kind}]")
    return "\n".join(parts)


def approx_tokens(text: str) -> np.ndarray:
    """The documented approximate tokenisation: 4 UTF-8 bytes per token, remainder dropped."""
    raw = text.encode("utf-8")
    n = len(raw) // BYTES_PER_TOKEN
    return np.frombuffer(raw[: n * BYTES_PER_TOKEN], dtype="<u4")


def _hidden(model: str, n: int) -> np.ndarray:
    base = namespace_root(f"claude-code-hidden:{model}") & _U32
    return ((base + np.arange(n, dtype=np.uint64)) & _U32).astype("<u4")


def _usage_prompt(u: dict[str, Any]) -> int:
    return int(u.get("input_tokens", 0)) + int(u.get("cache_creation_input_tokens", 0)) + int(
        u.get("cache_read_input_tokens", 0))


class _SessionBuilder:
    def __init__(self, sid: str, recs: list[_Rec], problems: Problems):
        self.sid, self.recs, self.problems = sid, recs, problems
        self.by_uuid = {r.data["uuid"]: r for r in recs if isinstance(r.data.get("uuid"), str)}
        self.gaps: list[float] = []

    def chain(self, rec: _Rec) -> list[_Rec]:
        out: list[_Rec] = []
        seen: set[str] = set()
        parent = rec.data.get("parentUuid")
        while isinstance(parent, str) and parent in self.by_uuid and parent not in seen:
            seen.add(parent)
            r = self.by_uuid[parent]
            out.append(r)
            parent = r.data.get("parentUuid")
        out.reverse()
        return out

    def calls(self) -> dict[str, list[_Call]]:
        threads: dict[str, dict[str, _Call]] = {}
        for r in self.recs:
            d = r.data
            if d.get("type") != "assistant":
                continue
            msg = d.get("message")
            if not isinstance(msg, dict):
                self.problems.bad(r.file, r.line, "message", "missing or not an object")
                continue
            if msg.get("model") == "<synthetic>":
                continue
            if not isinstance(msg.get("usage"), dict):
                self.problems.bad(r.file, r.line, "message.usage", "missing or not an object")
                continue
            thread = self.sidechain_ids(d) if d.get("isSidechain") else "main"
            key = str(msg.get("id") or d.get("requestId") or d.get("uuid"))
            threads.setdefault(thread, {}).setdefault(key, _Call(key)).recs.append(r)
        return {t: sorted(c.values(), key=lambda c: (c.first.file, c.first.line)) for t, c in threads.items()}

    def sidechain_ids(self, d: dict[str, Any]) -> str:
        """``agent-<agentId>``; inline sidechains of old versions without ``agentId`` are told
        apart by the uuid of their first record (the root of their chain)."""
        if d.get("agentId"):
            return f"agent-{d['agentId']}"
        root, seen = d, set()
        while True:
            parent = self.by_uuid.get(root.get("parentUuid") or "")
            if parent is None or not parent.data.get("isSidechain") or id(parent) in seen:
                break
            seen.add(id(parent))
            root = parent.data
        return f"agent-{str(root.get('uuid', 'sidechain'))[:8]}"

    def sidechains_without_calls(self, threads: dict[str, list[_Call]]) -> list[tuple[str, _Rec]]:
        first: dict[str, _Rec] = {}
        for r in self.recs:
            if r.data.get("isSidechain"):
                first.setdefault(self.sidechain_ids(r.data), r)
        return [(a, r) for a, r in first.items() if a not in threads]

    def request(self, call: _Call, hidden: int | None) -> tuple[Request, int, float, float, set[str], int]:
        """(request, hidden tokens used, submit time, finish time, chain uuids, real prompt)."""
        first = call.first
        chain = [r for r in self.chain(first) if r.data.get("type") in ("user", "assistant")]
        visible = approx_tokens("".join(_render(r.data) for r in chain))
        usage = first.data["message"]["usage"]
        real = _usage_prompt(usage)
        if hidden is None:
            hidden = max(0, real - len(visible))
        model = str(first.data["message"].get("model", ""))
        tokens = np.concatenate([_hidden(model, hidden), visible])
        blocks = block_hashes(tokens, BLOCK_TOKENS, root=namespace_root(f"claude-code:{model}"))
        out = max(int(r.data["message"]["usage"].get("output_tokens", 0)) for r in call.recs)
        parent = self.by_uuid.get(first.data.get("parentUuid") or "")
        submit = parent.ts if parent is not None else first.ts
        finish = max(r.ts for r in call.recs)
        req = Request(blocks=list(blocks), tail_tokens=len(tokens) - len(blocks) * BLOCK_TOKENS,
                      output_tokens=out)
        if real:
            self.gaps.append(abs(len(tokens) - real) / real)
        uuids = {r.data.get("uuid") for r in self.chain(first)}
        return req, hidden, submit, finish, uuids, real

    def thread_steps(self, name: str, calls: list[_Call]) -> list[dict[str, Any]]:
        """Requests of one thread with times and rewrite marks (before spawn merging)."""
        hidden: int | None = None
        out: list[dict[str, Any]] = []
        seen_boundaries: set[str] = set()
        prev_uuids: set[str] | None = None
        prev_call: _Call | None = None
        for c in calls:
            req, hidden, submit, finish, uuids, _real = self.request(c, hidden)
            boundaries = {u for u in uuids if (b := self.by_uuid.get(u)) is not None
                          and b.data.get("subtype") == "compact_boundary"}
            compact = bool(boundaries - seen_boundaries) and prev_call is not None
            seen_boundaries |= boundaries
            resume = (not compact and prev_call is not None and prev_uuids is not None
                      and not any(r.data.get("uuid") in uuids for r in prev_call.recs))
            out.append({"req": req, "submit": submit, "finish": finish, "compact": compact, "resume": resume})
            prev_uuids, prev_call = uuids, c
        return out

    def build(self) -> Session | None:
        threads = self.calls()
        if "main" not in threads:
            if self.recs:
                r = self.recs[0]
                self.problems.bad(r.file, r.line, "type", f"session {self.sid!r} has no main-thread response")
            return None
        for agent, recs in self.sidechains_without_calls(threads):
            self.problems.bad(recs.file, recs.line, "agentId", f"sub-agent {agent!r} without requests")
        steps_of = {t: self.thread_steps(t, c) for t, c in threads.items()}
        subs = sorted((s[0]["submit"], t) for t, s in steps_of.items() if t != "main")
        branches: list[Branch] = []
        main_branches = self.emit("main", None, "root", steps_of["main"], subs, steps_of)
        branches += main_branches
        for _t, name in subs:
            branches += self.emit(name, "main", "subagent", steps_of[name], [], steps_of)
        # sub-agents are opened by whichever main-lineage branch was current at spawn time
        return self.fix_parents(branches)

    def emit(self, name: str, parent: str | None, mode: str, reqs: list[dict[str, Any]],
             subs: list[tuple[float, str]], steps_of: dict[str, list[dict[str, Any]]]) -> list[Branch]:
        out: list[Branch] = []
        cur_id, cur_parent, cur_mode, cur_label = name, parent, mode, "sidechain" if mode == "subagent" else ""
        steps: list[Step] = []
        pending = list(subs)
        anchor: float | None = None
        waited: list[tuple[str, float]] = []
        n_resume = 0
        for k, r in enumerate(reqs):
            spawned_here = False
            while pending and pending[0][0] <= r["submit"]:
                t, child = pending.pop(0)
                child_end = steps_of[child][-1]["finish"]
                wait = child_end <= r["submit"] + WAIT_TOLERANCE_S
                steps.append(Spawn(branch=child, wait=wait, pause_s=max(0.0, t - (anchor if anchor is not None else t))))
                anchor = t
                if wait:
                    waited.append((child, child_end))
                spawned_here = True
            if r["resume"]:
                n_resume += 1
                child_id = f"{name}~{n_resume}"
                steps += [Fork(branch=child_id), End()]
                out.append(Branch(id=cur_id, parent=cur_parent, mode=cur_mode, steps=steps, label=cur_label))  # type: ignore[arg-type]
                cur_parent, cur_id, cur_mode, cur_label, steps = cur_id, child_id, "fork", "resume", []
            if r["compact"]:
                steps.append(Compact(blocks=r["req"].blocks))
            ready = anchor if anchor is not None else r["submit"]
            if spawned_here and waited:
                ready = max([ready] + [e for _c, e in waited])
                waited = []
            q: Request = r["req"]
            pause = 0.0 if k == 0 else max(0.0, r["submit"] - ready)
            steps.append(Request(blocks=q.blocks, tail_tokens=q.tail_tokens, output_tokens=q.output_tokens,
                                 pause_s=round(pause, 3)))
            anchor = r["finish"]
        for t, child in pending:  # spawned after the last main request: waited for by the end
            steps.append(Spawn(branch=child, wait=True, pause_s=max(0.0, t - (anchor or t))))
            anchor = t
        steps.append(End())
        out.append(Branch(id=cur_id, parent=cur_parent, mode=cur_mode, steps=steps, label=cur_label))  # type: ignore[arg-type]
        return out

    def fix_parents(self, branches: list[Branch]) -> Session:
        opener = {st.branch: b.id for b in branches for st in b.steps if isinstance(st, (Spawn, Fork))}
        fixed = [msgspec.structs.replace(b, parent=opener.get(b.id, b.parent)) if b.mode == "subagent" else b
                 for b in branches]
        return Session(id=self.sid, block_tokens=BLOCK_TOKENS, source="claude-code", approximate=True,
                       branches=fixed)


def _read(files: list[Path], problems: Problems) -> dict[str, list[_Rec]]:
    sessions: dict[str, list[_Rec]] = {}
    for f in files:
        for lineno, d in json_lines(f, problems):
            if d.get("type") not in ("user", "assistant", "system"):
                continue
            missing = next((k for k in ("uuid", "timestamp") if not isinstance(d.get(k), str)), None)
            if missing:
                problems.bad(str(f), lineno, missing, "missing or not a string")
                continue
            if d.get("type") != "system" and not isinstance(d.get("message"), dict):
                problems.bad(str(f), lineno, "message", "missing or not an object")
                continue
            try:
                ts = _parse_ts(d["timestamp"])
            except ValueError as exc:
                problems.bad(str(f), lineno, "timestamp", f"not an ISO 8601 time: {exc}")
                continue
            sid = str(d.get("sessionId") or f.stem)
            sessions.setdefault(sid, []).append(_Rec(d, str(f), lineno, ts))
    return sessions


def import_claude_code(src: str | os.PathLike[str], skip_bad: bool = False,
                       skip_bad_files: bool = False) -> ImportResult:
    """Import one transcript or every ``*.jsonl`` under a directory (recursively; sub-agent
    files ``agent-*.jsonl`` join their session through ``sessionId``; ``agent-acompact-*``
    files, internal to compaction, are skipped). ``skip_bad_files``: an empty or binary file is
    listed in ``skipped`` and the others imported, even without ``skip_bad``."""
    res = ImportResult()
    problems = Problems(skip_bad, res, skip_bad_files)
    p = Path(src)
    files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    files = [f for f in files if not f.name.startswith("agent-acompact")]
    builders = []
    for sid, recs in sorted(_read(files, problems).items()):
        b = _SessionBuilder(sid, recs, problems)
        s = b.build()
        builders.append(b)
        if s is not None:
            res.sessions.append(s)
    gaps = [g for b in builders for g in b.gaps]
    if gaps:
        res.notes.append(
            f"approximate tokenisation ({BYTES_PER_TOKEN} UTF-8 bytes per token plus a hidden prefix sized "
            f"from each thread's first usage): prompt lengths differ from message.usage by "
            f"{100 * float(np.mean(gaps)):.1f}% on average")
    return res
