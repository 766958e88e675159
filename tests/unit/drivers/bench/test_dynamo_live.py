"""``evolving bench dynamo --live`` without Dynamo (services/drivers/bench/dynamo_live.py): the profile
file ``evolving up`` reads is the equalised engine, the CPU meter reads real processes by role, the
figures of a drive report. The live run itself: tests/dynamo/test_dynamo_side_by_side.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.profiles import load_profile
from services.drivers.bench.dynamo_live import (
    CpuMeter,
    equalised_profile_toml,
    process_tree,
    role_of,
    trace_figures,
)
from services.drivers.bench.dynamo_model import equalised_profile
from services.drivers.gateway.drive import DriveReport, RequestResult


@pytest.mark.parametrize("name", ["gb300-glm52-pressure", "gb300-glm52"])
def test_profile_file_is_the_equalised_profile(tmp_path: Path, name: str) -> None:
    got = load_profile(str(equalised_profile_toml(name, tmp_path / "p.toml")))
    assert got == equalised_profile(load_profile(name))
    assert got.c2 == got.c3 == got.prefill_noise == got.decode_noise == 0.0 and got.c1 > 0


def test_cpu_meter_counts_a_busy_child_by_role(tmp_path: Path) -> None:
    # a child that burns ~0.3 s of CPU, named like a service of ours by its command line
    script = tmp_path / "burn.py"
    script.write_text("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
                      "time.sleep(30)\n")
    p = subprocess.Popen([sys.executable, str(script), "services.drivers.serve", "recorder"])
    try:
        meter = CpuMeter([os.getpid()])
        assert p.pid in meter.pids and meter.roles[p.pid] == "recorder"
        meter.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with open(f"/proc/{p.pid}/stat") as f:  # utime + stime: what process_time counts
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[11]) + int(fields[12]) >= 0.3 * os.sysconf("SC_CLK_TCK") - 1:
                break
            time.sleep(0.05)
        used = meter.stop()
        assert used["recorder"] <= 0.4 and used["recorder"] + meter.t0[p.pid] >= 0.28
    finally:
        p.kill()
        p.wait()
    assert p.pid not in process_tree([os.getpid()])


def test_roles_from_command_lines(tmp_path: Path) -> None:
    assert role_of(os.getpid()) in ("other", "up")  # pytest itself
    assert role_of(2 ** 22 + 12345) == "gone"


def test_trace_figures() -> None:
    rep = DriveReport(sessions=1, wall_s=10.0, results=[
        RequestResult("s", "b", "r1", 200, 1000, output_tokens=10, cached_tokens=0, ttft_s=0.5, latency_s=1.0),
        RequestResult("s", "b", "r2", 200, 3000, output_tokens=10, cached_tokens=2000, ttft_s=0.1, latency_s=2.0),
        RequestResult("s", "b", "r3", 502, 10, error="HTTP 502"),
    ])
    f = trace_figures(rep, {"engines": 0.3, "gateway": 0.1})
    assert f["requests"] == 2 and f["errors"] == 1 and f["throughput_rps"] == pytest.approx(0.2)
    assert f["kv_hit"] == pytest.approx(0.5) and f["e2e_mean_s"] == pytest.approx(1.5)
    assert f["ttft_p50_s"] == pytest.approx(0.3)
    assert f["cpu_ms_per_request"] == pytest.approx(200.0) and f["cpu_ms_per_request.engines"] == pytest.approx(150.0)
