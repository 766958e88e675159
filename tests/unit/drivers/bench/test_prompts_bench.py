"""``evolving bench prompts`` on a real nats-server, tiny: every way round-trips the ids (the bench
asserts it) and the bytes it reports are the codec's and the stream's (no timing is checked)."""

from __future__ import annotations

from services.drivers.bench.prompts import WAYS, format_report, run


def test_the_bench_measures_every_way_and_counts_the_bytes():
    res = run([300], requests=3, vocab=151_936)
    rows = res["sizes"]["300"]
    assert rows["requests"] == 3 and set(WAYS) <= set(rows)
    for way in ("KV bucket (file)", "KV bucket (memory)", "object store"):
        assert rows[way]["stored_bytes_per_request"] == 12 + 4 * 300  # header + 4-byte ids
        assert rows[way]["event_log_bytes_per_request"] == rows["event only"]["event_log_bytes_per_request"]
    grown = rows["ids in the event"]["event_log_bytes_per_request"] - rows["event only"]["event_log_bytes_per_request"]
    assert grown == 12 + 4 * 300  # the ids ride in the event: the log keeps them
    assert rows["event only"]["ratio_vs_event_only"] == 1.0
    assert "KV bucket (file)" in format_report(res)
