"""One contract for the KV TransferBackend port, run against the loopback fake and Mooncake (TCP).

The Mooncake class is skipped, with the import error as the reason, where the package or
libibverbs1 is missing; scripts/setup.sh installs both where it can.
"""

from __future__ import annotations

import abc

import pytest

torch = pytest.importorskip("torch")

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.transfer import (
    PeerUnreachable,
    PoolDescriptor,
    TransferBackend,
    TransferCorrupt,
    TransferError,
    make_transfer,
)
from engine.transfer.common import verify_landed
from engine.transfer.loopback import LoopbackFabric
from engine.transfer.mooncake import mooncake_available
from kernels.checksum import block_checksums
from kernels.layout import KvLayout, KvLayoutError
from kernels.pool import BlockPool
from tests.hyp import examples

LAYOUT = KvLayout(4, 2, 2, 8, "bf16")  # 256-byte blocks
SLOTS = 16


def filled(seed: int, layout: KvLayout = LAYOUT, num_slots: int = SLOTS) -> BlockPool:
    pool = BlockPool(layout, num_slots)
    gen = torch.Generator().manual_seed(seed)
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, dtype=torch.uint8, generator=gen))
    return pool


@pytest.fixture(scope="class")
def pair(request):
    # One pair per backend class: a Mooncake engine takes about a second to tear down.
    a, b = request.cls.make_pair()
    yield a, b
    a.close()
    b.close()


class TransferContract(abc.ABC):
    @staticmethod
    @abc.abstractmethod
    def make_pair() -> tuple[TransferBackend, TransferBackend]: ...

    @pytest.fixture
    def nodes(self, pair, request):
        a, b = pair
        pa, pb = filled(1), filled(2)
        pool_id = request.node.name[:40]
        da, db = a.register_pool(pa, pool_id), b.register_pool(pb, pool_id)
        yield a, b, pa, pb, da, db
        a.unregister_pool(pool_id)
        b.unregister_pool(pool_id)

    def test_is_a_transfer_backend(self, nodes):
        a, *_ = nodes
        assert isinstance(a, TransferBackend)

    def test_descriptor_says_where_the_pool_is(self, nodes):
        a, _, pa, _, da, _ = nodes
        assert da == PoolDescriptor(
            endpoint=a.endpoint,
            pool_id=da.pool_id,
            base_addr=pa.data_ptr(),
            slot_bytes=LAYOUT.block_bytes,
            num_slots=SLOTS,
            layout=LAYOUT.fingerprint(),
        )
        wire = msgspec.msgpack.encode(da)
        assert msgspec.msgpack.decode(wire, type=PoolDescriptor) == da

    def test_read_fetches_peer_blocks_into_local_slots(self, nodes):
        _, b, pa, pb, da, _ = nodes
        want = block_checksums(pa, [3, 4, 5, 9])
        untouched = block_checksums(pb, [0, 1, 2])
        stats = b.read_blocks(da, [3, 4, 5, 9], pb, [10, 11, 12, 0])
        assert block_checksums(pb, [10, 11, 12, 0]) == want
        assert block_checksums(pb, [1, 2]) == untouched[1:]
        assert (stats.blocks, stats.runs, stats.nbytes) == (4, 2, 4 * LAYOUT.block_bytes)

    def test_write_pushes_local_blocks_into_peer_slots(self, nodes):
        a, _, pa, pb, _, db = nodes
        want = block_checksums(pa, [7, 1])
        stats = a.write_blocks(pa, [7, 1], db, [15, 14])
        assert block_checksums(pb, [15, 14]) == want
        assert (stats.blocks, stats.runs) == (2, 2)

    def test_a_remote_block_may_be_read_into_two_slots(self, nodes):
        _, b, pa, pb, da, _ = nodes
        b.read_blocks(da, [6, 6], pb, [1, 2])
        assert block_checksums(pb, [1, 2]) == block_checksums(pa, [6, 6])

    def test_empty_transfer_moves_nothing(self, nodes):
        _, b, _, pb, da, _ = nodes
        before = pb.bytes.clone()
        assert b.read_blocks(da, [], pb, []).nbytes == 0
        assert torch.equal(pb.bytes, before)

    def test_bad_slots_and_layouts_are_refused_before_anything_moves(self, nodes):
        _, b, _, pb, da, _ = nodes
        before = pb.bytes.clone()
        with pytest.raises(KvLayoutError, match="slot 16 is outside 0..15"):
            b.read_blocks(da, [0, 16], pb, [0, 1])
        with pytest.raises(KvLayoutError, match="written twice"):
            b.read_blocks(da, [0, 1], pb, [2, 2])
        with pytest.raises(KvLayoutError, match="written twice"):
            b.write_blocks(pb, [0, 1], da, [3, 3])
        with pytest.raises(KvLayoutError, match="differ in length"):
            b.read_blocks(da, [0, 1], pb, [2])
        other = msgspec.structs.replace(da, layout="fp16:4x2x2x8")
        with pytest.raises(KvLayoutError, match="layout fp16:4x2x2x8"):
            b.read_blocks(other, [0], pb, [0])
        assert torch.equal(pb.bytes, before)

    def test_unregistered_local_pool_is_refused(self, nodes):
        _, b, _, _, da, _ = nodes
        with pytest.raises(TransferError, match="not registered"):
            b.read_blocks(da, [0], filled(3), [0])

    def test_pool_id_registered_twice_is_refused(self, nodes):
        a, _, _, _, da, _ = nodes
        with pytest.raises(TransferError, match="already registered"):
            a.register_pool(filled(4), da.pool_id)

    def test_unregistered_pool_cannot_be_read_by_peers_any_more(self, nodes):
        a, b, _, pb, _, _ = nodes
        extra = filled(5)
        dx = a.register_pool(extra, "extra")
        b.read_blocks(dx, [2], pb, [2])
        assert block_checksums(pb, [2]) == block_checksums(extra, [2])
        a.unregister_pool("extra")
        with pytest.raises(TransferError):
            b.read_blocks(dx, [3], pb, [3])
        with pytest.raises(TransferError, match="not registered"):
            a.unregister_pool("extra")

    def test_unknown_peer_is_unreachable(self, nodes):
        _, b, _, pb, da, _ = nodes
        gone = msgspec.structs.replace(da, endpoint=self.dead_endpoint())
        with pytest.raises(PeerUnreachable):
            b.resolve(gone)
        with pytest.raises(TransferError):
            b.read_blocks(gone, [0], pb, [0])

    @abc.abstractmethod
    def dead_endpoint(self) -> str: ...

    # ------------------------------------------------------------------ checksums
    def test_a_read_given_the_owners_checksums_verifies_what_landed(self, nodes):
        _, b, pa, pb, da, _ = nodes
        want = block_checksums(pa, [3, 4, 9])
        stats = b.read_blocks(da, [3, 4, 9], pb, [10, 11, 0], expect=want)
        assert stats.checksums == want == block_checksums(pb, [10, 11, 0])

    def test_a_read_cut_mid_way_is_refused_and_the_next_one_lands(self, nodes):
        _, b, pa, pb, da, _ = nodes
        want = block_checksums(pa, [0, 1, 2, 3])
        b.cut_transfers = 1
        with pytest.raises(TransferCorrupt, match="refused") as err:
            b.read_blocks(da, [0, 1, 2, 3], pb, [4, 5, 6, 7], expect=want)
        # the first half of the bytes arrived, the rest did not: the last two blocks differ
        assert err.value.slots == [6, 7]
        assert block_checksums(pb, [4, 5]) == want[:2]
        assert b.read_blocks(da, [0, 1, 2, 3], pb, [4, 5, 6, 7], expect=want).checksums == want

    def test_a_cut_falling_inside_a_block_is_refused(self, nodes):
        _, b, pa, pb, da, _ = nodes
        want = block_checksums(pa, [5, 6, 7])  # 1.5 blocks arrive: the middle one torn
        b.cut_transfers = 1
        with pytest.raises(TransferCorrupt) as err:
            b.read_blocks(da, [5, 6, 7], pb, [8, 9, 10], expect=want)
        assert err.value.slots == [9, 10]
        assert torch.equal(pb.bytes[9][: LAYOUT.block_bytes // 2], pa.bytes[6][: LAYOUT.block_bytes // 2])

    def test_without_checksums_a_cut_transfer_goes_unnoticed(self, nodes):
        """Why the checksums: the transport reports a cut transfer as done."""
        _, b, pa, pb, da, _ = nodes
        b.cut_transfers = 1
        stats = b.read_blocks(da, [0, 1], pb, [12, 13])
        assert stats.blocks == 2 and stats.checksums == []
        assert block_checksums(pb, [12]) == block_checksums(pa, [0])
        assert block_checksums(pb, [13]) != block_checksums(pa, [1])

    def test_a_write_gives_its_checksums_and_the_receiver_refuses_a_cut_one(self, nodes):
        a, _, pa, pb, _, db = nodes
        want = block_checksums(pa, [7, 8])
        stats = a.write_blocks(pa, [7, 8], db, [14, 15], checksums=True)
        assert stats.checksums == want
        assert verify_landed(pb, [14, 15], stats.checksums, "test") == want
        a.cut_transfers = 1
        cut = a.write_blocks(pa, [9, 10], db, [1, 2], checksums=True)
        assert cut.checksums == block_checksums(pa, [9, 10])
        with pytest.raises(TransferCorrupt) as err:
            verify_landed(pb, [1, 2], cut.checksums, "P->D push")
        assert err.value.slots == [2]

    def test_checksums_of_another_length_are_refused_before_anything_moves(self, nodes):
        _, b, _, pb, da, _ = nodes
        before = pb.bytes.clone()
        with pytest.raises(KvLayoutError, match="2 checksums for 3 slots"):
            b.read_blocks(da, [0, 1, 2], pb, [3, 4, 5], expect=[1, 2])
        assert torch.equal(pb.bytes, before)

    @settings(
        max_examples=examples(15),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
    )
    @given(
        pairs=st.lists(
            st.tuples(st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)),
            max_size=SLOTS,
            unique_by=lambda p: p[1],
        )
    )
    def test_random_reads_land_every_block_where_asked(self, nodes, pairs):
        _, b, pa, pb, da, _ = nodes
        remote = [r for r, _ in pairs]
        local = [loc for _, loc in pairs]
        expected = pb.bytes.clone()
        for r, loc in pairs:
            expected[loc] = pa.bytes[r]
        b.read_blocks(da, remote, pb, local)
        assert torch.equal(pb.bytes, expected)


class TestLoopback(TransferContract):
    @staticmethod
    def make_pair():
        fabric = LoopbackFabric()
        return make_transfer("loopback", node="a", fabric=fabric), make_transfer(
            "loopback", node="b", fabric=fabric
        )

    def dead_endpoint(self) -> str:
        return "loopback:nobody"

    def test_stale_descriptor_is_refused(self, nodes):
        _, b, _, pb, da, _ = nodes
        stale = msgspec.structs.replace(da, base_addr=da.base_addr + 1)
        with pytest.raises(PeerUnreachable, match="stale"):
            b.read_blocks(stale, [0], pb, [0])

    def test_injected_failure_raises_and_the_next_transfer_works(self, nodes):
        _, b, pa, pb, da, _ = nodes
        b.fail_transfers = 1
        with pytest.raises(TransferError, match="injected"):
            b.read_blocks(da, [1], pb, [1])
        b.read_blocks(da, [1], pb, [1])
        assert block_checksums(pb, [1]) == block_checksums(pa, [1])


_MOONCAKE_OK, _MOONCAKE_WHY = mooncake_available()


@pytest.mark.skipif(not _MOONCAKE_OK, reason=f"Mooncake unavailable: {_MOONCAKE_WHY}")
class TestMooncakeTcp(TransferContract):
    @staticmethod
    def make_pair():
        return make_transfer("mooncake"), make_transfer("mooncake")

    def dead_endpoint(self) -> str:
        import socket

        with socket.socket() as s:  # a port nobody listens on once closed
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"127.0.0.1:{port}"
