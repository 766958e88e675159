"""One contract, three token channels (services/adapters/bus/tokens.py): MemoryTokens, and
NatsTokens / NatsTokenMux on a real nats-server, each built from a bus as drivers build them."""

from __future__ import annotations

import pytest

from events.wire import TokenMsg, token_subject
from services.adapters.bus import NatsBus
from services.adapters.bus.tokens import MemoryTokens, NatsTokenMux, NatsTokens, TokenChannel


def _tok(request: str, i: int) -> TokenMsg:
    return TokenMsg(request=request, kind="chunk", tokens=1, node="n0", text=f"t{i}")


async def _drain(sub, n: int) -> list[TokenMsg]:
    return [await sub.get(5.0) for _ in range(n)]


async def _silent(sub, wait_s: float = 0.2) -> bool:
    try:
        await sub.get(wait_s)
    except TimeoutError:
        return True
    return False


class TokensContract:
    """Subclasses provide ``make(partition)`` -> (engine's channel, gateway's channel) and ``close()``."""

    async def make(self, partition: str):  # pragma: no cover - abstract
        raise NotImplementedError

    async def close(self) -> None:
        pass

    async def test_a_request_gets_its_messages_in_order_and_no_other(self, partition):
        engine, gw = await self.make(partition)
        assert isinstance(gw, TokenChannel) and isinstance(engine, TokenChannel)
        await gw.start()
        a, b = await gw.subscribe("req-a"), await gw.subscribe("req-b")
        for i in range(5):
            await engine.publish(_tok("req-a", i))
            await engine.publish(_tok("req-c", i))  # nobody here waits for it
        await engine.publish(_tok("req-b", 9))
        assert [m.text for m in await _drain(a, 5)] == [f"t{i}" for i in range(5)]
        assert [m.text for m in await _drain(b, 1)] == ["t9"]
        assert await _silent(a)
        await a.close()
        await b.close()
        await gw.stop()
        await self.close()

    async def test_two_subscribers_of_one_request_both_get_it_and_close_stops_one(self, partition):
        engine, gw = await self.make(partition)
        await gw.start()
        x, y = await gw.subscribe("r"), await gw.subscribe("r")
        await engine.publish(_tok("r", 1))
        assert (await x.get(5.0)).text == (await y.get(5.0)).text == "t1"
        await x.close()
        await x.close()  # idempotent
        await engine.publish(_tok("r", 2))
        assert (await y.get(5.0)).text == "t2"
        assert await _silent(x)
        await y.close()
        await gw.stop()
        await gw.stop()  # idempotent
        await self.close()

    async def test_another_partition_is_not_heard(self, partition):
        engine, gw = await self.make(partition)
        other, _ = await self.make(partition + "x")
        await gw.start()
        sub = await gw.subscribe("r")
        await other.publish(_tok("r", 1))
        await engine.publish(_tok("r", 2))
        assert (await sub.get(5.0)).text == "t2"
        assert await _silent(sub)
        await sub.close()
        await gw.stop()
        await self.close()


class TestMemoryTokens(TokensContract):
    async def make(self, partition):
        if not hasattr(self, "_chans"):
            self._chans = {}
        ch = self._chans.setdefault(partition, MemoryTokens(partition))  # one channel: publish and subscribe
        return ch, ch


class _NatsTokensBase(TokensContract):
    kind: type

    @pytest.fixture(autouse=True)
    def _url(self, nats_url):
        self.url = nats_url
        self.buses: list[NatsBus] = []

    async def make(self, partition):
        bus = await NatsBus.connect(self.url, partition)
        self.buses.append(bus)
        return NatsTokens.from_bus(bus), self.kind.from_bus(bus)

    async def close(self) -> None:
        for b in self.buses:
            await b.close()


class TestNatsTokens(_NatsTokensBase):
    kind = NatsTokens


class TestNatsTokenMux(_NatsTokensBase):
    kind = NatsTokenMux

    async def test_garbage_on_a_waited_subject_is_dropped(self, partition):
        """A message that does not decode on a request's subject never reaches it nor stops the mux."""
        bus = await NatsBus.connect(self.url, partition)
        self.buses.append(bus)
        mux = NatsTokenMux.from_bus(bus)
        sub = await mux.subscribe("r")  # starts the mux itself
        raw = await NatsBus.connect(self.url, partition)
        self.buses.append(raw)
        await raw.nc.publish(token_subject(partition, "r"), b"\xc1not msgpack")
        await NatsTokens.from_bus(raw).publish(_tok("r", 3))
        assert (await sub.get(5.0)).text == "t3"
        await sub.close()
        await mux.stop()
        await self.close()
