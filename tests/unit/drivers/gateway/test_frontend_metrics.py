"""The gateway's frontend metrics (``ei_frontend_*``, services/drivers/gateway/metrics.py):
Dynamo's buckets, and what one request observes, read back from the prometheus_client registry."""

from __future__ import annotations

from services.drivers.gateway.metrics import BUCKETS, GatewayMetrics, RequestObserver, log_buckets

# Dynamo's documented default buckets (metrics catalog, frontend histograms; +Inf implied)
DYNAMO = {
    "request_duration_seconds": (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 130.0, 260.0, 510.0),
    "time_to_first_token_seconds": (0.0, 0.0022, 0.0047, 0.01, 0.022, 0.047, 0.1, 0.22, 0.47, 1.0, 2.2, 4.7,
                                    10.0, 22.0, 48.0, 100.0, 220.0, 480.0),
    "inter_token_latency_seconds": (0.0, 0.0019, 0.0035, 0.0067, 0.013, 0.024, 0.045, 0.084, 0.16, 0.3, 0.56,
                                    1.1, 2.0),
    "input_sequence_tokens": (0.0, 100.0, 210.0, 430.0, 870.0, 1800.0, 3600.0, 7400.0, 15000.0, 31000.0,
                              63000.0, 130000.0),
    "output_sequence_tokens": (0.0, 100.0, 210.0, 430.0, 880.0, 1800.0, 3700.0, 7600.0, 16000.0, 32000.0),
}


def test_buckets_are_dynamos():
    for name, bounds in DYNAMO.items():
        assert BUCKETS[name] == bounds, name
    assert BUCKETS["cached_tokens"] == BUCKETS["input_sequence_tokens"]
    assert log_buckets(1.0, 1.001, 5) == (0.0, 1.0)  # duplicates after rounding are dropped


def _metrics() -> GatewayMetrics:
    return GatewayMetrics(lambda: 0, lambda: 0)


def _v(m: GatewayMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, {"model": "m", **labels}) or 0.0


def test_one_streamed_request():
    m, t = _metrics(), [10.0]
    obs = RequestObserver(m, "m", "chat_completions", True, clock=lambda: t[0])
    assert _v(m, "ei_frontend_queued_requests") == 1 and _v(m, "ei_frontend_inflight_requests") == 1
    t[0] = 10.5
    obs.tokens(1, prompt_tokens=300, cached_tokens=128)
    assert _v(m, "ei_frontend_queued_requests") == 0 and _v(m, "ei_frontend_inflight_requests") == 1
    assert _v(m, "ei_frontend_time_to_first_token_seconds_sum") == 0.5
    assert _v(m, "ei_frontend_time_to_first_token_seconds_bucket", le="0.47") == 0
    assert _v(m, "ei_frontend_time_to_first_token_seconds_bucket", le="1.0") == 1
    assert _v(m, "ei_frontend_input_sequence_tokens_sum") == 300
    assert _v(m, "ei_frontend_cached_tokens_sum") == 128 and _v(m, "ei_frontend_cached_tokens_count") == 1
    t[0] = 10.7
    obs.tokens(4)  # four tokens 0.2 s after the first: four ITL samples of 0.05 s
    assert _v(m, "ei_frontend_inter_token_latency_seconds_count") == 4
    assert abs(_v(m, "ei_frontend_inter_token_latency_seconds_sum") - 0.2) < 1e-9
    obs.tokens(0)  # nothing new: nothing observed
    t[0] = 12.0
    obs.finish(True)
    obs.finish(True)  # once only
    assert _v(m, "ei_frontend_inflight_requests") == 0
    assert _v(m, "ei_frontend_request_duration_seconds_sum") == 2.0
    assert _v(m, "ei_frontend_output_sequence_tokens_sum") == 5
    assert _v(m, "ei_frontend_output_tokens_total") == 5
    assert _v(m, "ei_frontend_input_tokens_total") == 300 and _v(m, "ei_frontend_cached_input_tokens_total") == 128
    assert _v(m, "ei_frontend_requests_total", endpoint="chat_completions", request_type="stream",
              status="success") == 1


def test_failures_count_as_errors_and_observe_no_duration():
    m = _metrics()
    obs = m.request("m", "completions", False)
    obs.finish(False)  # failed before any token (a 503 route timeout)
    assert _v(m, "ei_frontend_queued_requests") == 0 and _v(m, "ei_frontend_inflight_requests") == 0
    obs2 = m.request("m", "anthropic_messages", True)
    obs2.tokens(1, 10, 0)
    obs2.fail()  # an engine error inside the stream: the handler still returns normally
    obs2.finish(True)
    for ep, rt in (("completions", "unary"), ("anthropic_messages", "stream")):
        assert _v(m, "ei_frontend_requests_total", endpoint=ep, request_type=rt, status="error") == 1
    assert _v(m, "ei_frontend_request_duration_seconds_count") == 0
    assert _v(m, "ei_frontend_time_to_first_token_seconds_count") == 1
    # the existing names keep working next to the new ones
    assert b"ei_gateway_in_flight_requests" in m.exposition() and b"ei_frontend_requests_total" in m.exposition()
