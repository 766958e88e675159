"""``+prestage`` on the live stack, measured: the TTFT of the turns that follow a tool wait, with
and without the router's stage orders (docs/live.md, "Next turn's KV staged live").

For each router (``evolving`` and ``evolving+prestage``, same seed, same sessions) this starts
``evolving up --engines torch:N --prefill P --no-gateway --planner static`` on a random
checkpoint written once (no tokenizer: an engine's text is its token ids, so each agent's next
prompt is the previous prompt + the model's own output + a tool result, as a real agent's), and
runs ``--agents`` agents of ``--turns`` turns on the bus, as the gateway does (prompt ids into
the prompt store, ``BranchOpened`` + ``RequestSubmitted``, the token channel): a first prompt
of 512-1024 tokens, outputs of 64-128 tokens, tool results of 64-192 tokens after a tool wait
of ``--tool-s`` seconds. TTFT is the time from ``RequestSubmitted`` to the first token message.
Then ``up`` is stopped (SIGINT) and the stream read: stage orders, ``KvMoved`` decode -> prefill,
each prefill's cached and fetched tokens. Prints one JSON object (``--out``: also written there).

Not a test and not part of the package: a measurement command (it starts processes, reads the
clock). ``python scripts/prestage_live.py --agents 4 --turns 4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.backends.torch.loader import random_weights, write_gguf
from engine.backends.torch.model import LlamaConfig
from events.catalog import (
    BranchOpened,
    KvMoved,
    KvStageOrdered,
    RequestStarted,
    RequestSubmitted,
)
from events.hashing import block_hashes
from services.adapters.bus import NatsBus
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.tokens import NatsTokens
from services.drivers.up.testing import read_all, wait_ready_file

#: the checkpoint: SmolLM2-135M's shape (hidden 576, 9 / 3 heads, FFN 1536) on 12 blocks and a
#: 4,096-token vocabulary, random weights (greedy outputs are deterministic: same seed, same turns)
MODEL = LlamaConfig(vocab=4096, hidden=576, layers=12, heads=9, kv_heads=3, ffn=1536, rope_base=1e5, max_pos=8192)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, MODEL.vocab) for _ in range(n)]


async def agent(k: int, args, bus, tokens, store, rng: random.Random, rows: list) -> None:
    branch = f"a{k}"
    ctx = ids(rng, rng.randint(512, 1024))
    for t in range(args.turns):
        rid = f"{branch}/{t}"
        n_out = rng.randint(64, 128)
        await store.put(rid, ctx)
        sub = await tokens.subscribe(rid)
        evs = ([BranchOpened(ts=time.time(), src="driver", branch=branch, session=branch)] if t == 0 else [])
        evs.append(RequestSubmitted(ts=time.time(), src="driver", request=rid, branch=branch,
                                    blocks=block_hashes(ctx), prompt_tokens=len(ctx), max_tokens=n_out,
                                    ignore_eos=True))
        t0 = time.monotonic()
        await bus.publish_many(evs)
        ttft, text = None, []
        while True:
            m = await sub.get(600.0)
            if ttft is None and m.kind in ("first", "chunk", "done"):
                ttft = time.monotonic() - t0
            text.append(m.text or "")
            if m.kind in ("done", "error"):
                break
        await sub.close()
        out = [int(x) for x in "".join(text).split()]
        rows.append({"request": rid, "turn": t, "after_tool": t > 0, "prompt_tokens": len(ctx), "ttft_s": ttft,
                     "output_tokens": len(out)})
        tool_s = rng.uniform(*args.tool_s)
        ctx = ctx + out + ids(rng, rng.randint(64, 192))
        if t + 1 < args.turns:
            await asyncio.sleep(tool_s)


async def stream(bus) -> list:
    return [d.event for d in await read_all(bus)]


def spawn(cmd: list[str], log_path: Path) -> tuple:
    """``evolving up`` in a session of its own (SIGINT to the group stops it in order)."""
    log = open(log_path, "w")  # noqa: SIM115 - closed by the caller
    return log, subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def one(router: str, args, model: Path, run_dir: Path) -> dict:
    ready = run_dir / "ready.json"
    cmd = [sys.executable, "-m", "services.drivers.cli", "up", "--run-dir", str(run_dir), "--no-gateway",
           "--insecure", "--no-status", "--engines", f"torch:{args.engines}", "--prefill", str(args.prefill),
           "--model", str(model), "--planner", "static",
           f"--planner-arg=initial=\"{args.prefill}P{args.engines - args.prefill}D\"", "--router", router,
           "--ready-file", str(ready), "--heartbeat-timeout-s", "120", "--metrics-port", "-1"]
    log, proc = spawn(cmd, run_dir / "up.log")
    try:
        urls = await asyncio.to_thread(wait_ready_file, ready, proc, 600.0)
        bus = await NatsBus.connect(urls["nats"], partition="default")
        tokens, store = NatsTokens(bus.nc, "default"), NatsPromptStore.from_bus(bus)
        rows: list = []
        rng = random.Random(args.seed)
        seeds = [rng.randrange(1 << 30) for _ in range(args.agents)]
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        await asyncio.gather(*[agent(k, args, bus, tokens, store, random.Random(seeds[k]), rows)
                               for k in range(args.agents)])
        wall = time.monotonic() - t0
        load1 = os.getloadavg()[0]
        await asyncio.sleep(1.0)
        evs = await stream(bus)
        await bus.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                await asyncio.to_thread(proc.wait, 60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    starts = {e.request: e for e in evs if isinstance(e, RequestStarted) and e.phase == "prefill"}
    for r in rows:
        s = starts.get(r["request"])
        r["cached_tokens"] = s.cached_tokens if s else None
        r["fetched_tokens"] = s.fetched_tokens if s else None
        r["node"] = s.node if s else None
    staged_at = {e.request: e.dst_node for e in evs if isinstance(e, KvStageOrdered)}
    for r in rows:  # the previous turn's order named the node this turn was prefilled on
        prev = f"{r['request'].rpartition('/')[0]}/{r['turn'] - 1}"
        r["on_staged_node"] = r["node"] is not None and staged_at.get(prev) == r["node"]
    post = [r for r in rows if r["after_tool"]]
    ttft = [r["ttft_s"] for r in post]
    staged = [e for e in evs if isinstance(e, KvMoved) and e.src_phase == "decode" and e.dst_phase == "prefill"]
    return {"router": router, "requests": len(rows), "post_tool_turns": len(post),
            "post_tool_ttft_p50_s": round(statistics.median(ttft), 4), "post_tool_ttft_mean_s": round(statistics.mean(ttft), 4),
            "post_tool_cached_share": round(sum(r["cached_tokens"] or 0 for r in post)
                                            / max(1, sum(r["prompt_tokens"] for r in post)), 4),
            "post_tool_fetched_tokens": sum(r["fetched_tokens"] or 0 for r in post),
            "post_tool_on_staged_node": sum(r["on_staged_node"] for r in post),
            "stage_orders": sum(isinstance(e, KvStageOrdered) for e in evs),
            "staged_moves": len(staged), "staged_blocks": sum(len(e.blocks) for e in staged),
            "wall_s": round(wall, 1), "load_1min": [round(load0, 2), round(load1, 2)], "rows": rows}


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tool-s", type=lambda s: tuple(float(x) for x in s.split(",")), default=(2.0, 4.0))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routers", default="evolving,evolving+prestage")
    p.add_argument("--out", default=None, help="the whole report (every turn) as JSON here")
    p.add_argument("--run-dir", default=None,
                   help="keep each run's folder (its DuckDB log for `evolving verify`) here (default: a temp folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="prestage-live-") as tmp:
        base = Path(args.run_dir or tmp)
        model = Path(tmp) / "model.gguf"
        write_gguf(model, MODEL, random_weights(MODEL, seed=args.seed))
        results = []
        for i, router in enumerate(args.routers.split(",")):  # a router named twice: runs interleaved
            run_dir = base / f"run{i}-{router}"
            run_dir.mkdir(parents=True)
            results.append(await one(router, args, model, run_dir))
    pooled = {}
    for router in dict.fromkeys(args.routers.split(",")):
        ttft = [r["ttft_s"] for res in results if res["router"] == router for r in res["rows"] if r["after_tool"]]
        pooled[router] = {"post_tool_turns": len(ttft), "p50_s": round(statistics.median(ttft), 4),
                          "mean_s": round(statistics.mean(ttft), 4)}
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "pooled": pooled,
              "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    summary = [{k: v for k, v in r.items() if k != "rows"} for r in results]
    print(json.dumps({"runs": summary, "pooled": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
