"""Cancellation on the simulated node: ``SimNode.cancel`` drops a queued prefill
at once, stops a running decode at its next iteration boundary, and reports one
``RequestFinished(error="cancelled")`` with the tokens produced so far; the prompt's KV stays
cached as for a finished request. Times are hand-checked from the profile (noise off)."""

from __future__ import annotations

import pytest

from events.catalog import FirstToken, IterationDone, KvStored, RequestFinished, RequestStarted
from tests.unit.engine.test_simnode import Host, P, decode_s, job, prefill_s


def _finished(h, rid):
    return h.at(RequestFinished, rid)


def test_a_queued_prefill_is_dropped_at_once():
    h = Host()
    n = h.add("a", "collocated")
    big = 2 * P.prefill_token_budget  # r1's first chunk takes the whole budget: r2 waits, not started
    n.enqueue_prefill(job("r1", list(range(1, big // 64 + 1)), big, 50))
    n.enqueue_prefill(job("r2", list(range(10**6, 10**6 + 15)), 1000, 50))
    h.q.schedule(0.001, lambda: n.cancel("r2"))
    h.run()
    fin = _finished(h, "r2")
    assert len(fin) == 1 and fin[0].error == "cancelled" and fin[0].output_tokens == 0
    assert fin[0].ts == pytest.approx(0.001)
    assert not h.at(RequestStarted, "r2") and not h.at(FirstToken, "r2")
    assert _finished(h, "r1")[0].error == "" and _finished(h, "r1")[0].output_tokens == 50
    assert not n.pqueue and not n.pool.pinned()


def test_a_running_decode_stops_at_its_next_iteration_boundary():
    h = Host()
    n = h.add("a", "collocated")
    blocks = list(range(1, 16))
    n.enqueue_prefill(job("r", blocks, 1000, 10_000))
    t_p = prefill_s(1000)
    it = decode_s(1, 1001)
    cancel_at = t_p + 10.5 * it  # mid-way through the eleventh decode iteration
    h.q.schedule(cancel_at, lambda: n.cancel("r"))
    h.run()
    fin = _finished(h, "r")
    assert len(fin) == 1 and fin[0].error == "cancelled"
    assert fin[0].ts == pytest.approx(t_p + 11 * it, rel=1e-9)  # the run ends at the boundary
    assert fin[0].output_tokens == 1 + round(11 * P.t_acc)
    last = [e for e in h.log if isinstance(e, IterationDone) and e.phase == "decode"][-1]
    assert last.ts == pytest.approx(t_p + 11 * it, rel=1e-9)
    assert not n.running and n.working_tokens == 0 and not n.pool.pinned()
    assert set(blocks) <= n.l1 and set(blocks) <= n.l2  # the prompt's KV stays cached


def test_cancel_of_one_request_leaves_the_batch_running():
    h = Host()
    n = h.add("a", "collocated")
    n.enqueue_prefill(job("r1", list(range(1, 16)), 1000, 200))
    n.enqueue_prefill(job("r2", list(range(100, 115)), 1000, 200))
    h.q.schedule(3 * prefill_s(1000), lambda: n.cancel("r1"))
    h.run()
    assert _finished(h, "r1")[0].error == "cancelled"
    ok = _finished(h, "r2")
    assert len(ok) == 1 and ok[0].error == "" and ok[0].output_tokens == 200


def test_a_prefill_in_progress_ends_without_its_first_token():
    h = Host()
    n = h.add("a", "collocated")
    n.enqueue_prefill(job("r", list(range(1, 16)), 1000, 50))
    h.q.schedule(prefill_s(1000) / 3, lambda: n.cancel("r"))
    h.run()
    fin = _finished(h, "r")
    assert len(fin) == 1 and fin[0].error == "cancelled" and fin[0].output_tokens == 0
    assert fin[0].ts == pytest.approx(prefill_s(1000))  # at the end of the iteration it is in
    assert not h.at(FirstToken, "r") and not h.at(KvStored, "r")
    assert not n.pqueue and not n.busy


def test_cancel_of_a_request_the_node_does_not_hold_is_false_and_changes_nothing():
    h = Host()
    n = h.add("a", "collocated")
    assert n.cancel("nope") is False
    n.enqueue_prefill(job("r", list(range(1, 4)), 200, 3))
    h.run()
    assert n.cancel("r") is False  # finished already
    assert [e.error for e in h.at(RequestFinished)] == [""]


def test_a_disaggregated_decode_stops_on_its_decode_node():
    h = Host()
    h.add("p", "prefill")
    d = h.add("d", "decode")
    h.nodes["p"].enqueue_prefill(job("r", list(range(1, 16)), 1000, 5_000, decode="d"))
    transfer = 1e-3 + prefill_s(1000)  # well inside the decode (thousands of iterations)
    h.q.schedule(transfer + 0.5, lambda: d.cancel("r"))
    h.run()
    fin = _finished(h, "r")
    assert len(fin) == 1 and fin[0].node == "d" and fin[0].error == "cancelled"
    assert 1 < fin[0].output_tokens < 5_000
    assert fin[0].ts - (transfer + 0.5) <= decode_s(1, 1000 + 5_000)  # one iteration at most
