"""A durable consumer's state lives in nats-server's memory (nats_bus._durable_config): no
consumer-state file is written as it reads, and a server restart, which loses it, costs the
reader nothing: its next pull request finds no responder and the durable is made again after
the last message it handed out. A real nats-server, killed and started again on the same port
and store (the stream is on disk and survives)."""

from __future__ import annotations

import asyncio
import contextlib

from events.catalog import Tick
from services.adapters.bus import NatsBus
from services.adapters.bus.natsserver import EmbeddedNats


def _ticks(n: int, first: int = 0) -> list[Tick]:
    return [Tick(ts=float(first + i), src="test") for i in range(n)]


async def _read(it, out: list, consumer) -> None:
    async for d in it:
        out.append(d.seq)
        await consumer.ack(d.seq)


async def _until(pred, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def test_a_durable_reads_on_across_a_server_restart_without_loss_or_repeat(tmp_path):
    srv = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await NatsBus.connect(srv.url, "dm")
    task = None
    try:
        await bus.publish_many(_ticks(10))
        got: list[int] = []
        async with bus.consumer("keeper", start_seq=1) as c:
            info = await bus.js.consumer_info(bus.stream, "keeper")
            assert info.config.mem_storage is True
            task = asyncio.create_task(_read(c, got, c))
            await _until(lambda: len(got) == 10, 10, "the first 10 events")
            # no consumer-state file: only the stream's own folder under the store
            assert not list((tmp_path / "js").rglob("obs/keeper")), "a consumer-state file was written"

            srv.proc.kill()  # the server dies and takes the durable with it
            srv.proc.wait()
            srv.proc = None
            srv.start()  # same port, same store: the stream is back, the durable is not
            for _ in range(200):  # the client reconnects, then the stream answers
                with contextlib.suppress(Exception):
                    await bus.publish_many(_ticks(5, first=10))
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("could not publish after the restart")
            await _until(lambda: len(got) == 15, 20, "the 5 events published after the restart")
            await asyncio.sleep(0.5)  # nothing more comes: no repeat of 1..10
            assert got == list(range(1, 16))
            again = await bus.js.consumer_info(bus.stream, "keeper")
            assert again.config.mem_storage is True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            task = None
    finally:
        if task is not None:
            task.cancel()
        await bus.close()
        srv.stop()


async def test_a_durable_kept_in_a_file_by_an_earlier_version_is_made_again_in_memory(tmp_path):
    from nats.js import api

    srv = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await NatsBus.connect(srv.url, "dm2")
    try:
        await bus.publish_many(_ticks(3))
        await bus.js.add_consumer(bus.stream, config=api.ConsumerConfig(
            name="old", durable_name="old", ack_policy=api.AckPolicy.ALL,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=4,
            filter_subject="ei.dm2.>"))
        assert not (await bus.js.consumer_info(bus.stream, "old")).config.mem_storage
        async with bus.consumer("old", start_seq=4) as c:
            assert not c.reused  # a clean durable at the right start, but kept in a file
        assert (await bus.js.consumer_info(bus.stream, "old")).config.mem_storage is True
    finally:
        await bus.close()
        srv.stop()
