"""``evolving drive``: replay recorded agent sessions through the gateway, as a real client would.

Closed loop (replay/traces/format.py's :class:`SessionCursor`): a request is sent when its branch is
ready (its previous response finished, or its fork/spawn was issued) plus its pause divided
by ``--speedup``; the cursor learns each response's end and yields the next steps. Up to
``--concurrency`` sessions run at once; a finished session is replaced by the next one
(``Session.start_s`` is ignored: this is a closed-loop pool). Time inside the cursor is
*virtual*: wall seconds since the start x ``speedup``, so pauses shrink and service times
are stretched consistently.

Headers: every request carries ``x-branch-id`` (the cursor's global branch id, prefixed with a
per-run id so a second run never meets ended branches), and on a child branch
``x-parent-branch-id`` + ``x-branch-mode`` (fork | subagent). ``x-context-compacted: true``
goes on the first request after a trace ``compact`` step. ``x-branch-end: true`` goes on a
branch's last request when nothing but ``end`` follows it; otherwise (a fork or spawn after
the last request) the branch end is sent, when the cursor ends the branch, as a *branch-end
request*: ``max_tokens: 0`` with ``x-branch-end: true`` (see docs/gateway.md).

Prompts (:func:`synth_prompt`): the trace holds block hashes, not text, and the gateway
hashes the tokens of the text it receives. The driver therefore synthesises text whose
byte-level tokenisation (the gateway's default tokenizer, one ASCII character = one token)
has exactly the trace's prompt length and the trace's prefix structure: each full block is
``block_tokens`` ASCII hex characters derived from the trace's block hash (BLAKE2b), so equal
hashes give equal text and, chained, equal gateway hashes; the partial tail is derived from
the request id (never shared). Requests go to ``/v1/completions`` (no chat template, which
would add bytes). The gateway's hash values differ from the trace's; the structure (which
requests share which prefix) is the same, up to BLAKE2b collisions. With a non-byte
tokenizer configured on the gateway (``evolving up``'s default, ``--tokenizer auto``, is the
bundled model's) text lengths and prefixes would only be approximate, so the driver sends token
ids instead (:func:`synth_ids`, exact with any tokenizer): below ``DriveConfig.token_ids`` when
set, else below the ``vocab_size`` the gateway's ``/health`` reports when its ``tokenizer_name``
is not ``bytes`` (read when ``wait_s`` > 0, as ``evolving drive`` does by default).

On a terminal a progress bar (:class:`DriveProgress`, on stderr) shows sessions done/total, the
requests answered, the errors and the request rate; ``--no-progress`` hides it. Ctrl-C (SIGINT,
or SIGTERM) cancels the requests in flight and :func:`drive` returns the report so far, marked
``interrupted``: the command prints that summary, writes ``--out`` and exits 130.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, Event, RequestSubmitted
from replay.traces.format import End, Request, Session, SessionCursor


# --------------------------------------------------------------------------- prompt text (pure)
def _hex_stream(seed: bytes, n: int) -> str:
    out, counter = [], 0
    while sum(len(s) for s in out) < n:
        out.append(hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=32).hexdigest())
        counter += 1
    return "".join(out)[:n]


def block_text(block_hash: int, block_tokens: int = 64) -> str:
    """``block_tokens`` ASCII characters determined by the trace's block hash."""
    return _hex_stream(b"blk" + int(block_hash).to_bytes(8, "little"), block_tokens)


def tail_text(request: str, tail_tokens: int) -> str:
    """The partial last block: unique to the request (``#`` marks it apart from block text)."""
    if tail_tokens <= 0:
        return ""
    return ("#" + _hex_stream(b"tail" + request.encode(), tail_tokens))[:tail_tokens]


def synth_prompt(blocks: Sequence[int], tail_tokens: int, block_tokens: int, request: str) -> str:
    """Prompt text with ``len(blocks) * block_tokens + tail_tokens`` ASCII characters."""
    return "".join(block_text(h, block_tokens) for h in blocks) + tail_text(request, tail_tokens)


def _id_stream(seed: bytes, n: int, vocab: int) -> list[int]:
    # the top 7/8 of the vocabulary: clear of the control tokens at its bottom (SmolLM2: 0-16)
    base = vocab // 8
    raw = _hex_stream(seed, 4 * n)
    return [base + int(raw[4 * i:4 * i + 4], 16) % (vocab - base) for i in range(n)]


def synth_ids(blocks: Sequence[int], tail_tokens: int, block_tokens: int, request: str,
              vocab: int = 32768) -> list[int]:
    """Prompt token ids, exactly ``len(blocks) * block_tokens + tail_tokens`` of them: each full
    block's ``block_tokens`` ids derived from the trace's block hash (equal hashes, equal ids, so
    the gateway's chained hashes share exactly the trace's prefixes, block for block), the tail
    from the request id. For a real tokenizer, where text lengths are only approximate."""
    ids: list[int] = []
    for h in blocks:
        ids += _id_stream(b"blk" + int(h).to_bytes(8, "little"), block_tokens, vocab)
    return ids + (_id_stream(b"tail" + request.encode(), tail_tokens, vocab) if tail_tokens > 0 else [])


def last_request_steps(session: Session) -> dict[str, int | None]:
    """Per local branch id: the step index of its last request if only ``end`` follows it."""
    out: dict[str, int | None] = {}
    for b in session.branches:
        idx = None
        for i, st in enumerate(b.steps):
            if isinstance(st, Request):
                idx = i
        tail = b.steps[idx + 1:] if idx is not None else []
        out[b.id] = idx if all(isinstance(s, End) for s in tail) else None
    return out


# --------------------------------------------------------------------------- results
@dataclass
class RequestResult:
    session: str
    branch: str
    request: str
    status: int
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (vLLM's, Dynamo's and the gateway's)
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str = ""
    end_only: bool = False


@dataclass
class DriveReport:
    sessions: int = 0
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False  # stopped by Ctrl-C: the figures are those of the requests done by then

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.status == 200 and not r.end_only]

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.results if r.status != 200]

    def summary(self) -> dict:
        ok = self.ok
        ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
        lat = sorted(r.latency_s for r in ok)

        def pct(xs, q):
            return round(xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)], 4) if xs else None

        return {"sessions": self.sessions, "requests_ok": len(ok), "requests_failed": len(self.failed),
                "branch_end_requests": sum(r.end_only for r in self.results),
                "output_tokens": sum(r.output_tokens for r in ok),
                "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
                "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95),
                "wall_s": round(self.wall_s, 3), "interrupted": self.interrupted,
                "errors": sorted({r.error for r in self.failed})[:5]}


# --------------------------------------------------------------------------- the driver
@dataclass(frozen=True)
class DriveConfig:
    gateway: str = "http://127.0.0.1:8000"
    concurrency: int = 8
    speedup: float = 1.0
    model: str = "evolving-sim"
    timeout_s: float = 300.0
    run_id: str = ""
    stream: bool = True
    wait_s: float = 0.0  # poll GET /health this long before the first session (0: do not wait)
    api_key: str | None = None  # sent as 'Authorization: Bearer KEY' when the gateway wants keys
    # > 0: send prompts as ids below this vocabulary size (synth_ids), exact with any tokenizer; 0: ids
    # below the gateway's vocabulary when its /health names a tokenizer other than bytes, else text
    token_ids: int = 0


class _SessionRun:
    """One session: its cursor, its branches' header state, its in-flight requests."""

    def __init__(self, driver: Driver, session: Session, prefix: str) -> None:
        self.d, self.s = driver, session
        self.cur = SessionCursor(session, prefix=prefix)
        self.local_of = {self.cur.branch_id(b.id): b.id for b in session.branches}
        self.last_req = last_request_steps(session)
        self.opened: dict[str, BranchOpened] = {}
        self.compacted: set[str] = set()
        self.ended_by_header: set[str] = set()
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        self.take(self.cur.start(self.d.vnow()))
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def take(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, BranchOpened):
                self.opened[e.branch] = e
            elif isinstance(e, ContextCompacted):
                self.compacted.add(e.branch)
            elif isinstance(e, RequestSubmitted):
                compacted = e.branch in self.compacted
                self.compacted.discard(e.branch)
                self._spawn(self._request(e, compacted))
            elif isinstance(e, BranchEnded) and e.branch not in self.ended_by_header:
                self._spawn(self._end_branch(e))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    def _headers(self, branch: str) -> dict[str, str]:
        h = {"x-branch-id": branch}
        op = self.opened.get(branch)
        if op is not None and op.parent is not None:
            h["x-parent-branch-id"] = op.parent
            h["x-branch-mode"] = op.mode
        return h

    async def _request(self, e: RequestSubmitted, compacted: bool) -> None:
        await self.d.sleep_until(e.ts)
        local = self.local_of[e.branch]
        step = int(e.request.rsplit("/", 1)[1])
        h = self._headers(e.branch)
        if compacted:
            h["x-context-compacted"] = "true"
        if self.last_req.get(local) == step:
            h["x-branch-end"] = "true"
            self.ended_by_header.add(e.branch)
        bt = self.s.block_tokens
        tail = e.prompt_tokens - len(e.blocks) * bt
        vocab = self.d.vocab
        text = (synth_ids(e.blocks, tail, bt, e.request, vocab) if vocab > 0 else
                synth_prompt(e.blocks, tail, bt, e.request))
        await self.d.post(self.s.id, e.branch, e.request, text, max(1, e.max_tokens), h)
        self.take(self.cur.on_finished(e.request, self.d.vnow()))

    async def _end_branch(self, e: BranchEnded) -> None:
        await self.d.sleep_until(e.ts)
        h = {**self._headers(e.branch), "x-branch-end": "true"}
        await self.d.post(self.s.id, e.branch, "", "", 0, h, end_only=True)


class Driver:
    """Replays sessions through the gateway (see the module docstring)."""

    def __init__(self, config: DriveConfig, http=None) -> None:
        if config.speedup <= 0 or config.concurrency < 1:
            raise ValueError("speedup must be > 0 and concurrency >= 1")
        self.cfg = config
        self.http = http  # an aiohttp.ClientSession (or TestClient-compatible object)
        self.report = DriveReport()
        self._t0 = 0.0
        self.vocab = config.token_ids  # > 0: prompts go as ids below it (wait_ready may set it)

    def vnow(self) -> float:
        return (time.monotonic() - self._t0) * self.cfg.speedup

    def elapsed_s(self) -> float:
        """Wall seconds since the first session started (0 before)."""
        return time.monotonic() - self._t0 if self._t0 else 0.0

    async def sleep_until(self, due_v: float) -> None:
        wait = (due_v - self.vnow()) / self.cfg.speedup
        if wait > 0:
            await asyncio.sleep(wait)

    async def run(self, sessions: Sequence[Session]) -> DriveReport:
        own = self.http is None
        if own:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        try:
            if self.cfg.wait_s > 0:
                await self.wait_ready(self.cfg.wait_s)
        except BaseException:
            if own:
                await self.http.close()
            raise
        self._t0 = time.monotonic()
        queue = list(enumerate(sessions))
        queue.reverse()

        async def worker() -> None:
            while queue:
                k, s = queue.pop()
                await _SessionRun(self, s, f"{self.cfg.run_id}{k}:").run()
                self.report.sessions += 1

        try:
            await asyncio.gather(*(worker() for _ in range(min(self.cfg.concurrency, len(sessions)))))
        finally:  # also when cancelled (Ctrl-C): the report so far stays consistent
            self.report.wall_s = time.monotonic() - self._t0
            if own:
                await self.http.close()
        return self.report

    async def wait_ready(self, wait_s: float) -> None:
        """Poll the gateway's /health until it answers 200; raise ``TimeoutError`` after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        last = ""
        while time.monotonic() < deadline:
            try:
                async with self.http.get(self._url("/health")) as r:
                    if r.status == 200:
                        self._ids_for(await r.json())
                        return
                    last = f"HTTP {r.status}"
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
        raise TimeoutError(f"gateway {self.cfg.gateway} not ready after {wait_s:g} s ({last})")

    def _ids_for(self, health: dict) -> None:
        """Prompts as ids below the gateway's vocabulary when it does not tokenise bytes (the
        module docstring), unless ``token_ids`` said otherwise."""
        vocab = health.get("vocab_size")
        if not self.cfg.token_ids and health.get("tokenizer_name", "bytes") != "bytes" and isinstance(vocab, int):
            self.vocab = vocab

    def _url(self, path: str) -> str:
        base = self.cfg.gateway.rstrip("/")
        return f"{base}{path}" if base else path

    async def post(self, session: str, branch: str, request: str, prompt: str | list[int], max_tokens: int,
                   headers: dict[str, str], end_only: bool = False) -> RequestResult:
        # ignore_eos: the trace's recorded output length is the answer's length (an engine that
        # ends turns on its own, the sim's drawn lengths or a model's EOS, would cut it short)
        body = {"model": self.cfg.model, "prompt": prompt, "max_tokens": max_tokens,
                "stream": self.cfg.stream and not end_only, "ignore_eos": True}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        res = RequestResult(session, branch, request, 0, len(prompt), end_only=end_only)
        t0 = time.monotonic()
        try:
            if self.cfg.api_key:
                headers = {**headers, "Authorization": f"Bearer {self.cfg.api_key}"}
            async with self.http.post(self._url("/v1/completions"), json=body, headers=headers) as r:
                res.status = r.status
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                elif body["stream"]:
                    await self._read_stream(r, res, t0)
                else:
                    data = await r.json()
                    res.output_tokens = data.get("usage", {}).get("completion_tokens", 0)
                    res.cached_tokens = _cached_tokens(data.get("usage"))
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, the session goes on
            res.error = f"{type(exc).__name__}: {exc}"
        res.latency_s = time.monotonic() - t0
        self.report.results.append(res)
        return res

    @staticmethod
    async def _read_stream(r, res: RequestResult, t0: float) -> None:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.status, res.error = _stream_error_status(obj["error"]), obj["error"].get("message", "")
                    continue
                if res.ttft_s is None and any(c.get("text") for c in obj.get("choices", [])):
                    res.ttft_s = time.monotonic() - t0
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens", 0)
                    res.cached_tokens = _cached_tokens(obj["usage"])


def _cached_tokens(usage: dict | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


#: the status a non-stream answer would have had, by the error event's code (the gateway's codes
#: are words: docs/gateway.md, "Errors"); anything else counts as the engine's failure, 502
_STREAM_ERROR_STATUS = {"timeout": 504, "request_failed": 503, "route_timeout": 503, "engine_error": 502,
                        "internal_error": 500, "bus_unavailable": 503}


def _stream_error_status(err: dict) -> int:
    """The HTTP status an error event inside a stream stands for. Its ``code`` is a word
    (``timeout``) or a number; reading it as an int raised ``ValueError`` and ended the drive
    (one of the 62 requests an agent-load soak once counted lost)."""
    code = err.get("code")
    if isinstance(code, int) or (isinstance(code, str) and code.isdigit()):
        return int(code)
    return _STREAM_ERROR_STATUS.get(str(code), 502)


# --------------------------------------------------------------------------- progress, Ctrl-C
class DriveProgress:
    """A rich progress bar: sessions done/total, requests answered, errors, requests/s."""

    def __init__(self, total_sessions: int, console=None) -> None:
        self.progress = Progress(
            TextColumn("drive"), BarColumn(), MofNCompleteColumn(), TextColumn("sessions"),
            TextColumn("{task.fields[requests]} requests  {task.fields[errors]} errors  "
                       "{task.fields[rate]:.1f} req/s"),
            TimeElapsedColumn(), console=console or Console(stderr=True), auto_refresh=False, transient=False)
        self.task = self.progress.add_task("drive", total=total_sessions, requests=0, errors=0, rate=0.0)

    def update(self, report: DriveReport, elapsed_s: float) -> None:
        requests = sum(not r.end_only for r in report.results)
        errors = len(report.failed)
        rate = requests / elapsed_s if elapsed_s > 0 else 0.0
        self.progress.update(self.task, completed=report.sessions, requests=requests, errors=errors, rate=rate)
        self.progress.refresh()

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


async def drive(driver: Driver, sessions: Sequence[Session], progress: DriveProgress | None = None,
                period_s: float = 0.25) -> DriveReport:
    """Run ``driver`` over ``sessions``, updating ``progress`` every ``period_s``. SIGINT or
    SIGTERM cancels the run: the report so far comes back with ``interrupted`` set."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(driver.run(sessions))

    def interrupt() -> None:
        driver.report.interrupted = True
        task.cancel()

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, interrupt)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=period_s)
            if progress is not None:
                progress.update(driver.report, driver.elapsed_s())
        try:
            return task.result()
        except asyncio.CancelledError:
            if not driver.report.interrupted:
                raise
            return driver.report
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
