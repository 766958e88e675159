"""The fast block kernels against the loop reference, on random layouts and slot sets (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import ops, ref
from kernels.checksum import block_checksum, block_checksums, fast_checksums
from kernels.layout import DTYPE_BYTES, KvLayout, KvLayoutError
from kernels.pool import BlockPool, SlotAllocator, host_pool, word_dtype
from tests.hyp import examples

layouts = st.builds(
    KvLayout,
    block_tokens=st.integers(1, 8),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    head_dim=st.integers(1, 9),  # odd sizes make rows that only uint8/int16 divide
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
)


def filled(layout: KvLayout, num_slots: int, seed: int) -> BlockPool:
    pool = BlockPool(layout, num_slots)
    gen = torch.Generator().manual_seed(seed)
    pool.bytes.copy_(torch.randint(0, 256, pool.bytes.shape, dtype=torch.uint8, generator=gen))
    return pool


@st.composite
def pool_and_slots(draw, unique: bool):
    layout = draw(layouts)
    num_slots = draw(st.integers(1, 24))
    slot = st.integers(0, num_slots - 1)
    if unique:
        slots = draw(st.lists(slot, unique=True, max_size=num_slots))
    else:
        slots = draw(st.lists(slot, max_size=2 * num_slots))
    return layout, num_slots, slots, draw(st.integers(0, 2**31))


@settings(max_examples=examples(60), deadline=None)
@given(pool_and_slots(unique=False))
def test_gather_matches_reference(case):
    layout, num_slots, slots, seed = case
    pool = filled(layout, num_slots, seed)
    assert torch.equal(ops.gather_blocks(pool, slots), ref.ref_gather(pool, slots))


@settings(max_examples=examples(60), deadline=None)
@given(pool_and_slots(unique=True))
def test_scatter_matches_reference(case):
    layout, num_slots, slots, seed = case
    fast, slow = filled(layout, num_slots, seed), filled(layout, num_slots, seed)
    staging = filled(layout, max(len(slots), 1), seed + 1).bytes[: len(slots)]
    ops.scatter_blocks(fast, slots, staging)
    ref.ref_scatter(slow, slots, staging)
    assert torch.equal(fast.bytes, slow.bytes)


@settings(max_examples=examples(60), deadline=None)
@given(pool_and_slots(unique=True), st.data())
def test_copy_matches_reference_including_one_pool(case, data):
    layout, num_slots, dst_slots, seed = case
    src_slots = data.draw(
        st.lists(st.integers(0, num_slots - 1), min_size=len(dst_slots), max_size=len(dst_slots))
    )
    same_pool = data.draw(st.booleans())
    src = filled(layout, num_slots, seed)
    dst_fast = src if same_pool else filled(layout, num_slots, seed + 7)
    src_ref = filled(layout, num_slots, seed)
    dst_ref = src_ref if same_pool else filled(layout, num_slots, seed + 7)
    run_path = data.draw(st.booleans())  # copy run by run (large blocks) or through index kernels
    saved, ops.RUN_COPY_MIN_BYTES = ops.RUN_COPY_MIN_BYTES, 0 if run_path else 1 << 40
    try:
        handle = ops.copy_blocks(src, src_slots, dst_fast, dst_slots)
    finally:
        ops.RUN_COPY_MIN_BYTES = saved
    assert handle.done()
    handle.wait()
    ref.ref_copy(src_ref, src_slots, dst_ref, dst_slots)
    assert torch.equal(dst_fast.bytes, dst_ref.bytes)
    assert torch.equal(src.bytes, src_ref.bytes)


@settings(max_examples=examples(30), deadline=None)
@given(pool_and_slots(unique=False), st.integers(1, 3))
def test_broadcast_gives_every_target_the_same_blocks(case, targets):
    layout, num_slots, src_slots, seed = case
    src = filled(layout, num_slots, seed)
    pools = [BlockPool(layout, len(src_slots) + 1) for _ in range(targets)]
    plans = [(p, list(range(len(src_slots)))) for p in pools]
    handles = ops.broadcast_blocks(src, src_slots, plans)
    for h in handles:
        h.wait()
    want = block_checksums(src, src_slots)
    for p in pools:
        assert block_checksums(p, list(range(len(src_slots)))) == want


def test_typed_view_shares_memory_with_bytes():
    layout = KvLayout(2, 3, 2, 4, "bf16")
    pool = BlockPool(layout, 5)
    pool.typed()[3, 1, 2, 1, 0] = 1.5
    assert pool.typed().shape == (5, 2, 3, 2, 4)
    assert pool.bytes[3].any() and not pool.bytes[2].any()
    staging = ops.gather_blocks(pool, [3])
    assert staging.view(torch.bfloat16).reshape(1, *layout.block_shape)[0, 1, 2, 1, 0] == 1.5


def test_fp8_blocks_move_bit_exact():
    layout = KvLayout(4, 2, 1, 8, "fp8_e4m3")
    src = filled(layout, 6, 3)
    dst = BlockPool(layout, 6)
    ops.copy_blocks(src, [5, 0], dst, [1, 2]).wait()
    assert torch.equal(dst.bytes[1], src.bytes[5]) and torch.equal(dst.bytes[2], src.bytes[0])
    assert dst.typed().dtype == torch.float8_e4m3fn


def test_word_view_picks_the_widest_integer():
    assert word_dtype(16) == torch.int64
    assert word_dtype(12) == torch.int32
    assert word_dtype(6) == torch.int16
    assert word_dtype(9) == torch.uint8


def test_bad_inputs_raise_one_clear_line():
    layout = KvLayout(2, 1, 1, 4, "bf16")
    pool = BlockPool(layout, 4)
    with pytest.raises(KvLayoutError, match="slot 4 is outside 0..3"):
        ops.gather_blocks(pool, [4])
    with pytest.raises(KvLayoutError, match="written twice"):
        ops.scatter_blocks(pool, [1, 1], torch.zeros(2, layout.block_bytes, dtype=torch.uint8))
    with pytest.raises(KvLayoutError, match="2 x 16 bytes"):
        ops.scatter_blocks(pool, [1, 2], torch.zeros(3, layout.block_bytes, dtype=torch.uint8))
    other = BlockPool(KvLayout(2, 1, 1, 4, "fp16"), 4)
    with pytest.raises(KvLayoutError, match="layouts differ"):
        ops.copy_blocks(pool, [0], other, [0])
    with pytest.raises(KvLayoutError, match="impl"):
        ops.gather_blocks(pool, [0], impl="cuda-magic")
    with pytest.raises(KvLayoutError, match="triton"):
        ops.gather_blocks(pool, [0], impl="triton")


def test_checksum_tracks_the_bytes():
    layout = KvLayout(2, 1, 1, 4, "bf16")
    pool = filled(layout, 3, 11)
    before = block_checksum(pool, 1)
    pool.bytes[1, 5] ^= 1
    assert block_checksum(pool, 1) != before
    pool.bytes[1, 5] ^= 1
    assert block_checksum(pool, 1) == before


def test_slot_allocator_lowest_first_and_no_double_free():
    alloc = SlotAllocator(4)
    assert alloc.alloc(2) == [0, 1]
    alloc.free([0])
    assert alloc.alloc(2) == [0, 2]
    assert alloc.num_free == 1
    with pytest.raises(KvLayoutError, match="pool full: 2 slots asked, 1 free of 4"):
        alloc.alloc(2)
    with pytest.raises(KvLayoutError, match="slot 3 freed but not allocated"):
        alloc.free([3])


def test_host_pool_is_pinned_only_with_cuda():
    pool = host_pool(KvLayout(1, 1, 1, 8), 2)
    assert pool.is_pinned == torch.cuda.is_available()
    assert pool.slot_addr(1) - pool.data_ptr() == pool.block_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_device_paths_match_reference(impl):
    from kernels import triton_ops

    if impl == "triton" and not triton_ops.HAVE_TRITON:
        pytest.skip("triton is not installed")
    layout = KvLayout(16, 4, 2, 64, "bf16")
    host = filled(layout, 32, 5)
    host_ref = filled(layout, 32, 5)
    dev = BlockPool(layout, 32, "cuda")
    ops.copy_blocks(host, list(range(32)), dev, list(range(32))).wait()
    slots = [7, 3, 3, 30, 0]
    assert torch.equal(ops.gather_blocks(dev, slots, impl=impl).cpu(), ref.ref_gather(host_ref, slots))
    ops.copy_blocks(dev, [1, 2, 3], dev, [20, 21, 22], impl=impl).wait()
    ops.copy_blocks(dev, [20, 21, 22, 9], host, [0, 1, 2, 31]).wait()
    ref.ref_copy(host_ref, [1, 2, 3], host_ref, [20, 21, 22])
    ref.ref_copy(host_ref, [20, 21, 22, 9], host_ref, [0, 1, 2, 31])
    assert torch.equal(host.bytes, host_ref.bytes)


def ref_fast_checksum(pool: BlockPool, slot: int) -> int:
    """The fast checksum in plain Python integers over the same signed words."""
    import struct

    size = pool.words().element_size()
    fmt = {8: "q", 4: "i", 2: "h", 1: "B"}[size]  # torch.uint8 words are unsigned
    data = bytes(pool.bytes[slot].tolist())
    words = struct.unpack(f"<{len(data) // size}{fmt}", data)
    return sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64


@settings(max_examples=examples(40), deadline=None)
@given(pool_and_slots(unique=False))
def test_fast_checksum_matches_its_integer_definition(case):
    layout, num_slots, slots, seed = case
    pool = filled(layout, num_slots, seed)
    assert fast_checksums(pool, slots) == [ref_fast_checksum(pool, s) for s in slots]


@settings(max_examples=examples(40), deadline=None)
@given(pool_and_slots(unique=False), st.data())
def test_fast_checksum_sees_any_single_byte_change(case, data):
    layout, num_slots, _, seed = case
    pool = filled(layout, num_slots, seed)
    slot = data.draw(st.integers(0, num_slots - 1))
    pos = data.draw(st.integers(0, layout.block_bytes - 1))
    flip = data.draw(st.integers(1, 255))
    before = fast_checksums(pool, [slot])
    pool.bytes[slot, pos] ^= flip
    assert fast_checksums(pool, [slot]) != before


@pytest.mark.parametrize("head_dim, dtype", [(3, "fp8_e4m3"), (3, "bf16"), (2, "bf16"), (4, "bf16")])
def test_fast_checksum_on_every_word_width(head_dim, dtype):
    pool = filled(KvLayout(1, 1, 1, head_dim, dtype), 3, 9)  # 3, 6, 4 and 8-byte blocks
    pool.bytes[1].fill_(200)
    assert fast_checksums(pool, [0, 1, 2]) == [ref_fast_checksum(pool, s) for s in (0, 1, 2)]
    assert fast_checksums(pool, []) == []
