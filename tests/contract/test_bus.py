"""One contract, two backends: InMemoryBus and NatsBus against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest

from events import codec
from events.catalog import BranchOpened, KvStored, RequestSubmitted, Tick
from services.adapters.bus import (
    Bus,
    Connection,
    Consumer,
    InMemoryBus,
    Listener,
    Message,
    NatsBus,
    NoResponder,
    StreamInfo,
    subject_matches,
)


def _events(n: int):
    return [Tick(ts=float(i), src="test") for i in range(n)]


async def _applied(bus, durable: str, floor: int) -> int | None:
    """The durable's ack floor once JetStream applied a flushed ack (it does so after the
    reply-less ack reached it, so a loaded server can answer consumer_info first): up to 5 s."""
    got = None
    for _ in range(100):
        got = await bus.consumer_ack_floor(durable)
        if got == floor:
            break
        await asyncio.sleep(0.05)
    return got


async def _take(consumer, n: int, timeout: float = 5.0):
    out = []

    async def run():
        async for d in consumer:
            out.append(d)
            await consumer.ack(d.seq)
            if len(out) == n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


def _counts(info: StreamInfo) -> StreamInfo:
    """The counts both backends agree on (bytes and the leader's name are the backend's own)."""
    return StreamInfo(last_seq=info.last_seq, messages=info.messages, replicas=info.replicas,
                      dead_letters=info.dead_letters)


class BusContract:
    """Subclasses provide ``make_bus(partition)``."""

    async def make_bus(self, partition: str):  # pragma: no cover - abstract
        raise NotImplementedError

    async def test_publish_and_consume_in_order(self, partition):
        bus = await self.make_bus(partition)
        evs = _events(50)
        seqs = [await bus.publish(e) for e in evs]
        assert seqs == list(range(1, 51))
        async with bus.consumer("c1") as c:
            got = await _take(c, 50)
        assert [d.seq for d in got] == seqs
        assert [d.event for d in got] == evs
        assert all(d.subject == f"ei.{partition}.clock" for d in got)
        assert await bus.last_seq() == 50
        await bus.close()

    async def test_publish_many_keeps_order(self, partition):
        bus = await self.make_bus(partition)
        evs = _events(200)
        seqs = await bus.publish_many(evs)
        assert seqs == list(range(1, 201))
        async with bus.consumer(None) as c:
            got = await _take(c, 200)
        assert [d.event.ts for d in got] == [e.ts for e in evs]
        await bus.close()

    async def test_publish_many_with_ids_and_shadow(self, partition):
        bus = await self.make_bus(partition)
        evs = _events(3)
        assert await bus.publish_many(evs, msg_ids=["a", "b", "c"]) == [1, 2, 3]
        assert await bus.publish_many(evs, msg_ids=["a", "b", "d"]) == [1, 2, 4]
        await bus.publish_many(evs[:1], shadow="mine")
        async with bus.consumer(None, start_seq=5) as c:
            (d,) = await _take(c, 1)
        assert d.subject == f"ei.{partition}.shadow.mine.tick"
        await bus.close()

    async def test_durable_resumes_where_it_stopped(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(30))
        async with bus.consumer("resume") as c:
            first = await _take(c, 12)
        await bus.publish_many(_events(5))
        async with bus.consumer("resume") as c:
            rest = await _take(c, 23)
        assert [d.seq for d in first] == list(range(1, 13))
        assert [d.seq for d in rest] == list(range(13, 36))
        await bus.close()

    async def test_replay_from_given_sequence(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(10))
        async with bus.consumer("replayer", start_seq=7) as c:
            got = await _take(c, 4)
        assert [d.seq for d in got] == [7, 8, 9, 10]
        async with bus.consumer(None, start_seq=1) as c:
            got = await _take(c, 10)
        assert [d.seq for d in got] == list(range(1, 11))
        await bus.close()

    async def test_msg_id_deduplicates(self, partition):
        bus = await self.make_bus(partition)
        e = BranchOpened(ts=1.0, branch="b1")
        s1 = await bus.publish(e, msg_id="open-b1")
        s2 = await bus.publish(e, msg_id="open-b1")
        s3 = await bus.publish(Tick(ts=2.0))
        assert s1 == s2 == 1 and s3 == 2
        assert await bus.last_seq() == 2
        await bus.close()

    async def test_garbage_goes_to_dead_letter_and_consumer_goes_on(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish(Tick(ts=1.0))
        await bus.publish_raw(f"ei.{partition}.agent.x", b"\xc1garbage")
        newer = {codec.SCHEMA_HEADER: f"{codec.SCHEMA_MAJOR + 1}.0"}
        await bus.publish_raw(f"ei.{partition}.clock", codec.encode(Tick(ts=9.0)), newer)
        await bus.publish(Tick(ts=2.0))
        async with bus.consumer("dlq-test") as c:
            got = await _take(c, 2)
        assert [d.event.ts for d in got] == [1.0, 2.0]
        assert [d.seq for d in got] == [1, 4]
        for _ in range(50):
            letters = await bus.dead_letters()
            if len(letters) == 2:
                break
            await asyncio.sleep(0.02)
        assert [(x.seq, x.consumer) for x in letters] == [(2, "dlq-test"), (3, "dlq-test")]
        assert letters[0].subject == f"ei.{partition}.agent.x"
        assert "undecodable" in letters[0].reason
        assert "schema" in letters[1].reason and "upgrade" in letters[1].reason
        assert letters[0].data == b"\xc1garbage"
        await bus.close()

    async def test_subject_filter(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish(KvStored(ts=1.0, node="n1", tier="L1", blocks=[1]))
        await bus.publish(Tick(ts=2.0))
        await bus.publish(KvStored(ts=3.0, node="n2", tier="L2", blocks=[2]))
        async with bus.consumer("kv-only", subjects=f"ei.{partition}.kv.>") as c:
            got = await _take(c, 2)
        assert [d.seq for d in got] == [1, 3]
        await bus.close()

    async def test_snapshots_round_trip(self, partition):
        bus = await self.make_bus(partition)
        assert await bus.get_snapshot("router") is None
        blob = bytes(range(256)) * 5000  # > 1 MB: larger than one NATS message
        await bus.put_snapshot("router", blob)
        assert await bus.get_snapshot("router") == blob
        await bus.close()

    async def test_backend_satisfies_the_port(self, partition):
        bus = await self.make_bus(partition)
        assert isinstance(bus, Bus)
        async with bus.consumer(None) as c:
            assert isinstance(c, Consumer)
        await bus.close()

    async def test_durable_resumes_in_order_after_a_crash_mid_batch(self, partition):
        """A consumer that handed out messages it never acknowledged (a crash) resumes at its
        ack floor + 1, in stream order, with nothing lost and nothing skipped."""
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(40))
        c = bus.consumer("crashy")
        await c.__aenter__()
        got = []
        async for d in c:
            got.append(d.seq)
            if d.seq <= 10:
                await c.ack(d.seq)
            if d.seq == 25:
                break
        await c.flush()
        await c.__aexit__(None, None, None)  # 11..25 handed out, never acknowledged
        rest = []
        async with bus.consumer("crashy") as c2:

            async def upto_40():
                async for d in c2:
                    rest.append(d.seq)
                    if d.seq == 40:
                        return

            await asyncio.wait_for(upto_40(), 10)
        # at least once, in order: it restarts at or before 11 (an ack may still be in flight
        # when a process dies) and nothing after its first redelivery is skipped
        assert rest[0] <= 11 and rest == list(range(rest[0], 41))
        await bus.close()

    async def test_stream_info_counts_the_stream_and_its_dead_letters(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish(Tick(ts=1.0))
        await bus.publish_raw(f"ei.{partition}.agent.x", b"\xc1garbage")
        await bus.publish(Tick(ts=2.0))
        first = await bus.stream_info()
        assert _counts(first) == StreamInfo(last_seq=3, messages=3, replicas=1, dead_letters=0)
        assert first.replicas_current == 1 and isinstance(first.leader, str)
        await bus.publish(Tick(ts=3.0))
        assert (await bus.stream_info()).bytes > first.bytes > len(b"\xc1garbage")
        async with bus.consumer("info-test") as c:
            await _take(c, 3)
        for _ in range(50):  # the garbage reaches the dead-letter subject as the consumer passes it
            info = await bus.stream_info()
            if info.dead_letters:
                break
            await asyncio.sleep(0.02)
        assert _counts(info) == StreamInfo(last_seq=4, messages=4, replicas=1, dead_letters=1)
        await bus.close()

    async def test_another_partition_over_the_same_connection(self, partition):
        bus = await self.make_bus(partition)
        other = bus.for_partition(partition + "x")
        assert bus.for_partition(partition) is bus and other.partition == partition + "x"
        if isinstance(other, NatsBus):
            await other.ensure_streams()
        await other.publish(Tick(ts=1.0))
        assert (await other.last_seq(), await bus.last_seq()) == (1, 0)
        await other.close()  # leaves the shared connection open
        await bus.publish(Tick(ts=2.0))
        assert await bus.last_seq() == 1
        assert await bus.for_partition(partition + "x").last_seq() == 1  # one stream per partition
        await bus.close()

    async def test_request_reply_on_a_listened_subject(self, partition):
        bus = await self.make_bus(partition)
        subject = f"eictl.{partition}.echo"
        seen: list[Message] = []

        async def echo(msg: Message) -> bytes | None:
            seen.append(msg)
            if msg.data == b"boom":
                raise ValueError("a bad request")
            return None if msg.data == b"mute" else b"re:" + msg.data

        with pytest.raises(NoResponder):
            await bus.request(subject, b"x", timeout_s=2.0)
        lst = await bus.listen(subject, echo)
        assert isinstance(lst, Listener) and lst.subject == subject
        assert await bus.request(subject, b"hello", timeout_s=2.0) == b"re:hello"
        for silent in (b"mute", b"boom"):  # no reply, and a handler that raises: the requester times out
            with pytest.raises(TimeoutError):
                await bus.request(subject, silent, timeout_s=0.2)
        assert await bus.request(subject, b"again", timeout_s=2.0) == b"re:again"  # the listener goes on
        assert [m.data for m in seen] == [b"hello", b"mute", b"boom", b"again"]
        await lst.close()
        await lst.close()  # idempotent
        with pytest.raises(NoResponder):
            await bus.request(subject, b"x", timeout_s=2.0)
        await bus.close()

    async def test_listeners_see_events_as_they_are_stored(self, partition):
        bus = await self.make_bus(partition)
        got: list[Message] = []
        arrived = asyncio.Event()

        async def on_route(msg: Message) -> None:
            got.append(msg)
            arrived.set()

        lst = await bus.listen(f"ei.{partition}.*", on_route)  # one token: the clock, not agent.x
        other = bus.for_partition(partition + "y")
        if isinstance(other, NatsBus):
            await other.ensure_streams()
        everywhere = await bus.listen("ei.*.clock", on_route)  # a sibling's subjects are heard too
        await bus.publish(Tick(ts=1.0))
        await other.publish(Tick(ts=2.0))
        for _ in range(100):
            if len(got) >= 3:
                break
            await asyncio.sleep(0.02)
        assert sorted((m.subject, codec.decode_message(m.data, m.headers).ts) for m in got) == [
            (f"ei.{partition}.clock", 1.0), (f"ei.{partition}.clock", 1.0), (f"ei.{partition}y.clock", 2.0)]
        await lst.close()
        await everywhere.close()
        await other.close()
        await bus.close()

    async def test_rewind_a_durable_consumer(self, partition):
        bus = await self.make_bus(partition)
        assert await bus.consumer_ack_floor("rw") is None
        await bus.publish_many(_events(20))
        async with bus.consumer("rw") as c:
            await _take(c, 15)
            await c.flush()
        assert await _applied(bus, "rw", 15) == 15
        await bus.rewind_consumer("rw", 6)
        assert await bus.consumer_ack_floor("rw") == 5
        async with bus.consumer("rw") as c:
            again = await _take(c, 15)
        assert [d.seq for d in again] == list(range(6, 21))
        await bus.rewind_consumer("fresh", 18)  # a durable not there yet is made at that position
        async with bus.consumer("fresh") as c:
            assert [d.seq for d in await _take(c, 3)] == [18, 19, 20]
        await bus.close()

    async def test_url_says_where_another_process_reaches_it(self, partition):
        bus = await self.make_bus(partition)
        if isinstance(bus, NatsBus):
            assert bus.url == self.url
        else:
            assert bus.url is None
        await bus.close()

    async def test_consumers_lists_durables_and_open_readers(self, partition):
        bus = await self.make_bus(partition)
        assert await bus.consumers() == []
        await bus.publish_many(_events(20))
        async with bus.consumer("reader") as c:
            await _take(c, 15)
            await c.flush()
        assert await _applied(bus, "reader", 15) == 15
        clock = f"ei.{partition}.clock"
        async with bus.consumer(None, subjects=clock) as eph:
            assert await eph.pending() == 20  # nothing handed over yet
            await _take(eph, 20)
            assert await eph.pending() == 0
            states = {c.name: c for c in await bus.consumers()}
            (eph_name,) = [n for n in states if n != "reader"]
            e = states[eph_name]
            assert (e.durable, e.filter, e.pending, e.delivered, e.ack_floor, e.position) == (
                False, clock, 0, 20, 20, 20)
            r = states["reader"]
            # acknowledged 15 of 20: the other 5 wait for it (handed over or not)
            assert (r.durable, r.pending, r.ack_floor, r.position) == (True, 5, 15, 15)
            assert r.filter == f"ei.{partition}.>"
        assert [c.name for c in await bus.consumers()] == ["reader"]  # a closed ephemeral is gone
        await bus.close()

    async def test_pending_counts_only_the_readers_subjects(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(4))
        await bus.publish(BranchOpened(ts=1.0, branch="b1", session="s1"))
        async with bus.consumer(None, subjects=f"ei.{partition}.clock") as c:
            assert await c.pending() == 4
            await _take(c, 4)
            assert await c.pending() == 0
        await bus.close()

    async def test_connection_says_whether_it_reaches_its_server(self, partition):
        bus = await self.make_bus(partition)
        c = bus.connection()
        if isinstance(bus, NatsBus):
            assert c == Connection(connected=True, reconnecting=False, server=self.url.removeprefix("nats://"))
        else:
            assert c == Connection(connected=True)
        await bus.close()

    async def test_large_event_round_trips(self, partition):
        bus = await self.make_bus(partition)
        big = RequestSubmitted(ts=1.0, request="r", branch="b", blocks=list(range(2**63, 2**63 + 4000)),
                               prompt_tokens=256_000)
        await bus.publish(big)
        async with bus.consumer(None) as c:
            (d,) = await _take(c, 1)
        assert d.event == big
        await bus.close()


class TestInMemoryBus(BusContract):
    async def make_bus(self, partition):
        return InMemoryBus(partition)


class TestNatsBus(BusContract):
    @pytest.fixture(autouse=True)
    def _url(self, nats_url):
        self.url = nats_url

    async def make_bus(self, partition):
        return await NatsBus.connect(self.url, partition)

    async def test_a_clean_durable_is_kept_across_restarts(self, partition):
        """JetStream keeps the durable pull consumer (same creation time) when the last run
        acknowledged everything it was delivered; it is re-created only to move its start."""
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(20))
        async with bus.consumer("keeper") as c:
            await _take(c, 20)
        created = (await bus.js.consumer_info(bus.stream, "keeper")).created
        await bus.publish_many(_events(5))
        async with bus.consumer("keeper") as c:
            assert c.reused
            got = await _take(c, 5)
        assert [d.seq for d in got] == list(range(21, 26))
        assert (await bus.js.consumer_info(bus.stream, "keeper")).created == created
        async with bus.consumer("keeper", start_seq=3) as c:
            assert not c.reused
            (d,) = await _take(c, 1)
        assert d.seq == 3
        await bus.close()

    async def test_consumer_reads_the_sequence_from_metadata_over_many_batches(self, partition):
        bus = await self.make_bus(partition)
        await bus.publish_many(_events(5000))
        async with bus.consumer("big") as c:
            got = await _take(c, 5000, timeout=30)
        assert [d.seq for d in got] == list(range(1, 5001))
        await bus.close()


@pytest.mark.parametrize("pattern,subject,ok", [
    ("ei.p.>", "ei.p.kv.n1", True),
    ("ei.p.>", "ei.p", False),
    ("ei.p.kv.*", "ei.p.kv.n1", True),
    ("ei.p.kv.*", "ei.p.kv.n1.x", False),
    ("ei.p.kv.n1", "ei.p.kv.n2", False),
])
def test_subject_matches(pattern, subject, ok):
    assert subject_matches(pattern, subject) is ok
