"""An engine worker's metrics (engine/metrics.py): scrape-time gauges from the load and the
directory view, counters from the events the node emits."""

from __future__ import annotations

from engine.backend import NodeLoad
from engine.metrics import EngineMetrics
from events.catalog import IterationDone, NodeHeartbeat, RequestFinished, RequestStarted


def test_gauges_and_counters():
    load = [NodeLoad(role="prefill", running=2, queued=3, l1_used_tokens=640, l2_used_tokens=128)]
    m = EngineMetrics("n1", lambda: load[0], lambda tier: {"L1": 10, "L2": 2}[tier])
    assert m.value("ei_engine_num_running_reqs") == 2 and m.value("ei_engine_num_queue_reqs") == 3
    assert m.value("ei_engine_kv_used_tokens", tier="L1") == 640
    assert m.value("ei_engine_kv_blocks", tier="L1") == 10 and m.value("ei_engine_kv_blocks", tier="L2") == 2
    assert m.value("ei_engine_role", role="prefill") == 1 and m.value("ei_engine_role", role="decode") == 0
    assert m.value("ei_engine_prompt_tokens_total") == 0  # zeros exported from the start
    m.observe(RequestStarted(ts=1.0, src="n1", request="r", node="n1", phase="prefill", cached_tokens=256),
              prompt_tokens=300)
    m.observe(RequestStarted(ts=1.0, src="n1", request="r", node="n2", phase="decode"))  # another node's
    m.observe(IterationDone(ts=1.1, src="n1", node="n1", phase="prefill", duration_s=0.25))
    m.observe(IterationDone(ts=1.2, src="n1", node="n1", phase="decode", duration_s=0.5))
    m.observe(RequestFinished(ts=2.0, src="n1", request="r", node="n1", output_tokens=9))
    m.observe(RequestFinished(ts=2.0, src="n1", request="q", node="n1", error="boom"))
    m.observe(NodeHeartbeat(ts=2.0, src="n1", node="n1", role="prefill"))
    assert m.value("ei_engine_prompt_tokens_total") == 300 and m.value("ei_engine_cached_tokens_total") == 256
    assert m.value("ei_engine_requests_started_total", phase="prefill") == 1
    assert m.value("ei_engine_requests_started_total", phase="decode") == 0
    assert m.value("ei_engine_iterations_total", phase="decode") == 1
    assert m.value("ei_engine_iteration_seconds_total", phase="prefill") == 0.25
    assert m.value("ei_engine_requests_finished_total", status="ok") == 1
    assert m.value("ei_engine_requests_finished_total", status="error") == 1
    assert m.value("ei_engine_generation_tokens_total") == 9
    assert m.value("ei_engine_events_total", type="NodeHeartbeat") == 1
    load[0] = NodeLoad(role="decode", running=2, queued=0, l1_used_tokens=0, l2_used_tokens=0)  # read when scraped
    assert m.value("ei_engine_num_queue_reqs") == 0 and m.value("ei_engine_role", role="decode") == 1
    assert b'ei_engine_num_running_reqs{node="n1"} 2.0' in m.exposition()
