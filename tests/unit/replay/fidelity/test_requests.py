"""Per-request TTFT split (replay/fidelity/requests.py): requests matched across the two logs'
naming, queue wait and service apart, ratios only where both sides spent time."""

from events.catalog import FirstToken, RequestStarted, RequestSubmitted
from replay.fidelity.requests import format_split, request_times, split_ratios


def _req(rid: str, branch: str, sub: float, start: float, first: float) -> list:
    return [RequestSubmitted(ts=sub, src="gw", request=rid, branch=branch, prompt_tokens=64, blocks=[]),
            RequestStarted(ts=start, src="n0", request=rid, node="n0", phase="prefill"),
            FirstToken(ts=first, src="n0", request=rid, node="n0")]


def test_requests_are_matched_by_branch_and_turn_and_split_into_queue_and_service():
    live = [*_req("fid-static:1P1D-2:trace_1/main/ab-3", "fid-static:1P1D-2:trace_1/main", 100.0, 100.0, 104.0),
            *_req("fid-static:1P1D-3:trace_2/main/ab-4", "fid-static:1P1D-3:trace_2/main", 100.0, 104.0, 106.0),
            *_req("fid-static:1P1D-2:trace_1/main/ab-7", "fid-static:1P1D-2:trace_1/main", 110.0, 110.01, 110.5)]
    # the simulator names them by agent, submits them in another order, and ran turn 1's prefill 2x longer
    sim = [*_req("a1:trace_2/main/0", "a1:trace_2/main", 0.0, 6.0, 8.0),
           *_req("a0:trace_1/main/0", "a0:trace_1/main", 0.0, 0.0, 6.0),
           *_req("a0:trace_1/main/1", "a0:trace_1/main", 9.0, 9.0, 10.0)]
    lt, st = request_times(live), request_times(sim)
    assert sorted(lt) == sorted(st) == ["trace_1/main#0", "trace_1/main#1", "trace_2/main#0"]
    assert (lt["trace_2/main#0"].queue_s, lt["trace_2/main#0"].service_s) == (4.0, 2.0)
    assert st["trace_1/main#1"].ttft_s == 1.0 and lt["trace_1/main#1"].ttft_s == 0.5
    sp = split_ratios(lt, st)
    assert sp["matched"] == 3 and sp["live_only"] == sp["sim_only"] == 0
    # service: 6/4, 2/2, 1/0.49 -> median 1.5; queue: only trace_2 waited on both sides (6/4), the
    # 0.01 s live wait of trace_1#1 is under the floor
    assert sp["service_s"]["median_ratio"] == 1.5 and sp["service_s"]["counted"] == 3
    assert sp["queue_s"] == {"median_ratio": 1.5, "counted": 1, "live_total_s": 4.01, "sim_total_s": 6.0}
    assert sp["ttft_s"]["live_total_s"] == 10.5 and sp["ttft_s"]["sim_total_s"] == 15.0
    assert "queue 1.50x (n=1" in format_split("static:1P1D", sp)


def test_a_request_without_a_first_token_is_left_out_but_keeps_its_turn_number():
    live = [*_req("x-0:t/main/1", "x-0:t/main", 0.0, 0.0, 1.0), *_req("x-0:t/main/2", "x-0:t/main", 2.0, 2.0, 3.0)]
    live = [e for e in live if not (isinstance(e, FirstToken) and e.request == "x-0:t/main/1")]
    lt = request_times(live)
    assert list(lt) == ["t/main#1"]
    sp = split_ratios(lt, {})
    assert sp["matched"] == 0 and sp["live_only"] == 1 and sp["ttft_s"]["median_ratio"] is None
