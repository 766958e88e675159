"""The gateway's branch table: per branch, its version and previous prompt; decides the harness
events of each request. Pure and deterministic, no I/O: the caller passes ids and ``ts``.

The gateway reads a request's branch headers into :class:`BranchSignals`
(services/drivers/gateway/headers.py, docs/gateway.md "Branch headers"); this table turns them
into events:

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

A restarted gateway rebuilds the table by folding its partition's harness events
(:meth:`BranchTable.fold`), so a branch's next request continues where it was.

Layer 1 (core). May import: ``events``, msgspec, the standard library.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, Event, RequestSubmitted
from events.ids import BlockHash, BranchId, BranchMode, RequestId


@dataclass(frozen=True, slots=True)
class BranchSignals:
    """What the headers of one request say about its branch."""

    branch: str | None  # None: no branch headers (served as a one-request branch)
    parent: str | None = None
    mode: BranchMode = "root"
    end: bool = False
    compacted: bool = False
    source: str = "none"  # a Family.source, or none


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
        match ev:
            case BranchOpened():
                hid = self._header_id(ev.branch)
                self.ended.pop(hid, None)
                self.open[hid] = _Branch(session=ev.session or hid, eid=ev.branch, last_ts=ev.ts)
                self.open.move_to_end(hid)
            case BranchEnded():
                hid = self._header_id(ev.branch)
                st = self.open.get(hid)
                if st is None or st.eid != ev.branch:
                    return  # an end of a generation this table no longer holds
                del self.open[hid]
                if ev.reason == "idle":
                    self.expired[hid] = self.expired.pop(hid, 0) + 1
                    while len(self.expired) > self.max_ended:
                        self.expired.popitem(last=False)
                else:
                    self.ended[hid] = None
                    while len(self.ended) > self.max_ended:
                        self.ended.popitem(last=False)
            case ContextCompacted():
                st = self._known(ev)
                st.version = max(st.version, ev.version)
            case RequestSubmitted():
                st = self._known(ev)
                st.version = max(st.version, ev.version)
                st.blocks = list(ev.blocks)
                st.requests += 1
                st.last_ts = max(st.last_ts, ev.ts)
                self.open.move_to_end(self._header_id(ev.branch))

    def _known(self, ev: ContextCompacted | RequestSubmitted) -> _Branch:
        """The open branch ``ev`` names; one whose ``BranchOpened`` is gone (stream limits) is
        known from its requests."""
        hid = self._header_id(ev.branch)
        st = self.open.get(hid)
        if st is None or st.eid != ev.branch:
            st = self.open[hid] = _Branch(session=hid, eid=ev.branch, last_ts=ev.ts)
        return st

    def orphans(self, prefix: str, instance: str) -> list[str]:
        """Open one-request branches (``<prefix><instance>-<n>``, no branch headers) of another
        gateway instance: no request can name them again, so a restarted gateway ends them."""
        own = f"{prefix}{instance}-"
        return [b for b in self.open if b.startswith(prefix) and not b.startswith(own)]
