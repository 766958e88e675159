"""Property tests of the closed-loop cursor on random session trees."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import BranchEnded, BranchOpened, RequestSubmitted
from replay.traces.format import (
    Branch,
    Compact,
    Fork,
    Request,
    Session,
    SessionCursor,
    Spawn,
    validate_session,
)
from tests.hyp import examples


@st.composite
def sessions(draw):
    n = draw(st.integers(1, 6))
    steps: list[list] = [[Request(blocks=[i, k], output_tokens=1, pause_s=draw(st.floats(0, 5)))
                          for k in range(draw(st.integers(1, 3)))] for i in range(n)]
    parents, modes, opened_by = [None], ["root"], {}
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        mode = draw(st.sampled_from(["fork", "subagent"]))
        wait = draw(st.booleans())
        cls = Fork if mode == "fork" else Spawn
        pos = draw(st.integers(0, len(steps[p])))
        steps[p].insert(pos, cls(branch=f"b{i}", wait=wait, pause_s=draw(st.floats(0, 3))))
        parents.append(f"b{p}")
        modes.append(mode)
        opened_by[f"b{i}"] = (f"b{p}", wait)
    for s in steps:
        if draw(st.booleans()):
            s.insert(draw(st.integers(0, len(s))), Compact(blocks=[99]))
    branches = [Branch(id=f"b{i}", parent=parents[i], mode=modes[i], steps=steps[i]) for i in range(n)]
    return Session(id="p", branches=branches), opened_by


@settings(max_examples=examples(150), deadline=None)
@given(sessions(), st.floats(0.1, 10))
def test_every_branch_opens_and_ends_and_waits_hold(case, service_s):
    s, opened_by = case
    assert validate_session(s) == []
    cur = SessionCursor(s)
    evs = list(cur.start(0.0))
    heap = [(e.ts + service_s, e.request) for e in evs if isinstance(e, RequestSubmitted)]
    heapq.heapify(heap)
    while heap:
        t, rid = heapq.heappop(heap)
        new = cur.on_finished(rid, t)
        assert all(e.ts >= t for e in new)
        for e in new:
            if isinstance(e, RequestSubmitted):
                heapq.heappush(heap, (e.ts + service_s, e.request))
        evs += new
    assert cur.done and cur.in_flight == []
    n_req = sum(1 for _ in s.requests())
    assert sum(isinstance(e, RequestSubmitted) for e in evs) == n_req
    opened = [e.branch for e in evs if isinstance(e, BranchOpened)]
    ended = {e.branch: e.ts for e in evs if isinstance(e, BranchEnded)}
    assert sorted(opened) == sorted(ended) == sorted(f"p/{b.id}" for b in s.branches)
    subs = [e for e in evs if isinstance(e, RequestSubmitted)]
    for e in subs:  # a branch ends after its last response
        assert ended[e.branch] >= e.ts + service_s - 1e-9
    for child, (parent, wait) in opened_by.items():
        if not wait:
            continue
        t_open = next(e.ts for e in evs if isinstance(e, BranchOpened) and e.branch == f"p/{child}")
        later = [e.ts for e in subs if e.branch == f"p/{parent}" and e.ts >= t_open]
        nxt = [t for t in later if t > t_open] or later
        if nxt:  # the parent's next request comes after the waited child ended
            assert min(nxt) >= ended[f"p/{child}"] - 1e-9
        assert ended[f"p/{parent}"] >= ended[f"p/{child}"] - 1e-9
