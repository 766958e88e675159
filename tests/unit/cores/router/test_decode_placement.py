"""LeastTtftRouter's decode choice when some decode nodes have not decoded yet.

Found in the fixed-4P5D ablation (docs/router.md "Decode node"): with ``t_acc`` = 1.0
for a node that never decoded and ~2.6 measured on the others, the unmeasured node's predicted
time per output token was 2.6x too high, it never got a request and so never measured: one
decode node of five stayed idle for the whole run.
"""

from __future__ import annotations

from events.catalog import IterationDone, RouteDecided
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return out


def measured_decode(node: str, ts: float, t_acc: float = 2.6, batch: int = 4) -> IterationDone:
    return IterationDone(ts=ts, node=node, phase="decode", duration_s=0.02, batch=batch, t_fwd=1.0,
                         accepted_tokens=round(t_acc * batch), iterations=10)


def test_a_decode_node_that_never_decoded_gets_requests():
    r = LeastTtftRouter()
    evs = s.register(1, 2) + [s.branch("b", 0.0), measured_decode("d00", 0.5)]
    evs += [s.submit(f"q{i}", "b", s.blocks(1000 * (i + 1), 20), 1.0 + i) for i in range(6)]
    decode = [e.decode_node for e in feed(r, evs) if isinstance(e, RouteDecided)]
    # same model, same t_acc (d01 takes the pooled measurement): the batch decides
    assert decode == ["d00", "d01", "d00", "d01", "d00", "d01"]


def test_measured_nodes_keep_their_own_t_acc():
    """A node measured slower per iteration-request keeps its own figure, not the pooled one."""
    r = LeastTtftRouter()
    evs = s.register(1, 3) + [s.branch("b", 0.0), measured_decode("d00", 0.5, t_acc=3.0),
                               measured_decode("d01", 0.5, t_acc=1.0)]
    evs += [s.submit(f"q{i}", "b", s.blocks(1000 * (i + 1), 20), 1.0 + i) for i in range(3)]
    decode = [e.decode_node for e in feed(r, evs) if isinstance(e, RouteDecided)]
    # d02 is unmeasured: pooled t_acc (3.0*40 + 1.0*40) / 80 = 2.0. d00 (3.0) wins each time:
    # d02 would need eq. 2 at batch 2..3 to cost 1.5x its batch-1 time, and it costs ~1.05x
    assert decode == ["d00", "d00", "d00"]
