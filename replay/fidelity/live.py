"""One stack served live: ``evolving up --engines torch:N`` with the stack's planner, router,
eviction, KV pool and start split, the scaled sessions replayed through its gateway by the
driver of ``evolving drive`` (prompts sent as token ids, so lengths and shared prefixes are
the trace's exactly), then ``up`` stopped and its recorder's DuckDB log returned.

The stack's parts come from the simulator's own description of it (replay/sim/stacks.py
``Stack.core_config``), so the live run and the simulated one are configured from one source:

=================  ===============================================================
Stack part         ``evolving up`` option
=================  ===============================================================
planner + kwargs   ``--planner NAME --planner-arg K=V`` (warm-up, window, mechanism, split)
router + kwargs    ``--router NAME --router-arg K=V``
start split        ``--prefill P`` (the first P engines prefill, the rest decode)
eviction           ``--engine-arg=--eviction=lru|count_aware``
KV pool            ``--engine-arg=--fetch-mode=async|at_start|none``
=================  ===============================================================

**One engine, its own cores.** The simulator's nodes are separate GPUs: one node's iteration
never slows another's. Torch on the CPU takes every core for each engine by default, so two
engines on one box share them, and an iteration took 1.35-1.55x as long while the other engine
computed as when it ran alone (the quiet run of 6 Dec: 7 of the calibration's 8 long prefill
iterations overlapped the other engine's and fitted eq. 1 at 1.4-1.5x what the split stacks'
first chunks took with their decode engine still idle, hence their simulated P95 TTFT +38-43%;
docs/simulator.md section 9). The engines
of a fidelity run therefore get ``OMP_NUM_THREADS`` = cores / engines each: ``evolving up`` gives
every torch engine its share (services/drivers/up/launch.py ``torch_engine_env``), as it gives
its vLLM servers.

Not a pure module: it starts processes and reads the clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.sim.stacks import Stack
from replay.traces.format import Session
from services.drivers.gateway.drive import DriveConfig, Driver, DriveReport
from services.drivers.soak.live_up import LiveUp

#: ``evolving up --heartbeat-timeout-s`` of a fidelity run (see ``up_args``)
HEARTBEAT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LiveRun:
    stack: str
    db: Path
    report: DriveReport
    ready_s: float  # up's start to every engine registered and the gateway answering
    drive_s: float


def _kv(kwargs: dict[str, Any], skip: Sequence[str]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in sorted(kwargs.items()) if k not in skip]


def up_args(conf: dict[str, Any], stack: Stack, engines: int) -> list[str]:
    """``evolving up`` options serving ``stack`` (module docstring) from its ``core_config``."""
    planner = conf["planner"]["kwargs"]
    router = conf["router"]["kwargs"]
    args = ["--planner", stack.planner, *[f"--planner-arg={a}" for a in _kv(planner, ("name",))],
            "--router", stack.router, *[f"--router-arg={a}" for a in _kv(router, ("name", "shadow"))],
            f"--engine-arg=--eviction={stack.eviction}", f"--engine-arg=--fetch-mode={stack.fetch_mode}"]
    roles = stack.initial_roles(engines)
    if "prefill" in roles:
        args += ["--prefill", str(roles.count("prefill"))]
    # a torch engine on a loaded 2-core box can go more than the default 10 s without a heartbeat
    # reaching the stream (a 2K-token prefill iteration alone took 10-20 s at load 16-20): the
    # liveness watcher then removed both engines of a run and 8 of its 12 requests hung until the
    # client's timeout. Liveness is not what fidelity measures; a removal there is a lost run.
    # (the torch engine's default staging pool is enough: a pull larger than it moves in chunks)
    return [*args, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)]


async def run_live(stack: Stack, conf: dict[str, Any], sessions: Sequence[Session], *, engines: int,
                   concurrency: int, run_dir: Path, model: str | None = None, vocab: int = 49152,
                   extra: Sequence[str] = (),
                   start_timeout_s: float = 300.0, request_timeout_s: float = 900.0) -> LiveRun:
    """Serve ``sessions`` on a live ``stack`` of ``engines`` torch engines (prompt ids below
    ``vocab``, the model's vocabulary size); the log's path."""
    args = up_args(conf, stack, engines)
    if model:
        args += ["--model", model]
    up = LiveUp(run_dir=run_dir, engines=f"torch:{engines}", up_args=[*args, *extra],  # type: ignore[arg-type]
                 start_timeout_s=start_timeout_s)
    t0 = time.monotonic()
    try:
        await up.start()
        ready_s = time.monotonic() - t0
        cfg = DriveConfig(gateway=up.gateway, concurrency=concurrency, model="evolving",
                          timeout_s=request_timeout_s, run_id=f"fid-{stack.name}-", wait_s=30.0, token_ids=vocab)
        t1 = time.monotonic()
        report = await Driver(cfg).run(list(sessions))
        drive_s = time.monotonic() - t1
        await up.stop()
    finally:
        up.kill()
    return LiveRun(stack.name, up.db, report, ready_s, drive_s)


def run_live_sync(*a, **kw) -> LiveRun:
    return asyncio.run(run_live(*a, **kw))
