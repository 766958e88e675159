"""The recorder's memory and size tools: the heap trim after appends, the recorder-only RSS
bench (services/drivers/recorder/rss.py) and the per-format log size (logsize.py)."""

from __future__ import annotations

import asyncio
import random

from events.catalog import KvEvicted, RequestSubmitted, Tick
from services.adapters.bus import InMemoryBus
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder import logsize, rss, service


def _log(path, n_prompts=30):
    """Prompts of growing chains and evictions of a scattered half of them (a simulated run's shape)."""
    rng = random.Random(5)
    chain: list[int] = []
    evs = []
    for i in range(n_prompts):
        chain = chain + [rng.getrandbits(64) for _ in range(40)]
        evs.append(RequestSubmitted(ts=float(i), request=f"r{i}", branch="b", blocks=list(chain)))
        if i % 3 == 2:
            evs.append(KvEvicted(ts=i + 0.5, node="n1", tier="L1", blocks=sorted(rng.sample(chain, len(chain) // 2))))
    log = DuckDbEventLog(path)
    log.append([(k + 1, "ei.default.x", e) for k, e in enumerate(evs)])
    log.close()
    return evs


def test_logsize_appends_the_same_events_per_format_and_format_3_stores_evictions_smaller(tmp_path):
    evs = _log(tmp_path / "run.duckdb")
    r = logsize.run(str(tmp_path / "run.duckdb"), ("2", "3"), with_columns=True, keep=str(tmp_path))
    assert r["events"] == len(evs) and r["simulated_s"] == evs[-1].ts
    v2, v3 = r["formats"]["2"], r["formats"]["3"]
    assert v3["columns"]["event_rows"]["block_starts"] < v2["columns"]["event_rows"]["block_starts"] / 4
    assert "bitmap_bits" in v3["columns"]["event_rows"] and "bitmap_bits" not in v2["columns"]["event_rows"]
    for fmt in ("2", "3"):  # the files it wrote hold the events, equal
        ro = DuckDbEventLog(tmp_path / f"format{fmt}.duckdb", read_only=True)
        assert [e for _, _, e in ro.read()] == evs
        ro.close()


def test_the_rss_bench_cycles_the_log_with_new_hashes_and_reports_the_second_half_slope(tmp_path):
    _log(tmp_path / "run.duckdb", n_prompts=12)
    out = tmp_path / "rss.duckdb"
    r = rss.run(str(tmp_path / "run.duckdb"), rows=80, batch=7, sample_rows=10, out=str(out))
    assert r["rows"] == 80 and r["source_events"] == 16 and len(r["samples"]) >= 8
    assert r["samples"][-1]["dict_mb"] == r["samples"][0]["dict_mb"] > 0  # bounded: allocated once
    assert isinstance(r["slope_mb_per_100k_rows"], float)
    ro = DuckDbEventLog(out, read_only=True)
    rows = list(ro.read())
    (distinct,) = ro.con.execute("SELECT count(DISTINCT hash) FROM block_dict").fetchone()
    ro.close()
    assert [s for s, _, _ in rows] == list(range(1, 81))
    # 5 cycles of the 16 events: each cycle's hashes are its own (XOR of the cycle), reused within it
    assert distinct == 480 * 5 and rows[16][2].blocks[0] != rows[0][2].blocks[0]


def test_release_free_heap_trims_glibc_and_run_recorder_calls_it_at_most_every_interval(tmp_path, monkeypatch):
    assert service.release_free_heap() is True  # glibc here (Linux CI and the dev machines)
    calls = []
    monkeypatch.setattr(service, "release_free_heap", lambda: calls.append(1) or True)

    async def go(interval):
        bus = InMemoryBus()
        await bus.publish_many([Tick(ts=float(i)) for i in range(1, 41)])
        log = DuckDbEventLog(tmp_path / f"run{interval}.duckdb")
        stop = asyncio.Event()
        task = asyncio.create_task(run_recorder_until(bus, log, stop, interval))
        while log.last_seq() < 40:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        log.close()

    async def run_recorder_until(bus, log, stop, interval):
        return await service.run_recorder(bus, log, max_batch=4, flush_interval_s=0.01, stop=stop,
                                          trim_interval_s=interval)

    asyncio.run(go(0.0))
    assert len(calls) >= 10  # every append (10 batches of 4)
    calls.clear()
    asyncio.run(go(None))
    assert calls == []
