"""``evolving up --partitions N``: one set of cores, one stream and one recorder per partition.

``up`` calls :func:`plan_partitioned` instead of planning one partition (docs/partitions.md):

* partition names: ``p0 .. p<N-1>`` (``<partition>-<i>`` for a non-default ``--partition``);
* the ``--engines`` are split into contiguous blocks (services/cores/partitions.py) and keep
  cluster-wide ids ``n0 .. n<E-1>``; ``--prefill`` is split in proportion to the blocks;
* per partition: a recorder into ``RUN_DIR/run.<p>.duckdb`` (its own run configuration, so
  ``evolving verify`` replays it alone), a directory, a planner, a router (and ``--shadow``
  routers), every one on ``ei.<p>.…`` with its stream ``EI_<P>``; child names ``<p>/<name>``,
  logs ``logs/<p>-<name>.log``;
* one gateway serving every partition (``--partitions p0,p1,..``): it sends each session to
  the partition of its root branch.

Not supported with several partitions (refused with one line by :func:`check_partitions`): the
generated per-service NATS accounts (they cover one partition: use ``--insecure`` or
``--nats-url``), ``--engines sglang-fake`` (its peer URLs name partition-local nodes) and a fixed
``--metrics-port`` (use 0 or -1).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.adapters.bus.natsserver import free_port
from services.adapters.eventlog import DuckDbEventLog
from services.cores.partitions import PartitionMap, partition_names
from services.drivers.up.children import G_GATEWAY, Child, run_config
from services.drivers.up.options import UpSpec, gateway_options


def check_partitions(spec: UpSpec) -> str | None:
    n = spec.partitions
    if n <= 1:
        return None
    if spec.nats_url is None and not spec.insecure:
        return (f"--partitions {n}: the generated NATS accounts cover one partition; add --insecure "
                f"(embedded server without accounts) or use --nats-url")
    if spec.engine_kind == "sglang-fake":
        return f"--partitions {n} does not support --engines sglang-fake (peer URLs are per partition)"
    if spec.engines < n:
        return f"--partitions {n} needs at least {n} engines (one per partition), got --engines {spec.engines}"
    if spec.metrics_port > 0:
        return f"--partitions {n}: use --metrics-port 0 (free ports) or -1 (off), not a fixed first port"
    return None


def _share(total: int, weights: list[int]) -> list[int]:
    """``total`` in proportion to ``weights`` (largest remainder, ties to the first)."""
    w = sum(weights)
    exact = [total * x / w for x in weights]
    out = [int(e) for e in exact]
    for i in sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    return out


def engine_map(spec: UpSpec) -> PartitionMap:
    n = spec.partitions
    return PartitionMap.contiguous([f"n{i}" for i in range(spec.engines)],
                                   partition_names(n, spec.partition))


def partition_db(db: Path, partition: str) -> Path:
    return db.with_name(f"{db.stem}.{partition}{db.suffix}")


def plan_partitioned(spec: UpSpec, url: str, run_dir: Path, db: Path, plan_one) -> tuple[list, dict]:
    """The children of every partition (``plan_one`` = up's ``plan_children`` for one partition)
    and one gateway for all of them; writes each partition's run configuration into its log."""
    pmap = engine_map(spec)
    sizes = [len(ns) for ns in pmap.nodes]
    prefill = _share(spec.prefill, sizes) if spec.prefill is not None else [None] * len(sizes)
    children, dbs, metrics = [], {}, {}
    logs = run_dir / "logs"
    start = 0
    for i, name in enumerate(pmap.names):
        a = replace(spec, partition=name, engines=sizes[i], prefill=prefill[i], no_gateway=True, partitions=1)
        pdb = partition_db(db, name)
        with DuckDbEventLog(pdb) as log:
            log.set_run_config({**run_config(a), "partitions": pmap.describe()})
        part, urls = plan_one(a, url, run_dir, pdb, None)
        for c in part:
            if c.name.startswith("engine-n"):  # the cluster-wide node id and seed
                local = int(c.name.removeprefix("engine-n"))
                node = pmap.nodes[i][local]
                c.cmd[c.cmd.index("--node") + 1] = node
                c.cmd[c.cmd.index("--seed") + 1] = str(start + local)
                c.name = f"engine-{node}"
            c.log_path = logs / f"{name}-{c.name}.log"
            c.name = f"{name}/{c.name}"
            children.append(c)
        metrics.update({f"{name}/{k}": v for k, v in urls.get("metrics", {}).items()})
        dbs[name] = str(pdb)
        start += sizes[i]
    out: dict = {"nats": url, "db": ",".join(dbs.values()), "logs": str(logs), "metrics": metrics,
                 "partitions": pmap.describe()}
    if not spec.no_gateway:
        port = spec.gateway_port or free_port()
        children.append(Child("gateway", [sys.executable, "-m", "services.drivers.gateway", "--host", "127.0.0.1",
                                          "--port", str(port), "--nats-url", url, "--partition", pmap.names[0],
                                          "--partitions", ",".join(pmap.names), *gateway_options(spec)], G_GATEWAY,
                              logs / "gateway.log"))
        out["gateway"] = f"http://127.0.0.1:{port}"
    return children, out


async def wait_partitions(up, bus, timeout_s: float = 60.0) -> None:
    """``Up._wait_services`` for every partition: each decision service of each partition wrote
    its configuration (a child that cannot load its plug-in ends the wait)."""
    names = engine_map(up.spec).names
    buses = [bus.for_partition(p) for p in names]
    keys = ["config.directory", "config.planner", "config.router",
            *[f"config.shadow.{name}" for name in up.spec.shadow]]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not up.stop.is_set():
        up.check_plugins()
        if up.failure is not None:
            return
        if all([await b.get_snapshot(k) is not None for b in buses for k in keys]):
            return
        await asyncio.sleep(0.2)
