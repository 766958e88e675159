"""The SGLang backend: one SGLang server (launched or attached by URL) behind the engine port.

A request's life (docs/engines.md has the picture)
1. ``enqueue_prefill``: ``input_ids`` are the prompt's real token ids when the job carries them
   (``job.tokens``, read by the worker from the gateway's prompt store); a job without them (a
   replayed trace) gets ids made from its block hashes (:func:`prompt_ids`; equal blocks give
   equal ids, so SGLang's radix cache sees the trace's reuse), and the ids' own block hashes are
   registered as aliases of the request's blocks in the page map. Collocated (``--disaggregation-mode null``): one streamed
   ``POST /generate`` to our server. Prefill: the request goes to our server *and* to the decode
   node's server (``--peer-url``) with the same ``bootstrap_host/port/room`` - what SGLang's
   router does to pair a prefill and a decode server; the decode server streams the text.
2. First streamed chunk: ``RequestStarted(prefill, cached_tokens=meta_info.cached_tokens)`` and
   ``FirstToken`` on this node (and ``RequestStarted(decode)`` on the decode node when split).
3. Chunks: ``TokenMsg`` with the text delta. End: ``RequestFinished`` (``completion_tokens``)
   and ``done``. An HTTP error ends the request with an ``error`` token and ``RequestFinished``.
4. KV: ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` from the server's ZMQ publisher,
   translated by :class:`PageMap` into ``KvStored``/``KvEvicted`` through the node's KvPool
   (mirror mode: SGLang evicts on its own).

Role switch (SGLang's runtime PD role switch, PR #28403): stop taking new work is the
planner's part (it routes away from a switching node); the backend waits until nothing is in
flight (``--drain-timeout-s``), then ``POST /pd_role_switch {"new_role": R}``. SGLang refuses
unless idle, started with ``--enable-pd-role-switch``, in PD mode, and prefill<->decode only;
it then resets its prefix cache (so the switch is ``in_place_drop_kv`` for us). Where it
refuses (or the target is ``collocated``), the backend restarts a server it launched with the
new ``--disaggregation-mode``, or reports the old role in ``RoleSwitched`` when it only
attached. How it was really done, when that differs from the ordered mechanism, is in the
``RoleSwitched`` event itself (``mechanism``: ``in_place_drop_kv``, ``restart`` or ``refused``),
and also an ``AnomalyReported(component="engine.sglang", kind="role_switch_<...>")`` published
just before it, so SQL over anomalies lists every fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import shlex
import sys
import time
from urllib.parse import urlparse

import aiohttp

from engine.backend import BackendUnavailable, DecodeJob, PrefillJob, WorkerHost
from engine.backends.attached import (
    VOCAB,
    AttachedServer,
    finish_of,
    prompt_ids,
    sampling_params,
    sse_data,
    structured_params,
)
from engine.backends.kvmap import PageMap
from engine.backends.sglang.logparse import parse_decode_line
from engine.backends.sglang.options import SglangConfig
from engine.backends.sglang.wire import SGLANG_TIERS, parse_frames
from engine.kvpool import KvPool
from engine.profiles import Profile
from events.catalog import AnomalyReported, IterationDone, RoleSwitched
from events.ids import NodeId, RequestId, Role, SwitchMechanism
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger

log = get_logger("sglang")
__all__ = ["VOCAB", "SglangBackend", "SglangConfig", "bootstrap_room", "prompt_ids"]


def bootstrap_room(request: str) -> int:
    """A stable 63-bit room id per request (SGLang pairs prefill and decode by it)."""
    return int.from_bytes(hashlib.blake2b(request.encode(), digest_size=8).digest(), "little") >> 1


class SglangBackend(AttachedServer):
    """``EngineBackend`` driving one SGLang server (module docstring)."""

    engine_name = "sglang"
    running_metric, queued_metric = "sglang:num_running_reqs", "sglang:num_queue_reqs"
    metrics_off_note = "start SGLang with --enable-metrics"
    parse_frames = staticmethod(parse_frames)
    server_label, url_flag = "SGLang", "--sglang-url"

    name = "sglang"

    def __init__(self, host: WorkerHost, node: str, role: Role, profile: Profile, cfg: SglangConfig) -> None:
        self.host, self.cfg, self.profile = host, cfg, profile
        self.node_id = NodeId(node)
        self._role: Role = role
        self.server_mode = "null"
        self.bt = profile.block_tokens
        self.pool = KvPool(self.node_id, self.bt, profile.l1_capacity_tokens, profile.l2_capacity_tokens,
                           choose=lambda tier, tokens, pinned: [], emit=host.emit, now=self._now)
        self.pagemap = PageMap(self.bt, tiers=SGLANG_TIERS)
        self.jobs: dict[str, PrefillJob] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.started: set[str] = set()
        self.status = "up"
        self._held: list[PrefillJob] = []
        self.server_load: tuple[int, int] | None = None  # (running, queued) from /metrics
        self.kv_seq: dict[int, int] = {}  # DP rank -> last sequence seen
        self.kv_descriptor: dict | None = None
        self.kv_gaps = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._bg: list[asyncio.Task] = []

    # ------------------------------------------------------------------ helpers
    @classmethod
    async def preflight(cls, cfg: SglangConfig) -> None:
        """Attach mode: is something answering ``/health`` at the URL? One line if not."""
        if cfg.launch or not cfg.url:
            return
        await cls.check_health(cfg.url)

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s))
        if self.cfg.launch:
            await self._launch(self.cfg.launch)
        else:
            await self._wait_healthy()
        await self._read_server_info()
        endpoints, topic = self.kv_endpoints()
        if endpoints:
            log.info("sglang_kv_events", endpoints=endpoints, topic=topic)
            self._bg.append(asyncio.create_task(self._kv_events(endpoints, topic), name="sglang-kv-events"))
        else:
            log.warning("sglang_kv_events_off", url=self.cfg.url,
                        note="no --kv-events-endpoint and no kv_events in /server_info: the directory will not "
                             "learn this node's cache")
        if self.cfg.metrics_interval_s > 0:
            self._bg.append(asyncio.create_task(self._poll_metrics(), name="sglang-metrics"))

    async def _read_server_info(self) -> None:
        async with self._http.get(f"{self.cfg.url}/server_info") as r:
            info = await r.json(content_type=None)
        self.server_mode = str(info.get("disaggregation_mode") or "null")
        role = "collocated" if self.server_mode == "null" else self.server_mode
        if role != self._role:
            log.warning("role_from_server", node=self.node_id, asked=self._role, server=role)
            self._role = role
        page = int(info.get("page_size") or 1)
        if page % self.bt and self.bt % page:
            log.warning("page_size_mismatch", page_size=page, block_tokens=self.bt,
                        note="blocks still map (token chain), but pages straddle blocks")
        self.role_switch_enabled = bool(info.get("enable_pd_role_switch"))
        self.kv_descriptor = info.get("kv_events") if isinstance(info.get("kv_events"), dict) else None

    def kv_endpoints(self) -> tuple[list[str], str]:
        """ZMQ endpoints and topic to subscribe to: ``--kv-events-endpoint`` when given ("none":
        off), else the ``kv_events`` descriptor of ``/server_info`` as SGLang's own gateway reads
        it - one publisher per DP rank at ``endpoint_port_base + rank``, on the worker URL's host
        when the publisher binds a wildcard."""
        ep = self.cfg.kv_events_endpoint
        if ep:
            return ([] if ep == "none" else [ep]), self.cfg.kv_events_topic
        d = self.kv_descriptor
        if not d or d.get("publisher") != "zmq" or not d.get("endpoint_port_base"):
            return [], ""
        host = str(d.get("endpoint_host") or "*")
        if host in ("*", "0.0.0.0", "::", ""):
            host = _host_of(self.cfg.url)
        base, n = int(d["endpoint_port_base"]), max(1, int(d.get("dp_size") or 1))
        return [f"tcp://{host}:{base + r}" for r in range(n)], str(d.get("topic") or "")

    async def _launch(self, cmd: str) -> None:
        log.info("sglang_launch", cmd=cmd)
        self._proc = await asyncio.create_subprocess_exec(*shlex.split(cmd), stdout=asyncio.subprocess.PIPE,
                                                          stderr=asyncio.subprocess.STDOUT)
        self._bg.append(asyncio.create_task(self._server_log(self._proc.stdout), name="sglang-log"))
        deadline = time.monotonic() + self.cfg.launch_timeout_s
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                raise BackendUnavailable(f"SGLang launch exited with code {self._proc.returncode}: {cmd}")
            with contextlib.suppress(BackendUnavailable):
                await self.check_health(self.cfg.url)
                return
            await asyncio.sleep(1.0)
        raise BackendUnavailable(f"SGLang at {self.cfg.url} not healthy after {self.cfg.launch_timeout_s:.0f} s: {cmd}")

    async def close(self) -> None:
        await self._cancel_all()
        await self._stop_server()

    async def _stop_server(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                await wait_for(self._proc.wait(), 60)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()

    # ------------------------------------------------------------------ requests
    def enqueue_prefill(self, job: PrefillJob) -> None:
        self.jobs[job.request] = job
        if self.status != "up":  # draining or switching: send once the server serves its new role
            self._held.append(job)
            return
        self.tasks[job.request] = asyncio.create_task(self._serve(job), name=f"sglang-{job.request}")

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for job in held:
            if job.request in self.jobs:
                self.enqueue_prefill(job)

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        if request in self.started or request not in self.jobs:
            return None
        task = self.tasks.pop(request, None)
        if task is None:  # held during a switch: never sent
            self._held = [j for j in self._held if j.request != request]
            return self.jobs.pop(request)
        task.cancel()
        self._bg.append(asyncio.create_task(self._post("/abort_request", {"rid": request})))
        return self.jobs.pop(request)

    def _abort(self, request: RequestId) -> None:
        """A held request was never sent; a sent one is aborted on the server (``/abort_request``)."""
        held = len(self._held)
        self._held = [j for j in self._held if j.request != request]
        if len(self._held) == held:
            self._bg.append(asyncio.create_task(self._post("/abort_request", {"rid": request})))

    def kv_arrived(self, job: DecodeJob) -> None:
        """SGLang moves the KV itself (bootstrap pairing): nothing to do here."""

    async def _post(self, path: str, body: dict, url: str | None = None) -> tuple[int, dict]:
        async with self._http.post(f"{url or self.cfg.url}{path}", json=body) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text) if text else {}
            except ValueError:
                return r.status, {"message": text[:200]}

    def _failed_node(self, job: PrefillJob) -> NodeId:
        return job.decode_node

    async def _serve_one(self, job: PrefillJob) -> None:
        rid = job.request
        ids = self._request_ids(job)
        body = {"input_ids": ids, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": max(1, job.max_tokens), **sampling_params(job, seed=False),
                                    **structured_params(job, "sglang")}}
        decode_node, decode_url = self.node_id, self.cfg.url
        side = None
        if self.server_mode != "null":
            body |= {"bootstrap_host": self.cfg.bootstrap_host or _host_of(self.cfg.url),
                     "bootstrap_port": self.cfg.bootstrap_port, "bootstrap_room": bootstrap_room(rid)}
            if job.decode_node != self.node_id and job.decode_node in self.cfg.peers:
                decode_node, decode_url = job.decode_node, self.cfg.peers[job.decode_node]
                side = asyncio.create_task(self._post("/generate", body | {"stream": False}))
        text_len, total, sent, finish = 0, 0, 1, "length"
        try:
            async with self._http.post(f"{decode_url}/generate", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"POST {decode_url}/generate -> {r.status}: {(await r.text())[:200]}")
                async for out in sse_data(r.content):
                    meta = out.get("meta_info") or {}
                    text = out.get("text") or ""
                    if meta.get("finish_reason"):
                        finish = finish_of(meta["finish_reason"])
                    total = int(meta.get("completion_tokens", total))
                    if rid not in self.started:
                        self._first(job, decode_node, int(meta.get("cached_tokens") or 0), text)
                        text_len = len(text)
                        continue
                    delta, text_len = text[text_len:], len(text)
                    if delta or total > sent:
                        self._token(request=rid, kind="chunk", tokens=max(0, total - sent), total=total, text=delta)
                        sent = max(sent, total)
            if side is not None:
                await side
            self._finish(job, decode_node, total, None, finish)
        except (asyncio.CancelledError, aiohttp.ClientConnectorError):
            if side is not None:
                side.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - one failed request never stops the node
            log.error("sglang_request_failed", request=rid, error=str(exc))
            self._finish(job, decode_node, total, str(exc))

    # ------------------------------------------------------------------ iteration timing
    async def _server_log(self, stream: asyncio.StreamReader) -> None:
        """Pass the launched server's output through (to our stderr) and turn its decode log
        lines into ``IterationDone`` (engine/backends/sglang/logparse.py names the source)."""
        while True:
            line = await stream.readline()
            if not line:
                return
            sys.stderr.buffer.write(line)
            self.on_log_line(line.decode(errors="replace"))

    def on_log_line(self, line: str) -> None:
        stat = parse_decode_line(line)
        it = stat.iteration_s() if stat is not None else None
        if it is None:
            return
        self.host.emit(IterationDone(ts=self._now(), src=self.node_id, node=self.node_id, phase="decode",
                                     duration_s=it, batch=stat.running, t_fwd=self.profile.t_fwd,
                                     accepted_tokens=round(stat.running * stat.accept_len), queued=stat.queued,
                                     iterations=self.cfg.decode_log_interval))

    # ------------------------------------------------------------------ KV events
    # ------------------------------------------------------------------ role switch
    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        if self.status != "up":
            return
        self.status = "draining"
        self._bg.append(asyncio.create_task(self._switch(to_role, mechanism), name="sglang-switch"))

    async def _switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        t0 = self._now()
        drained = len(self.tasks)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        how, dropped, detail = "in_place_drop_kv", True, ""
        try:
            if to_role == self._role:
                how, dropped = "in_place", False
            elif to_role in ("prefill", "decode") and self.server_mode != "null":
                req = {"new_role": to_role}
                if to_role == "decode" and self.cfg.decode_cuda_graph_memory_gb is not None:
                    req["decode_cuda_graph_memory_gb"] = self.cfg.decode_cuda_graph_memory_gb
                status, out = await self._post("/pd_role_switch", req)
                while (status != 200 and "not idle" in str(out.get("message", ""))
                       and time.monotonic() < deadline):  # requests sent to it by a prefill peer: wait
                    await asyncio.sleep(0.2)
                    status, out = await self._post("/pd_role_switch", req)
                if status == 200 and out.get("success"):
                    self.server_mode = to_role
                else:
                    detail = str(out.get("message", status))
                    how = await self._fallback(to_role, detail)
            else:
                detail = "SGLang switches prefill<->decode only"
                how = await self._fallback(to_role, detail)
        except Exception as exc:  # noqa: BLE001 - a failed switch is reported, the node stays up
            detail, how = str(exc), "refused"
        if how == "refused":
            dropped = False
        else:
            self._role = to_role
        log.info("sglang_switch", node=self.node_id, to_role=to_role, how=how, detail=detail)
        self.status = "up"
        if how != mechanism:  # also an anomaly, so SQL over anomalies sees every fallback
            self.host.emit(AnomalyReported(ts=self._now(), src=self.node_id, component="engine.sglang",
                                           kind=f"role_switch_{how}", ref=self.node_id,
                                           detail=f"ordered {mechanism} to {to_role}; {how}" + (f": {detail}" if detail
                                                                                               else "")))
        self.host.emit(RoleSwitched(ts=self._now(), src=self.node_id, node=self.node_id, role=self._role,
                                    drained=drained, duration_s=self._now() - t0, kv_dropped=dropped,
                                    mechanism="" if how == mechanism else how))
        self._release_held()

    async def _fallback(self, to_role: Role, why: str) -> str:
        if self.cfg.switch_fallback != "restart" or not self.cfg.launch:
            log.warning("switch_refused", node=self.node_id, to_role=to_role, why=why)
            return "refused"
        mode = "null" if to_role == "collocated" else to_role
        cmd = re.sub(r"\s--disaggregation-mode[ =]\S+", "", self.cfg.launch) + f" --disaggregation-mode {mode}"
        await self._stop_server()
        self.apply_kv_cleared()
        await self._launch(cmd)
        self.cfg.launch = cmd
        await self._read_server_info()
        return "restart"

    def apply_kv_cleared(self) -> None:
        self.pagemap.pages.clear()
        self.pool.drop_all()


def _host_of(url: str | None) -> str:
    return urlparse(url or "").hostname or "127.0.0.1"
