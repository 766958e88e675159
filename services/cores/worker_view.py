"""What an engine worker knows of its partition: a pure core, snapshotted like the services'.

The worker folds the whole stream into it: the directory (other nodes' KV for fetch plans,
active-branch counts for eviction) and the requests in flight (a ``RequestSubmitted`` is
needed when a route, perhaps a late reroute, names this node). No I/O, no clock.

``snapshot()`` / ``from_snapshot()`` carry both, so a worker restarts from its snapshot plus the
tail of the stream, as the services do (services/adapters/runner.py), instead of refolding from
sequence 1 (engine/worker/stream.py says when it writes one).
"""

from __future__ import annotations

import msgspec

from events.catalog import Event, RequestFinished, RequestSubmitted
from services.cores.directory.core import DirectoryCore

#: Bump when the snapshot layout changes: an older snapshot is then ignored (rebuild from 1).
SNAPSHOT_VERSION = 1


class _Snap(msgspec.Struct, array_like=True):
    version: int
    directory: bytes
    requests: list[RequestSubmitted]


class WorkerView:
    """Directory plus requests in flight (module docstring)."""

    name = "engine-view"

    def __init__(self, directory: DirectoryCore | None = None,
                 requests: dict[str, RequestSubmitted] | None = None) -> None:
        self.directory = directory or DirectoryCore()
        self.requests: dict[str, RequestSubmitted] = requests or {}

    def apply(self, event: Event) -> list[Event]:
        self.directory.apply(event)
        match event:
            case RequestSubmitted():
                self.requests[event.request] = event
            case RequestFinished():
                self.requests.pop(event.request, None)
        return []

    def snapshot(self) -> bytes:
        return msgspec.msgpack.encode(_Snap(SNAPSHOT_VERSION, self.directory.snapshot(),
                                            list(self.requests.values())))

    @classmethod
    def from_snapshot(cls, data: bytes) -> WorkerView:
        snap = msgspec.msgpack.decode(data, type=_Snap)
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"engine view snapshot version {snap.version}, expected {SNAPSHOT_VERSION}")
        return cls(DirectoryCore.from_snapshot(snap.directory), {r.request: r for r in snap.requests})
