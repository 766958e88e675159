"""Token streaming between engines and the gateway: core NATS, not the event stream.

Generated tokens are not facts the control plane folds (``FirstToken`` / ``RequestFinished``
are), so they travel on core NATS (no JetStream storage, at-most-once) on the subject

    ``eitok.<partition>.<key>``   with ``key = token_key(request)``

``token_key`` is the first 16 hex digits of BLAKE2b(request id), so any request id (slashes,
dots, spaces) maps to one safe subject token. Outside ``ei.<p>.>`` on purpose: the partition's
stream never stores these messages.

Each message is one JSON-encoded :class:`TokenMsg` (readable with ``nats sub 'eitok.>'``):

- ``kind="first"``: the first output token exists (prefill done), ``tokens=1``.
- ``kind="chunk"``: ``tokens`` more tokens, ``total`` generated so far, ``text`` their text.
- ``kind="done"``: generation finished, ``total`` output tokens, ``finish_reason``.
- ``kind="error"``: the request failed on the engine, ``error`` says why.

The sim engine generates no real text: ``text`` is ``"tok "`` per token (:func:`sim_text`).
The gateway subscribes to the request's subject *before* it publishes ``RequestSubmitted``
(core NATS keeps nothing for late subscribers) and stops after ``done``/``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Literal

import msgspec

from events.subjects import token

SIM_TOKEN_TEXT = "tok "
_ENC = msgspec.json.Encoder()


class TokenMsg(msgspec.Struct, frozen=True, kw_only=True):
    request: str
    kind: Literal["first", "chunk", "done", "error"]
    tokens: int = 0  # new tokens in this message
    total: int = 0  # tokens generated so far (including these)
    text: str = ""  # text of the new tokens
    node: str = ""
    ts: float = 0.0
    finish_reason: str = ""
    error: str = ""
    simulated: bool = False  # the text is dummy ("tok " per token) from the sim engine


_DEC = msgspec.json.Decoder(TokenMsg)


def sim_text(n: int) -> str:
    """The sim engine's dummy text for ``n`` tokens."""
    return SIM_TOKEN_TEXT * max(0, n)


def token_key(request: str) -> str:
    return hashlib.blake2b(request.encode(), digest_size=8).hexdigest()


def token_subject(partition: str, request: str) -> str:
    return f"eitok.{token(partition)}.{token_key(request)}"


def encode(msg: TokenMsg) -> bytes:
    return _ENC.encode(msg)


def decode(data: bytes) -> TokenMsg:
    return _DEC.decode(data)


class TokenSub:
    """The messages of one request, in arrival order."""

    def __init__(self, request: str, closer) -> None:
        self.request = request
        self.queue: asyncio.Queue[TokenMsg] = asyncio.Queue()
        self._closer = closer

    def _put(self, msg: TokenMsg) -> None:
        if msg.request == self.request:  # a digest collision never mixes two requests
            self.queue.put_nowait(msg)

    async def get(self, timeout_s: float) -> TokenMsg:
        """The next message; raises ``asyncio.TimeoutError`` after ``timeout_s`` of silence."""
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            await closer()


class NatsTokens:
    """Token channel over a nats-py client (``bus.nc`` of a :class:`services.bus.NatsBus`)."""

    def __init__(self, nc, partition: str) -> None:
        self.nc, self.partition = nc, partition

    async def publish(self, msg: TokenMsg) -> None:
        await self.nc.publish(token_subject(self.partition, msg.request), encode(msg))

    async def subscribe(self, request: str) -> TokenSub:
        sub_obj = TokenSub(request, None)

        async def cb(m) -> None:
            try:
                sub_obj._put(decode(m.data))
            except msgspec.DecodeError:
                pass  # not ours; the gateway counts timeouts, not garbage

        nsub = await self.nc.subscribe(token_subject(self.partition, request), cb=cb)
        await self.nc.flush()  # the server knows the subscription before the request is submitted

        async def close() -> None:
            # a closed connection has nothing left to release
            with contextlib.suppress(Exception):
                await nsub.unsubscribe()

        sub_obj._closer = close
        return sub_obj


class MemoryTokens:
    """In-process twin of :class:`NatsTokens` (tests, and a gateway on an InMemoryBus)."""

    def __init__(self, partition: str = "default") -> None:
        self.partition = partition
        self._subs: dict[str, list[TokenSub]] = {}
        self.published: list[TokenMsg] = []

    async def publish(self, msg: TokenMsg) -> None:
        self.published.append(msg)
        for s in list(self._subs.get(token_subject(self.partition, msg.request), ())):
            s._put(msg)

    async def subscribe(self, request: str) -> TokenSub:
        subj = token_subject(self.partition, request)

        async def close() -> None:
            lst = self._subs.get(subj, [])
            if sub in lst:
                lst.remove(sub)
            if not lst:
                self._subs.pop(subj, None)

        sub = TokenSub(request, close)
        self._subs.setdefault(subj, []).append(sub)
        return sub
