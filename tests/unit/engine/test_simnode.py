"""Hand-checkable timings of the simulated node (noise off): every expected time is written
from the profile's formulas, never read back from the node."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine.backends.sim.node import PrefillJob, SimNode
from engine.profiles import load_profile
from events.catalog import FetchStep, FirstToken, KvEvicted, KvFetched, RequestFinished, RoleSwitched
from replay.sim.simulation import EventQueue
from services.cores.directory.core import DirectoryCore
from services.cores.directory.eviction import LruEviction

P = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)


class Host:
    """A minimal node host: the virtual clock, a directory folding the node events, a log."""

    def __init__(self):
        self.q = EventQueue()
        self.log = []
        self.dir = DirectoryCore()
        self.nodes = {}
        self.policy = LruEviction(P.block_tokens)

    @property
    def now(self):
        return self.q.now

    def emit(self, e):
        self.log.append(e)
        self.dir.apply(e)

    def schedule(self, t, fn, *args):
        self.q.schedule(t, fn, *args)

    def choose_eviction(self, node, tier, tokens, pinned):
        return self.policy.choose(self.dir, node, tier, tokens, pinned)

    def peer(self, node):
        return self.nodes.get(node)

    def add(self, nid, role, fetch_mode="async"):
        n = SimNode(nid, role, P, self, seed=1, fetch_mode=fetch_mode)
        self.nodes[nid] = n
        return n

    def run(self):
        while self.q.step():
            pass

    def at(self, kind, request=None):
        return [e for e in self.log if isinstance(e, kind) and (request is None or e.request == request)]


def job(rid, blocks, prompt, out, decode="a", plan=()):
    return PrefillJob(request=rid, blocks=blocks, prompt_tokens=prompt, max_tokens=out, decode_node=decode,
                      fetch_plan=list(plan), enqueued_s=0.0)


def prefill_s(t_uc, t_c=0, t_rst=0):
    return P.c0 + P.c1 * t_uc + P.c2 * (t_uc * t_c + t_uc * (t_uc + 1) / 2) + P.c3 * t_rst


def decode_s(batch, ctx):
    phi = 1 - (1 - P.experts_per_token / P.experts) ** (P.t_fwd * batch)
    return P.d0 + P.d1 * phi + P.d2 * batch + P.d_ctx * ctx


def test_one_collocated_node_one_request():
    h = Host()
    n = h.add("a", "collocated")
    blocks = list(range(1, 16))  # 15 full blocks + 40 tail tokens = 1000 tokens
    n.enqueue_prefill(job("r", blocks, 1000, 11))
    h.run()
    t_p = prefill_s(1000)
    assert h.at(FirstToken)[0].ts == pytest.approx(t_p, rel=1e-12)
    iters = math.ceil(10 / P.t_acc)  # first token came from prefill
    fin = h.at(RequestFinished)[0]
    assert fin.ts == pytest.approx(t_p + iters * decode_s(1, 1001), rel=1e-12)
    assert fin.output_tokens == 11
    assert n.l1 == set(blocks) and n.l2 == set(blocks)


def test_disaggregated_request_pays_the_kv_transfer():
    h = Host()
    h.add("p", "prefill")
    d = h.add("d", "decode")
    h.nodes["p"].enqueue_prefill(job("r", list(range(1, 16)), 1000, 3, decode="d"))
    h.run()
    transfer = P.p2d_latency_s + 1000 * P.kv_bytes_per_token / P.p2d_bandwidth_Bps
    fin = h.at(RequestFinished)[0]
    assert fin.node == "d"
    assert fin.ts == pytest.approx(prefill_s(1000) + transfer + 1 * decode_s(1, 1001), rel=1e-12)
    assert set(range(1, 16)) <= d.l1


def _fetch_case(fetch_mode):
    """Node q holds a 160-block prefix in host memory; node p first serves a 16,384-token
    request X (one full iteration), then R, whose prefix must come from q."""
    h = Host()
    p = h.add("p", "prefill", fetch_mode)
    q = h.add("q", "prefill", fetch_mode)
    h.add("d", "decode")
    prefix = list(range(1000, 1160))
    q._store("L2", prefix)
    x_blocks = list(range(5000, 5256))  # 256 blocks = 16,384 tokens
    p.enqueue_prefill(job("x", x_blocks, 16384, 1, decode="d"))
    plan = [FetchStep(src_node="q", first_block=0, n_blocks=160, tier="L2")]
    p.enqueue_prefill(job("r", prefix + [7, 8], 160 * 64 + 128 + 10, 1, decode="d", plan=plan))
    h.run()
    return h


def test_async_fetch_hides_under_the_queue_wait_and_fetch_at_start_adds_it():
    fetch = P.fetch_latency_s + 160 * 64 * P.kv_bytes_per_token / P.fetch_bandwidth_Bps
    x_end = prefill_s(16384)
    t_r = prefill_s(138, t_c=160 * 64)

    h = _fetch_case("async")
    assert fetch < x_end  # the fetch fits under X's iteration
    f = h.at(KvFetched, "r")[0]
    assert f.duration_s == pytest.approx(fetch) and f.hidden_s == pytest.approx(fetch)
    assert h.at(FirstToken, "r")[0].ts == pytest.approx(x_end + t_r, rel=1e-12)

    h2 = _fetch_case("at_start")
    assert h2.at(KvFetched, "r")[0].hidden_s == 0.0
    assert h2.at(FirstToken, "r")[0].ts == pytest.approx(x_end + fetch + t_r, rel=1e-12)

    h3 = _fetch_case("none")  # no pool: R recomputes its prefix
    assert not h3.at(KvFetched, "r")
    assert h3.at(FirstToken, "r")[0].ts == pytest.approx(x_end + prefill_s(160 * 64 + 138), rel=1e-12)


def test_fetch_reads_only_blocks_the_source_holds():
    h = Host()
    p = h.add("p", "prefill")
    q = h.add("q", "prefill")
    h.add("d", "decode")
    q._store("L2", [1, 2, 3])
    plan = [FetchStep(src_node="q", first_block=0, n_blocks=5, tier="L2")]  # stale plan: 5 blocks
    p.enqueue_prefill(job("r", [1, 2, 3, 4, 5], 330, 1, decode="d", plan=plan))
    h.run()
    f = h.at(KvFetched, "r")
    assert [e.blocks for e in f] == [[1, 2, 3]]
    assert "unknown_block" not in h.dir.anomalies()  # nothing read from a node without a copy


@pytest.mark.parametrize("mechanism,delay,keeps", [("in_place", P.switch_in_place_s, True),
                                                   ("restart", P.restart_s, False),
                                                   ("in_place_drop_kv", P.switch_in_place_s, False)])
def test_switch_mechanisms(mechanism, delay, keeps):
    h = Host()
    n = h.add("a", "prefill")
    h.add("d", "decode")
    n.enqueue_prefill(job("r", list(range(1, 16)), 1000, 1, decode="d"))
    h.run()
    t0 = h.now
    held = set(n.l1)
    n.order_switch("decode", mechanism)
    h.run()
    ack = h.at(RoleSwitched)[-1]
    assert ack.role == "decode" and n.role == "decode"
    assert ack.ts == pytest.approx(t0 + delay)
    assert ack.kv_dropped is (not keeps)
    if keeps:
        assert n.l1 == held and not h.at(KvEvicted)
    else:
        assert not n.l1 and not n.l2
        assert {b for e in h.at(KvEvicted) for b in e.blocks} == held
        assert all(node != "a" for b in held for node, _ in h.dir.holders(b))


def test_switch_drains_running_requests_first():
    h = Host()
    n = h.add("a", "prefill")
    h.add("d", "decode")
    n.enqueue_prefill(job("r", list(range(1, 16)), 1000, 1, decode="d"))
    h.q.schedule(0.001, n.order_switch, "decode", "in_place")  # during the prefill iteration
    h.run()
    ack = h.at(RoleSwitched)[-1]
    assert ack.ts == pytest.approx(prefill_s(1000) + P.switch_in_place_s)
    assert ack.duration_s == pytest.approx(prefill_s(1000) + P.switch_in_place_s - 0.001)
    assert h.at(FirstToken)[0].ts < ack.ts


def test_collocated_to_decode_switches_once_prefill_is_drained_while_decoding_continues():
    h = Host()
    n = h.add("a", "collocated")
    n.enqueue_prefill(job("long", list(range(1, 16)), 1000, 2000))  # decodes for a long time
    h.q.schedule(0.001, n.order_switch, "decode", "in_place")
    h.run()
    ack = h.at(RoleSwitched)[-1]
    assert ack.role == "decode"
    # the prefill iteration was the only work of the phase it leaves: the switch follows it
    assert ack.ts == pytest.approx(prefill_s(1000) + P.switch_in_place_s)
    assert h.at(RequestFinished)[0].ts > ack.ts  # decoding went on after the switch


def test_in_place_switch_to_prefill_serves_prefill_at_once_and_carries_running_decodes():
    """METHOD.md §4.1/§4.4: a collocated node ordered to prefill takes
    prefill work from the order on, and the decodes it runs finish in place, one decode step
    per prefill iteration (a mixed batch costing their per-request share of eq. 2)."""
    h = Host()
    n = h.add("a", "collocated")
    h.add("d", "decode")
    n.enqueue_prefill(job("long", list(range(1, 16)), 1000, 4000))  # decodes ~2000 iterations here
    h.q.schedule(1.0, n.order_switch, "prefill", "in_place")
    news = [job(f"p{i}", list(range(100 * (i + 1), 100 * (i + 1) + 15)), 1000, 10, decode="d") for i in range(3)]
    for j in news:
        h.q.schedule(1.0, n.enqueue_prefill, j)
    h.run()
    first = {e.request: e.ts for e in h.at(FirstToken)}
    t_long = prefill_s(1000)  # the first request's prefill (alone on the node)
    it_d = decode_s(1, 1001)
    done_iters = math.floor((1.0 - t_long) / it_d) + 1  # the decode run is cut at its next boundary
    start = t_long + done_iters * it_d
    carried = P.d2 * 1  # one running decode rides along; its context is charged by d_ctx
    ctx = 1001 + done_iters * P.t_acc
    sum_A = 3 * (1000 * 1001 / 2)  # three 1000-token prompts in one iteration (no shared prefix)
    mixed = P.c0 + P.c1 * 3000 + P.c2 * sum_A + carried + P.d_ctx * ctx
    assert first["p0"] == first["p1"] == first["p2"] == pytest.approx(start + mixed)
    # the running decode advanced during that prefill iteration, reported as a decode step
    carried_steps = [e for e in h.log if getattr(e, "phase", None) == "decode" and e.ts == pytest.approx(start + mixed)]
    assert carried_steps and carried_steps[0].batch == 1 and carried_steps[0].iterations == 1
    # the switch completes once the running decode finished in place; nothing was dropped
    ack = h.at(RoleSwitched)[-1]
    fin = {e.request: e.ts for e in h.at(RequestFinished)}
    assert ack.role == "prefill" and ack.ts == pytest.approx(fin["long"] + P.switch_in_place_s)
    assert not ack.kv_dropped and ack.drained == 1


def test_a_collocated_node_not_switching_makes_the_same_prefills_wait_for_its_decode_run():
    """The contrast: a collocated node that is not switching lets its decode run end first (the
    warm-up scheduling, unchanged), so the same prefills get their first token later."""
    h = Host()
    n = h.add("a", "collocated")
    h.add("d", "decode")
    n.enqueue_prefill(job("long", list(range(1, 16)), 1000, 4000))
    news = [job(f"p{i}", list(range(100 * (i + 1), 100 * (i + 1) + 15)), 1000, 10, decode="d") for i in range(3)]
    for j in news:
        h.q.schedule(1.0, n.enqueue_prefill, j)
    h.run()
    switched = Host()
    m = switched.add("a", "collocated")
    switched.add("d", "decode")
    m.enqueue_prefill(job("long", list(range(1, 16)), 1000, 4000))
    switched.q.schedule(1.0, m.order_switch, "prefill", "in_place")
    for j in [job(f"p{i}", list(range(100 * (i + 1), 100 * (i + 1) + 15)), 1000, 10, decode="d") for i in range(3)]:
        switched.q.schedule(1.0, m.enqueue_prefill, j)
    switched.run()
    ttft = max(e.ts for e in h.at(FirstToken) if e.request != "long")
    ttft_switched = max(e.ts for e in switched.at(FirstToken) if e.request != "long")
    assert ttft_switched < ttft


def test_a_higher_priority_job_goes_ahead_of_queued_ones_equal_ones_keep_their_order():
    """``nvext.agent_hints.priority`` (PrefillJob.priority): a queued, not started job of lower
    priority waits behind it; the running one is never displaced. Each job fills a whole
    iteration (16,384 tokens), so the first-token order is the queue order."""
    h = Host()
    n = h.add("a", "collocated")
    big = 256 * 64  # one full prefill iteration each

    def j(rid, base, prio):
        return replace(job(rid, list(range(base, base + 256)), big, 1), priority=prio)

    n.enqueue_prefill(j("first", 10_000, 0))  # running by the time the others arrive

    def later():
        for rid, base, prio in [("low", 20_000, 0), ("low2", 30_000, 0), ("high", 40_000, 5),
                                ("neg", 50_000, -1), ("zero", 60_000, 0)]:
            n.enqueue_prefill(j(rid, base, prio))

    h.schedule(0.001, later)
    h.run()
    order = [e.request for e in sorted(h.at(FirstToken), key=lambda e: e.ts)]
    assert order == ["first", "high", "low", "low2", "zero", "neg"]
