"""The gateway's token channel on core NATS: one subscription per partition, not one per request.

``NatsTokens`` (services/adapters/bus/tokens.py) subscribes each request's subject and flushes,
so the server knows the subscription before the request is published: a ``SUB`` + ``PING`` and
a wait for the ``PONG`` on every request's path to its first token, and an ``UNSUB`` after it.
:class:`TokenMux` subscribes ``eitok.<p>.>`` once at start (flushed then) and hands each message
to the request its subject's key names (``events.wire.token_key``); a request registers before
it is published, in process, with no I/O. A key no request here waits for is dropped without
decoding (another gateway's request). ``bench gateway`` measured the difference (docs/gateway.md).
"""

from __future__ import annotations

import msgspec

from events.wire import decode, encode, token_key, token_subject
from services.adapters.bus.tokens import TokenSub
from services.adapters.logging import get_logger

log = get_logger("gateway")


class TokenMux:
    """Publish / subscribe tokens of one partition over one wildcard subscription (``nc``: a
    nats-py client, e.g. ``NatsBus.nc``)."""

    def __init__(self, nc, partition: str) -> None:
        self.nc, self.partition = nc, partition
        self._subs: dict[str, list[TokenSub]] = {}  # token key -> the requests waiting on it
        self._nsub = None

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
        for s in subs:
            s._put(msg)  # checks the request id: a digest collision never mixes two requests

    async def publish(self, msg) -> None:
        await self.nc.publish(token_subject(self.partition, msg.request), encode(msg))

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
            try:
                await nsub.unsubscribe()
            except Exception as exc:  # noqa: BLE001 - the connection may already be gone
                log.debug("token_unsubscribe_failed", error=str(exc))
