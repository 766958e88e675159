"""Token channel adapters (core NATS and in-process) for the wire messages of ``events.wire``.

The subject scheme, :class:`~events.wire.TokenMsg` and its codec live in ``events/wire.py``
(the bottom layer, shared with the engines). This module holds what talks to the outside:

- :class:`NatsTokens` publishes / subscribes ``eitok.<partition>.<key>`` on a nats-py client,
  one subscription per request (an engine publishes only; tests).
- :class:`NatsTokenMux` is the gateway's: one subscription ``eitok.<partition>.*`` for every
  request. ``NatsTokens`` subscribes each request's subject and flushes, so the server knows
  the subscription before the request is published: a ``SUB`` + ``PING`` and a wait for the
  ``PONG`` on every request's path to its first token, and an ``UNSUB`` after it. The mux
  subscribes once at :meth:`~NatsTokenMux.start` (flushed then) and hands each message to the
  request its subject's key names (``events.wire.token_key``); a request registers before it is
  published, in process, with no I/O. A key no request here waits for is dropped without
  decoding (another gateway's request). ``bench gateway`` measured the difference (docs/gateway.md).
- :class:`MemoryTokens` is their in-process twin (tests, a gateway on an InMemoryBus).

All three satisfy :class:`TokenChannel` and pass the same contract (tests/contract/test_tokens.py).
Drivers build the NATS ones from a bus (``from_bus``), never from its connection.

The gateway subscribes to the request's subject *before* it publishes ``RequestSubmitted``
(core NATS keeps nothing for late subscribers) and stops after ``done``/``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Protocol, runtime_checkable

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
from services.adapters.aio import wait_for

#: ``token_subject`` of (partition, request), remembered: an engine publishes a streaming
#: request's subject once per decode iteration (a blake2b digest each time before)
_subject = functools.lru_cache(maxsize=4096)(token_subject)


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
        """The next message; raises ``asyncio.TimeoutError`` after ``timeout_s`` of silence.
        A message already queued is taken at once, without the timeout's timer."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        return await wait_for(self.queue.get(), timeout_s)

    async def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            await closer()


@runtime_checkable
class TokenChannel(Protocol):
    """The token channel of one partition: engines publish, the gateway subscribes a request
    before it submits it. ``start()`` before the first request, ``stop()`` at the end (both
    idempotent; no-ops where a channel has nothing to set up)."""

    partition: str

    async def start(self) -> None: ...

    async def publish(self, msg: TokenMsg) -> None: ...

    async def subscribe(self, request: str) -> TokenSub: ...

    async def stop(self) -> None: ...


class NatsTokens:
    """Token channel over a nats-py client; build it from a bus with :meth:`from_bus`."""

    def __init__(self, nc, partition: str) -> None:
        self.nc, self.partition = nc, partition

    @classmethod
    def from_bus(cls, bus, partition: str | None = None) -> NatsTokens:
        """The channel over a :class:`~services.adapters.bus.nats_bus.NatsBus`'s connection (the
        bus's partition unless another is named): drivers never take the connection out of the bus."""
        return cls(bus.nc, partition or bus.partition)

    async def start(self) -> None:
        pass  # one subscription per request: nothing to set up

    async def stop(self) -> None:
        pass  # each request's subscription ends with its TokenSub.close()

    async def publish(self, msg: TokenMsg) -> None:
        await self.nc.publish(_subject(self.partition, msg.request), encode(msg))

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


class NatsTokenMux:
    """The token channel of one partition over one wildcard subscription (module docstring);
    build it from a bus with :meth:`from_bus`."""

    def __init__(self, nc, partition: str) -> None:
        self.nc, self.partition = nc, partition
        self._subs: dict[str, list[TokenSub]] = {}  # token key -> the requests waiting on it
        self._nsub = None

    @classmethod
    def from_bus(cls, bus, partition: str | None = None) -> NatsTokenMux:
        """The mux over a :class:`~services.adapters.bus.nats_bus.NatsBus`'s connection (the
        bus's partition unless another is named)."""
        return cls(bus.nc, partition or bus.partition)

    async def start(self) -> None:
        if self._nsub is None:
            prefix = token_subject(self.partition, "x").rsplit(".", 1)[0]
            self._nsub = await self.nc.subscribe(prefix + ".*", cb=self._on_msg, pending_msgs_limit=-1,
                                                 pending_bytes_limit=-1)
            await self.nc.flush()  # the server knows it before the first request is published

    async def _on_msg(self, m) -> None:
        subs = self._subs.get(m.subject.rsplit(".", 1)[-1])
        if not subs:
            return
        try:
            msg = decode(m.data)
        except msgspec.DecodeError:
            return  # not ours; the gateway counts timeouts, not garbage
        for s in list(subs):
            s._put(msg)  # checks the request id: a digest collision never mixes two requests

    async def publish(self, msg: TokenMsg) -> None:
        await self.nc.publish(_subject(self.partition, msg.request), encode(msg))

    async def subscribe(self, request: str) -> TokenSub:
        if self._nsub is None:
            await self.start()
        key = token_key(request)

        async def close() -> None:
            lst = self._subs.get(key, [])
            if sub in lst:
                lst.remove(sub)
            if not lst:
                self._subs.pop(key, None)

        sub = TokenSub(request, close)
        self._subs.setdefault(key, []).append(sub)
        return sub

    async def stop(self) -> None:
        if self._nsub is not None:
            nsub, self._nsub = self._nsub, None
            with contextlib.suppress(Exception):  # the connection may already be gone
                await nsub.unsubscribe()


class MemoryTokens:
    """In-process twin of :class:`NatsTokens` and :class:`NatsTokenMux` (tests, and a gateway
    on an InMemoryBus)."""

    def __init__(self, partition: str = "default") -> None:
        self.partition = partition
        self._subs: dict[str, list[TokenSub]] = {}
        self.published: list[TokenMsg] = []

    async def start(self) -> None:
        pass  # in process: nothing to set up

    async def stop(self) -> None:
        pass

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
