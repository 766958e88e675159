"""The agent-session trace format (version 1): types, load/save, validation, event cursor.

Pure module: no I/O except ``load_sessions`` / ``save_sessions``, no clock, no randomness.
The full specification with a worked example is in ``docs/traces.md``.

Shape
-----
A :class:`Session` is one agent run: a tree of :class:`Branch` es. The first branch is the
root (``mode="root"``, ``parent=None``). Each branch is a list of steps (tagged union on the
field ``kind``):

- :class:`Request` ``{"kind": "request", "blocks": [...], "tail_tokens", "output_tokens",
  "pause_s", "at_s", "pause_kind"}`` -- one LLM call. ``blocks`` are the chained 64-bit hashes
  of the prompt's *full* blocks of ``Session.block_tokens`` tokens, ``tail_tokens`` the tokens of the partial
  last block (``0 <= tail_tokens < block_tokens``), so the prompt has
  ``len(blocks) * block_tokens + tail_tokens`` tokens. ``output_tokens`` is the recorded
  output length. ``pause_s`` is the client time before the call (tool run or user think time);
  ``pause_kind`` says which (``"tool"``, ``"human"``, ``""`` unknown; optional, for pacing).
- :class:`Fork` ``{"kind": "fork", "branch", "wait", "pause_s"}`` -- opens child ``branch``
  (``mode="fork"``) that reuses this branch's context (its requests start with our blocks).
- :class:`Spawn` ``{"kind": "spawn", "branch", "wait", "pause_s"}`` -- opens sub-agent
  ``branch`` (``mode="subagent"``) with a fresh context.
- :class:`Compact` ``{"kind": "compact", "blocks"}`` -- the harness rewrote this branch's
  context (summary): the version is bumped and ``blocks`` are the new context's full blocks.
- :class:`End` ``{"kind": "end"}`` -- the branch ends (optional; implied after the last step).

Timing (closed loop)
--------------------
Each branch has a *ready time*: when its previous response finished (a ``Request``), or when
its previous ``Fork``/``Spawn`` was issued. A step with ``pause_s`` starts that long after the
ready time, so slower serving stretches the session as it would in reality. A child opened
with ``wait=True`` must end before the parent's *next Request* is submitted (Fork/Spawn steps
in between are not held back, so parallel sub-agents are expressed as several spawns with
``wait=True`` followed by the request that joins them); the pause of that request then counts
from ``max(ready, end of the waited children)``. ``Request.at_s`` (optional, open loop) pins a
request to ``session start + at_s`` instead; it is still never submitted before the branch's
previous response finished (a branch has at most one request in flight). ``Session.start_s``
is the session's arrival offset in the workload (open arrivals); ``None`` means "whenever the
driver starts it" (a closed-loop pool at fixed concurrency).

Driver API (used by the simulator and the live trace driver)
------------------------------------------------------------
::

    cur = SessionCursor(session, prefix="")      # prefix makes ids unique across runs
    evs = cur.start(t0)                          # BranchOpened(root) + first RequestSubmitted
    ...                                          # each event carries its due time in ``ts``
    evs = cur.on_finished(request_id, t)         # response of request_id finished at t
    cur.done                                     # every branch ended, nothing in flight
    cur.in_flight                                # submitted, not finished request ids

``start`` and ``on_finished`` return the events the session emits as a consequence, sorted
by ``ts`` (``ts >= t``; a ``RequestSubmitted`` is due after its pause: the driver publishes
it at ``ts``). Events: ``BranchOpened(branch, parent, mode, session)``,
``RequestSubmitted(request, branch, version, blocks, prompt_tokens, max_tokens,
block_tokens)``, ``ContextCompacted(branch, version, blocks)``, ``BranchEnded(branch)``.
Ids are deterministic: branch ``f"{prefix}{session.id}/{branch.id}"``, request
``f"{branch}/{step_index}"``. ``session_events(session, response_s)`` runs a whole session with
a fixed service-time function (tests, dry runs).

Block size
----------
A session keeps its source's block size; ``reblock(session, block_tokens)`` re-cuts it to the
serving side's (the simulator does, per started session), so every token is charged as the
trace says (Mooncake's 512-token blocks on 64-token engines).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

import msgspec

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, Event, RequestSubmitted
from events.hashing import hash_block_tokens, namespace_root
from events.ids import BranchId, RequestId
from events.jsondepth import too_deep

FORMAT_VERSION = 1
#: The deepest JSON nesting a trace record may have (a session line nests 6 deep, a
#: kv-cache-tester document 4, a Claude Code transcript line a few more): deeper text is refused
#: before it is decoded (``events.jsondepth``), far from where Python's decoders and our
#: recursive readers would hit the interpreter's recursion limit (~1,000).
MAX_JSON_DEPTH = 128
_MAX_U64 = (1 << 64) - 1
_SRC = "trace"
#: What the client did during ``Request.pause_s``: ``"tool"`` (a tool ran: the prompt appends a
#: tool result), ``"human"`` (a user turn: the prompt appends user text), ``""`` (unknown).
PauseKind = Literal["", "tool", "human"]


# --------------------------------------------------------------------------- types
class Request(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="request"):
    """One LLM call of a branch (see the module docstring)."""

    blocks: list[int]
    tail_tokens: int = 0
    output_tokens: int
    pause_s: float = 0.0
    at_s: float | None = None
    pause_kind: PauseKind = ""


class Fork(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="fork"):
    """Open child ``branch`` (mode ``fork``) that reuses this branch's context."""

    branch: str
    wait: bool = False
    pause_s: float = 0.0


class Spawn(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="spawn"):
    """Open sub-agent ``branch`` (mode ``subagent``) with a fresh context."""

    branch: str
    wait: bool = True
    pause_s: float = 0.0


class Compact(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="compact"):
    """The context was rewritten (version + 1); ``blocks`` are the new context's full blocks."""

    blocks: list[int] = []


class End(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="end"):
    """The branch ends; no later step."""


Step = Request | Fork | Spawn | Compact | End
Mode = Literal["root", "fork", "subagent"]


class Branch(msgspec.Struct, frozen=True, kw_only=True):
    """A unit of context with its own step sequence. ``label`` is free text (e.g. sub-agent type)."""

    id: str
    parent: str | None = None
    mode: Mode = "root"
    steps: list[Step] = []
    label: str = ""


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """One agent session: a tree of branches; ``branches[0]`` is the root.

    ``source`` says where it came from (``"weka:trace_0291.json"``, ``"synthetic:cc"``);
    ``approximate`` is true when the block hashes come from an approximate tokenisation.
    """

    id: str
    format_version: int = FORMAT_VERSION
    block_tokens: int = 64
    source: str = ""
    approximate: bool = False
    start_s: float | None = None
    branches: list[Branch] = []

    def branch(self, branch_id: str) -> Branch:
        for b in self.branches:
            if b.id == branch_id:
                return b
        raise KeyError(branch_id)

    def requests(self) -> Iterator[tuple[Branch, int, Request]]:
        """Every request of the session: (branch, step index, request), branches in order."""
        for b in self.branches:
            for i, s in enumerate(b.steps):
                if isinstance(s, Request):
                    yield b, i, s


def prompt_tokens(req: Request, block_tokens: int) -> int:
    return len(req.blocks) * block_tokens + req.tail_tokens


# --------------------------------------------------------------------------- errors
class TraceFormatError(ValueError):
    """Bad trace input: names the file, the line (1-based, 0 if unknown) and the field."""

    def __init__(self, file: str | os.PathLike[str], line: int, field: str, message: str):
        self.file, self.line, self.field, self.message = str(file), line, field, message
        super().__init__(f"{self.file}:{line}: {field}: {message}")


def validate_session(s: Session) -> list[tuple[str, str]]:
    """Semantic checks the type system cannot express. Returns ``[(field path, problem)]``."""
    errs: list[tuple[str, str]] = []
    if s.format_version > FORMAT_VERSION:
        errs.append(("format_version", f"version {s.format_version} is newer than {FORMAT_VERSION}"))
    if s.block_tokens <= 0:
        errs.append(("block_tokens", "must be positive"))
    if not s.branches:
        return errs + [("branches", "a session needs at least one branch")]
    ids = [b.id for b in s.branches]
    index = {b: i for i, b in enumerate(ids)}
    if len(index) != len(ids):
        errs.append(("branches", "branch ids are not unique"))
    opened: dict[str, tuple[str, str]] = {}  # child -> (parent, mode)
    for bi, b in enumerate(s.branches):
        at = f"branches[{bi}]"
        if bi == 0 and (b.mode != "root" or b.parent is not None):
            errs.append((at, "the first branch must be the root (mode root, no parent)"))
        if bi > 0 and b.mode == "root":
            errs.append((f"{at}.mode", "only the first branch is the root"))
        if not any(isinstance(st, Request) for st in b.steps):
            errs.append((f"{at}.steps", f"branch {b.id!r} has no request"))
        for si, st in enumerate(b.steps):
            sat = f"{at}.steps[{si}]"
            if isinstance(st, End) and si != len(b.steps) - 1:
                errs.append((sat, "end must be the last step"))
            elif isinstance(st, Request):
                if not 0 <= st.tail_tokens < s.block_tokens:
                    errs.append((f"{sat}.tail_tokens", f"must be in [0, {s.block_tokens})"))
                if st.output_tokens < 0 or st.pause_s < 0 or (st.at_s is not None and st.at_s < 0):
                    errs.append((sat, "output_tokens, pause_s and at_s must be >= 0"))
                if any(not 0 <= h <= _MAX_U64 for h in st.blocks):
                    errs.append((f"{sat}.blocks", "hashes must be unsigned 64-bit"))
            elif isinstance(st, (Fork, Spawn)):
                mode = "fork" if isinstance(st, Fork) else "subagent"
                if st.pause_s < 0:
                    errs.append((f"{sat}.pause_s", "must be >= 0"))
                if st.branch not in index:
                    errs.append((f"{sat}.branch", f"unknown branch {st.branch!r}"))
                elif st.branch in opened:
                    errs.append((f"{sat}.branch", f"branch {st.branch!r} is opened twice"))
                elif index[st.branch] <= bi:
                    errs.append((f"{sat}.branch", "a child must be listed after its parent"))
                else:
                    opened[st.branch] = (b.id, mode)
                    child = s.branches[index[st.branch]]
                    if child.parent != b.id or child.mode != mode:
                        errs.append((f"{sat}.branch", (f"child {st.branch!r} must have parent "
                                     f"{b.id!r} and mode {mode!r}")))
            elif isinstance(st, Compact) and any(not 0 <= h <= _MAX_U64 for h in st.blocks):
                errs.append((f"{sat}.blocks", "hashes must be unsigned 64-bit"))
    for bi, b in enumerate(s.branches[1:], start=1):
        if b.id not in opened:
            errs.append((f"branches[{bi}]", f"branch {b.id!r} is never opened by a fork or spawn"))
    return errs


# --------------------------------------------------------------------------- load / save
_DECODER = msgspec.json.Decoder(Session)
_ENCODER = msgspec.json.Encoder()


def _field_of(exc: msgspec.ValidationError) -> tuple[str, str]:
    msg = str(exc)
    if " - at `" in msg:
        text, _, path = msg.rpartition(" - at `")
        return path.rstrip("`").removeprefix("$.").removeprefix("$"), text
    return "(line)", msg


def depth_error(raw: bytes | str, file: str, lineno: int) -> TraceFormatError | None:
    """The error for JSON text nested deeper than :data:`MAX_JSON_DEPTH`, or ``None``."""
    depth = too_deep(raw, MAX_JSON_DEPTH)
    if depth is None:
        return None
    return TraceFormatError(file, lineno, "(json)", f"JSON nested {depth} deep (the limit is {MAX_JSON_DEPTH}): "
                                                    "not a trace record")


def decode_session(line: bytes | str, file: str = "<input>", lineno: int = 0) -> Session:
    """Decode and validate one session; raise :class:`TraceFormatError` naming the field."""
    deep = depth_error(line, file, lineno)
    if deep is not None:
        raise deep
    try:
        s = _DECODER.decode(line)
    except msgspec.ValidationError as exc:
        field, text = _field_of(exc)
        raise TraceFormatError(file, lineno, field or "(session)", text) from None
    except msgspec.DecodeError as exc:
        raise TraceFormatError(file, lineno, "(json)", f"not valid JSON: {exc}") from None
    problems = validate_session(s)
    if problems:
        field, text = problems[0]
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise TraceFormatError(file, lineno, field, f"session {s.id!r}: {text}{more}")
    return s


def _trace_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".json"))
    return [path]


GZIP_MAGIC = b"\x1f\x8b"


def sniff(head: bytes, *, gzip_ok: bool) -> str | None:
    """Why ``head`` (the first bytes of a file) is not text this importer can read, or ``None``.

    Empty (or blank) input, gzip data where plain text is expected (``gzip_ok`` False) and
    binary data (a NUL byte, or bytes that are not UTF-8) each get a one-line reason."""
    if not head.strip():
        return "empty file: no records"
    if head.startswith(GZIP_MAGIC):
        return None if gzip_ok else "gzip-compressed data, not JSONL text (decompress it first: gunzip)"
    if b"\x00" in head:
        return "binary data, not JSON text"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # a multi-byte character cut by the sniff window is fine
            return f"binary data, not UTF-8 JSON text (byte {exc.start})"
    return None


def iter_sessions(
    path: str | os.PathLike[str], errors: list[TraceFormatError] | None = None
) -> Iterator[Session]:
    """Sessions of a JSONL file (one per line; blank lines skipped) or of every ``.jsonl`` /
    ``.json`` file in a directory, sorted by name. With ``errors`` given, a bad line is
    appended there and skipped; without, it raises :class:`TraceFormatError`. An empty, binary
    or gzip file is one error (line 0, field ``(file)``), not one per line."""
    for f in _trace_files(Path(path)):
        with open(f, "rb") as fh:
            why = sniff(fh.read(8192), gzip_ok=False)
            if why is not None:  # empty, binary or gzip: one line, not a JSON error per line
                exc = TraceFormatError(str(f), 0, "(file)", why)
                if errors is None:
                    raise exc
                errors.append(exc)
                continue
            fh.seek(0)
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield decode_session(line, str(f), lineno)
                except TraceFormatError as exc:
                    if errors is None:
                        raise
                    errors.append(exc)


def load_sessions(
    path: str | os.PathLike[str], errors: list[TraceFormatError] | None = None
) -> list[Session]:
    return list(iter_sessions(path, errors))


def encode_session(s: Session) -> bytes:
    return _ENCODER.encode(s)


def save_sessions(path: str | os.PathLike[str], sessions: Iterable[Session]) -> int:
    """Write sessions as JSONL (one per line); returns how many were written."""
    n = 0
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as fh:
        for s in sessions:
            fh.write(encode_session(s) + b"\n")
            n += 1
    return n


# --------------------------------------------------------------------------- block size
def reblock(s: Session, block_tokens: int) -> Session:
    """``s`` re-expressed in blocks of ``block_tokens`` tokens (the serving side's block size), so
    every token is charged as the trace's own block size says. One size must divide the other.

    - **split** (trace blocks of ``k * block_tokens``, e.g. Mooncake's 512 into 64): block ``h``
      becomes ``k`` sub-blocks ``hash_block_tokens(h, [j])`` (``h`` names its prefix), ``j < k``; a prefix hit of
      ``m`` trace blocks is then a hit of ``m * k`` sub-blocks, the same tokens. The partial tail
      block of the trace was never hashed (its content is unknown), so its full sub-blocks get
      hashes unique to the request (``[j, 2**32 - 1, step salt]``): charged, never a hit, as
      before; the rest stays ``tail_tokens``.
    - **merge** (trace blocks of ``block_tokens / k``): every ``k`` trace blocks become one block
      named by the last of them (chained, so it names the whole prefix); leftover trace blocks
      join the tail.

    Returns ``s`` itself when the sizes are equal. Deterministic; raises ``ValueError`` when
    neither size divides the other.
    """
    src = s.block_tokens
    if block_tokens == src:
        return s
    if block_tokens <= 0 or (src % block_tokens and block_tokens % src):
        raise ValueError(f"session {s.id!r}: blocks of {src} tokens cannot be re-cut into blocks of "
                         f"{block_tokens} tokens (one size must divide the other)")
    cache: dict[int, list[int]] = {}

    def split(blocks: list[int]) -> list[int]:
        out: list[int] = []
        k = src // block_tokens
        for h in blocks:
            sub = cache.get(h)
            if sub is None:
                sub = cache[h] = [hash_block_tokens(h, [j]) for j in range(k)]
            out += sub
        return out

    def merge(blocks: list[int]) -> tuple[list[int], int]:
        k = block_tokens // src
        n = len(blocks) // k
        return [blocks[(i + 1) * k - 1] for i in range(n)], (len(blocks) - n * k) * src

    salt_root = namespace_root(f"reblock:{s.id}")
    branches = []
    for bi, b in enumerate(s.branches):
        steps: list[Step] = []
        for si, st in enumerate(b.steps):
            if isinstance(st, Request):
                if src > block_tokens:
                    blocks, tail = split(st.blocks), st.tail_tokens
                    parent = blocks[-1] if blocks else salt_root
                    salt = [bi, si]
                    while tail >= block_tokens:
                        parent = hash_block_tokens(parent, [len(blocks), 0xFFFFFFFF, *salt])
                        blocks.append(parent)
                        tail -= block_tokens
                else:
                    blocks, extra = merge(st.blocks)
                    tail = st.tail_tokens + extra
                st = msgspec.structs.replace(st, blocks=blocks, tail_tokens=tail)
            elif isinstance(st, Compact):
                blocks = split(st.blocks) if src > block_tokens else merge(st.blocks)[0]
                st = msgspec.structs.replace(st, blocks=blocks)
            steps.append(st)
        branches.append(msgspec.structs.replace(b, steps=steps))
    return msgspec.structs.replace(s, block_tokens=block_tokens, branches=branches)


def cut_session(s: Session, turns: int) -> Session:
    """``s`` with only its first ``turns`` requests, in the session's order (``Session.requests``:
    the root branch first, then the children in order). A branch cut short ends after its last
    kept request; a child whose ``Fork``/``Spawn`` was cut, or that keeps no request, is dropped
    with that step. The prefix structure of what is kept is the trace's."""
    if turns < 1:
        raise ValueError("turns must be >= 1")
    left = turns
    opened = {s.branches[0].id} if s.branches else set()
    cut: list[tuple[Branch, list]] = []
    for b in s.branches:
        if b.id not in opened or left == 0:
            continue
        steps: list = []
        for st in b.steps:
            if isinstance(st, Request):
                if left == 0:
                    while not isinstance(steps[-1], Request):  # nothing after the last request kept
                        steps.pop()
                    break
                left -= 1
            if not isinstance(st, End):
                steps.append(st)
        if any(isinstance(st, Request) for st in steps):
            opened |= {st.branch for st in steps if isinstance(st, Fork | Spawn)}
            cut.append((b, steps))
    kept = {b.id for b, _ in cut}
    branches = [Branch(id=b.id, parent=b.parent, mode=b.mode, label=b.label,
                       steps=[*(st for st in steps if not (isinstance(st, Fork | Spawn) and st.branch not in kept)),
                              End()])
                for b, steps in cut]
    return Session(id=s.id, format_version=s.format_version, block_tokens=s.block_tokens, source=s.source,
                   approximate=s.approximate, start_s=s.start_s, branches=branches)


# --------------------------------------------------------------------------- event cursor
class _BranchState:
    __slots__ = ("branch", "ended", "gid", "next", "ready", "version", "waiting_req", "waits")

    def __init__(self, branch: Branch, gid: str):
        self.branch, self.gid = branch, gid
        self.next = 0  # index of the next step to run
        self.ready = 0.0
        self.version = 0
        self.waiting_req: str | None = None  # request in flight
        self.waits: set[str] = set()  # children (local ids) the next request waits for
        self.ended = False


class SessionCursor:
    """Closed-loop driver of one session (pure; see the module docstring for the API)."""

    def __init__(self, session: Session, prefix: str = ""):
        self.session = session
        self.prefix = prefix
        self._t0 = 0.0
        self._st: dict[str, _BranchState] = {
            b.id: _BranchState(b, f"{prefix}{session.id}/{b.id}") for b in session.branches
        }
        self._by_req: dict[str, str] = {}
        self._parent_waiting: dict[str, str] = {}  # child -> parent whose next request waits
        self._opened: list[str] = []
        self._started = False

    @property
    def done(self) -> bool:
        return self._started and not self._by_req and all(
            self._st[b].ended for b in self._opened)

    @property
    def in_flight(self) -> list[str]:
        return sorted(self._by_req)

    def branch_id(self, local: str) -> BranchId:
        return BranchId(self._st[local].gid)

    def start(self, t0: float) -> list[Event]:
        """Open the root branch at ``t0`` and run it up to its first request."""
        assert not self._started, "SessionCursor.start called twice"
        self._started = True
        self._t0 = t0
        root = self.session.branches[0]
        out: list[Event] = [BranchOpened(ts=t0, src=_SRC, branch=self.branch_id(root.id),
                                         parent=None, mode="root", session=self.session.id)]
        self._st[root.id].ready = t0
        self._opened.append(root.id)
        self._advance(root.id, out)
        return sorted(out, key=lambda e: e.ts)

    def on_finished(self, request: str, t: float) -> list[Event]:
        """The response of ``request`` finished at ``t``: run its branch on."""
        local = self._by_req.pop(request, None)
        if local is None:
            raise KeyError(f"request {request!r} is not in flight in session {self.session.id!r}")
        st = self._st[local]
        st.waiting_req = None
        st.ready = max(st.ready, t)
        out: list[Event] = []
        self._advance(local, out)
        return sorted(out, key=lambda e: e.ts)

    # The branch runs steps until it submits a request (then waits for its response) or ends.
    def _advance(self, local: str, out: list[Event]) -> None:
        st = self._st[local]
        steps = st.branch.steps
        while st.next < len(steps) and not st.ended:
            i, step = st.next, steps[st.next]
            if isinstance(step, Request):
                if st.waits:
                    return  # resumed by the last waited child's end
                due = st.ready + step.pause_s
                if step.at_s is not None:
                    due = max(self._t0 + step.at_s, st.ready)
                rid = f"{st.gid}/{i}"
                out.append(RequestSubmitted(
                    ts=due, src=_SRC, request=RequestId(rid), branch=BranchId(st.gid),
                    version=st.version, blocks=list(step.blocks),  # BlockHash is a NewType: the ints
                    prompt_tokens=prompt_tokens(step, self.session.block_tokens),
                    max_tokens=step.output_tokens, block_tokens=self.session.block_tokens))
                st.next += 1
                st.ready = due
                st.waiting_req = rid
                self._by_req[rid] = local
                return
            st.next += 1
            if isinstance(step, (Fork, Spawn)):
                t = st.ready + step.pause_s
                st.ready = t
                child = self._st[step.branch]
                self._opened.append(step.branch)
                out.append(BranchOpened(ts=t, src=_SRC, branch=BranchId(child.gid),
                                        parent=BranchId(st.gid), mode=child.branch.mode,
                                        session=self.session.id))
                if step.wait:
                    st.waits.add(step.branch)
                    self._parent_waiting[step.branch] = local
                child.ready = t
                self._advance(step.branch, out)
            elif isinstance(step, Compact):
                st.version += 1
                out.append(ContextCompacted(ts=st.ready, src=_SRC, branch=BranchId(st.gid),
                                            version=st.version,
                                            blocks=list(step.blocks)))
        if st.waiting_req is None and not st.ended:
            self._end(local, out)

    def _end(self, local: str, out: list[Event]) -> None:
        st = self._st[local]
        if st.waits:
            return  # a branch ends only after the children it waits for
        st.ended = True
        out.append(BranchEnded(ts=st.ready, src=_SRC, branch=BranchId(st.gid)))
        parent = self._parent_waiting.pop(local, None)
        if parent is not None:
            pst = self._st[parent]
            pst.waits.discard(local)
            pst.ready = max(pst.ready, st.ready)
            if not pst.waits and pst.waiting_req is None:
                self._advance(parent, out)


def session_events(
    session: Session, response_s: Callable[[RequestSubmitted], float] | float = 1.0,
    t0: float | None = None, prefix: str = "",
) -> list[Event]:
    """All events of ``session`` when every response takes ``response_s`` (seconds, or a
    function of the request): a reference closed-loop run for tests and dry runs."""
    cur = SessionCursor(session, prefix)
    start = t0 if t0 is not None else (session.start_s or 0.0)
    fn = response_s if callable(response_s) else (lambda _r, d=float(response_s): d)
    out: list[Event] = []
    heap: list[tuple[float, str]] = []

    def take(evs: list[Event]) -> None:
        for e in evs:
            out.append(e)
            if isinstance(e, RequestSubmitted):
                heapq.heappush(heap, (e.ts + fn(e), e.request))

    take(cur.start(start))
    while heap:
        t, rid = heapq.heappop(heap)
        take(cur.on_finished(rid, t))
    out.sort(key=lambda e: e.ts)  # stable: same-ts events keep their causal order
    return out
