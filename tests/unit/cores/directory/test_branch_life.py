"""The five rows of METHOD.md §3 ("one branch's life") and the §4.1 count rules, with exact
counts per block and copy."""

from __future__ import annotations

import pytest

from events import codec
from events.catalog import (
    AnomalyReported,
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    KvEvicted,
    KvMoved,
    KvStored,
    NodeRegistered,
    NodeRemoved,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from services.cores.directory import DirectoryCore

NODES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def cluster() -> DirectoryCore:
    d = DirectoryCore()
    for node, role in NODES.items():
        assert d.apply(NodeRegistered(ts=0.0, node=node, role=role)) == []
    return d


def serve(d, req, branch, blocks, ts, version=0, p="p0", dn="d0"):
    """A request's life as engines report it: submit, route, prefill stores, P2D transfer."""
    out = []
    out += d.apply(RequestSubmitted(ts=ts, request=req, branch=branch, version=version, blocks=blocks))
    out += d.apply(RouteDecided(ts=ts, request=req, prefill_node=p, decode_node=dn))
    for tier in ("L1", "L2"):
        out += d.apply(KvStored(ts=ts, node=p, tier=tier, blocks=blocks, request=req))
    out += d.apply(KvMoved(ts=ts, src_node=p, dst_node=dn, blocks=blocks, request=req))
    return out


def counts(d, blocks) -> dict[tuple[int, str], int]:
    """Every non-zero count among ``blocks`` x nodes."""
    return {(b, n): d.count(b, n) for b in blocks for n in NODES if d.count(b, n)}


def on(blocks, nodes, c=1):
    return {(b, n): c for b in blocks for n in nodes}


# Each row: a scenario (list of steps) and the exact expected counts afterwards.
def row_continuation(d):
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3], ts=1)
    serve(d, "r2", "a", [1, 2, 3, 4, 5], ts=10)  # tool result appended, same version
    return on([1, 2, 3, 4, 5], ["p0", "d0"])


def row_compaction(d):
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3, 4], ts=1)
    d.apply(ContextCompacted(ts=5, branch="a", version=1, blocks=[9]))
    serve(d, "r2", "a", [9, 10], ts=6, version=1)
    # the replaced history is referenced by no branch (still cached, count 0)
    return on([9, 10], ["p0", "d0"])


def row_fork(d):
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3], ts=1)
    d.apply(BranchOpened(ts=2, branch="b", parent="a", mode="fork"))
    serve(d, "r2", "b", [1, 2, 3, 7], ts=3)
    return {**on([1, 2, 3], ["p0", "d0"], 2), **on([7], ["p0", "d0"])}


def row_subagent(d):
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3], ts=1)
    d.apply(BranchOpened(ts=2, branch="s", parent="a", mode="subagent"))
    serve(d, "r2", "s", [20, 21], ts=3, p="p1", dn="d1")
    return {**on([1, 2, 3], ["p0", "d0"]), **on([20, 21], ["p1", "d1"])}


def row_resume(d):
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3, 4], ts=0)
    serve(d, "r2", "a", [1, 2, 3, 4, 5], ts=359)  # after a 359 s sub-agent wait
    return on([1, 2, 3, 4, 5], ["p0", "d0"])


ROWS = {
    "continuation": row_continuation,
    "compaction": row_compaction,
    "fork": row_fork,
    "subagent": row_subagent,
    "resume_after_wait": row_resume,
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_method_table_rows(row):
    d = cluster()
    expected = ROWS[row](d)
    assert counts(d, range(1, 30)) == expected
    assert d.anomalies() == {}


def test_compaction_keeps_replaced_history_cached_with_count_zero():
    d = cluster()
    row_compaction(d)
    assert d.holders(2) == [("d0", "L1"), ("p0", "L1"), ("p0", "L2")]
    assert [d.count(b, "p0") for b in (1, 2, 3, 4, 9, 10)] == [0, 0, 0, 0, 1, 1]
    assert d.branch("a")["version"] == 1


def test_fork_end_of_one_branch_leaves_the_other_counting():
    d = cluster()
    row_fork(d)
    d.apply(BranchEnded(ts=9, branch="a"))
    assert counts(d, range(1, 10)) == {**on([1, 2, 3], ["p0", "d0"]), **on([7], ["p0", "d0"])}
    d.apply(BranchEnded(ts=10, branch="b"))
    assert counts(d, range(1, 10)) == {}


def test_subagent_never_counts_its_parents_blocks_even_if_shared():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3], ts=1)
    d.apply(BranchOpened(ts=2, branch="s", parent="a", mode="subagent"))
    serve(d, "r2", "s", [1, 20], ts=3)  # shares the parent's first block (same system prompt)
    assert counts(d, range(1, 30)) == {**on([1, 2, 3], ["p0", "d0"]), **on([20], ["p0", "d0"])}
    d.apply(BranchEnded(ts=4, branch="s"))
    assert counts(d, range(1, 30)) == on([1, 2, 3], ["p0", "d0"])


def test_continuation_never_counts_twice_and_a_new_version_replaces():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    for i, blocks in enumerate(([1], [1, 2], [1, 2, 2, 3], [1, 2, 2, 3])):
        serve(d, f"r{i}", "a", blocks, ts=i)
    assert counts(d, [1, 2, 3]) == on([1, 2, 3], ["p0", "d0"])
    serve(d, "r9", "a", [1, 5], ts=9, version=1)  # rewrite through a request with a new version
    assert counts(d, [1, 2, 3, 5]) == on([1, 5], ["p0", "d0"])


# ----------------------------------------------------------------------------- KV moves
@pytest.mark.parametrize(
    "src,dst,src_phase,dst_phase,expected_nodes",
    [
        ("p0", "p1", "prefill", "prefill", ["p1", "d0"]),  # P2P: the count moves, source -1
        ("d0", "d1", "decode", "decode", ["p0", "d1"]),  # D2D
        ("p0", "d1", "prefill", "decode", ["p0", "d1"]),  # P2D: both keep; decode copy now d1
        ("d0", "p1", "decode", "prefill", ["p1", "d0"]),  # D2P: both keep; prefill copy now p1
    ],
)
def test_kv_move_within_and_across_phases(src, dst, src_phase, dst_phase, expected_nodes):
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(KvMoved(ts=2, src_node=src, dst_node=dst, blocks=[1, 2], src_phase=src_phase,
                    dst_phase=dst_phase, branch="a"))
    assert counts(d, [1, 2]) == on([1, 2], expected_nodes)
    assert d.last_access(1, src, "L1") == 2.0  # the source copy was read


def test_role_switch_decode_to_prefill_resets_counts_and_keeps_kv():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(RoleSwitched(ts=2, node="d0", role="prefill"))
    assert counts(d, [1, 2]) == on([1, 2], ["p0"])
    assert ("d0", "L1") in d.holders(1)  # KV stays, now evictable first
    assert d.counts_on("d0") == {}


def test_role_switch_prefill_to_decode_keeps_counts():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(RoleSwitched(ts=2, node="p0", role="decode"))
    assert counts(d, [1, 2]) == on([1, 2], ["p0", "d0"])


def test_role_switch_that_drops_kv_and_node_removal():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(RoleSwitched(ts=2, node="p0", role="decode", kv_dropped=True))
    assert counts(d, [1, 2]) == on([1, 2], ["d0"])
    assert d.holders(1) == [("d0", "L1")]
    d.apply(NodeRemoved(ts=3, node="d0"))
    assert d.holders(1) == [] and counts(d, [1, 2]) == {}
    assert "d0" not in d.lookup([1]).per_node


def test_evicted_copy_shows_no_count_and_a_restored_copy_shows_it_again():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(KvEvicted(ts=2, node="p0", tier="L1", blocks=[2]))
    assert d.count(2, "p0") == 1  # the L2 copy on p0 still exists
    d.apply(KvEvicted(ts=3, node="p0", tier="L2", blocks=[2]))
    assert d.count(2, "p0") == 0 and d.count(1, "p0") == 1
    d.apply(KvStored(ts=4, node="p0", tier="L2", blocks=[2]))
    assert d.count(2, "p0") == 1


# ----------------------------------------------------------------------------- anomalies
def kinds(out):
    assert all(isinstance(e, AnomalyReported) and e.component == "directory" for e in out)
    return [e.kind for e in out]


def test_anomalies_are_reported_counted_and_never_drive_counts_negative():
    d = cluster()
    assert kinds(d.apply(BranchEnded(ts=1, branch="ghost"))) == ["unknown_branch"]
    assert kinds(d.apply(KvEvicted(ts=1, node="p0", tier="L1", blocks=[5]))) == ["unknown_block"]
    assert kinds(d.apply(RouteDecided(ts=1, request="nope", prefill_node="p0", decode_node="d0"))) == [
        "unknown_request"]
    assert kinds(d.apply(KvStored(ts=1, node="x9", tier="L1", blocks=[5]))) == ["unknown_node"]
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1, version=3)
    assert kinds(d.apply(RequestSubmitted(ts=2, request="r2", branch="a", version=2, blocks=[7]))) == [
        "stale_version"]
    assert kinds(d.apply(BranchOpened(ts=2, branch="a"))) == ["duplicate_branch"]
    d.apply(BranchEnded(ts=3, branch="a"))
    assert kinds(d.apply(BranchEnded(ts=4, branch="a"))) == ["ended_branch"]
    assert kinds(d.apply(BranchOpened(ts=5, branch="f", parent="zz", mode="fork"))) == ["unknown_parent"]
    # a request of a branch never opened (lost BranchOpened) opens it as a root and counts
    assert kinds(serve(d, "r3", "late", [4], ts=6)) == ["unknown_branch"]
    assert d.count(4, "p0") == 1
    assert d.anomalies() == {"duplicate_branch": 1, "ended_branch": 1, "stale_version": 1,
                             "unknown_block": 1, "unknown_branch": 2, "unknown_node": 1,
                             "unknown_parent": 1, "unknown_request": 1}
    assert all(c >= 0 for n in NODES for c in d.counts_on(n).values())


def test_shadow_route_decisions_are_ignored():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    d.apply(RequestSubmitted(ts=1, request="r1", branch="a", blocks=[1]))
    d.apply(RouteDecided(ts=1, request="r1", prefill_node="p1", decode_node="d1", shadow=True))
    assert d.branch("a")["prefill_holder"] is None
    d.apply(RouteDecided(ts=1, request="r1", prefill_node="p1", decode_node="d1"))
    assert (d.branch("a")["prefill_holder"], d.branch("a")["decode_holder"]) == ("p1", "d1")


# ----------------------------------------------------------------------------- collocated and node events
def test_collocated_node_counts_a_branch_once_and_switching_to_prefill_drops_decode_counts():
    d = cluster()
    d.apply(NodeRegistered(ts=0, node="c0", role="collocated"))
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1, p="c0", dn="c0")
    assert d.count(1, "c0") == 1  # both phases on one node: counted once
    d.apply(RoleSwitched(ts=2, node="c0", role="prefill"))
    view = d.branch("a")
    assert (view["prefill_holder"], view["decode_holder"]) == ("c0", None)
    assert d.count(1, "c0") == 1
    d.apply(BranchOpened(ts=3, branch="b"))  # unrouted store on a collocated node: prefill phase
    d.apply(RoleSwitched(ts=3, node="c0", role="collocated"))
    d.apply(RequestSubmitted(ts=3, request="r2", branch="b", blocks=[5]))
    d.apply(KvStored(ts=3, node="c0", tier="L1", blocks=[5], branch="b"))
    assert d.branch("b")["prefill_holder"] == "c0" and d.branch("b")["decode_holder"] is None


def test_kv_stored_by_a_decode_node_without_route_attaches_the_decode_phase():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    d.apply(RequestSubmitted(ts=0, request="r1", branch="a", blocks=[1]))
    d.apply(KvStored(ts=1, node="d1", tier="L2", blocks=[1], branch="a"))
    assert (d.branch("a")["prefill_holder"], d.branch("a")["decode_holder"]) == (None, "d1")
    assert d.count(1, "d1") == 1


def test_kv_fetched_puts_blocks_in_both_tiers_of_the_destination():
    from events.catalog import KvFetched

    d = cluster()
    d.apply(KvStored(ts=1, node="p0", tier="L2", blocks=[1, 2]))
    d.apply(KvFetched(ts=5, request="x", src_node="p0", dst_node="p1", blocks=[1, 2]))
    assert d.holders(2) == [("p0", "L2"), ("p1", "L1"), ("p1", "L2")]
    assert d.last_access(1, "p0", "L2") == 5.0 and d.last_access(1, "p1", "L1") == 5.0


def test_reregistration_with_a_new_role_applies_the_switch_rule_and_keeps_kv():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1], ts=1)
    d.apply(NodeRegistered(ts=2, node="d0", role="prefill"))
    assert d.count(1, "d0") == 0 and ("d0", "L1") in d.holders(1)
    assert d.nodes()["d0"] == "prefill"


def test_a_node_seen_before_its_registration_is_added_then_registered():
    d = DirectoryCore()
    out = d.apply(KvStored(ts=0, node="late", tier="L1", blocks=[3]))
    assert [e.kind for e in out] == ["unknown_node"]
    assert d.nodes() == {"late": None}
    assert d.apply(NodeRegistered(ts=1, node="late", role="decode")) == []
    assert d.nodes() == {"late": "decode"} and d.holders(3) == [("late", "L1")]


def test_rewrite_without_version_bump_is_applied_and_reported():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2, 3], ts=1)
    out = serve(d, "r2", "a", [1, 9], ts=2)
    assert [e.kind for e in out] == ["unversioned_rewrite"]
    assert counts(d, [1, 2, 3, 9]) == on([1, 9], ["p0", "d0"])


def test_compaction_with_the_version_a_request_already_carried_is_ignored():
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    serve(d, "r2", "a", [7, 8], ts=2, version=1)  # the request arrived before the compaction
    assert d.apply(ContextCompacted(ts=3, branch="a", version=1, blocks=[7])) == []
    assert counts(d, [1, 2, 7, 8]) == on([7, 8], ["p0", "d0"])


def test_block_hashes_outside_64_bits_never_reach_the_core():
    """The event type refuses them at decode (msgpack and the DuckDB log's JSON): they go to
    the dead-letter path; the whole unsigned 64-bit range is accepted and stored."""
    for bad in (-1, 2**64):
        for ev in (RequestSubmitted(ts=1, request="r", branch="a", blocks=[1, bad]),
                   KvStored(ts=1, node="p0", tier="L1", blocks=[bad])):
            with pytest.raises(codec.CodecError, match="blocks"):
                codec.from_json(codec.to_json(ev))
            if bad < 0:  # msgpack itself cannot carry 2**64
                with pytest.raises(codec.CodecError, match="blocks"):
                    codec.decode(codec.encode(ev))
    d = cluster()
    ok = KvStored(ts=2, node="p0", tier="L1", blocks=[2**64 - 1, 0])
    assert codec.decode(codec.encode(ok)) == ok
    d.apply(ok)
    assert d.holders(2**64 - 1) == [("p0", "L1")] and d.holders(0) == [("p0", "L1")]


def test_fork_of_an_ended_parent_is_a_resume_that_counts_its_first_request():
    # Over HTTP the gateway only learns of a fork at its first request, which may come after
    # the parent's end (trace_0504 resumes 3,058 s later): not an anomaly, and the resumed
    # context is counted once on the node that serves it.
    d = cluster()
    d.apply(BranchOpened(ts=0, branch="a"))
    serve(d, "r1", "a", [1, 2], ts=1)
    d.apply(BranchEnded(ts=2, branch="a"))
    assert d.count(1, "p0") == 0 and d.count(2, "p0") == 0
    assert d.apply(BranchOpened(ts=3, branch="a~1", parent="a", mode="fork")) == []
    serve(d, "r2", "a~1", [1, 2, 3], ts=4)
    assert counts(d, [1, 2, 3]) == on([1, 2, 3], ["p0", "d0"])
    assert d.anomalies() == {}
