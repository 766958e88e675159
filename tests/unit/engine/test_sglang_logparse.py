"""Decode iteration timing from SGLang's scheduler log line (engine/backends/sglang/logparse.py)."""

from __future__ import annotations

import pytest

from engine.backends.sglang.logparse import DecodeStat, parse_decode_line

# the shape metrics_reporter.py writes (0.5.23), with and without the optional parts
PLAIN = ("[2026-12-01 10:00:00 TP0] Decode batch, #running-req: 12, #token: 40960, token usage: 0.05, "
         "cuda graph: True, gen throughput (token/s): 1200.00, #queue-req: 3")
SPEC = ("[2026-12-01 10:00:00 DP1 TP4] Decode batch [812], #running-req: 8, #token: 9000, token usage: 0.01, "
        "accept len: 2.50, accept rate: 0.75, pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 1, "
        "#retracted-req: 0, cuda graph: True, gen throughput (token/s): 400.00, #queue-req: 0, "
        "est. decode TFLOPS/s (per GPU): 1.00")


@pytest.mark.parametrize(("line", "stat", "it_s"), [
    (PLAIN, DecodeStat(running=12, throughput_tps=1200.0, queued=3), 0.01),
    (SPEC, DecodeStat(running=8, throughput_tps=400.0, queued=0, accept_len=2.5), 0.05),
])
def test_decode_lines(line, stat, it_s):
    got = parse_decode_line(line)
    assert got == stat and got.iteration_s() == pytest.approx(it_s)


def test_other_lines_and_idle_intervals():
    assert parse_decode_line("[2026-12-01 10:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 64") is None
    idle = parse_decode_line(PLAIN.replace("1200.00", "0.00"))
    assert idle is not None and idle.iteration_s() is None
