"""Snapshots that cannot lie: any bit flipped, a foreign core or configuration, a position the
stream does not have - each is refused, and the service rebuilds from sequence 0 with the same
state it would have had."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import BranchOpened, KvStored, NodeRegistered, RequestSubmitted
from services.adapters.bus import InMemoryBus
from services.adapters.runner import (
    RunnerConfig,
    ServiceRunner,
    SnapshotRejected,
    _RunnerSnap,
    open_snapshot,
    seal_snapshot,
)
from services.cores.directory.core import DirectoryCore
from tests.hyp import examples


def events():
    out = [NodeRegistered(ts=0.0, node="n1", role="prefill"), BranchOpened(ts=0.5, branch="b")]
    for i in range(20):
        out.append(RequestSubmitted(ts=1.0 + i, request=f"r{i}", branch="b", version=0,
                                    blocks=list(range(1, 10 + i)), prompt_tokens=64 * (9 + i)))
        out.append(KvStored(ts=1.5 + i, node="n1", tier="L1", blocks=list(range(1, 10 + i))))
    return out


def runner(bus, config=None) -> ServiceRunner:
    return ServiceRunner(bus, RunnerConfig(name="directory", config=config or {"policy": "count"}),
                         DirectoryCore, DirectoryCore.from_snapshot)


async def folded_runner(bus) -> ServiceRunner:
    seqs = await bus.publish_many(events())
    r = runner(bus)
    await r.load()
    for seq, ev in zip(seqs, events(), strict=True):
        r.seqd.fold(seq, ev)
    r.recovering = False
    await r.snapshot()
    return r


async def test_a_sealed_snapshot_restores_exactly():
    bus = InMemoryBus()
    first = await folded_runner(bus)
    second = runner(bus)
    await second.load()
    assert second.restored_from == first.applied_seq == len(events())
    assert second.core.snapshot() == first.core.snapshot()


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_any_flipped_bit_is_refused(data):
    import asyncio

    async def go():
        bus = InMemoryBus()
        await folded_runner(bus)
        blob = bytearray(await bus.get_snapshot("directory"))
        i = data.draw(st.integers(0, len(blob) - 1), label="byte")
        bit = data.draw(st.integers(0, 7), label="bit")
        blob[i] ^= 1 << bit
        with pytest.raises(SnapshotRejected):
            open_snapshot(bytes(blob), "services.cores.directory.core.DirectoryCore", runner(bus).fp, 10**6,
                          type("R", (), {"from_snapshot": staticmethod(DirectoryCore.from_snapshot)}))
        await bus.put_snapshot("directory", bytes(blob))
        again = runner(bus)
        await again.load()
        assert again.restored_from == 0  # rebuilt from sequence 0, never a silently changed state

    asyncio.run(go())


async def test_foreign_core_configuration_and_a_position_beyond_the_stream_are_refused():
    bus = InMemoryBus()
    r = await folded_runner(bus)
    data = await bus.get_snapshot("directory")
    restorer = type("R", (), {"from_snapshot": staticmethod(DirectoryCore.from_snapshot)})
    name = "services.cores.directory.core.DirectoryCore"
    with pytest.raises(SnapshotRejected, match="core"):
        open_snapshot(data, "services.cores.router.least_ttft.LeastTtftRouter", r.fp, 10**6, restorer)
    with pytest.raises(SnapshotRejected, match="configuration"):
        open_snapshot(data, name, runner(bus, {"policy": "lru"}).fp, 10**6, restorer)
    with pytest.raises(SnapshotRejected, match="stream ends at 3"):
        open_snapshot(data, name, r.fp, 3, restorer)
    assert open_snapshot(data, name, r.fp, len(events()), restorer).applied_seq == len(events())


async def test_a_resealed_snapshot_with_a_forged_position_is_refused():
    """Changing the sealed position (and recomputing the checksum) still fails: the position
    inside the core's own envelope must agree."""
    bus = InMemoryBus()
    r = await folded_runner(bus)
    snap = msgspec.msgpack.decode(await bus.get_snapshot("directory"), type=_RunnerSnap)
    forged = seal_snapshot(snap.core, snap.fingerprint, r.seqd)
    forged_snap = msgspec.msgpack.decode(forged, type=_RunnerSnap)
    from services.adapters.runner import _snapshot_checksum
    lie = msgspec.structs.replace(forged_snap, applied_seq=5, checksum=_snapshot_checksum(
        forged_snap.format, forged_snap.schema, forged_snap.core, forged_snap.fingerprint, 5, forged_snap.sequenced))
    restorer = type("R", (), {"from_snapshot": staticmethod(DirectoryCore.from_snapshot)})
    with pytest.raises(SnapshotRejected, match="inner position"):
        open_snapshot(msgspec.msgpack.encode(lie), snap.core, snap.fingerprint, 10**6, restorer)


async def test_an_old_layout_snapshot_rebuilds():
    bus = InMemoryBus()
    await bus.publish_many(events())
    await bus.put_snapshot("directory", msgspec.msgpack.encode(["abc", b"old"]))
    r = runner(bus)
    await r.load()
    assert r.restored_from == 0 and r.recovering
