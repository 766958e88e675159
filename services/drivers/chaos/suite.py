"""The run: start the stack, run the scenarios one after the other under load, stop
everything, verify the recorder's log and account for every event."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.adapters.eventlog import DuckDbEventLog
from services.adapters.logging import get_logger
from services.drivers.chaos.accounting import ChaosReport, ScenarioResult, account, finished_requests
from services.drivers.chaos.progress import Progress
from services.drivers.chaos.scenarios import Scenario, recover, scenarios
from services.drivers.chaos.supervisor import ChaosCluster
from services.drivers.chaos.torch_model import torch_missing
from services.drivers.chaos.vllm_engines import vllm_missing
from services.drivers.recorder.verify import verify_log
from services.drivers.up.testing import acting_route_counts

log = get_logger("chaos")


def select(known: list[Scenario], *, quick: bool = False, only: list[str] | None = None,
           engines: bool = False, backend: str = "sim") -> list[Scenario]:
    """The scenarios a run plays: ``only`` (each must exist, and an engines-only one needs
    ``engines``), else the quick ones or all, without the engines-only ones unless ``engines``.
    ``quick`` with ``engines`` is the engine faults' own short form (``engine_quick``: the
    worker killed mid-prefill and mid-decode, the partitioned worker, the cut transfer, the
    restarted gateway), without it the services' and the bus's (``quick``). With the ``vllm``
    backend the run is the vLLM faults (``vllm``: a worker killed mid-decode, its server killed
    mid-decode, its KV-event socket cut), quick or not; a vLLM-only one needs that backend."""
    vllm = engines and backend == "vllm"
    if only:
        unknown = set(only) - {s.name for s in known}
        if unknown:
            raise ValueError(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(s.name for s in known)}")
        need = sorted(s.name for s in known if s.name in only and s.engines_only and not engines)
        if need:
            raise ValueError(f"scenario(s) {', '.join(need)} kill engine workers: run them with --engines")
        need = sorted(s.name for s in known if s.name in only and s.vllm_only and not vllm)
        if need:
            raise ValueError(f"scenario(s) {', '.join(need)} hit vLLM servers: run them with --engines vllm")
        return [s for s in known if s.name in only]
    if vllm:
        return [s for s in known if s.vllm]
    return [s for s in known if (not quick or (s.engine_quick if engines else s.quick))
            and (engines or not s.engines_only) and not s.vllm_only]


async def serve_a_while(stack: ChaosCluster, dwell_s: float, cap_s: float = 60.0) -> None:
    """Keep the load on the (recovered) stack until the requests of ``dwell_s`` seconds of it,
    published from now on, are decided: on a busy machine that takes longer than ``dwell_s``
    (the load generator and the router run late), and a fixed sleep would leave the window
    nearly empty. Bounded by ``cap_s`` (not a failure: the table's columns say what was lost)."""
    want = max(1, round(stack.rate * dwell_s))
    t, since = time.monotonic(), len(stack.tail.deliveries)

    async def served() -> bool:
        return stack.tail.decided_after(stack.load.published, t, since) >= want

    with contextlib.suppress(TimeoutError):
        await stack.wait(served, cap_s, f"{want} requests decided", every_s=0.2)


async def run_chaos(*, quick: bool = False, only: list[str] | None = None, workdir: Path | None = None,
                    rate: float = 20.0, dwell_s: float | None = None, engines: bool = False,
                    engine_backend: str = "sim", model: str | None = None, max_in_flight: int | None = None,
                    drain_stall_s: float = 45.0, drain_cap_s: float = 1800.0,
                    on_progress: Callable[[str], None] | None = None) -> ChaosReport:
    """Start the stack, run the scenarios one after the other under load, stop everything, and
    account for every event. ``on_progress(name)`` is called as each scenario starts.
    ``engine_backend`` (with ``engines``): the workers' backend, ``sim``, ``torch`` (on
    ``model``, else a tiny random checkpoint the run writes) or ``vllm`` (a vLLM server per
    node on ``model``, else SmolLM2). ``max_in_flight``: the load keeps at most that many requests
    unfinished (None: open loop at ``rate``)."""
    chosen = select(scenarios(), quick=quick, only=only, engines=engines, backend=engine_backend)
    if engines and engine_backend == "torch" and (why := torch_missing()):
        raise ValueError(why)
    if engines and engine_backend == "vllm" and (why := vllm_missing()):
        raise ValueError(why)
    if engines and engine_backend in ("torch", "vllm") and model is not None and not Path(model).exists():
        raise ValueError(f"--model {model} does not exist")
    dwell_s = (0.5 if quick else 3.0) if dwell_s is None else dwell_s
    t_start = time.monotonic()
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ei-chaos-")
        workdir = Path(tmp.name)
    # real workers on a loaded 2-core machine miss a 2 s heartbeat deadline (all four were removed
    # within 20 s in a trial run): give them 6 s
    stack = ChaosCluster(Path(workdir), rate=rate, engines=engines, heartbeat_timeout_s=6.0 if engines else 2.0,
                  kv_bytes=engines and any(s.kv_bytes for s in chosen), engine_backend=engine_backend, model=model,
                  max_in_flight=max_in_flight)
    results: list[ScenarioResult] = []
    try:
        if on_progress:
            on_progress("starting the stack")
        await stack.start()
        baseline = ScenarioResult("steady-load", "no fault (control)")
        plan: list[tuple[ScenarioResult, Scenario | None]] = [(baseline, None)]
        plan += [(ScenarioResult(s.name, s.fault), s) for s in chosen]
        for res, sc in plan:
            if on_progress:
                on_progress(res.name)
            s0 = await stack.bus.last_seq()
            p0 = len(stack.load.published)
            n_unplanned = len(stack.unplanned)
            n_rejoins = len(stack.load.rejoins)
            try:
                if sc is None:
                    await serve_a_while(stack, dwell_s)
                    t = time.monotonic()
                    res.recover_s = await recover(stack, t, await stack.bus.last_seq())
                    res.survived = True
                else:
                    await sc.run(stack, res)
                    await serve_a_while(stack, dwell_s)  # keep the load on the recovered stack a while
            except Exception as exc:  # noqa: BLE001 - a scenario that fails is a row, not a crash
                res.survived = False
                res.detail = f"{type(exc).__name__}: {exc}"
                log.error("scenario_failed", scenario=res.name, error=res.detail)
            rejoined = stack.load.rejoins[n_rejoins:]
            if rejoined:
                again = "removed for silence and registered again: " + ", ".join(rejoined)
                res.detail = "; ".join(filter(None, [res.detail, again]))
            exits = stack.unplanned[n_unplanned:]
            if exits:
                res.survived = False
                res.detail = "; ".join(filter(None, [res.detail, "unplanned: " + ", ".join(exits)]))
            res.window = (s0, await stack.bus.last_seq())
            res.published = (p0, len(stack.load.published))
            results.append(res)
        if on_progress:
            on_progress("draining and verifying")
        await stack.stop_load()
        head = await stack.bus.last_seq()
        wanted = set(stack.load.requests())

        async def settled() -> bool:
            if stack.tail.cursor < head:
                return False  # the harness's copy of the stream is not complete yet
            decided = acting_route_counts(stack.tail.deliveries)
            if engines:  # and run to their end (or failed with an error) on the engines
                done = finished_requests(stack.tail.deliveries)
                if not all(r in done for r in wanted if decided[r]):
                    return False
            return await stack.caught_up(head) and all(decided[r] for r in wanted)

        t_drain = time.monotonic()
        drain: dict[str, Any] = {}
        if engines:
            # the engines finish what they queued at their own pace (minutes behind on a busy
            # machine): wait while their work moves on the stream; "hung" is what is still in
            # flight once no request has started, progressed or ended for stall_s (the old fixed
            # 240 s counted requests still finishing under load as hung: docs/chaos.md)
            watch = Progress(stack.tail, stall_s=drain_stall_s)
            # requests still open at these seconds into the drain: what a fixed deadline there
            # would have counted as hung (the old one was 240 s)
            marks = [0, 30, 60, 120, 240, 480, 960]
            drain["open_at_s"] = {}

            async def settled_or_stalled() -> bool:
                el = time.monotonic() - t_drain
                if marks and el >= marks[0]:
                    decided = acting_route_counts(stack.tail.deliveries)
                    done = finished_requests(stack.tail.deliveries)
                    drain["open_at_s"][str(marks.pop(0))] = sum(1 for r in wanted if decided[r] and r not in done)
                if await settled():
                    drain["ended"] = "settled"
                    return True
                if watch.stalled():
                    drain["ended"] = f"stalled: no engine work for {watch.stall_s:g} s"
                    return True
                return False

            try:
                await stack.wait(settled_or_stalled, drain_cap_s, "every request finished", every_s=0.5)
            except TimeoutError:
                drain["ended"] = f"cap: {drain_cap_s:g} s with engine work still moving"
            drain["work_events"] = watch.moves
        else:
            try:
                await stack.wait(settled, 30, "every request decided")
                drain["ended"] = "settled"
            except TimeoutError:
                drain["ended"] = "cap: 30 s"
        drain["s"] = round(time.monotonic() - t_drain, 1)
        # the last decisions land after the load's last event: the last window ends where the
        # harness's copy of the stream ends once everything is decided
        results[-1].window = (results[-1].window[0], max(head, stack.tail.cursor))
        rcs = await stack.stop_services()
        stack.procs.clear()
        stream = list(stack.tail.deliveries)
        verify: dict[str, Any] = {"ok": False}
        recorded: set[int] | None = None
        div_seqs: list[int] = []
        try:
            with DuckDbEventLog(stack.db, read_only=True) as elog:
                recorded = {row[0] for row in elog.read(1)}
                report = verify_log(elog, keep_going=True)
            verify = report.to_dict()
            div_seqs = [d.seq for d in report.divergences]
        except Exception as exc:  # noqa: BLE001 - an unreadable log is a failed verify, reported
            verify = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        verify["stop_exit_codes"] = rcs
        account(results, stack.load, stream, recorded, div_seqs, engines=engines)
        return ChaosReport(results, events=len(stream), requests=len(wanted), verify=verify,
                           publish_retries=stack.load.retries, unplanned_exits=list(stack.unplanned),
                           rejoins=list(stack.load.rejoins),
                           elapsed_s=time.monotonic() - t_start, quick=quick, engines=engines,
                           engine_backend=engine_backend if engines else "", drain=drain)
    finally:
        await stack.close()
        if tmp is not None:
            tmp.cleanup()
