"""``evolving bench gateway``'s bookkeeping (pure): the conversations it sends, and the per-request
split and paired overhead it computes from the observed arrival times."""

from __future__ import annotations

import argparse

from services.drivers.bench.gateway import (
    Bench,
    Client,
    GatewayBenchSpec,
    Sample,
    _row,
    add_arguments,
    format_report,
)


def test_a_client_extends_its_branch_then_starts_a_new_one():
    c = Client("c", turns=3, first=100, per_turn=10)
    seen = [c.next() for _ in range(4)]
    assert [(b, new) for b, _, new in seen] == [("c.1", True), ("c.1", False), ("c.1", False), ("c.2", True)]
    m1, m2, m3 = seen[0][1], seen[1][1], seen[2][1]
    assert m2[:1] == m1 and m3[:3] == m2 and len(m3) == 5  # each turn's prompt extends the last one
    assert len(m1[0]["content"]) == 100 and len(m2[2]["content"]) == 10
    assert seen[3][1][0]["content"] != m1[0]["content"]  # a new branch: a new prompt


def test_the_split_sums_to_the_ttft_and_the_overhead_excludes_the_engine(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    b = Bench(GatewayBenchSpec(**vars(p.parse_args([]))), tmp_path)  # the flags' defaults are the spec's
    samples = []
    for i in range(10):  # full path: in 1 ms, router 2 ms, engine 20 + i ms, out 0.5 ms
        t0 = 100.0 + i
        rid = f"g{i}"
        b.obs.sub[rid], b.obs.route[rid], b.obs.tok[rid] = t0 + 0.001, t0 + 0.003, t0 + 0.023 + i / 1e3
        samples.append(Sample("gateway", 4, 23.5 + i, rid, t0))
        rid = f"a{i}"  # engine alone: publish 0.2 ms, engine 20 + i ms
        b.obs.route[rid], b.obs.tok[rid] = t0 + 0.0002, t0 + 0.0202 + i / 1e3
        samples.append(Sample("engine", 4, 20.2 + i, rid, t0))
    b.cpu[4] = {"gateway": 0.03, "router": 0.02}
    row = _row(b, 4, samples)
    assert abs(row["paired_overhead_ms"]["p50"] - 3.5) < 1e-6 and abs(row["paired_overhead_ms"]["p99"] - 3.5) < 1e-6
    sp = row["split_ms"]
    assert [round(sp[k]["p50"], 3) for k in ("gateway_in", "router", "gateway_out")] == [1.0, 2.0, 0.5]
    assert abs(row["difference_ms"]["p50"] - 3.3) < 1e-6
    assert row["gateway_cpu_ms_per_request"] == 3.0 and row["router_cpu_ms_per_request"] == 2.0
    assert row["engine_alone_ttft_ms"]["n"] == row["full_path_ttft_ms"]["n"] == 10
    r = {"engine": "sim", "model": "sim", "prompt_tokens": 1, "turn_tokens": 1, "max_tokens": 1, "requests_per_path": 10,
         "load_avg": [1, 1, 1], "cpus": 2, "rows": [row], "target_p99_ms": 10.0, "worst_paired_p99_ms": 3.5,
         "meets_target": True, "n_errors": 0}
    assert "paired overhead" in format_report(r) and "met" in format_report(r)


def test_process_cpu_is_read_finer_than_a_clock_tick():
    """CI read 0.0 ms of gateway CPU for a 4-request phase: /proc/PID/stat counts in 10 ms ticks.
    The threads' schedstat nanoseconds see 2 ms of work. The process read is a child that spins
    2 ms between two lines on its stdin: its one thread lives through both readings, as the
    gateway's and router's do (the pytest worker's own threads may exit between two readings and
    take their time with them, which once read -8.5 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from services.drivers.bench.gateway import _proc_cpu_s

    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel has no /proc/PID/task/TID/schedstat: the tick count is all there is")
    spin = ("import sys, time\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "t = time.process_time()\n"
            "while time.process_time() - t < 0.002:\n"
            "    pass\n"
            "print('done', flush=True)\n"
            "sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-S", "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        c0 = _proc_cpu_s(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        used = _proc_cpu_s(child.pid) - c0
        child.stdin.write("end\n")
        child.stdin.flush()
        child.wait(timeout=30)
    finally:
        child.kill()
    assert 0.0015 < used < 1.0, used
    assert _proc_cpu_s(2**22 + 12345) != _proc_cpu_s(2**22 + 12345)  # no such process: NaN
