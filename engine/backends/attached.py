"""What every backend attached to an engine server shares (SGLang, vLLM): the health check and
the wait for a server still loading, the server's load from its Prometheus ``/metrics``, its KV
events over ZMQ folded into the node's pool, a request's retry while the server restarts, its
streamed ``data:`` lines, the prompt ids it is sent, the events of its first token and its end,
the token channel and the engine-port properties. A subclass sets the class attributes below
and holds ``host``, ``node_id``, ``_role``, ``bt``, ``cfg`` (``url``, ``wait_s``, ``retry_s``,
``metrics_interval_s``), ``_http``, ``jobs``, ``tasks``, ``started``, ``_bg``, ``pool``,
``pagemap``, ``server_load``, ``kv_seq`` and ``kv_gaps``, and implements ``_serve_one``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, ClassVar

import aiohttp
import zmq
import zmq.asyncio

from engine.backend import BackendUnavailable, NodeLoad, PrefillJob
from events.catalog import FirstToken, RequestFinished, RequestStarted
from events.hashing import block_hashes
from events.ids import NodeId, RequestId, Role
from events.wire import TokenMsg
from services.adapters.logging import get_logger

log = get_logger("engine")

VOCAB = 32000  # synthetic ids stay below every tokenizer's vocabulary size we serve


def prompt_ids(blocks, prompt_tokens: int, block_tokens: int, request: str) -> list[int]:
    """Token ids for a prompt known by its block hashes: ``block_tokens`` ids per block, drawn
    from SHAKE-256 of the block hash (equal hashes, equal ids), then a tail from the request id."""
    out: list[int] = []
    for b in blocks:
        digest = hashlib.shake_256(int(b).to_bytes(8, "little")).digest(2 * block_tokens)
        out.extend(1 + int.from_bytes(digest[2 * i:2 * i + 2], "little") % (VOCAB - 1) for i in range(block_tokens))
    tail = max(1, prompt_tokens - len(out))
    digest = hashlib.blake2b(request.encode(), digest_size=64).digest()
    out.extend(1 + digest[i % 64] for i in range(tail))
    return out


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[dict]:
    """The JSON of each ``data:`` line of a server-sent-event stream, up to ``data: [DONE]``."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def sampling_params(job: PrefillJob, *, seed: bool = True) -> dict[str, Any]:
    """The request's sampling and stopping as vLLM's and SGLang's fields (``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``): greedy when the client sent none;
    ``ignore_eos`` true unless the request says false (a trace replay's budget is its recorded
    length, as before; the gateway says false for a client's request). ``seed``: False for an
    engine that names it otherwise."""
    out: dict[str, Any] = {"ignore_eos": job.ignore_eos is not False, "temperature": 0}
    sp = job.sampling
    if sp is not None:
        out |= {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k if sp.top_k > 0 else -1}
        if sp.stop:
            out["stop"] = list(sp.stop)
        if seed and sp.seed is not None:
            out["seed"] = sp.seed
    return out


def structured_params(job: PrefillJob, engine: str) -> dict[str, Any]:
    """A constrained request's constraint (``sampling.constraint``: a forced tool call, a JSON
    schema) in the server's own structured-output fields, which it enforces itself (docs/engines.md,
    "Structured output"); ``{}`` for free text. ``engine``: ``vllm`` (``structured_outputs``:
    ``json``, or an xgrammar ``structural_tag`` sequence when the value has a prefix or suffix -
    a Hermes ``<tool_call>`` ... ``</tool_call>``) or ``sglang`` (``json_schema`` /
    ``structural_tag`` in its sampling params)."""
    c = job.sampling.constraint if job.sampling is not None else None
    if c is None:
        return {}
    schema = json.loads(c.json_schema)
    if not c.prefix and not c.suffix:
        return ({"structured_outputs": {"json": schema}} if engine == "vllm"
                else {"json_schema": c.json_schema})
    elements = ([{"type": "const_string", "value": c.prefix}] if c.prefix else []) + \
        [{"type": "json_schema", "json_schema": schema}] + \
        ([{"type": "const_string", "value": c.suffix}] if c.suffix else [])
    tag = json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}})
    return {"structured_outputs": {"structural_tag": tag}} if engine == "vllm" else {"structural_tag": tag}


def finish_of(reason: Any) -> str:
    """A server's finish reason (vLLM's string, SGLang's ``{"type": ...}``) as ours: ``stop``
    (EOS or a stop string) or ``length``."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return "stop" if reason in ("stop", "eos", "stop_str", "stop_token") else "length"


def prom_sum(text: str, metric: str) -> float:
    """Sum of every sample of ``metric`` in Prometheus text exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


class AttachedServer:
    """Mixin: the server-facing half both attached backends have in common (module docstring)."""

    engine_name: ClassVar[str]  # "sglang" / "vllm": log event names, ``<name>_metrics_off``
    running_metric: ClassVar[str]  # the server's gauge of running requests
    queued_metric: ClassVar[str]  # ... and of queued ones
    metrics_off_note: ClassVar[str] = ""  # what to tell the operator when /metrics is 404
    parse_frames: ClassVar[Callable[[list[bytes]], tuple[Any, int, Any]]]  # the three ZMQ frames
    server_label: ClassVar[str]  # "SGLang" / "vLLM": what the operator's messages call the server
    url_flag: ClassVar[str]  # the worker's flag that names the server's URL

    # ------------------------------------------------------------------ health
    @classmethod
    async def check_health(cls, url: str) -> None:
        """Is something answering ``/health`` at ``url``? :class:`BackendUnavailable` in one line if not."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
                    s.get(f"{url}/health") as r:
                if r.status != 200:
                    raise BackendUnavailable(f"{cls.server_label} server at {url} is not healthy: "
                                             f"GET /health -> {r.status}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            reason = type(exc).__name__ if not str(exc) else str(exc).splitlines()[0]
            raise BackendUnavailable(f"no {cls.server_label} server at {url} ({reason}); "
                                     f"start one or fix {cls.url_flag}") from None

    async def _wait_healthy(self) -> None:
        """Attach: wait up to ``cfg.wait_s`` for ``/health`` (a server still loading its model)."""
        deadline = time.monotonic() + self.cfg.wait_s
        while True:
            try:
                await self.check_health(self.cfg.url)
                return
            except BackendUnavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _cancel_all(self) -> None:
        """Cancel every request and background task, wait for them, close the HTTP session."""
        tasks = [*self.tasks.values(), *self._bg]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------------ requests
    def queued(self) -> list[RequestId]:
        return [r for r in self.jobs if r not in self.started]

    def progress(self) -> None:
        """Tokens are reported as the server streams them."""

    def _request_ids(self, job: PrefillJob) -> list[int]:
        """The ids sent: the prompt's real ids (the gateway's prompt store), or for a replayed trace
        (no tokens) ids made from its block hashes, whose own block hashes are then registered as
        aliases of the request's blocks in the page map (with real ids they are the same)."""
        if job.tokens is not None:
            ids = list(job.tokens)
        else:
            ids = prompt_ids(job.blocks, job.prompt_tokens, self.bt, job.request)
        for sent, ours in zip(block_hashes(ids, self.bt), job.blocks, strict=False):
            self.pagemap.alias(sent, ours)
        return ids

    def cancel(self, request: RequestId) -> bool:
        """The client went away (``RequestCancelled``): the request's stream to the server is
        closed - vLLM aborts a request whose client disconnects, SGLang is told as well
        (:meth:`_abort`) - and it is reported finished, ``error="cancelled"``, on the node a
        failure would be (no token message: nobody reads it)."""
        job = self.jobs.pop(request, None)
        if job is None:
            return False
        task = self.tasks.pop(request, None)
        if task is not None:
            task.cancel()
        self._abort(request)
        self.started.discard(request)
        self.host.emit(RequestFinished(ts=self._now(), src=self.node_id, request=request,
                                       node=self._failed_node(job), error="cancelled"))
        return True

    def _abort(self, request: RequestId) -> None:
        """Tell the server a request's client is gone (beyond closing its stream); nothing by default."""

    def _failed_node(self, job: PrefillJob) -> NodeId:
        """The node a request that failed before its first token is reported finished on."""
        return self.node_id

    async def _serve(self, job: PrefillJob) -> None:
        """One request, retried while the server cannot be reached and nothing was sent yet (a
        server restarting, e.g. a peer's role switch); any other failure ends it with an error."""
        try:
            deadline = time.monotonic() + self.cfg.retry_s
            while True:
                try:
                    await self._serve_one(job)
                    break
                except aiohttp.ClientConnectorError:
                    if job.request in self.started or time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed request never stops the node
            log.error(f"{self.engine_name}_request_failed", request=job.request, error=f"{type(exc).__name__}: {exc}")
            self._finish(job, self._failed_node(job), 0, f"{type(exc).__name__}: {exc}")

    def _first(self, job: PrefillJob, decode_node: NodeId, cached: int, text: str) -> None:
        """The first streamed chunk: prefill started (with the server's cached prefix) and its first
        token on this node, decode started on ``decode_node``."""
        rid = job.request
        self.started.add(rid)
        now = self._now()
        self.host.emit(RequestStarted(ts=now, src=self.node_id, request=rid, node=self.node_id, phase="prefill",
                                      cached_tokens=min(cached, max(0, job.prompt_tokens - 1))))
        self.host.emit(FirstToken(ts=now, src=self.node_id, request=rid, node=self.node_id))
        self._token(request=rid, kind="first", tokens=1, total=1, text=text)
        self.host.emit(RequestStarted(ts=now, src=self.node_id, request=rid, node=decode_node, phase="decode"))

    def _finish(self, job: PrefillJob, decode_node: NodeId, total: int, error: str | None,
                finish_reason: str = "length") -> None:
        rid = job.request
        self.jobs.pop(rid, None)
        self.tasks.pop(rid, None)
        self.started.discard(rid)
        if error is not None:
            self._token(request=rid, kind="error", error=error)
        else:
            self._token(request=rid, kind="done", tokens=0, total=total, finish_reason=finish_reason)
        # a failure says so on the stream too (it was a RequestFinished like a completion's: the
        # recorder, verify and the chaos accounting counted a broken stream as a finished request)
        self.host.emit(RequestFinished(ts=self._now(), src=self.node_id, request=rid, node=decode_node,
                                       output_tokens=total, error=error or ""))

    def _now(self) -> float:
        catch_up = getattr(self.host, "catch_up", None)
        return catch_up() if catch_up is not None else self.host.now

    @property
    def role(self) -> Role:
        return self._role

    @property
    def id(self) -> NodeId:
        return self.node_id

    def _token(self, **kw) -> None:
        self.host.token(TokenMsg(node=self.node_id, ts=self._now(), **kw))

    def load(self) -> NodeLoad:
        """Requests this worker sent, or the server's own gauges when larger (a decode server
        also runs the requests its prefill peers sent it)."""
        running, queued = len(self.started), len(self.jobs) - len(self.started)
        if self.server_load is not None:
            running, queued = max(running, self.server_load[0]), max(queued, self.server_load[1])
        return NodeLoad(role=self._role, running=running, queued=queued,
                        l1_used_tokens=self.pool.used_tokens("L1"), l2_used_tokens=self.pool.used_tokens("L2"))

    async def _poll_metrics(self) -> None:
        """The server's running / queued gauges from ``/metrics``, summed over label sets (one per
        DP rank). A server that answers 404 exports none: polling stops and the load counts only
        this worker's requests."""
        while True:
            await asyncio.sleep(self.cfg.metrics_interval_s)
            try:
                async with self._http.get(f"{self.cfg.url}/metrics") as r:
                    if r.status == 404:
                        log.warning(f"{self.engine_name}_metrics_off", url=self.cfg.url, note=self.metrics_off_note)
                        return
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue  # restarting: keep the last reading
            self.server_load = (int(prom_sum(text, self.running_metric)), int(prom_sum(text, self.queued_metric)))
            self._metrics_seen(text)

    async def _kv_events(self, endpoints: list[str], topic: str) -> None:
        """Subscribe to the server's KV events (one publisher per DP rank) and fold every batch;
        a gap in a rank's sequence is counted and logged, a restarted publisher starts over."""
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        for ep in endpoints:
            sock.connect(ep)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        try:
            while True:
                parts = await sock.recv_multipart()
                try:
                    _, seq, batch = type(self).parse_frames(parts)
                except Exception as exc:  # noqa: BLE001 - a bad message is counted, not fatal
                    log.error("kv_event_unreadable", engine=self.engine_name, error=str(exc))
                    continue
                rank = batch.attn_dp_rank or 0  # one sequence per DP rank
                last = self.kv_seq.get(rank, -1)
                if 0 <= seq <= last:  # the publisher restarted (a relaunch): its sequence starts over
                    self._publisher_restarted(rank, last, seq)
                    last = -1
                if last >= 0 and seq != last + 1:
                    self.kv_gaps += 1
                    log.warning("kv_event_gap", engine=self.engine_name, rank=rank, expected=last + 1, got=seq)
                    self._events_lost(rank, last + 1, seq)
                self.kv_seq[rank] = seq
                self.apply_kv(batch)
        finally:
            sock.close(linger=0)

    def _publisher_restarted(self, rank: int, last: int, seq: int) -> None:
        """A publisher's sequence started over (``seq`` after ``last``): its server restarted. Nothing by default."""

    def _events_lost(self, rank: int, expected: int, got: int) -> None:
        """Events ``expected`` .. ``got - 1`` of a publisher never arrived. Nothing by default (counted)."""

    def _metrics_seen(self, text: str) -> None:
        """The server's ``/metrics`` text, at each poll. Nothing by default."""

    def apply_kv(self, batch) -> None:
        self._observe(self.pagemap.apply(batch))

    def _observe(self, changes: Iterable) -> None:
        """The page map's changes into the node's pool (what the directory then learns)."""
        for ch in changes:
            if ch.kind == "stored":
                self.pool.observe_stored(ch.tier, ch.blocks)
            elif ch.kind == "evicted":
                self.pool.observe_removed(ch.tier, ch.blocks)
            else:
                self.pool.drop_all()
