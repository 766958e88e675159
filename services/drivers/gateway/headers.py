"""Branch signals from HTTP headers (pure, no I/O); the gateway folds them with the branch table
of services/cores/branches.py.

The harness tells the gateway which branch (unit of context with its own request sequence)
a request belongs to. Eight header families are read; when several are present the first one in
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
``session-affinity``   ``x-session-affinity`` / - / - (aiperf's multi-turn mode, pi-ai; opencode
                       sends it too, equal to its ``x-session-id``, which wins)
``correlation``        ``x-correlation-id`` / - / - (aiperf: one per conversation; last, as a
                       generic tracing header some clients set per request)
=====================  =========================================================================

Rules:

- Ids are 1-256 characters of valid UTF-8 without control characters.
- A parent without a mode means ``subagent`` (a fresh context: it never claims reuse of the
  parent's KV it might not have). A mode without a parent is an error.
- Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); anything else is an error.
  Any of the three end headers ends the branch, whichever family named it.
- What the signals mean for the branch's events (``BranchOpened``, ``ContextCompacted``,
  ``BranchEnded``, side requests) is decided by the pure branch table,
  services/cores/branches.py; this module only reads headers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from services.cores.branches import BranchSignals
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
# Benchmark clients: aiperf 0.13's multi-turn mode sends both, stable per conversation. Neither
# ends a session: the branch table's idle expiry closes it, as for the agent-native families.
H_AFFINITY = "x-session-affinity"
H_CORRELATION = "x-correlation-id"

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
    Family("session-affinity", H_AFFINITY),
    Family("correlation", H_CORRELATION),
)
END_HEADERS = (H_END, H_DYN_TRAJ_FINAL, H_DYN_FINAL)


class HeaderError(ValueError):
    """A bad header value; ``field`` names the header."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


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
