"""Property tests of the node model with tiny KV capacities: every request finishes exactly
once, capacities hold at every event, evictions and fetches name only held blocks."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.sim.node import PrefillJob, SimNode
from engine.profiles import load_profile
from events.catalog import FetchStep, KvEvicted, KvFetched, KvMoved, KvStored, RequestFinished
from replay.sim.simulation import EventQueue
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import CountAwareEviction
from tests.hyp import examples

TINY = replace(load_profile("gb300-glm52"), l1_capacity_tokens=64 * 40, l2_capacity_tokens=64 * 80,
               prefill_noise=0.05, decode_noise=0.05)


class Host:
    def __init__(self):
        self.q, self.log, self.dir, self.nodes = EventQueue(), [], DirectoryCore(), {}
        self.policy = CountAwareEviction(64)
        self.held = defaultdict(set)

    @property
    def now(self):
        return self.q.now

    def emit(self, e):
        self.log.append(e)
        self.dir.apply(e)
        t = type(e)
        if t is KvStored:
            for tier in e.tiers():  # a write-through store: L1 and L2
                self.held[e.node, tier].update(e.blocks)
        elif t is KvEvicted:
            assert set(e.blocks) <= self.held[e.node, e.tier]
            self.held[e.node, e.tier].difference_update(e.blocks)
        elif t is KvMoved:
            assert set(e.blocks) <= self.held[e.src_node, "L1"] | self.held[e.src_node, "L2"]
            self.held[e.dst_node, e.dst_tier].update(e.blocks)
        elif t is KvFetched:
            assert set(e.blocks) <= self.held[e.src_node, "L1"] | self.held[e.src_node, "L2"]
            self.held[e.dst_node, "L1"].update(e.blocks)
            self.held[e.dst_node, "L2"].update(e.blocks)
        for (node, tier), blocks in self.held.items():
            cap = TINY.l1_capacity_tokens if tier == "L1" else TINY.l2_capacity_tokens
            assert len(blocks) * 64 <= cap, f"{node} {tier} over capacity"

    def schedule(self, t, fn, *args):
        self.q.schedule(t, fn, *args)

    def choose_eviction(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    def peer(self, node):
        return self.nodes.get(node)


request = st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 63), st.integers(1, 40),
                    st.floats(0, 5), st.sampled_from(["p0", "p1"]))


@settings(max_examples=examples(30), deadline=None)
@given(st.lists(request, min_size=1, max_size=12), st.sampled_from(["async", "at_start", "none"]))
def test_every_request_finishes_once_within_capacity(reqs, fetch_mode):
    h = Host()
    for nid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        h.nodes[nid] = SimNode(nid, role, TINY, h, seed=7, fetch_mode=fetch_mode)
    ids = []
    for i, (family, nblocks, tail, out, at, node) in enumerate(reqs):
        blocks = [family * 1000 + b for b in range(nblocks)]  # same family = shared prefix
        other = "p1" if node == "p0" else "p0"
        plan = [FetchStep(src_node=other, first_block=0, n_blocks=nblocks)]
        job = PrefillJob(request=f"r{i}", blocks=blocks, prompt_tokens=nblocks * 64 + tail, max_tokens=out,
                         decode_node="d0", fetch_plan=plan, enqueued_s=at)
        h.schedule(at, h.nodes[node].enqueue_prefill, job)
        ids.append(f"r{i}")
    while h.q.step():
        pass
    done = [e.request for e in h.log if isinstance(e, RequestFinished)]
    assert sorted(done) == sorted(ids)
    for n in h.nodes.values():
        assert n.l1 == h.held[n.id, "L1"] and n.l2 == h.held[n.id, "L2"]
        assert not n.running and not n.dwaiting and not n.pqueue and n.working_tokens == 0
