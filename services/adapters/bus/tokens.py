"""Token channel adapters (core NATS and in-process) for the wire messages of ``events.wire``.

The subject scheme, :class:`~events.wire.TokenMsg` and its codec live in ``events/wire.py``
(the bottom layer, shared with the engines). This module holds what talks to the outside:

- :class:`NatsTokens` publishes / subscribes ``eitok.<partition>.<key>`` on a nats-py client.
- :class:`MemoryTokens` is its in-process twin (tests, a gateway on an InMemoryBus).

The gateway subscribes to the request's subject *before* it publishes ``RequestSubmitted``
(core NATS keeps nothing for late subscribers) and stops after ``done``/``error``.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from events.wire import (  # noqa: F401 - re-exported for the adapters' users
    SIM_WORDS,
    TokenMsg,
    decode,
    encode,
    sim_text,
    token_key,
    token_subject,
)


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
    """Token channel over a nats-py client; build it from a bus with :meth:`from_bus`."""

    def __init__(self, nc, partition: str) -> None:
        self.nc, self.partition = nc, partition

    @classmethod
    def from_bus(cls, bus, partition: str | None = None) -> NatsTokens:
        """The channel over a :class:`~services.adapters.bus.nats_bus.NatsBus`'s connection (the
        bus's partition unless another is named): drivers never take the connection out of the bus."""
        return cls(bus.nc, partition or bus.partition)

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
