"""The worker's view (services/cores/worker_view.py): requests in flight follow submit/finish, and a snapshot
restores exactly the state folded so far; a snapshot of another layout version is refused."""

from __future__ import annotations

import msgspec
import pytest

from events.catalog import KvStored, NodeRegistered, RequestFinished, RequestSubmitted
from services.cores.worker_view import SNAPSHOT_VERSION, WorkerView, _Snap


def stream():
    yield NodeRegistered(ts=0.0, node="n1", role="collocated", l1_capacity_tokens=10**6)
    for i in range(4):
        yield RequestSubmitted(ts=1.0 + i, request=f"r{i}", branch="b", blocks=[10 + i, 20 + i], prompt_tokens=130,
                               max_tokens=4)
    yield KvStored(ts=6.0, node="n1", tier="L1", blocks=[10, 20], request="r0")
    yield RequestFinished(ts=7.0, request="r0", node="n1", output_tokens=4)


def test_requests_in_flight_and_snapshot_round_trip():
    v = WorkerView()
    for e in stream():
        assert v.apply(e) == []
    assert sorted(v.requests) == ["r1", "r2", "r3"]
    w = WorkerView.from_snapshot(v.snapshot())
    assert w.requests == v.requests
    assert w.directory.snapshot() == v.directory.snapshot()
    assert set(w.directory.copies("n1", "L1")) == {10, 20}
    # folding the same tail into both keeps them equal
    tail = RequestFinished(ts=8.0, request="r1", node="n1", output_tokens=4)
    v.apply(tail)
    w.apply(tail)
    assert w.snapshot() == v.snapshot()


def test_other_layout_version_is_refused():
    data = msgspec.msgpack.encode(_Snap(SNAPSHOT_VERSION + 1, WorkerView().directory.snapshot(), []))
    with pytest.raises(ValueError, match="version"):
        WorkerView.from_snapshot(data)
