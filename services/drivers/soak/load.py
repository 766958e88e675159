"""The soak's traffic: streaming chat requests at a Poisson rate, spread over N agent streams.

Arrivals are a Poisson process of rate ``rate`` (exponential gaps from a seeded
``random.Random``), as benchmark_serving's ``--request-rate`` draws them. Each arrival is served
by the next idle **agent stream**: a multi-turn session on its own branch (``x-branch-id``)
whose every turn extends the previous prompt (the shared system prompt, the turns so far and
the engine's replies), so the gateway hashes a growing prefix and the router can reuse the KV
of the turn before. Every ``fork_every``-th turn is a **fork**: a one-request child branch
(``x-parent-branch-id``, ``x-branch-mode: fork``, ``x-branch-end: true``) on the parent's
context, as a harness forks a branch to try something; the parent does not see its reply.
The session's last turn carries ``x-branch-end: true`` and the stream starts a new session at
its next arrival. The system prompt is the same in every session (prefix shared across
branches). When every stream is busy an arrival waits for one (FIFO): ``wait_s`` in its
outcome, and the soak fails if fewer requests were sent than a Poisson process of that rate
gives (stats.poisson_floor): the stack did not keep up.

Each stream holds one keep-alive connection, as an agent's own HTTP client does: with a pool
shared by all streams, the connections open (and the gateway's sockets) follow the bursts.

At the end, each stream with a session still open sends the branch-end request Dynamo calls
"a dedicated minimal request" (``max_tokens: 0`` + ``x-branch-end: true``), so no branch is
left for the gateway's idle expiry.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import string
import time
from dataclasses import dataclass, field

import aiohttp

from services.adapters.aio import wait_for
from services.drivers.soak.stats import Outcome


@dataclass(frozen=True)
class LoadConfig:
    gateway: str
    rate: float = 5.0  # arrivals per second (Poisson)
    streams: int = 8  # concurrent agent streams
    turns: int = 6  # requests per session (the last ends its branch)
    fork_every: int = 3  # every k-th turn is a one-request fork (0: none)
    system_tokens: int = 1024  # shared system prompt (byte tokenizer: 1 character = 1 token)
    user_tokens: int = 192  # new text per turn
    max_tokens: int = 32
    model: str = "evolving-sim"
    timeout_s: float = 60.0
    seed: int = 0
    run_id: str = "soak"


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + " ", k=n))


def _session(timeout_s: float) -> aiohttp.ClientSession:
    """One keep-alive connection per agent stream, as an agent's own HTTP client holds it: the
    connections (and the gateway's sockets) stay as many as the streams, whatever the bursts."""
    conn = aiohttp.TCPConnector(limit=1, keepalive_timeout=300)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s))


@dataclass
class _Stream:
    index: int
    http: aiohttp.ClientSession
    session: int = -1
    turn: int = 0  # turns sent in the current session
    messages: list[dict] = field(default_factory=list)

    def branch(self, run_id: str) -> str:
        return f"{run_id}-s{self.index}-{self.session}"


class Load:
    """Poisson arrivals over ``streams`` agent sessions through the gateway's chat API."""

    def __init__(self, cfg: LoadConfig) -> None:
        if cfg.rate <= 0 or cfg.streams < 1 or cfg.turns < 1:
            raise ValueError("--rate must be > 0, --streams and --turns >= 1")
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.system = _text(random.Random(cfg.seed + 1), cfg.system_tokens)
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, float] = {}  # request number -> sent_s
        self.arrivals = 0  # arrivals drawn before the end of the load
        self.backlog: collections.deque[float] = collections.deque()  # arrival times waiting for a stream
        self.branch_end_requests = 0
        self.errors: collections.Counter = collections.Counter()
        self._idle: asyncio.Queue[_Stream] = asyncio.Queue()
        self._n = 0
        self._t0 = 0.0

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ the run
    async def run(self, duration_s: float, t0: float) -> None:
        """Send until ``duration_s`` after ``t0`` (monotonic), then wait for what is in flight
        (each request is bounded by ``timeout_s``) and end the sessions left open."""
        self._t0 = t0
        streams = [_Stream(i, http=_session(self.cfg.timeout_s)) for i in range(self.cfg.streams)]
        for s in streams:
            self._idle.put_nowait(s)
        tasks: set[asyncio.Task] = set()
        try:
            next_s = self.rng.expovariate(self.cfg.rate)
            while next_s < duration_s:
                # an arrival at next_s: wait for its time, then for an idle stream
                delay = next_s - self.now_s()
                if delay > 0:
                    await asyncio.sleep(delay)
                self.arrivals += 1
                self.backlog.append(next_s)
                stream = await self._next_idle(duration_s)
                if stream is None:
                    break  # the load ended with arrivals still waiting (they stay in the backlog)
                arrived = self.backlog.popleft()
                t = asyncio.create_task(self._turn(stream, arrived))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                next_s += self.rng.expovariate(self.cfg.rate)
            # arrivals drawn after the last one sent but before the end count as arrivals too
            while next_s < duration_s:
                self.arrivals += 1
                next_s += self.rng.expovariate(self.cfg.rate)
            if tasks:
                await asyncio.wait(set(tasks))
            await asyncio.gather(*(self._end_session(s) for s in streams if s.turn > 0))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*(s.http.close() for s in streams), return_exceptions=True)

    async def _next_idle(self, duration_s: float) -> _Stream | None:
        try:
            if not self._idle.empty():
                return self._idle.get_nowait()
            return await wait_for(self._idle.get(), max(0.0, duration_s - self.now_s()))
        except TimeoutError:
            return None

    # ------------------------------------------------------------------ one turn
    async def _turn(self, s: _Stream, arrived_s: float) -> None:
        try:
            cfg = self.cfg
            if s.turn == 0 or s.turn >= cfg.turns:  # a new session on this stream
                s.session, s.turn, s.messages = s.session + 1, 0, [{"role": "system", "content": self.system}]
            s.turn += 1
            parent = s.branch(cfg.run_id)
            user = {"role": "user", "content": f"turn {s.turn}: " + _text(self.rng, cfg.user_tokens)}
            if cfg.fork_every and s.turn % cfg.fork_every == 0 and s.turn < cfg.turns:
                headers = {"x-branch-id": f"{parent}-f{s.turn}", "x-parent-branch-id": parent,
                           "x-branch-mode": "fork", "x-branch-end": "true"}
                await self._send(s.http, [*s.messages, user], headers, arrived_s)
                return  # a fork's reply stays on its own branch
            headers = {"x-branch-id": parent}
            if s.turn >= cfg.turns:
                headers["x-branch-end"] = "true"
            reply = await self._send(s.http, [*s.messages, user], headers, arrived_s)
            s.messages += [user, {"role": "assistant", "content": reply or ""}]
            if s.turn >= cfg.turns:
                s.turn = 0  # the branch ended: the next arrival opens a new session
        finally:
            self._idle.put_nowait(s)

    async def _send(self, http: aiohttp.ClientSession, messages: list[dict], headers: dict[str, str],
                    arrived_s: float) -> str | None:
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": self.cfg.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        n = self._n
        self._n += 1
        sent = self.now_s()
        self.in_flight[n] = sent
        t0 = time.monotonic()
        ttft, parts, error = None, [], ""
        try:
            async with http.post(f"{self.cfg.gateway}/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    error = f"HTTP {r.status}: {(await r.text())[:200]}"
                else:
                    done = False
                    async for line in r.content:
                        line = line.strip()
                        if not line.startswith(b"data: "):
                            continue
                        if line == b"data: [DONE]":
                            done = True
                            break
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            error = f"stream error: {obj['error'].get('message', '')[:200]}"
                            break
                        for c in obj.get("choices", []):
                            text = (c.get("delta") or {}).get("content")
                            if text:
                                if ttft is None:
                                    ttft = time.monotonic() - t0
                                parts.append(text)
                    if not done and not error:
                        error = "stream ended before [DONE]"
        except Exception as exc:  # noqa: BLE001 - a failed request is an outcome, the soak goes on
            error = f"{type(exc).__name__}: {exc}"[:200]
        e2e = time.monotonic() - t0
        del self.in_flight[n]
        ok = not error and ttft is not None
        if not ok and not error:
            error = "no content token"
        if error:
            self.errors[error.split(":", 1)[0]] += 1
        self.outcomes.append(Outcome(sent, ok, ttft, e2e, max(0.0, sent - arrived_s), error))
        return "".join(parts) if ok else None

    async def _end_session(self, s: _Stream) -> None:
        """The branch-end request for a session the load left open (not a measured request)."""
        body = {"model": self.cfg.model, "messages": [{"role": "user", "content": "end"}], "max_tokens": 0}
        headers = {"x-branch-id": s.branch(self.cfg.run_id), "x-branch-end": "true"}
        try:
            async with s.http.post(f"{self.cfg.gateway}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                if r.status == 200:
                    self.branch_end_requests += 1
                else:
                    self.errors[f"branch-end HTTP {r.status}"] += 1
        except Exception as exc:  # noqa: BLE001 - counted; the soak's verdict reads the errors
            self.errors[f"branch-end {type(exc).__name__}"] += 1
