"""Branch signals from HTTP headers, and the per-branch bookkeeping of the gateway (pure, no I/O).

The harness tells the gateway which branch (unit of context with its own request sequence)
a request belongs to. Six header families are read; when several are present the first one in
this order wins and the others are ignored (docs/gateway.md, "Branch headers", has the table):

=====================  =========================================================================
family (``source``)    branch / parent / end
=====================  =========================================================================
``ei`` (ours)          ``x-branch-id`` / ``x-parent-branch-id`` (+ ``x-branch-mode``) / ``x-branch-end``
``dynamo-trajectory``  ``x-dynamo-trajectory-id`` / ``x-dynamo-parent-trajectory-id`` /
                       ``x-dynamo-trajectory-final``
``dynamo``             ``x-dynamo-session-id`` / ``x-dynamo-parent-session-id`` / ``x-dynamo-session-final``
``claude-code``        ``x-claude-code-agent-id`` when present (a sub-agent; its parent is
                       ``x-claude-code-parent-agent-id``, else the session), else
                       ``x-claude-code-session-id`` / - / (never: idle expiry ends it)
``opencode``           ``x-session-id`` / ``x-parent-session-id`` / -
``codex``              ``thread-id`` when it differs from ``session-id`` (a sub-agent; its parent
                       is the ``parent_thread_id`` of ``x-codex-turn-metadata``, else the session),
                       else ``session-id`` / - / -
=====================  =========================================================================

Rules:

- Ids are 1-256 characters of valid UTF-8 without control characters.
- A parent without a mode means ``subagent`` (a fresh context: it never claims reuse of the
  parent's KV it might not have). A mode without a parent is an error.
- Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); anything else is an error.
  Any of the three end headers ends the branch, whichever family named it.
- :class:`BranchTable` decides the harness events of one request: ``BranchOpened`` on first
  sight; ``ContextCompacted`` when ``x-context-compacted`` is true or when the prompt no longer
  extends the branch's previous prompt (the previous prompt's full blocks are not a prefix of
  the new prompt's blocks), never on a branch's first request - unless the request is a *side
  request* (below); ``BranchEnded`` after the
  response when the request ends the branch (or carried no branch headers at all), and
  ``BranchEnded(reason="idle")`` from :meth:`BranchTable.expire` for a branch without a request
  for longer than its TTL (decided from the ``ts`` values the caller passes, nothing else).
- **Side requests** (:func:`is_side`): on a branch an agent-native header names (Claude Code,
  OpenCode, Codex: clients that never say which calls are side calls), a chat request *without
  tools* whose prompt shares not even its first block with the branch's previous prompt, or (the
  OpenCode family) that is the first request the branch sees, is a call beside the agent's conversation (opencode's
  title request, an agent's summary call), not a rewrite of it: it runs on its own child branch
  ``<branch>:side-<request>`` (``BranchOpened(parent=branch, mode="subagent")``, ended after its
  response), and the branch's prompt, version and blocks stay as they were (no
  ``ContextCompacted``). A branch opened by a side request takes its own first request as usual.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, Event, RequestSubmitted
from events.ids import BlockHash, BranchId, BranchMode, RequestId
from services.drivers.gateway.api import clip

H_BRANCH = "x-branch-id"
H_PARENT = "x-parent-branch-id"
H_MODE = "x-branch-mode"
H_END = "x-branch-end"
H_COMPACTED = "x-context-compacted"
# Dynamo's canonical agent-session headers (dynamo-llm src/protocols/agents.rs, and
# https://docs.nvidia.com/dynamo/dev/agents/session-i-ds), and its newer trajectory names.
H_DYN_SESSION = "x-dynamo-session-id"
H_DYN_PARENT = "x-dynamo-parent-session-id"
H_DYN_FINAL = "x-dynamo-session-final"
H_DYN_TRAJ = "x-dynamo-trajectory-id"
H_DYN_TRAJ_PARENT = "x-dynamo-parent-trajectory-id"
H_DYN_TRAJ_FINAL = "x-dynamo-trajectory-final"
# Agent-native headers (the constants HEADER_CLAUDE_CODE_*, HEADER_CODEX_SESSION_ID,
# HEADER_OPENCODE_* in dynamo-llm's src/protocols/agents.rs).
H_CC_SESSION = "x-claude-code-session-id"
H_CC_AGENT = "x-claude-code-agent-id"
H_CC_PARENT_AGENT = "x-claude-code-parent-agent-id"
H_OC_SESSION = "x-session-id"
H_OC_PARENT = "x-parent-session-id"
H_CODEX_SESSION = "session-id"
# Codex 0.171 (measured): every request carries its agent's thread; a sub-agent's thread differs
# from the session, and its turn metadata (JSON) names the parent thread
H_CODEX_THREAD = "thread-id"
H_CODEX_TURN_META = "x-codex-turn-metadata"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
MAX_ID_LEN = 256


@dataclass(frozen=True, slots=True)
class Family:
    """One header family: ``branch`` names the branch, ``parent`` its parent. ``child`` (Claude
    Code's agent id) names the branch instead when present, a sub-agent whose parent is
    ``parent`` or else the ``branch`` header's id (the session). ``strict``: a self-parent is an
    error (families a client sets on purpose) rather than ignored (agent-native ones)."""

    source: str
    branch: str
    parent: str | None = None
    child: str | None = None
    strict: bool = False
    #: (header, key): the parent of a ``child`` read from a JSON object header (Codex's turn
    #: metadata) when no ``parent`` header names it
    parent_json: tuple[str, str] | None = None


#: Precedence order: the first family whose branch header is present wins.
FAMILIES: tuple[Family, ...] = (
    Family("ei", H_BRANCH, H_PARENT, strict=True),
    Family("dynamo-trajectory", H_DYN_TRAJ, H_DYN_TRAJ_PARENT, strict=True),
    Family("dynamo", H_DYN_SESSION, H_DYN_PARENT, strict=True),
    Family("claude-code", H_CC_SESSION, H_CC_PARENT_AGENT, child=H_CC_AGENT),
    Family("opencode", H_OC_SESSION, H_OC_PARENT),
    Family("codex", H_CODEX_SESSION, child=H_CODEX_THREAD, parent_json=(H_CODEX_TURN_META, "parent_thread_id")),
)
END_HEADERS = (H_END, H_DYN_TRAJ_FINAL, H_DYN_FINAL)


class HeaderError(ValueError):
    """A bad header value; ``field`` names the header."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True, slots=True)
class BranchSignals:
    """What the headers of one request say about its branch."""

    branch: str | None  # None: no branch headers (served as a one-request branch)
    parent: str | None = None
    mode: BranchMode = "root"
    end: bool = False
    compacted: bool = False
    source: str = "none"  # a Family.source, or none


def _get(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)
    if v is None:
        return None
    return v.strip()


def parse_bool(headers: Mapping[str, str], name: str) -> bool:
    v = _get(headers, name)
    if v is None:
        return False
    low = v.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise HeaderError(name, f"expected a boolean (true/false/1/0), got {clip(v)!r}")


def _ident(headers: Mapping[str, str], name: str | None) -> str | None:
    if name is None:
        return None
    v = _get(headers, name)
    if v is None:
        return None
    if not v:
        raise HeaderError(name, "must not be empty")
    if len(v) > MAX_ID_LEN:
        raise HeaderError(name, f"longer than {MAX_ID_LEN} characters")
    if any(ord(c) < 32 for c in v):
        raise HeaderError(name, "contains control characters")
    if not v.isascii():
        try:  # aiohttp keeps bytes that are not UTF-8 as lone surrogates; no event could carry them
            v.encode()
        except UnicodeEncodeError:
            raise HeaderError(name, f"the {name} header is not valid UTF-8") from None
    return v


def _json_ident(headers: Mapping[str, str], name: str, key: str) -> str | None:
    """An id under ``key`` in the JSON object of header ``name``; None when the header is absent,
    not a JSON object, or the value is not a valid id (metadata, not a signal: never an error)."""
    raw = _get(headers, name)
    if not raw:
        return None
    try:
        v = json.loads(raw).get(key)
    except (ValueError, AttributeError):
        return None
    if not isinstance(v, str) or not v:
        return None
    try:
        return _ident({key: v}, key)
    except HeaderError:
        return None


def parse_branch_headers(headers: Mapping[str, str]) -> BranchSignals:
    """Read the branch signals of one request (``headers`` must be case-insensitive, like
    aiohttp's ``CIMultiDictProxy``, or have lower-case keys). Raises :class:`HeaderError`."""
    ends = [parse_bool(headers, name) for name in END_HEADERS]  # every one is validated
    end = any(ends)
    compacted = parse_bool(headers, H_COMPACTED)
    raw_mode = _get(headers, H_MODE)
    fam = next((f for f in FAMILIES if _get(headers, f.branch) is not None), None)
    if fam is None:
        for f in FAMILIES:
            # a lone thread-id is no sign of Codex (a generic name, and Codex always sends session-id)
            for name in (f.parent, f.child if f.parent_json is None else None):
                if name is not None and _get(headers, name) is not None:
                    raise HeaderError(name, f"given without {f.branch}")
        if raw_mode is not None:
            raise HeaderError(H_MODE, f"given without {H_BRANCH} (or another family's branch header)")
        return BranchSignals(branch=None, end=end, compacted=compacted)
    branch = _ident(headers, fam.branch)
    parent = _ident(headers, fam.parent)
    child = _ident(headers, fam.child)
    if parent is None and fam.parent_json is not None and child is not None:
        parent = _json_ident(headers, *fam.parent_json)
    if fam.child is not None:  # Claude Code: the session, or a sub-agent of it
        if child is not None and child != branch:
            branch, parent = child, (parent if parent is not None and parent != child else branch)
        else:
            parent = None
    assert branch is not None
    if parent is not None and parent == branch:
        if fam.strict:
            raise HeaderError(fam.parent or H_PARENT, "a branch cannot be its own parent")
        parent = None
    if raw_mode is not None:
        mode = raw_mode.lower()
        if mode not in ("fork", "subagent"):
            raise HeaderError(H_MODE, f"expected 'fork' or 'subagent', got {clip(raw_mode)!r}")
        if parent is None:
            raise HeaderError(H_MODE, f"a {mode} needs {fam.parent or H_PARENT}")
    else:
        mode = "subagent" if parent is not None else "root"
    return BranchSignals(branch=branch, parent=parent, mode=mode, end=end, compacted=compacted,  # type: ignore[arg-type]
                         source=fam.source)


# --------------------------------------------------------------------------- branch table
class BranchStateError(ValueError):
    """A request names a branch that can no longer take requests (it ended)."""

    def __init__(self, branch: str, message: str) -> None:
        self.branch = branch
        super().__init__(message)


@dataclass(slots=True)
class _Branch:
    session: str
    eid: str = ""  # the branch id in the events: the header's id, or ``id~N`` once it expired
    version: int = 0
    blocks: list[BlockHash] = field(default_factory=list)  # previous prompt's full blocks
    requests: int = 0
    last_ts: float = 0.0  # ts of its latest request (idle expiry)


@dataclass(frozen=True, slots=True)
class Admission:
    """The harness events to publish before the request is submitted, and whether the branch
    ends after its response. ``compaction`` is ``header``, ``inferred`` or empty; ``branch``: the
    table's key of the branch the request runs on (a side request's own branch), None: the one
    the caller passed."""

    before: list[Event]
    request: RequestSubmitted
    end_after: bool
    compaction: str = ""
    opened: bool = False
    branch: str | None = None
    side: bool = False


@dataclass(frozen=True, slots=True)
class Expiry:
    """A branch ended by :meth:`BranchTable.expire`: its session (the partition key) and the
    ``BranchEnded(reason="idle")`` to publish."""

    branch: str
    session: str
    event: BranchEnded


#: The header families whose clients never mark a side call: their tool-less, unrelated calls
#: are side requests (:func:`is_side`). Ours and Dynamo's name every branch on purpose.
AGENT_NATIVE = ("claude-code", "opencode", "codex")
#: The families whose client sends a side call at the same time as its session's first turn
#: (opencode 1.18: the title request, measured), so a tool-less first request is one.
SIDE_FIRST = ("opencode",)


def is_side(sig: BranchSignals, tools: bool | None, previous: Sequence[BlockHash] | None,
            blocks: Sequence[BlockHash]) -> bool:
    """A side request (module docstring): a chat request without tools (``tools is False``; None:
    a completions request, never one) on an agent-native branch, no end or compaction header,
    whose prompt has a full block and either shares not even its first block with the branch's
    previous prompt (which has one) or, on OpenCode's family (:data:`SIDE_FIRST`), opens the
    branch (``previous`` None)."""
    if tools is not False or sig.source not in AGENT_NATIVE or sig.end or sig.compacted or not blocks:
        return False
    if previous is None:  # first sight: only OpenCode sends its side call beside its first turn
        return sig.source in SIDE_FIRST
    return len(previous) > 0 and previous[0] != blocks[0]


def extends(previous: Sequence[BlockHash], new: Sequence[BlockHash]) -> bool:
    """True when ``new`` starts with every block of ``previous`` (the prompt grew)."""
    return len(new) >= len(previous) and list(new[: len(previous)]) == list(previous)


class BranchTable:
    """Per-branch version and previous context; decides the harness events of a request.

    Pure and deterministic: the caller passes ids and ``ts``. Ended branches are remembered
    (up to ``max_ended``, oldest forgotten first) so a late request on them is refused.

    Idle expiry (``ttl_s``; None or <= 0: never): :meth:`expire` ends every open branch whose
    latest request is more than ``ttl_s`` older than ``now`` with ``BranchEnded(reason="idle")``.
    An expired branch is not refused later: a new request on its id opens it again under the
    event id ``<id>~2`` (``~3``, ...), since a branch id that ended on the stream is never
    reopened there; its session (and so its partition) stays the original one.
    """

    def __init__(self, src: str = "gateway", max_ended: int = 100_000, ttl_s: float | None = None) -> None:
        self.src = src
        self.open: OrderedDict[str, _Branch] = OrderedDict()  # least recently active first
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.expired: OrderedDict[str, int] = OrderedDict()  # header id -> times it expired
        self.max_ended = max_ended
        self.ttl_s = ttl_s if ttl_s is not None and ttl_s > 0 else None

    def event_id(self, branch: str) -> str:
        """The id the events give ``branch`` (its current generation's, if it is open)."""
        st = self.open.get(branch)
        if st is not None:
            return st.eid
        n = self.expired.get(branch, 0)
        return branch if n == 0 else f"{branch}~{n + 1}"

    def admit(self, sig: BranchSignals, branch: str, request: str, blocks: list[BlockHash],
              prompt_tokens: int, max_tokens: int, block_tokens: int, ts: float, *,
              priority: int | msgspec.UnsetType = msgspec.UNSET,
              osl: int | msgspec.UnsetType = msgspec.UNSET, sampling: dict | None = None,
              tools: bool | None = None) -> Admission:
        """``branch`` is ``sig.branch`` or, for a request without branch headers, a fresh id.
        ``priority`` / ``osl``: the request's agent hints, carried on ``RequestSubmitted``, as
        ``sampling`` (its ``ignore_eos``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``).
        ``tools``: whether a chat request has tools (None: a completions request), for :func:`is_side`."""
        if branch in self.ended:
            raise BranchStateError(branch, f"branch {branch!r} has ended (an end header was sent: "
                                   f"x-branch-end / x-dynamo-session-final / x-dynamo-trajectory-final); "
                                   f"use a new branch id")
        before: list[Event] = []
        st = self.open.get(branch)
        opened = st is None
        compaction = ""
        side = sig.branch is not None and is_side(sig, tools, None if st is None else st.blocks, blocks)
        if st is None:
            parent = sig.parent if sig.branch is not None else None
            pst = self.open.get(parent) if parent is not None else None
            # a child joins its parent's session (the parent's own id if this gateway never saw it)
            session = branch if parent is None else (pst.session if pst is not None else parent)
            st = self.open[branch] = _Branch(session=session, eid=self.event_id(branch))
            peid = None if parent is None else (pst.eid if pst is not None else parent)
            before.append(BranchOpened(ts=ts, src=self.src, branch=BranchId(st.eid),
                                       parent=BranchId(peid) if peid else None,
                                       mode=sig.mode if parent else "root", session=st.session))
            if side:  # opened by a side request: its own first request sets its prompt (no compaction)
                st.last_ts = ts
        else:
            self.open.move_to_end(branch)
            if side:
                st.last_ts = max(st.last_ts, ts)
            elif sig.compacted:
                compaction = "header"
            elif not extends(st.blocks, blocks):
                compaction = "inferred"
        common = dict(prompt_tokens=prompt_tokens, max_tokens=max_tokens, block_tokens=block_tokens,
                      priority=priority, osl=osl, **(sampling or {}))
        if side:  # its own child branch, one request, ended after the response
            sid = f"{st.eid}:side-{request.rpartition('/')[2]}"
            self.open[sid] = _Branch(session=st.session, eid=sid, blocks=list(blocks), requests=1, last_ts=ts)
            before.append(BranchOpened(ts=ts, src=self.src, branch=BranchId(sid), parent=BranchId(st.eid),
                                       mode="subagent", session=st.session))
            req = RequestSubmitted(ts=ts, src=self.src, request=RequestId(request), branch=BranchId(sid), version=0,
                                   blocks=list(blocks), **common)
            return Admission(before=before, request=req, end_after=True, opened=opened, branch=sid, side=True)
        if compaction:
            st.version += 1
            before.append(ContextCompacted(ts=ts, src=self.src, branch=BranchId(st.eid),
                                           version=st.version, blocks=list(blocks)))
        st.blocks = list(blocks)
        st.requests += 1
        st.last_ts = max(st.last_ts, ts) if st.requests > 1 else ts
        req = RequestSubmitted(ts=ts, src=self.src, request=RequestId(request), branch=BranchId(st.eid),
                               version=st.version, blocks=list(blocks), **common)
        end_after = sig.end or sig.branch is None
        return Admission(before=before, request=req, end_after=end_after, compaction=compaction,
                         opened=opened)

    def end(self, branch: str, ts: float) -> BranchEnded | None:
        """Close ``branch``; returns the event to publish (None if it was not open)."""
        st = self.open.pop(branch, None)
        if st is None:
            return None
        self.ended[branch] = None
        while len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)
        return BranchEnded(ts=ts, src=self.src, branch=BranchId(st.eid))

    def expire(self, now: float) -> list[Expiry]:
        """End every open branch idle for longer than ``ttl_s`` at time ``now`` (a request's
        ``ts`` or a tick's): ``BranchEnded(ts=now, reason="idle")`` each, oldest first."""
        if self.ttl_s is None:
            return []
        out: list[Expiry] = []
        limit = now - self.ttl_s
        while self.open:
            branch, st = next(iter(self.open.items()))
            if st.last_ts >= limit:  # idle for at most ttl_s
                break
            del self.open[branch]
            self.expired[branch] = self.expired.pop(branch, 0) + 1
            while len(self.expired) > self.max_ended:
                self.expired.popitem(last=False)
            out.append(Expiry(branch, st.session, BranchEnded(ts=now, src=self.src, branch=BranchId(st.eid),
                                                              reason="idle")))
        return out

    # ------------------------------------------------------------ rebuilt from the stream
    def _header_id(self, eid: str) -> str:
        """The header id of the event id ``eid``: ``x`` for ``x~N`` when ``x`` expired N-1 times
        (its N-th generation), else ``eid`` itself (an id that merely contains ``~``)."""
        base, sep, n = eid.rpartition("~")
        if sep and n.isdigit() and int(n) >= 2 and self.expired.get(base, 0) == int(n) - 1:
            return base
        return eid

    def fold(self, ev: Event) -> None:
        """Apply one harness event of the partition's stream, in stream order: a restarted
        gateway rebuilds its table from ``ei.<p>.agent.>`` (``BranchOpened``, ``ContextCompacted``,
        ``RequestSubmitted``, ``BranchEnded``), so a branch's next request continues its version
        and prefix (no second ``BranchOpened``, no spurious compaction) and an ended branch stays
        ended. Whichever gateway published them; other events are ignored."""
        if isinstance(ev, BranchOpened):
            hid = self._header_id(ev.branch)
            self.ended.pop(hid, None)
            self.open[hid] = _Branch(session=ev.session or hid, eid=ev.branch, last_ts=ev.ts)
            self.open.move_to_end(hid)
            return
        if not isinstance(ev, RequestSubmitted | ContextCompacted | BranchEnded):
            return
        hid = self._header_id(ev.branch)
        st = self.open.get(hid)
        if st is None or st.eid != ev.branch:
            if isinstance(ev, BranchEnded):
                return
            # its BranchOpened is gone (stream limits): the branch is known from its requests
            st = self.open[hid] = _Branch(session=hid, eid=ev.branch, last_ts=ev.ts)
        if isinstance(ev, BranchEnded):
            del self.open[hid]
            if ev.reason == "idle":
                self.expired[hid] = self.expired.pop(hid, 0) + 1
                while len(self.expired) > self.max_ended:
                    self.expired.popitem(last=False)
            else:
                self.ended[hid] = None
                while len(self.ended) > self.max_ended:
                    self.ended.popitem(last=False)
        elif isinstance(ev, ContextCompacted):
            st.version = max(st.version, ev.version)
        else:
            st.version = max(st.version, ev.version)
            st.blocks = list(ev.blocks)
            st.requests += 1
            st.last_ts = max(st.last_ts, ev.ts)
            self.open.move_to_end(hid)

    def orphans(self, prefix: str, instance: str) -> list[str]:
        """Open one-request branches (``<prefix><instance>-<n>``, no branch headers) of another
        gateway instance: no request can name them again, so a restarted gateway ends them."""
        own = f"{prefix}{instance}-"
        return [b for b in self.open if b.startswith(prefix) and not b.startswith(own)]
