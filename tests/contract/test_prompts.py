"""One contract, two prompt stores: InMemoryPromptStore and NatsPromptStore on a real
nats-server (services/adapters/bus/prompts.py); plus the codec's invariants."""

from __future__ import annotations

import asyncio

import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.prompts import (
    HEADER,
    InMemoryPromptStore,
    PromptCodecError,
    PromptStore,
    decode_tokens,
    encode_tokens,
    join,
    prompt_key,
    split,
)
from tests.hyp import examples

ids_st = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=examples(40))
@given(ids_st, st.integers(HEADER.size + 1, 200))
def test_codec_round_trip_through_chunks(ids, value_bytes):
    data = encode_tokens(ids)
    values = split(data, value_bytes)
    assert all(len(v) <= value_bytes for v in values)
    assert join(values) == data and decode_tokens(data) == ids


def test_codec_width_and_bad_input():
    assert len(encode_tokens([1, 65535])) == HEADER.size + 4  # 16-bit ids: 2 bytes each
    assert len(encode_tokens([1, 65536])) == HEADER.size + 8
    for bad in ([-1], [2**32], ["a"]):
        with pytest.raises(ValueError, match="token ids"):
            encode_tokens(bad)
    with pytest.raises(PromptCodecError, match="shorter"):
        decode_tokens(b"EIP")
    with pytest.raises(PromptCodecError, match="holds"):
        decode_tokens(encode_tokens([1, 2, 3])[:-1])
    assert prompt_key("a/b c") == prompt_key("a/b c") != prompt_key("a/b d")
    assert len(prompt_key("x")) == 32 and prompt_key("x").isalnum()


class PromptContract:
    """Subclasses provide ``make(partition, **kw)``."""

    async def make(self, partition: str, **kw):  # pragma: no cover - abstract
        raise NotImplementedError

    async def test_round_trip_overwrite_and_absent(self, partition):
        s = await self.make(partition)
        assert isinstance(s, PromptStore)
        assert await s.get("never-stored") is None
        assert await s.put("b/1", [1, 2, 3]) == HEADER.size + 6
        assert await s.get("b/1") == [1, 2, 3]
        await s.put("b/1", [70000, 5])  # a retry replaces the value
        assert await s.get("b/1") == [70000, 5]
        await s.put("b/2", [])
        assert await s.get("b/2") == []
        await s.close()

    async def test_warm_then_serve(self, partition):
        """Warm leaves the store taking writes and holding nothing a request can read."""
        s = await self.make(partition)
        took = await s.warm(30.0)
        assert 0.0 <= took < 30.0
        assert await s.get("r1") is None
        await s.put("r1", [4, 5])
        assert await s.get("r1") == [4, 5]
        await s.close()

    async def test_a_prompt_larger_than_one_value_is_chunked(self, partition):
        s = await self.make(partition, value_bytes=1000)
        ids = [(i * 7919) % 150_000 for i in range(10_000)]  # 4-byte ids: 40 KB in 41 values
        assert await s.put("long", ids) == HEADER.size + 40_000
        assert await s.get("long") == ids
        await s.close()


class TestInMemoryPromptStore(PromptContract):
    async def make(self, partition, **kw):
        return InMemoryPromptStore(**kw)

    async def test_values_expire_after_the_ttl(self):
        now = [0.0]
        s = InMemoryPromptStore(ttl_s=10, clock=lambda: now[0], value_bytes=100)
        await s.put("r", list(range(200)))
        now[0] = 9.9
        assert await s.get("r") == list(range(200))
        now[0] = 10.0
        assert await s.get("r") is None and not s._values  # the chunks are gone too


class TestNatsPromptStore(PromptContract):
    @pytest.fixture(autouse=True)
    def _url(self, nats_url):
        self.url = nats_url
        self._ncs = []

    async def make(self, partition, **kw):
        nc = await nats.connect(self.url)
        self._ncs.append(nc)
        return NatsPromptStore(nc, partition, **kw)

    @pytest.fixture(autouse=True)
    async def _close(self):
        yield
        for nc in self._ncs:
            await nc.close()

    async def test_a_reader_of_an_absent_bucket_gets_none_and_the_writer_creates_it(self, partition):
        reader = await self.make(partition)
        assert await reader.get("r") is None  # no bucket yet: None, not an error
        reader._missing_until = 0.0
        writer = await self.make(partition, ttl_s=30)
        await writer.put("r", [9, 8])
        assert await reader.get("r") == [9, 8]
        info = await writer.js.stream_info(writer.stream)
        assert info.config.max_age == 30 and info.config.allow_direct and info.config.max_msgs_per_subject == 1

    async def test_values_expire_after_the_ttl(self, partition):
        s = await self.make(partition, ttl_s=1.0)
        await s.put("r", [1, 2])
        assert await s.get("r") == [1, 2]
        for _ in range(50):  # JetStream expires by max_age on its own timer
            await asyncio.sleep(0.1)
            if await s.get("r") is None:
                break
        assert await s.get("r") is None
