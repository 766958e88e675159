"""The directory remembers at most ``max_ended`` ended branches, the oldest end forgotten first,
and a snapshot carries that order: a restored core forgets (and so decides) exactly as one that
folded the whole history (the soak found ``_ended`` kept every branch)."""

from __future__ import annotations

from events.catalog import BranchEnded, BranchOpened, KvStored, NodeRegistered, RequestSubmitted
from services.cores.directory import DirectoryCore


def life(i: int, ts: float) -> list:
    b = f"b{i:05d}"
    return [BranchOpened(ts=ts, branch=b), RequestSubmitted(ts=ts, request=f"r{i}", branch=b, blocks=[i + 10]),
            BranchEnded(ts=ts, branch=b)]


def fold(core: DirectoryCore, events) -> list:
    out = []
    for e in events:
        out.extend(core.apply(e))
    return out


def test_ended_branches_are_bounded_oldest_first():
    d = DirectoryCore(max_ended=50)
    d.apply(NodeRegistered(ts=0.0, node="p0", role="prefill"))
    for i in range(2000):
        fold(d, life(i, float(i)))
    assert len(d._ended) == 50 == len(d._end_order)
    assert sorted(d._ended) == [f"b{i:05d}" for i in range(1950, 2000)]
    # a late KV report of a remembered ended branch is quiet; of a forgotten one, an unknown branch
    assert fold(d, [KvStored(ts=3000.0, node="p0", tier="L1", blocks=[1], branch="b01999")]) == []
    late = fold(d, [KvStored(ts=3000.0, node="p0", tier="L1", blocks=[2], branch="b00000")])
    assert [e.kind for e in late] == ["unknown_branch"]


def test_default_bound_keeps_the_snapshot_of_the_same_history_byte_equal():
    a, b = DirectoryCore(), DirectoryCore()
    for core in (a, b):
        for i in range(300):
            fold(core, life(i, float(i)))
    assert a.snapshot() == b.snapshot()
    assert len(a._ended) == 300  # under the default bound nothing is forgotten


def test_a_restored_core_forgets_the_same_branches_as_the_folding_one():
    """Fold 120 lives, snapshot at 70 (past the bound of 40), restore, fold the rest: the same
    anomalies, the same ended set and a byte-equal snapshot as the core that never restarted."""
    events = [NodeRegistered(ts=0.0, node="p0", role="prefill")]
    for i in range(120):
        events += life(i, float(i))
        if i % 7 == 0:  # late reports of older branches (some remembered, some forgotten)
            events.append(KvStored(ts=float(i), node="p0", tier="L1", blocks=[i], branch=f"b{max(0, i - 45):05d}"))
    cut = next(k for k, e in enumerate(events) if isinstance(e, BranchEnded) and e.branch == "b00070")
    whole = DirectoryCore(max_ended=40)
    out_whole = fold(whole, events)
    first = DirectoryCore(max_ended=40)
    out_first = fold(first, events[:cut + 1])
    restored = DirectoryCore.from_snapshot(first.snapshot(), max_ended=40)
    out_rest = fold(restored, events[cut + 1:])
    assert out_first + out_rest == out_whole
    assert any(e.kind == "unknown_branch" for e in out_whole)  # the bound did forget some
    assert restored._ended == whole._ended and list(restored._end_order) == list(whole._end_order)
    assert restored.snapshot() == whole.snapshot()
