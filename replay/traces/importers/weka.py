"""Importer for Claude Code sessions in the kv-cache-tester format (weka-claude-code traces).

One JSON document per session (``id``, ``block_size``, ``hash_id_scope``, ``requests``), plain
or gzipped (``.json.gz``; told by content); see ``docs/traces.md`` for the mapping. Rules (all
stated here and in the docs):

- The main thread is branch ``main``; an inline ``{"type": "subagent"}`` entry becomes a
  ``Spawn`` of branch ``<agent_id>`` (mode ``subagent``, label = ``subagent_type``) whose
  requests' ``t`` count from the spawn. The parent *waits* for it when the next main-thread
  request starts after the sub-agent ended (``t + duration_ms``, 1 s tolerance since main-thread
  ``t`` are whole seconds); otherwise it ran in the background (``wait=False``). Without
  ``duration_ms`` (absent or null) the sub-agent ends with its last response; a spawn with no
  later parent request is waited for (the parent ends after it). A sub-agent whose requests
  were all bad (``--skip-bad``) is dropped with its spawn, and reported.
- ``hash_ids`` are the blocks, namespaced per session with ``namespaced_hash("weka:<id>", h)``
  (scope ``local``: ids of two files are unrelated; sub-agents share their parent's namespace).
  ``tail_tokens = in - len(hash_ids) * block_size``.
- ``pause_s = think_time``, except for the first main-thread request after sub-agent spawns:
  its pause counts from the later of the last spawn and the end of the sub-agents it waited
  for, so the replay keeps the recorded spacing (``t - that time``, at least 0). A spawn's
  pause counts from the previous response's end (``t + api_time``) or the previous spawn.
  Without ``think_time`` (absent or null, as in some real sessions) the pause is the gap since
  the previous response ended (``t - previous t - previous api_time``, at least 0).
  ``pause_kind`` is ``"tool"`` when ``input_types`` holds ``"tool_result"``, ``"human"`` when it
  holds only user content (``"text"``), ``""`` without ``input_types``.
- Context rewrites, judged against the branch's previous request: let ``d`` be how many of
  the previous request's blocks the new prompt does not share as a prefix.
  ``d <= 2`` is a continuation (the harness re-renders the end of the context).
  Otherwise, if the prompt shrank to at most half (``in <= 0.5 * previous in``) it is a
  **compaction** (``Compact`` with the new prompt's blocks, before the request); if not, it is
  a **branch resume** of an older prefix: the branch forks a child ``<branch>~<n>`` (mode
  ``fork``) that carries on, and ends.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, Step, depth_error
from replay.traces.importers import cache as trace_cache
from replay.traces.importers._common import (
    ImportResult,
    Problems,
    common_prefix,
    decode_text,
    json_path,
    locate,
)

_MODULE = "replay/traces/importers/weka.py"  # the code fingerprint of its cache entries
EDIT_SLACK_BLOCKS = 2
COMPACT_RATIO = 0.5
WAIT_TOLERANCE_S = 1.0


class _Bad(Exception):
    def __init__(self, path: list[str | int], message: str):
        self.path, self.message = path, message


def _num(obj: dict[str, Any], key: str, path: list[str | int], *, integer: bool = False,
         required: bool = True, default: float = 0.0) -> Any:
    if key not in obj:
        if required:
            raise _Bad(path + [key], "missing field")
        return default
    v = obj[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or v < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise _Bad(path + [key], f"must be {kind}, got {v!r}")
    return v


@dataclass
class _SpawnStep:
    """A spawn being built: ``wait`` is decided by the parent's next request (None: none came,
    the parent waits for it before ending)."""

    branch: str
    pause_s: float
    wait: bool | None = None


def pause_kind(input_types: Any) -> str:
    """``"tool"`` when the prompt appends a tool result, ``"human"`` when it appends only user
    text (a user turn), ``""`` when the record does not say (see docs/traces.md, pacing)."""
    if not isinstance(input_types, list) or not input_types:
        return ""
    return "tool" if "tool_result" in input_types else "human"


@dataclass
class _Thread:
    """Builds the branches of one thread (main or a sub-agent) and its resumes."""

    branch_id: str
    parent: str | None
    mode: str
    label: str = ""
    steps: list[Any] = field(default_factory=list)
    prev_blocks: list[int] | None = None
    prev_ids: list[int] = field(default_factory=list)  # the hash_ids that prev_blocks maps
    prev_in: int = 0
    resumes: int = 0


class _Builder:
    def __init__(self, sid: str, ns: str, block_size: int, problems: Problems, file: str, text: str):
        self.sid, self.ns, self.bs = sid, ns, block_size
        self.problems, self.file, self.text = problems, file, text
        self.threads: list[_Thread] = []
        self.ids: set[str] = set()
        self.hashes: dict[int, int] = {}  # local id -> namespaced hash (ids repeat in every prompt)
        self.keyed = _keyed_blake2b(ns)

    def report(self, bad: _Bad) -> None:
        line, col = locate(self.text, bad.path)
        self.problems.bad(self.file, line, json_path(bad.path), f"{bad.message} (column {col})")

    def unique(self, want: str) -> str:
        bid, n = want, 1
        while bid in self.ids:
            n += 1
            bid = f"{want}#{n}"
        self.ids.add(bid)
        return bid

    def walk(self, reqs: list[Any], path: list[str | int], th: _Thread, t0: float) -> float:
        """Add the thread's steps; returns the absolute time its last response finished."""
        self.threads.append(th)
        anchor = t0  # when the previous step (response end or spawn) happened
        pending: list[tuple[_SpawnStep, float]] = []  # spawns whose wait flag the next request decides
        waited_end = -1.0
        after_spawn = False
        for i, r in enumerate(reqs):
            rp = path + [i]
            try:
                if not isinstance(r, dict):
                    raise _Bad(rp, "must be an object")
                if r.get("type") == "subagent":
                    t = t0 + _num(r, "t", rp)
                    sub = r.get("requests")
                    if not isinstance(sub, list) or not sub:
                        raise _Bad(rp + ["requests"], "sub-agent without requests")
                    # duration_ms absent or null: the sub-agent ended with its last response
                    dur = None if r.get("duration_ms") is None else _num(r, "duration_ms", rp)
                    child = _Thread(self.unique(str(r.get("agent_id") or f"agent@{i}")), th.branch_id,
                                    "subagent", label=str(r.get("subagent_type", "")))
                    step = _SpawnStep(child.branch_id, max(0.0, t - anchor))
                    th.steps.append(step)
                    end = self.walk(sub, rp + ["requests"], child, t)
                    if dur is not None:
                        end = t + dur / 1000.0
                    pending.append((step, end))
                    anchor, after_spawn = t, True
                    continue
                req, t, fin = self.request(r, rp, t0, anchor, th)
            except _Bad as bad:
                self.report(bad)
                continue
            for step, end in pending:
                step.wait = end <= t + WAIT_TOLERANCE_S
                if step.wait:
                    waited_end = max(waited_end, end)
            pending.clear()
            if after_spawn:
                req = msgspec.structs.replace(req, pause_s=max(0.0, t - max(anchor, waited_end)))
                after_spawn, waited_end = False, -1.0
            th = self.place(th, req, r)
            th.prev_ids = r["hash_ids"]
            anchor = fin
        # spawns after the thread's last request: the thread ends once they have (wait stays None
        # -> True when the session is built)
        return anchor

    def request(self, r: dict[str, Any], rp: list[str | int], t0: float,
                anchor: float, th: _Thread) -> tuple[Request, float, float]:
        t = t0 + _num(r, "t", rp)
        n_in = _num(r, "in", rp, integer=True)
        out = _num(r, "out", rp, integer=True)
        # think_time absent (some real sessions): the gap since the previous response ended
        think = _num(r, "think_time", rp) if r.get("think_time") is not None else max(0.0, t - anchor)
        api = _num(r, "api_time", rp, required=False)
        ids = r.get("hash_ids")
        if not isinstance(ids, list) or (ids and set(map(type, ids)) != _INT_ONLY):  # bools, floats refused
            raise _Bad(rp + ["hash_ids"], "missing or not a list of integers")
        tail = n_in - len(ids) * self.bs
        if not 0 <= tail < self.bs:
            raise _Bad(rp + ["hash_ids"], f"{len(ids)} blocks of {self.bs} do not fit in={n_in} tokens")
        # A prompt extends its thread's previous one: the mapped prefix is reused (the mapping is
        # per id), only the ids after it are looked up; the same list as mapping every id.
        n = common_prefix(th.prev_ids, ids) if th.prev_blocks is not None else 0
        cache, keyed = self.hashes, self.keyed
        blocks = th.prev_blocks[:n] if n else []
        blocks += [cache[h] if h in cache else cache.setdefault(h, _hash(keyed, h)) for h in ids[n:]]
        return Request(blocks=blocks, tail_tokens=tail, output_tokens=out, pause_s=float(think),
                       pause_kind=pause_kind(r.get("input_types"))), t, t + api

    def place(self, th: _Thread, req: Request, r: dict[str, Any]) -> _Thread:
        """Append ``req`` to ``th``, first recognising a compaction or a branch resume."""
        n_in = r["in"]
        if th.prev_blocks is not None:
            d = len(th.prev_blocks) - common_prefix(th.prev_blocks, req.blocks)
            if d > EDIT_SLACK_BLOCKS and n_in <= COMPACT_RATIO * th.prev_in:
                th.steps.append(Compact(blocks=req.blocks))
            elif d > EDIT_SLACK_BLOCKS:
                th.resumes += 1
                base = th.branch_id.split("~")[0]
                child = _Thread(self.unique(f"{base}~{th.resumes}"), th.branch_id, "fork",
                                label="resume", resumes=th.resumes)
                th.steps += [Fork(branch=child.branch_id, wait=False), End()]
                self.threads.append(child)
                th = child
        th.steps.append(req)
        th.prev_blocks, th.prev_in = req.blocks, n_in
        return th

    def session(self, source: str) -> Session | None:
        """The session, or ``None`` (reported) when the main thread kept no request. A sub-agent
        left without a usable request (all of them bad, skipped) is dropped with its spawn and
        its own children, and reported."""
        has_req = {th.branch_id for th in self.threads if any(isinstance(s, Request) for s in th.steps)}
        parent = {th.branch_id: th.parent for th in self.threads}

        def alive(bid: str | None) -> bool:
            while bid is not None:
                if bid not in has_req:
                    return False
                bid = parent.get(bid)
            return True

        if not alive(self.threads[0].branch_id):
            self.problems.bad(self.file, 1, "requests", "the session has no usable request")
            return None
        branches = []
        for th in self.threads:
            if not alive(th.branch_id):
                if th.parent is not None and alive(th.parent):
                    self.problems.bad(self.file, 1, "requests",
                                      f"sub-agent {th.branch_id!r} kept no usable request: dropped")
                continue
            steps: list[Step] = []
            for st in th.steps:
                if isinstance(st, _SpawnStep):
                    if alive(st.branch):
                        steps.append(Spawn(branch=st.branch, pause_s=st.pause_s,
                                           wait=True if st.wait is None else st.wait))
                else:
                    steps.append(st)
            if not steps or not isinstance(steps[-1], End):
                steps.append(End())
            branches.append(Branch(id=th.branch_id, parent=th.parent, mode=th.mode,  # type: ignore[arg-type]
                                   steps=steps, label=th.label))
        # children after parents: a thread's resumes/sub-agents were appended after it
        return Session(id=self.sid, block_tokens=self.bs, source=source, branches=branches)


_INT_ONLY = {int}


def _keyed_blake2b(namespace: str):
    """The keyed BLAKE2b state ``namespaced_hash`` starts from, for :func:`_hash` to copy."""
    return hashlib.blake2b(digest_size=8, key=namespace.encode()[:64])


def _hash(keyed, local_id: int) -> int:
    """``namespaced_hash(namespace, local_id)`` from its keyed state (copying the state skips
    hashing the key block again: ~2x faster; tests/unit/replay/traces/test_import_weka_fast.py
    pins the equality)."""
    h = keyed.copy()
    h.update(int(local_id).to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def weka_namespace(session_id: str, scope: str = "local") -> str:
    return "weka" if scope == "global" else f"weka:{session_id}"


def import_weka_file(path: str | os.PathLike[str], problems: Problems) -> Session | None:
    """One session from a kv-cache-tester JSON document (plain or gzip, told by content). A file
    imported without any problem is cached (replay/traces/importers/cache.py: keyed by its bytes,
    its name and this code, never stale); the next import of the same bytes reads the cache."""
    raw, name = Path(path).read_bytes(), Path(path).name  # the session's id and source name the file
    cached = trace_cache.load(_MODULE, raw, name)
    if cached is not None:
        return cached
    before = len(problems.result.skipped)
    s = _import_weka_bytes(path, raw, problems)
    if s is not None and len(problems.result.skipped) == before:
        trace_cache.store(_MODULE, raw, name, s)
    return s


def _import_weka_bytes(path: str | os.PathLike[str], raw: bytes, problems: Problems) -> Session | None:
    file = str(path)
    text = decode_text(file, raw, problems)
    if text is None:
        return None
    deep = depth_error(text, file, 0)
    if deep is not None:
        problems.bad(file, deep.line, deep.field, deep.message)
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.bad(file, exc.lineno, "(json)", f"not valid JSON: {exc.msg} (column {exc.colno})")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        line, _ = locate(text, [])
        problems.bad(file, line, "requests", "missing or not a list")
        return None
    bs = doc.get("block_size", 64)
    if not isinstance(bs, int) or bs <= 0:
        problems.bad(file, 1, "block_size", f"must be a positive integer, got {bs!r}")
        return None
    name = Path(path).name
    sid = str(doc.get("id") or name.removesuffix(".gz").removesuffix(".json"))
    b = _Builder(sid, weka_namespace(sid, str(doc.get("hash_id_scope", "local"))), bs, problems, file, text)
    root = _Thread(b.unique("main"), None, "root")
    b.walk(doc["requests"], ["requests"], root, 0.0)
    return b.session(f"weka:{name}")


def weka_files(src: str | os.PathLike[str]) -> list[Path]:
    """``src`` itself, or every ``*.json`` / ``*.json.gz`` file of the directory, sorted by name."""
    p = Path(src)
    if not p.is_dir():
        return [p]
    return sorted((f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz"))),
                  key=lambda f: f.name)


def import_weka(src: str | os.PathLike[str], skip_bad: bool = False) -> ImportResult:
    """Import one ``.json`` / ``.json.gz`` file or every such file of a directory (sorted)."""
    res = ImportResult()
    problems = Problems(skip_bad, res)
    for f in weka_files(src):
        s = import_weka_file(f, problems)
        if s is not None:
            res.sessions.append(s)
    return res
