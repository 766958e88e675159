"""A node that is not collocated never starves the decodes it runs behind a prefill backlog
(`evolving chaos --engines`: worker d1 kept starting prefills and ran no decode
iteration for minutes, 2180 requests hung).

Decodes reach a prefill node when no decode node is left (the router's "decode on the prefill
node" fallback) or when a transfer lands after a switch; before, such a node always chose a
prefill iteration while any prefill was eligible, so under a steady flow of prefills its
decodes never advanced. Now they ride along each prefill iteration (a mixed batch, as an
in-place switch to prefill does), and the node decodes alone once no prefill is eligible."""

from __future__ import annotations

import pytest

from engine.backends.sim.node import PrefillJob
from events.catalog import FirstToken, IterationDone, RequestFinished, RequestStarted

from .test_simnode import Host


def _flow(h: Host, node, n: int, spacing_s: float, decode: str) -> None:
    """``n`` prefills arriving ``spacing_s`` apart (faster than the node clears them), each to
    decode on ``decode``."""
    for i in range(n):
        def enqueue(i=i):
            node.enqueue_prefill(PrefillJob(request=f"r{i}", blocks=[i * 1000 + k for k in range(4)],
                                            prompt_tokens=266, max_tokens=16, decode_node=decode, fetch_plan=[],
                                            enqueued_s=h.now))
        h.schedule(i * spacing_s, enqueue)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_decodes_advance_while_the_prefill_queue_stays_long(role):
    h = Host()
    n = h.add("d1", role)
    _flow(h, n, 2000, 0.002, decode="d1")  # the fallback: decode on the node that prefills
    h.run()
    fin = sorted(e.ts for e in h.at(RequestFinished))
    last_first_token = max(e.ts for e in h.at(FirstToken))
    assert len(fin) == 2000
    # before, not one finished until the backlog of prefills was cleared; now they finish all
    # along it (at the pace of one decode step per prefill iteration, 128 running at most)
    assert sum(1 for t in fin if t < last_first_token) >= len(fin) // 5
    assert fin[0] < 0.25 * last_first_token
    carried = [e for e in h.at(IterationDone) if e.phase == "decode" and e.ts < last_first_token]
    assert len(carried) >= 20  # one per prefill iteration of the backlog (32 here; 0 before)


def test_a_collocated_node_still_alternates_decode_runs_with_prefill():
    """The collocated scheduling is unchanged: it alternates whole decode runs with prefill
    iterations (no mixed batch outside an in-place switch to prefill)."""
    h = Host()
    n = h.add("c", "collocated")
    _flow(h, n, 300, 0.002, decode="c")
    h.run()
    assert len(h.at(RequestFinished)) == 300
    runs = [e for e in h.at(IterationDone) if e.phase == "decode"]
    assert runs and all(e.duration_s > 0 for e in runs)
    assert any(e.iterations > 1 for e in runs)
    starts = [e for e in h.at(RequestStarted) if e.phase == "decode"]
    assert len(starts) == 300
