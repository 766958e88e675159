"""A SimNode's host for unit tests: an event queue, a real directory that folds every event the
node emits, a real eviction policy over it, and the peers by id (the simulator's Simulation in
miniature). Shared by the sim-node tests that check what the node keeps and evicts."""

from __future__ import annotations

from replay.sim.simulation import EventQueue
from services.cores.directory.core import DirectoryCore


class DirectoryHost:
    def __init__(self, policy) -> None:
        self.q = EventQueue()
        self.log: list = []
        self.dir = DirectoryCore()
        self.nodes: dict = {}
        self.policy = policy

    @property
    def now(self) -> float:
        return self.q.now

    def emit(self, e) -> None:
        self.log.append(e)
        self.dir.apply(e)

    def schedule(self, t, fn, *args) -> None:
        self.q.schedule(t, fn, *args)

    def choose_eviction(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    def peer(self, node):
        return self.nodes.get(node)
