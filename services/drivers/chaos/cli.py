"""``evolving chaos``: the command (``register`` adds it to the ``evolving`` parser)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

#: ``--engines BACKEND``: the engine workers' backend (engine.worker --backend)
ENGINE_BACKENDS = ("sim", "torch", "vllm")
#: with --engines --quick (sim): the CI form; at 20 the workers fell behind under load and its rows waited on the backlog
QUICK_ENGINES_RATE = 10.0
TORCH_RATE = 4.0  # the harness's default requests/s with --engines torch (10 overran one torch decode node at load average 20-25)
VLLM_RATE = 1.0  # with --engines vllm: two vLLM servers of one thread each (services/drivers/chaos/vllm_engines.py)
#: with --engines vllm, the load's requests unfinished at once (two per server): at an open 1/s a
#: one-thread server that prefills ~200 tokens/s fell behind on this 2-core machine and the queue
#: grew to 179 requests, so cut-kv-events' two fresh requests never ran within its 180 s
VLLM_MAX_IN_FLIGHT = 4


def _interrupt(signum, frame) -> None:
    """SIGINT/SIGTERM: stop the run (the finally blocks stop every child); a second signal while
    they do (``timeout`` forwards its own SIGTERM beside the user's) must not cut them short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _cmd(args) -> int:
    from services.drivers.chaos.report import render  # lazy: evolving --help +300 ms (nats: the suite)
    from services.drivers.chaos.scenarios import scenarios  # lazy: evolving --help +300 ms (nats: the suite)
    from services.drivers.chaos.suite import run_chaos, select  # lazy: evolving --help +360 ms (nats, duckdb)

    err = Console(stderr=True)
    # SIGTERM stops the run like Ctrl-C: the finally blocks stop every child (nothing left behind)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    # nats-py logs every refused reconnect with a traceback: expected while a server is down
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if args.model and args.engines not in ("torch", "vllm"):
        err.print("evolving chaos: --model names the checkpoint of --engines torch or vllm")
        return 2
    try:
        engines = args.engines is not None
        n = len(select(scenarios(), quick=args.quick, only=only, engines=engines, backend=args.engines or "sim")) + 3
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("chaos", total=n)

            def step(name: str) -> None:
                progress.update(task, description=f"chaos: {name}", advance=0 if name == "starting the stack" else 1)

            rate = args.rate if args.rate is not None else (
                TORCH_RATE if args.engines == "torch" else VLLM_RATE if args.engines == "vllm"
                else QUICK_ENGINES_RATE if engines and args.quick else 20.0)
            report = asyncio.run(run_chaos(quick=args.quick, only=only, rate=rate, engines=engines,
                                           engine_backend=args.engines or "sim", model=args.model,
                                           max_in_flight=args.max_in_flight if args.max_in_flight is not None else (
                                               VLLM_MAX_IN_FLIGHT if args.engines == "vllm" else None),
                                           workdir=Path(args.workdir) if args.workdir else None, on_progress=step))
    except ValueError as exc:
        err.print(f"evolving chaos: {exc}")
        return 2
    except KeyboardInterrupt:  # the stack was stopped by run_chaos's finally
        err.print("evolving chaos: interrupted; the stack is stopped")
        return 130
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return 0 if report.ok else 1


def register(sub, bench) -> None:
    p = sub.add_parser("chaos", help="fault suite over a live stack under load: loss/duplicate/divergence table")
    p.add_argument("--quick", action="store_true", help="the short suite CI runs (about a minute)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]", help="run only these scenarios")
    p.add_argument("--rate", type=float, default=None,
                   help="harness requests/s during the run (default 20; 10 with --engines --quick, the CI form; 4 with "
                        "--engines torch, whose workers compute every token and move real KV; 1 with --engines vllm)")
    p.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="the load keeps at most N of its requests unfinished; an arrival that finds none free is "
                        "skipped, as a client with N slots would (default: open loop; 4 with --engines vllm)")
    p.add_argument("--engines", nargs="?", const="sim", default=None, choices=ENGINE_BACKENDS, metavar="BACKEND",
                   help="run an engine worker per node (engine.worker) instead of the load generator's nodes: "
                        "sim (the default), torch (the reference engine on a tiny random checkpoint the run "
                        "writes, or --model) or vllm (two vLLM servers on SmolLM2 or --model, a worker each, and "
                        "the vLLM faults); partition-engine then SIGSTOPs the worker")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="--engines torch: the checkpoint the workers load (a .gguf file or a Hugging Face folder; "
                        "default: a tiny random Llama the run writes into its work directory); --engines vllm: "
                        "what the servers serve (default SmolLM2-135M-Instruct, converted)")
    p.add_argument("--workdir", default=None, help="keep the services' logs and the DuckDB log here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)


if __name__ == "__main__":  # pragma: no cover
    from services.drivers.cli import main

    sys.exit(main(["chaos", *sys.argv[1:]]))
