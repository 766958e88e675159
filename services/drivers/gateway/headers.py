"""Branch signals from HTTP headers, and the per-branch bookkeeping of the gateway (pure, no I/O).

The harness tells the gateway which branch (unit of context with its own request sequence)
a request belongs to. Two header families are read; ours win when both are present:

====================================  ======================================  ===================
ours                                  Dynamo (docs.nvidia.com/dynamo, agents)  meaning
====================================  ======================================  ===================
``x-branch-id``                       ``x-dynamo-session-id``                 branch id
``x-parent-branch-id``                ``x-dynamo-parent-session-id``          parent branch
``x-branch-mode`` (fork | subagent)   (none: a Dynamo child is a subagent)    how the child starts
``x-branch-end`` (bool)               ``x-dynamo-session-final`` (bool)       branch ends after
                                                                              this response
``x-context-compacted`` (bool)        (none)                                  context rewritten
====================================  ======================================  ===================

Rules (docs/gateway.md has the full table):

- A parent without a mode means ``subagent`` (a fresh context: it never claims reuse of the
  parent's KV it might not have). A mode without a parent is an error.
- Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); anything else is an error.
- :class:`BranchTable` decides the harness events of one request: ``BranchOpened`` on first
  sight; ``ContextCompacted`` when ``x-context-compacted`` is true or when the prompt no longer
  extends the branch's previous prompt (the previous prompt's full blocks are not a prefix of
  the new prompt's blocks), never on a branch's first request; ``BranchEnded`` after the
  response when the request ends the branch (or carried no branch headers at all).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, Event, RequestSubmitted
from events.ids import BlockHash, BranchId, BranchMode, RequestId

H_BRANCH = "x-branch-id"
H_PARENT = "x-parent-branch-id"
H_MODE = "x-branch-mode"
H_END = "x-branch-end"
H_COMPACTED = "x-context-compacted"
# Dynamo's canonical agent-session headers (dynamo-llm src/protocols/agents.rs, and
# https://docs.nvidia.com/dynamo/dev/agents/session-i-ds).
H_DYN_SESSION = "x-dynamo-session-id"
H_DYN_PARENT = "x-dynamo-parent-session-id"
H_DYN_FINAL = "x-dynamo-session-final"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
MAX_ID_LEN = 256


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
    source: str = "none"  # ei | dynamo | none


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
    raise HeaderError(name, f"expected a boolean (true/false/1/0), got {v!r}")


def _ident(headers: Mapping[str, str], name: str) -> str | None:
    v = _get(headers, name)
    if v is None:
        return None
    if not v:
        raise HeaderError(name, "must not be empty")
    if len(v) > MAX_ID_LEN:
        raise HeaderError(name, f"longer than {MAX_ID_LEN} characters")
    if any(ord(c) < 32 for c in v):
        raise HeaderError(name, "contains control characters")
    return v


def parse_branch_headers(headers: Mapping[str, str]) -> BranchSignals:
    """Read the branch signals of one request (``headers`` must be case-insensitive, like
    aiohttp's ``CIMultiDictProxy``, or have lower-case keys). Raises :class:`HeaderError`."""
    ours = _ident(headers, H_BRANCH)
    dyn = _ident(headers, H_DYN_SESSION)
    branch = ours if ours is not None else dyn
    source = "ei" if ours is not None else ("dynamo" if dyn is not None else "none")
    parent = _ident(headers, H_PARENT)
    if parent is None and ours is None:
        parent = _ident(headers, H_DYN_PARENT)
    raw_mode = _get(headers, H_MODE)
    end = parse_bool(headers, H_END) or parse_bool(headers, H_DYN_FINAL)
    compacted = parse_bool(headers, H_COMPACTED)
    if branch is None:
        for name in (H_PARENT, H_MODE, H_DYN_PARENT):
            if _get(headers, name) is not None:
                raise HeaderError(name, f"given without {H_BRANCH} (or {H_DYN_SESSION})")
        return BranchSignals(branch=None, end=end, compacted=compacted)
    if raw_mode is not None:
        mode = raw_mode.lower()
        if mode not in ("fork", "subagent"):
            raise HeaderError(H_MODE, f"expected 'fork' or 'subagent', got {raw_mode!r}")
        if parent is None:
            raise HeaderError(H_MODE, f"a {mode} needs {H_PARENT}")
    else:
        mode = "subagent" if parent is not None else "root"
    if parent is not None and parent == branch:
        raise HeaderError(H_PARENT, "a branch cannot be its own parent")
    return BranchSignals(branch=branch, parent=parent, mode=mode, end=end, compacted=compacted,  # type: ignore[arg-type]
                         source=source)


# --------------------------------------------------------------------------- branch table
class BranchStateError(ValueError):
    """A request names a branch that can no longer take requests (it ended)."""

    def __init__(self, branch: str, message: str) -> None:
        self.branch = branch
        super().__init__(message)


@dataclass(slots=True)
class _Branch:
    session: str
    version: int = 0
    blocks: list[BlockHash] = field(default_factory=list)  # previous prompt's full blocks
    requests: int = 0


@dataclass(frozen=True, slots=True)
class Admission:
    """The harness events to publish before the request is submitted, and whether the branch
    ends after its response. ``compaction`` is ``header``, ``inferred`` or empty."""

    before: list[Event]
    request: RequestSubmitted
    end_after: bool
    compaction: str = ""
    opened: bool = False


def extends(previous: Sequence[BlockHash], new: Sequence[BlockHash]) -> bool:
    """True when ``new`` starts with every block of ``previous`` (the prompt grew)."""
    return len(new) >= len(previous) and list(new[: len(previous)]) == list(previous)


class BranchTable:
    """Per-branch version and previous context; decides the harness events of a request.

    Pure and deterministic: the caller passes ids and ``ts``. Ended branches are remembered
    (up to ``max_ended``, oldest forgotten first) so a late request on them is refused.
    """

    def __init__(self, src: str = "gateway", max_ended: int = 100_000) -> None:
        self.src = src
        self.open: dict[str, _Branch] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.max_ended = max_ended

    def admit(self, sig: BranchSignals, branch: str, request: str, blocks: list[BlockHash],
              prompt_tokens: int, max_tokens: int, block_tokens: int, ts: float) -> Admission:
        """``branch`` is ``sig.branch`` or, for a request without branch headers, a fresh id."""
        if branch in self.ended:
            raise BranchStateError(branch, f"branch {branch!r} has ended (x-branch-end / "
                                   f"x-dynamo-session-final was sent); use a new branch id")
        before: list[Event] = []
        st = self.open.get(branch)
        opened = st is None
        compaction = ""
        if st is None:
            parent = sig.parent if sig.branch is not None else None
            # a child joins its parent's session (the parent's own id if this gateway never saw it)
            session = branch if parent is None else (self.open[parent].session if parent in self.open
                                                     else parent)
            st = self.open[branch] = _Branch(session=session)
            before.append(BranchOpened(ts=ts, src=self.src, branch=BranchId(branch),
                                       parent=BranchId(parent) if parent else None,
                                       mode=sig.mode if parent else "root", session=st.session))
        elif sig.compacted:
            compaction = "header"
        elif not extends(st.blocks, blocks):
            compaction = "inferred"
        if compaction:
            st.version += 1
            before.append(ContextCompacted(ts=ts, src=self.src, branch=BranchId(branch),
                                           version=st.version, blocks=list(blocks)))
        st.blocks = list(blocks)
        st.requests += 1
        req = RequestSubmitted(ts=ts, src=self.src, request=RequestId(request), branch=BranchId(branch),
                               version=st.version, blocks=list(blocks), prompt_tokens=prompt_tokens,
                               max_tokens=max_tokens, block_tokens=block_tokens)
        end_after = sig.end or sig.branch is None
        return Admission(before=before, request=req, end_after=end_after, compaction=compaction,
                         opened=opened)

    def end(self, branch: str, ts: float) -> BranchEnded | None:
        """Close ``branch``; returns the event to publish (None if it was not open)."""
        if self.open.pop(branch, None) is None:
            return None
        self.ended[branch] = None
        while len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)
        return BranchEnded(ts=ts, src=self.src, branch=BranchId(branch))
