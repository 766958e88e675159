"""Sessions without headers: which open branch a headerless chat request continues (pure, no I/O).

A client that sends no branch headers (mini-swe-agent, aider, a plain SDK script) still sends
its whole conversation every turn. The rule (docs/gateway.md, "Sessions without headers"):

1. Each message gets a key: its role, its text (text parts joined, other parts as ``[<type>]``,
   stripped of surrounding whitespace), its tool calls (id, name, arguments), ``tool_call_id``
   and ``name`` (:func:`message_key`); both APIs' messages go through the same OpenAI-style
   form (``anthropic_api.chat_messages``), so the same conversation hashes the same.
2. The conversation's chain: ``h_1 = H(k_1)``, ``h_i = H(h_{i-1} || k_i)`` (BLAKE2b, 16 bytes),
   so ``h_i`` names the exact first ``i`` messages (:func:`chain`).
3. After admitting a request of ``n`` messages on branch ``b``, ``h_n -> b`` is remembered; after
   its response, ``h_{n+1} -> b`` too, with the assistant's reply as message ``n + 1``.
4. A new headerless request of ``N`` messages continues the branch of the **longest proper
   prefix** ``h_k`` (``k < N``) that is remembered, live and whose branch is still open: the
   previous request plus the reply the client sent back (``k = n + 1``) wins over the previous
   request alone (``k = n``), which matches a reply the client rewrote. No match: a new branch.
   A request that only repeats a remembered list (``k = N``) is not a continuation: two
   identical first requests are two conversations as far as anyone can tell.

The index is bounded: entries live ``ttl_s`` (the branches' idle TTL) from their last use, and
at most ``max_entries`` are kept (least recently used dropped first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import msgspec

ChainHash = NewType("ChainHash", bytes)  # names a conversation's first i messages

_ENC = msgspec.json.Encoder(order="sorted")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    out = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, Mapping):
            kind = part.get("type", "text")
            out.append(str(part.get("text") or "") if kind == "text" else f"[{kind}]")
        else:
            out.append(str(part))
    return "".join(out).strip()


def _call(c: Any) -> Any:
    if not isinstance(c, Mapping):
        return c
    fn = c.get("function")
    fn = fn if isinstance(fn, Mapping) else {}
    return [c.get("id"), fn.get("name"), fn.get("arguments")]


def message_key(m: Mapping[str, Any]) -> bytes:
    """The bytes one message contributes to the chain (what identifies it across requests)."""
    calls = m.get("tool_calls")
    return _ENC.encode([m.get("role"), _text(m.get("content")),
                        [_call(c) for c in calls] if isinstance(calls, list) else [],
                        m.get("tool_call_id"), m.get("name")])


def link(parent: ChainHash | None, message: Mapping[str, Any]) -> ChainHash:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(hashlib.blake2b(message_key(message), digest_size=16).digest())
    return ChainHash(h.digest())


def chain(messages: Iterable[Mapping[str, Any]]) -> list[ChainHash]:
    """``[h_1, ..., h_n]``: ``h_i`` names the first ``i`` messages."""
    out: list[ChainHash] = []
    for m in messages:
        out.append(link(out[-1] if out else None, m))
    return out


@dataclass(slots=True)
class _Entry:
    branch: str
    ts: float  # last remembered or matched (event clock)


class ConversationIndex:
    """Conversation prefixes -> the branch that sent them (the module docstring has the rule).

    ``find`` and ``remember`` take the caller's ``now`` (event-clock seconds); nothing else
    decides an entry's life. ``ttl_s`` None or <= 0: entries live until pushed out by
    ``max_entries``."""

    def __init__(self, ttl_s: float | None = 1800.0, max_entries: int = 65_536) -> None:
        assert max_entries > 0, "the index must be able to hold an entry"
        self.ttl_s = ttl_s if ttl_s is not None and ttl_s > 0 else None
        self.max_entries = max_entries
        self._entries: OrderedDict[ChainHash, _Entry] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, e: _Entry, now: float) -> bool:
        return self.ttl_s is None or now - e.ts <= self.ttl_s

    def find(self, hashes: Sequence[ChainHash], now: float, is_open=lambda _b: True) -> tuple[str, int] | None:
        """``(branch, k)`` for the longest proper prefix ``hashes[k - 1]`` (``k < len(hashes)``)
        remembered, live and on a branch ``is_open`` says is open; None when there is none."""
        self.expire(now)
        for k in range(len(hashes) - 1, 0, -1):
            e = self._entries.get(hashes[k - 1])
            if e is not None and self._live(e, now) and is_open(e.branch):
                e.ts = max(e.ts, now)
                self._entries.move_to_end(hashes[k - 1])
                return e.branch, k
        return None

    def remember(self, h: ChainHash, branch: str, now: float) -> None:
        """``h`` now names a prefix ``branch`` sent (the newest sender wins)."""
        self._entries[h] = _Entry(branch, now)
        self._entries.move_to_end(h)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def expire(self, now: float) -> int:
        """Drop the entries unused for longer than ``ttl_s`` at ``now``; how many."""
        if self.ttl_s is None:
            return 0
        n = 0
        while self._entries:
            h, e = next(iter(self._entries.items()))
            if self._live(e, now):
                break
            del self._entries[h]
            n += 1
        return n
