"""``restart-gateway`` (``--engines`` only): the gateway restarted mid-stream.

The stack runs no gateway otherwise (the load generator publishes on the bus). This scenario
starts one (``python -m services.drivers.gateway`` on a free loopback port, JSON log
``gateway.log`` in the work directory), serves a streaming chat completion on branch
``chaos-gw`` through it and, once the first tokens have reached the client, SIGTERMs the
gateway and starts it again. Checks:

1. what the client sees of the interrupted stream, within 20 s of the signal: an SSE error
   event (the gateway's clean error), or a closed connection without ``[DONE]``; a client still
   waiting then has **hung** (not survived);
2. the next request of the same branch, to the restarted gateway, answers 200 with a complete
   completion, and its ``RequestSubmitted`` names the same branch with no second
   ``BranchOpened`` (the restarted gateway rebuilt its branch table from the stream).

The load generator pauses its requests first and the row waits until at most 20 of them are
unfinished (while the engines' work moves on the stream: a loaded machine drains slowly). The row's detail says which of the two the client saw in 1 (a closed connection is what a
gateway that does not end its streams on SIGTERM gives: no hang, but no error message). The
load generator sends no new requests during this row (its heartbeats go on): on a loaded
machine the engines' queues, and the token messages queued behind their events, ran past the
gateway's timeouts before its first request was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp

from events.catalog import BranchOpened, RequestSubmitted
from services.adapters.aio import wait_for
from services.drivers.chaos.accounting import ScenarioResult, finished_requests
from services.drivers.chaos.progress import Progress
from services.drivers.chaos.supervisor import ChaosCluster
from services.drivers.up.testing import REPO, acting_route_counts

BRANCH = "chaos-gw"
MAX_TOKENS = 3000  # a stream of several seconds on the sim engines: time to cut it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gateway(stack: ChaosCluster, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.drivers.gateway", "--host", "127.0.0.1", "--port", str(port),
           "--nats-url", stack.cluster.url, "--partition", stack.partition, "--stream-replicas", "3",
           # the workers' token messages queue behind their events (seconds late under load)
           "--route-timeout-s", "60", "--token-timeout-s", "120", "--log-format", "json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(stack.workdir / "gateway.log", "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    stack.extra_procs["gateway"] = proc
    return proc


async def _up(stack: ChaosCluster, http: aiohttp.ClientSession, base: str) -> None:
    async def ok() -> bool:
        try:
            async with http.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    await stack.wait(ok, 60, "the gateway to answer /health", every_s=0.3)


def _body(turn: int, stream: bool) -> dict:
    return {"model": "evolving-sim", "stream": stream, "max_tokens": MAX_TOKENS if stream else 32,
            "messages": [{"role": "user", "content": f"chaos turn {t}: " + "lorem ipsum " * 40}
                         for t in range(turn + 1)]}


async def _complete(http: aiohttp.ClientSession, base: str, turn: int) -> tuple[int, str]:
    async with http.post(f"{base}/v1/chat/completions", json=_body(turn, False), headers={"x-branch-id": BRANCH},
                         timeout=aiohttp.ClientTimeout(total=240)) as r:
        text = await r.text()
        if r.status != 200:
            return r.status, text[:200]
        choice = json.loads(text)["choices"][0]
        return r.status, choice.get("finish_reason") or ""


async def restart_gateway(stack: ChaosCluster, res: ScenarioResult) -> None:
    # the load's requests stop meanwhile: on a loaded machine the engines' queues (and their
    # token messages, queued behind their events) ran past the gateway's 120 s token timeout
    stack.load.paused = True
    try:
        await _drained(stack)
        await _restart_gateway(stack, res)
    finally:
        stack.load.paused = False


async def _drained(stack: ChaosCluster, most: int = 20, stall_s: float = 30.0, cap_s: float = 600.0) -> None:
    """Wait until at most ``most`` of the load's decided requests are unfinished, so this row's
    own requests do not queue behind minutes of backlog: while engine work moves on the stream
    (a loaded machine drains slowly), not past ``stall_s`` without any (``cap_s`` bounds it)."""
    watch = Progress(stack.tail, stall_s=stall_s)

    def open_() -> int:
        decided = acting_route_counts(stack.tail.deliveries)
        done = finished_requests(stack.tail.deliveries)
        return sum(1 for r in stack.load.requests() if decided[r] and r not in done)

    async def few() -> bool:
        return open_() <= most or watch.stalled()

    with contextlib.suppress(TimeoutError):
        await stack.wait(few, cap_s, "the engines' backlog to drain", every_s=1.0)


async def _restart_gateway(stack: ChaosCluster, res: ScenarioResult) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    spawn_gateway(stack, port)
    async with aiohttp.ClientSession() as http:
        await _up(stack, http, base)
        status, why = await _complete(http, base, 0)
        if status != 200:
            res.detail = f"the gateway did not serve the branch's first request: {status} {why}"
            return
        seen = {"chunks": 0, "error": "", "done": False, "closed": ""}
        first = asyncio.Event()

        async def stream() -> None:
            try:
                async with http.post(f"{base}/v1/chat/completions", json=_body(1, True),
                                     headers={"x-branch-id": BRANCH},
                                     timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as r:
                    async for raw in r.content:
                        line = raw.decode(errors="replace").strip()
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            seen["done"] = True
                            break
                        with contextlib.suppress(ValueError):
                            msg = json.loads(data)
                            if "error" in msg:
                                seen["error"] = str(msg["error"].get("message", msg["error"]))[:200]
                                continue
                        seen["chunks"] += 1
                        first.set()
                seen["closed"] = seen["closed"] or "stream ended"
            except (aiohttp.ClientError, asyncio.IncompleteReadError, ConnectionError) as exc:
                seen["closed"] = f"{type(exc).__name__}"
            finally:
                first.set()

        task = asyncio.create_task(stream(), name="chaos-gw-stream")
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(first.wait(), 150)
        if not seen["chunks"]:
            task.cancel()
            res.detail = f"no token reached the client within 150 s ({seen})"
            return
        t = time.monotonic()
        gw = stack.extra_procs["gateway"]
        gw.send_signal(signal.SIGTERM)
        ended = True
        try:
            await wait_for(asyncio.shield(task), 20)
        except TimeoutError:
            ended = False
            task.cancel()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(gw.wait, 30)
        if gw.poll() is None:
            gw.kill()
            gw.wait()
        rc = gw.returncode
        mark = len(stack.tail.deliveries)
        spawn_gateway(stack, port)
        await _up(stack, http, base)
        res.recover_s = time.monotonic() - t
        status, why = await _complete(http, base, 2)
    head = await stack.bus.last_seq()  # the tail catches up with the last request's events

    async def read() -> bool:
        return stack.tail.cursor >= head

    with contextlib.suppress(TimeoutError):
        await stack.wait(read, 30, "the harness's copy of the stream", every_s=0.1)
    subs = [d.event for d in stack.tail.deliveries[mark:]
            if type(d.event) is RequestSubmitted and d.event.branch == BRANCH]
    reopened = [d for d in stack.tail.deliveries[mark:] if type(d.event) is BranchOpened and d.event.branch == BRANCH]
    if seen["error"]:
        saw = f"an SSE error event after {seen['chunks']} chunks: {seen['error']!r}"
    elif seen["done"]:
        saw = f"a complete stream ({seen['chunks']} chunks): the signal did not interrupt it"
    elif ended:
        saw = f"the connection closed after {seen['chunks']} chunks without [DONE] or an error event ({seen['closed']})"
    else:
        saw = f"no end within 20 s after {seen['chunks']} chunks (hung)"
    rebuilt = bool(subs) and not reopened
    res.survived = ended and status == 200 and rebuilt
    res.detail = (f"gateway SIGTERMed mid-stream (exit {rc}) and started again; the client saw {saw}; "
                  f"the branch's next request: {status} {why}"
                  + ("; same branch, no new BranchOpened (table rebuilt from the stream)" if rebuilt else
                     f"; branch table not rebuilt ({len(subs)} submissions, {len(reopened)} BranchOpened again)"))
