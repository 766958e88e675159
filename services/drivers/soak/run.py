"""The soak run: start (or attach to) the stack, load it for ``duration_s`` while sampling every
process, then account for every request and event, verify the log and judge growth."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.adapters.logging import get_logger
from services.drivers.soak.live_up import LiveUp, LiveUpError, check_log, soak_profile, verify
from services.drivers.soak.load import Load, LoadConfig
from services.drivers.soak.procs import Sampler
from services.drivers.soak.stats import Flatness, flat, intervals, nearest_rank, poisson_floor, verdict

log = get_logger("soak")


@dataclass(frozen=True)
class Limits:
    """What counts as flat over the second half of the run (docs/chaos.md, "Soak", says why)."""

    rss_mb_per_min: float = 1.0
    fds_per_min: float = 0.5
    latency_p50_per_min: float = 0.05  # a fraction of the second half's median, per minute
    latency_p99_per_min: float = 0.10
    latency_floor_s_per_min: float = 0.002  # a relative limit never below this (tiny latencies)
    min_span_s: float = 60.0  # a second half shorter than this is reported, not judged


@dataclass
class SoakConfig:
    duration_s: float
    load: LoadConfig
    run_dir: Path
    engines: int = 4
    up_args: list[str] = field(default_factory=list)
    profile: str = "gb300-glm52"  # the engines' profile, with its KV tiers shrunk to kv_capacity_tokens
    kv_capacity_tokens: int = 131_072  # GPU KV per node (host: twice); 0: the profile's own
    ready_file: Path | None = None  # attach to this running `evolving up`
    interval_s: float | None = None  # None: duration / 60, at least 1 s
    sample_s: float | None = None  # None: duration / 120, between 1 and 5 s
    limits: Limits = field(default_factory=Limits)
    verify: bool = True

    def interval(self) -> float:
        return self.interval_s or max(1.0, self.duration_s / 60)

    def sample(self) -> float:
        return self.sample_s or min(5.0, max(1.0, self.duration_s / 120))


@dataclass
class Live:
    """What the progress display shows, updated while the load runs."""

    elapsed_s: float = 0.0
    duration_s: float = 0.0
    phase: str = "starting the stack"
    load: Load | None = None
    sampler: Sampler | None = None
    last: dict[str, Any] = field(default_factory=dict)  # the latest full interval


def growth(sampler: Sampler, rows, interval_s: float, duration_s: float, limits: Limits) -> list[Flatness]:
    """The flatness of every process's RSS and fds and of the latency percentiles."""
    judged = duration_s / 2 >= limits.min_span_s
    out: list[Flatness] = []
    for name, s in sorted(sampler.series.items()):
        client = name == "soak"  # the client keeps every outcome for the final percentiles: shown only
        # anonymous RSS: file-backed pages (shared libraries) are dropped and read back by the
        # kernel at will (every process lost ~20 % of its RSS at once in a trial), a leak is anonymous
        for what, ys, lim, unit in (("anon", [r / 1e6 for r in s.anon_bytes], limits.rss_mb_per_min, "MB/min"),
                                    ("fds", s.fds, limits.fds_per_min, "fds/min")):
            f = flat(f"{what} {name}", s.t_s, ys, limit=lim, unit=unit)
            f.judged = f.judged and judged and not client
            out.append(f)
    mids = [r.start_s + interval_s / 2 for r in rows]
    for key, lim in (("ttft_p50_s", limits.latency_p50_per_min), ("ttft_p99_s", limits.latency_p99_per_min),
                     ("e2e_p50_s", limits.latency_p50_per_min), ("e2e_p99_s", limits.latency_p99_per_min)):
        f = flat(key.removesuffix("_s").replace("_", " "), mids, [getattr(r, key) for r in rows], limit=lim,
                 unit="s/min", relative=True, floor=limits.latency_floor_s_per_min)
        f.judged = f.judged and judged
        out.append(f)
    return out


async def run_soak(cfg: SoakConfig, live: Live | None = None,
                   on_update: Callable[[Live], None] | None = None) -> dict[str, Any]:
    """The whole soak; the report (``ok`` and ``reasons`` say whether it passed)."""
    live = live or Live()
    live.duration_s = cfg.duration_s
    up_args = list(cfg.up_args)
    if cfg.ready_file is None and cfg.kv_capacity_tokens > 0:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        up_args += ["--profile", str(soak_profile(cfg.profile, cfg.kv_capacity_tokens, cfg.run_dir / "profile.toml"))]
    elif cfg.ready_file is None:
        up_args += ["--profile", cfg.profile]
    stack = LiveUp(run_dir=cfg.run_dir, engines=cfg.engines, up_args=up_args, ready_file=cfg.ready_file)
    report: dict[str, Any] = {"config": _config(cfg)}

    def tick(phase: str | None = None) -> None:
        if phase:
            live.phase = phase
            log.info("soak_phase", phase=phase)
        if on_update:
            on_update(live)

    try:
        tick("starting the stack" if not stack.attached else "attaching")
        t_start = time.monotonic()
        await stack.start()
        report["stack"] = {"attached": stack.attached, "gateway": stack.gateway, "db": str(stack.db),
                           "run_dir": str(cfg.run_dir), "partition": stack.partition,
                           "start_s": round(time.monotonic() - t_start, 1)}
        load = Load(LoadConfig(**{**cfg.load.__dict__, "gateway": stack.gateway}))
        sampler = Sampler(stack.root_pid(), extra=stack.pids() if stack.attached else None)
        live.load, live.sampler = load, sampler
        tick("loading")
        t0 = time.monotonic()
        task = asyncio.create_task(load.run(cfg.duration_s, t0))
        next_sample, interval = 0.0, cfg.interval()
        reported = 0
        while not task.done():
            now = time.monotonic() - t0
            live.elapsed_s = min(now, cfg.duration_s)
            if now >= next_sample:
                await asyncio.to_thread(sampler.sample, now)
                next_sample += cfg.sample()
            done = int(min(now, cfg.duration_s) // interval)
            if done > reported:  # an interval has ended: show it (its late answers may still come)
                rows = intervals(load.outcomes, interval, (done) * interval)
                live.last = rows[-1].to_dict()
                reported = done
                log.debug("soak_interval", **live.last)
            tick()
            await asyncio.wait({task}, timeout=0.5)
        task.result()
        await asyncio.to_thread(sampler.sample, time.monotonic() - t0)
        load_s = time.monotonic() - t0

        tick("reading the stream")
        await asyncio.sleep(1.0)  # the last RequestFinished may follow its `done` token by a moment
        state = await stack.stream_state()
        if not stack.attached:
            tick("stopping the stack (the recorder drains to the head)")
            report["stack"]["up_rc"] = await stack.stop()
        tick("checking the log")
        path = await stack.log_for_check(state.head)
        recorded, requests, by_type = await asyncio.to_thread(check_log, path, state, load.cfg.run_id)
        vres = None
        if cfg.verify:
            tick("verify (refolding the log through fresh cores)")
            vres = await asyncio.to_thread(verify, path)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(stack.kill)

    rows = intervals(load.outcomes, interval, cfg.duration_s, list(load.in_flight.values()))
    flats = growth(sampler, rows, interval, cfg.duration_s, cfg.limits)
    sent = len(load.outcomes) + len(load.in_flight)
    answered = sum(o.ok for o in load.outcomes)
    failed = len(load.outcomes) - answered
    v = verdict(sent=sent, answered=answered, failed=failed, expected_arrivals=cfg.load.rate * cfg.duration_s,
                recorded=recorded, verify_ok=None if vres is None else bool(vres.get("ok")), flatness=flats,
                restarts=sampler.restarts())
    if requests["submitted"] != sent or requests["decided_once"] != requests["submitted"]:
        v.reasons.append(f"log: {requests['submitted']} soak requests submitted for {sent} sent, "
                         f"{requests['decided_once']} decided once, {requests['undecided']} undecided, "
                         f"{requests['decided_twice']} decided twice")
    if requests["finished_ok"] < answered:
        v.reasons.append(f"log: {requests['finished_ok']} RequestFinished for {answered} answered requests")
    branch_end_errors = sum(n for k, n in load.errors.items() if k.startswith("branch-end"))
    if branch_end_errors:
        v.reasons.append(f"{branch_end_errors} branch-end request(s) failed")
    if not stack.attached and report["stack"].get("up_rc") != 0:
        v.reasons.append(f"evolving up exited {report['stack'].get('up_rc')} when stopped")
    good = [o for o in load.outcomes if o.ok]
    report.update({
        "ok": v.ok, "reasons": v.reasons,
        "totals": {"arrivals": load.arrivals, "expected_arrivals": round(cfg.load.rate * cfg.duration_s, 1),
                   "poisson_floor": round(poisson_floor(cfg.load.rate * cfg.duration_s), 1),
                   "sent": sent, "answered": answered, "failed": failed, "in_flight_at_end": len(load.in_flight),
                   "backlog_at_end": len(load.backlog), "branch_end_requests": load.branch_end_requests,
                   "load_s": round(load_s, 1), "achieved_rate": round(sent / cfg.duration_s, 3),
                   "errors": dict(load.errors.most_common(8)),
                   "ttft_p50_s": _r(nearest_rank([o.ttft_s for o in good if o.ttft_s is not None], 0.5)),
                   "ttft_p99_s": _r(nearest_rank([o.ttft_s for o in good if o.ttft_s is not None], 0.99)),
                   "e2e_p50_s": _r(nearest_rank([o.e2e_s for o in good], 0.5)),
                   "e2e_p99_s": _r(nearest_rank([o.e2e_s for o in good], 0.99)),
                   "wait_p99_s": _r(nearest_rank([o.wait_s for o in load.outcomes], 0.99))},
        "recorded": recorded.to_dict(), "requests_on_log": requests, "events_by_type": by_type, "verify": vres,
        "flatness": [f.to_dict() for f in flats], "intervals": [r.to_dict() for r in rows],
        "processes": {n: s.to_dict() for n, s in sorted(sampler.series.items())},
        "machine": sampler.machine_dict(),
    })
    m = report["machine"]
    if m["t_s"]:
        report["totals"]["machine_busy_cores"] = round(sum(m["busy_cores"]) / len(m["t_s"]), 2)
        report["totals"]["other_busy_cores"] = round(sum(m["other_cores"]) / len(m["t_s"]), 2)
        report["totals"]["cores"] = os.cpu_count()
    return report


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def _config(cfg: SoakConfig) -> dict[str, Any]:
    return {"duration_s": cfg.duration_s, "rate": cfg.load.rate, "streams": cfg.load.streams,
            "turns": cfg.load.turns, "fork_every": cfg.load.fork_every, "system_tokens": cfg.load.system_tokens,
            "user_tokens": cfg.load.user_tokens, "max_tokens": cfg.load.max_tokens, "seed": cfg.load.seed,
            "engines": cfg.engines, "up_args": cfg.up_args, "profile": cfg.profile,
            "kv_capacity_tokens": cfg.kv_capacity_tokens, "interval_s": cfg.interval(), "sample_s": cfg.sample(),
            "attach": str(cfg.ready_file) if cfg.ready_file else None, "limits": cfg.limits.__dict__}


def parse_duration(raw: str) -> float:
    """``90``, ``90s``, ``10m``, ``1h``, ``1.5m`` -> seconds (> 0)."""
    text = raw.strip().lower()
    mult = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(text[-1:], None)
    num = text[:-1] if mult else text
    try:
        val = float(num) * (mult or 1.0)
    except ValueError:
        raise ValueError(f"--duration {raw!r}: use seconds or a number with s, m or h (e.g. 10m)") from None
    if not math.isfinite(val) or val <= 0:
        raise ValueError(f"--duration {raw!r} must be > 0")
    return val


__all__ = ["Limits", "Live", "LiveUpError", "SoakConfig", "parse_duration", "run_soak"]
