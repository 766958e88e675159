"""``evolving bench kv``: KV block kernels and transfer bandwidth against plain torch / sockets."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--layout",
        default="bf16:16x64x8x128",
        help="KV layout dtype:TOKENSxLAYERSxHEADSxDIM (default 2 MiB blocks: 16 tokens of a "
        "32-layer, 8-KV-head model, K and V)",
    )
    p.add_argument("--slots", type=int, default=64, help="pool size in blocks")
    p.add_argument("--blocks", type=int, default=24, help="random blocks moved per call")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path; the best is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-transfer", action="store_true", help="skip the Mooncake vs raw socket part")
    p.add_argument("--transfer-blocks", type=int, default=16, help="blocks per Mooncake/socket transfer")


def _bench_kv(args: argparse.Namespace) -> int:
    try:
        import torch  # lazy: optional dependency (torch)
    except ImportError:
        print("evolving bench kv needs torch: pip install -e '.[kv]' (or bash scripts/setup.sh)")
        return 2
    from services.drivers.bench.kv import format_report, run  # lazy: optional dependency (torch)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device here")
        return 2
    result = run(
        device=args.device,
        layout=args.layout,
        num_slots=args.slots,
        blocks=args.blocks,
        repeats=args.repeats,
        seed=args.seed,
        transfer=not args.no_transfer,
        transfer_blocks=args.transfer_blocks,
    )
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def register(sub, bench) -> None:
    p = bench.add_parser("kv", help="KV block gather/scatter/host copy and Mooncake transfer bandwidth")
    add_arguments(p)
    p.set_defaults(func=_bench_kv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.drivers.bench.kv_cli", description=__doc__)
    add_arguments(p)
    try:  # logs to stderr, so --json stays parseable (services/ may be absent on a bare GPU box)
        from services.adapters.logging import configure_logging  # lazy: optional (bare GPU box)

        configure_logging()
    except ImportError:
        pass
    return _bench_kv(p.parse_args(argv))


if __name__ == "__main__":  # python -m services.drivers.bench.kv_cli --device cuda: no `evolving` install needed
    import sys

    sys.exit(main())
