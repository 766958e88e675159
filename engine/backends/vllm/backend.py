"""The vLLM backend: one running vLLM server, attached by URL, behind the engine port.

Attach only (``--backend vllm --vllm-url URL``): the worker never launches vLLM.
1. ``enqueue_prefill``: the prompt's token ids are the job's own (``job.tokens``, read by the
   worker from the gateway's prompt store); a job without them (a replayed trace) gets ids
   made from its block hashes, as for SGLang (engine/backends/sglang/backend.py
   :func:`prompt_ids`), whose block hashes are registered as aliases of the request's blocks in
   the page map.
   One streamed ``POST /v1/completions`` (vLLM's OpenAI-compatible API) with the ids as
   ``prompt``, ``max_tokens``, the request's sampling and stopping (``attached.sampling_params``:
   greedy and ``ignore_eos`` unless the request says otherwise), ``request_id`` (our request id,
   also ``X-Request-Id``) and ``stream_options {include_usage, continuous_usage_stats}``; the
   server's ``finish_reason`` becomes the ``done`` message's.
2. First streamed chunk: ``RequestStarted(prefill)`` (``cached_tokens``: the prefix of the
   request's blocks the node's pool holds in L1, i.e. what vLLM's own KV events said it
   cached; vLLM reports ``prompt_tokens_details.cached_tokens`` only in the last chunk),
   ``FirstToken``, ``RequestStarted(decode)``. Chunks: ``TokenMsg`` with the text delta, counted
   by ``usage.completion_tokens``. End: ``RequestFinished``. A reroute of a request without a
   token yet closes the stream: vLLM aborts a request whose client went away.
3. KV: vLLM's ZMQ publisher (``--kv-events-config``; one per DP rank, port + rank), decoded in
   any of vLLM's layouts (engine/backends/vllm/wire.py) and translated by the page map both
   engine backends share (engine/backends/kvmap.py) with vLLM's media: ``GPU`` -> L1, ``CPU`` -> L2, storage
   tiers skipped. Of a hybrid model's KV-cache groups (``group_idx``) only the first
   full-attention group is followed: a sliding-window group drops blocks that the full group
   still holds.
4. Role: with ``--vllm-pd`` (the server runs a ``kv_both`` KV connector shared with its
   peers) any role, switched in place, and prefill on one server with decode on another
   (engine/backends/vllm/pd.py); without it collocated only: ``order_switch`` to another role is
   acknowledged with the old role (``RoleSwitched.mechanism="refused"`` and an
   ``AnomalyReported``).
5. Load: this worker's requests, or vLLM's ``vllm:num_requests_running`` /
   ``vllm:num_requests_waiting`` from ``/metrics`` when larger. No iteration timing (no log).
6. The server's own limits, read at start: the KV capacity the node registers is vLLM's
   ``num_gpu_blocks`` x ``block_size`` (``vllm:cache_config_info`` on ``/metrics``; the
   profile's when the server exports none), the context limit its ``max_model_len``
   (``GET /v1/models``): ``max_tokens`` is cut to what fits, a longer prompt fails with one line.
7. The node's KV view is kept true to the server's cache (:meth:`VllmBackend.resync`): the view
   is dropped (``KvEvicted`` of every block: the directory forgets them) and the server's prefix
   cache reset (``POST /reset_prefix_cache``, served by vLLM with ``VLLM_SERVER_DEV_MODE=1``;
   ``evolving up`` starts its servers so) whenever the two may have parted: at the worker's
   start (a restarted worker has lost its page map and vLLM still holds blocks), when the
   publisher's sequence starts over or ``process_start_time_seconds`` changes (a new server
   instance: its cache is empty, the old blocks must go) and when events were lost (a gap). A
   server that refuses the reset keeps its blocks: events about them are counted
   (``orphan_pages``, ``unknown_removed``) and exported on the worker's ``/metrics``
   (``ei_engine_kv_event_anomalies_total{kind}``), never silently dropped.
8. The view against vLLM's own cache: when the server reports ``cached_tokens`` (started with
   ``--enable-prompt-tokens-details``, as ``evolving up`` starts it), the prefix the view
   predicted (:meth:`VllmBackend.predicted_cached`, what ``RequestStarted.cached_tokens`` says)
   is compared with it per request: ``ei_engine_cached_tokens_vs_server_total{outcome}``
   (``agree``, ``disagree``) and ``ei_engine_cached_tokens_vs_server_diff_tokens_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import aiohttp

from engine.backend import BackendUnavailable, DecodeJob, PrefillJob, WorkerHost
from engine.backends.attached import (
    AttachedServer,
    finish_of,
    prom_sum,
    sampling_params,
    sse_data,
    structured_params,
)
from engine.backends.kvmap import PageMap
from engine.backends.vllm.options import VllmConfig
from engine.backends.vllm.pd import VllmPd, request_seed
from engine.backends.vllm.wire import MEDIUM_CPU, MEDIUM_GPU, parse_frames
from engine.kvpool import KvPool
from engine.profiles import Profile
from events.catalog import AnomalyReported
from events.ids import NodeId, RequestId, Role, SwitchMechanism
from services.adapters.logging import get_logger

log = get_logger("vllm")

#: vLLM's ``medium`` -> our tier (``cpu``: the Mooncake store connector's spelling).
VLLM_TIERS = {None: "L1", MEDIUM_GPU: "L1", MEDIUM_CPU: "L2", "cpu": "L2"}


def prom_labels(text: str, metric: str) -> dict[str, str]:
    """The labels of the first sample of ``metric`` in Prometheus text exposition ({} when absent)."""
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body = line[len(metric) + 1:line.rfind("}")]
            out, i = {}, 0
            while i < len(body):
                eq = body.index("=", i)
                key, j, val = body[i:eq].strip(", "), eq + 2, []
                while body[j] != '"':
                    if body[j] == "\\":
                        j += 1
                    val.append(body[j])
                    j += 1
                out[key] = "".join(val)
                i = j + 1
            return out
    return {}


def capacity_of(text: str) -> int | None:
    """vLLM's KV capacity in tokens from its ``/metrics`` (``num_gpu_blocks`` x ``block_size``)."""
    info = prom_labels(text, "vllm:cache_config_info")
    try:
        return int(info["num_gpu_blocks"]) * int(info["block_size"])
    except (KeyError, ValueError):
        return None


class VllmBackend(VllmPd, AttachedServer):
    """``EngineBackend`` attached to one vLLM server (module docstring)."""

    engine_name = "vllm"
    running_metric, queued_metric = "vllm:num_requests_running", "vllm:num_requests_waiting"
    parse_frames = staticmethod(parse_frames)
    server_label, url_flag = "vLLM", "--vllm-url"

    name = "vllm"
    events_silence_s = 5.0  # after a request that filled a KV block, this long without an event is an error
    reset_tries, reset_retry_s = 10, 1.0  # a prefix-cache reset refused while blocks are held is tried again

    def __init__(self, host: WorkerHost, node: str, role: Role, profile: Profile, cfg: VllmConfig) -> None:
        self.host, self.cfg, self.profile = host, cfg, profile
        self.node_id = NodeId(node)
        if role != "collocated" and not cfg.pd:
            log.warning("vllm_role_collocated", node=node, asked=role,
                        note="without --vllm-pd (a KV connector on the server) the vLLM backend serves collocated only")
        self._role: Role = role if cfg.pd else "collocated"
        self.handed_off = 0  # prefills whose decode went to another node's server (pd.py)
        self.loaded_tokens = 0  # prompt tokens decode requests found cached or loaded (pd.py)
        self.bt = profile.block_tokens
        self.pool = KvPool(self.node_id, self.bt, profile.l1_capacity_tokens, profile.l2_capacity_tokens,
                           choose=lambda tier, tokens, pinned: [], emit=host.emit, now=self._now)
        self.pagemap = PageMap(self.bt, tiers=VLLM_TIERS)
        self.model = cfg.model
        self.jobs: dict[str, PrefillJob] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.started: set[str] = set()
        self.server_load: tuple[int, int] | None = None
        self.kv_seq: dict[int, int] = {}
        self.kv_gaps = 0
        self.kv_group: int | None = None  # the KV-cache group followed (hybrid models)
        self.skipped: Counter[str] = Counter()
        self.resyncs: Counter[str] = Counter()  # why the KV view was dropped (module docstring, 7)
        self.kv_capacity_tokens: tuple[int, int] | None = None  # (L1, L2) the server has, once read
        self.max_model_len: int | None = None
        self.server_started_s: float | None = None  # process_start_time_seconds of the server
        self.kv_events_seen = 0
        self._usage: dict[str, int] = {}  # request -> the cached_tokens its server reported
        self._usage_total: dict[str, int] = {}  # request -> its closing completion_tokens
        self.cached_vs_server: Counter[str] = Counter()  # agree / disagree / diff_tokens (module docstring, 8)
        self.server_block_size = 16  # vLLM's --block-size, read at start (the CPU default 128 when not exported)
        self._silence_check: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None
        self._bg: list[asyncio.Task] = []

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    @classmethod
    async def preflight(cls, cfg: VllmConfig) -> None:
        """Is a server answering ``/health`` at the URL? One line if not."""
        await cls.check_health(cfg.url)

    async def start(self) -> None:
        await self._wait_healthy()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
                                           headers=self._headers())
        await self._server_facts()
        await self.resync("worker_start")
        if self.cfg.kv_events_endpoints:
            log.info("vllm_kv_events", endpoints=self.cfg.kv_events_endpoints, topic=self.cfg.kv_events_topic)
            self._bg.append(asyncio.create_task(self._kv_events(self.cfg.kv_events_endpoints,
                                                                self.cfg.kv_events_topic), name="vllm-kv-events"))
        else:
            log.warning("vllm_kv_events_off", url=self.cfg.url,
                        note="no --kv-events-endpoint: the directory will not learn this node's cache")
        if self.cfg.metrics_interval_s > 0:
            self._bg.append(asyncio.create_task(self._poll_metrics(), name="vllm-metrics"))

    async def close(self) -> None:
        await self._cancel_all()

    async def _server_facts(self) -> None:
        """The model served, its ``max_model_len`` and the server's KV capacity (module docstring, 6)."""
        async with self._http.get(f"{self.cfg.url}/v1/models") as r:
            data = (await r.json(content_type=None)).get("data") or [] if r.status == 200 else []
        if not data:
            await self._http.close()
            raise BackendUnavailable(f"vLLM at {self.cfg.url} lists no model (GET /v1/models -> {r.status}); "
                                     "pass --vllm-model")
        entry = next((d for d in data if d.get("id") == self.model), None if self.model else data[0])
        self.model = self.model or str(data[0]["id"])
        if entry is not None and isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]
        try:
            async with self._http.get(f"{self.cfg.url}/metrics") as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, OSError):
            text = ""
        cap = capacity_of(text)
        with contextlib.suppress(KeyError, ValueError):
            self.server_block_size = int(prom_labels(text, "vllm:cache_config_info")["block_size"])
        if cap is not None:
            self.kv_capacity_tokens = (cap, 0)
            self.pool.l1_cap_blocks = cap // self.bt
        else:
            log.warning("vllm_capacity_unknown", url=self.cfg.url,
                        note="no vllm:cache_config_info on /metrics: the node registers the profile's KV capacity")
        self.server_started_s = prom_sum(text, "process_start_time_seconds") or None
        log.info("vllm_server", url=self.cfg.url, model=self.model, max_model_len=self.max_model_len,
                 kv_capacity_tokens=cap)

    # ------------------------------------------------------------------ the KV view (module docstring, 7)
    async def resync(self, reason: str) -> bool:
        """Drop the node's KV view and reset the server's prefix cache; True if the server did."""
        self._drop_view(reason)
        for attempt in range(self.reset_tries):
            if attempt:  # vLLM refuses while blocks are held (requests of a previous worker still ending)
                await asyncio.sleep(self.reset_retry_s)
            ok, detail, again = await self._reset_once()
            if ok or not again:
                break
        if not ok:
            self.resyncs["reset_refused"] += 1
            log.warning("vllm_cache_reset_refused", url=self.cfg.url, reason=reason, detail=detail,
                        note="blocks vLLM cached before now stay unknown to the directory: events about them are "
                             "counted as orphan_pages / unknown_removed (start vLLM with VLLM_SERVER_DEV_MODE=1)")
        return ok

    async def _reset_once(self) -> tuple[bool, str, bool]:
        """One ``POST /reset_prefix_cache``: (done, why not, worth trying again). vLLM answers 200
        with ``{"success": false}`` while blocks are still held, 404 without dev mode."""
        try:
            async with self._http.post(f"{self.cfg.url}/reset_prefix_cache") as r:
                if r.status != 200:
                    return False, f"POST /reset_prefix_cache -> {r.status}", False
                try:
                    body = await r.json(content_type=None)
                except ValueError:
                    body = None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"POST /reset_prefix_cache: {type(exc).__name__}", True
        if isinstance(body, dict) and body.get("success") is False:
            return False, "POST /reset_prefix_cache -> success false (blocks still held)", True
        return True, "", False

    def _drop_view(self, reason: str) -> None:
        """Forget every block of the node (``KvEvicted`` per tier) and the page map's state."""
        self.resyncs[reason] += 1
        held = len(self.pool.l1) + len(self.pool.l2)
        self.pagemap.pages.clear()
        self.kv_seq.clear()
        self.pool.drop_all()
        if reason != "worker_start":
            detail = f"{reason}: dropped the node's {held} KV blocks; the view refills from the server's events"
            log.warning("vllm_kv_view_dropped", node=self.node_id, reason=reason, blocks=held)
            self.host.emit(AnomalyReported(ts=self._now(), src=self.node_id, component="engine.vllm",
                                           kind="engine_kv_resync", ref=self.node_id, detail=detail))

    def _publisher_restarted(self, rank: int, last: int, seq: int) -> None:
        self._drop_view("server_restarted")  # a new server's cache starts empty: no reset to ask for

    def _events_lost(self, rank: int, expected: int, got: int) -> None:
        if self._http is not None:
            self._bg.append(asyncio.create_task(self.resync("events_lost"), name="vllm-resync"))

    def _metrics_seen(self, text: str) -> None:
        started = prom_sum(text, "process_start_time_seconds") or None
        if started is None or started == self.server_started_s:
            return
        known, self.server_started_s = self.server_started_s, started
        if known is not None:  # another server process answers at the URL now
            self._bg.append(asyncio.create_task(self.resync("server_instance_changed"), name="vllm-resync"))

    # ------------------------------------------------------------------ the view vs vLLM's own cache
    def predicted_cached(self, job: PrefillJob, prompt_len: int) -> int:
        """The prompt tokens vLLM will find cached, as the node's view (the directory's) predicts:
        the request's leading blocks held in L1, at most ``prompt_len - 1`` tokens in whole vLLM
        blocks (vLLM computes a prompt's last token even on a full hit, so a prompt of exactly N
        cached blocks reuses N - 1 of them)."""
        held = self.pool.prefix_len(job.blocks, 0, self.pool.l1) * self.bt
        sbs = self.server_block_size
        return min(held, (max(0, prompt_len - 1) // sbs) * sbs)

    def _compare_cached(self, request: RequestId, predicted: int, server: int) -> None:
        """vLLM's reported ``cached_tokens`` (``--enable-prompt-tokens-details``) against the
        prediction: counted, the difference in tokens summed (the worker's ``/metrics``)."""
        outcome = "agree" if predicted == server else "disagree"
        self.cached_vs_server[outcome] += 1
        self.cached_vs_server["diff_tokens"] += abs(predicted - server)
        if outcome == "disagree":
            log.info("vllm_cached_disagree", request=request, predicted=predicted, server=server)

    async def _check_events_arrive(self) -> None:
        """A request filled a whole vLLM block, so vLLM published a ``BlockStored``: say so loudly if
        none arrived (the usual cause: an endpoint that is not the server's host and port)."""
        await asyncio.sleep(self.events_silence_s)
        if not self.kv_events_seen:
            self.resyncs["silent_publisher"] += 1
            log.error("vllm_kv_events_silent", url=self.cfg.url, endpoints=self.cfg.kv_events_endpoints,
                      note="a request filled a KV block but no KV event arrived: is --kv-events-endpoint the server's "
                           "host and the port of its --kv-events-config endpoint (the server binds tcp://*:P; connect "
                           "to tcp://HOST:P), and its topic --kv-events-topic?")

    def kv_event_counts(self) -> dict[str, int]:
        """What could not be folded or had to be dropped, by kind (the worker's ``/metrics``)."""
        out = {"orphan_pages": 0, "unknown_removed": 0, "sequence_gaps": self.kv_gaps}
        out.update(self.pagemap.errors)
        out.update({f"skipped_{k}": v for k, v in self.skipped.items()})
        out.update({f"resync_{k}": v for k, v in self.resyncs.items()})
        return out

    # ------------------------------------------------------------------ requests
    def enqueue_prefill(self, job: PrefillJob) -> None:
        self.jobs[job.request] = job
        self.tasks[job.request] = asyncio.create_task(self._serve(job), name=f"vllm-{job.request}")

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        if request in self.started or request not in self.jobs:
            return None
        task = self.tasks.pop(request, None)
        if task is not None:
            task.cancel()  # the stream closes: vLLM aborts a request whose client went away
        return self.jobs.pop(request)

    def _body(self, job: PrefillJob | DecodeJob, ids: list[int], max_tokens: int) -> dict:
        """The streamed ``POST /v1/completions`` of a request: its ids, budget, sampling, id."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                **sampling_params(job), **structured_params(job, "vllm"), "request_id": job.request}
        if self.cfg.pd and "seed" not in body and body.get("temperature"):
            body["seed"] = request_seed(job.request)  # prefill and decode servers draw the same first token
        return body

    def _fits(self, job: PrefillJob | DecodeJob, ids: list[int]) -> int | None:
        """The ``max_tokens`` to send (cut to what fits ``max_model_len``), or None: the prompt does not fit."""
        max_tokens = max(1, job.max_tokens)
        if self.max_model_len is None:
            return max_tokens
        if len(ids) >= self.max_model_len:
            return None
        return min(max_tokens, self.max_model_len - len(ids))

    async def _stream(self, rid: str, body: dict):
        """Each choice chunk of the server's stream as ``(text, completion tokens so far, finish
        reason or None)``; the closing usage chunk's ``cached_tokens`` and ``completion_tokens`` go to
        ``self._usage[rid]`` and ``self._usage_total[rid]``."""
        total = 0
        async with self._http.post(f"{self.cfg.url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {self.cfg.url}/v1/completions -> {r.status}: {(await r.text())[:200]}")
            async for out in sse_data(r.content):
                if "error" in out and not out.get("choices"):
                    raise RuntimeError(str(out["error"].get("message", out["error"]))
                                       if isinstance(out["error"], dict) else str(out["error"]))
                usage = out.get("usage") or {}
                choices = out.get("choices") or []
                if not choices:  # the closing usage chunk
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        self._usage[rid] = details["cached_tokens"]
                    if "completion_tokens" in usage:
                        self._usage_total[rid] = int(usage["completion_tokens"])
                    continue
                total = int(usage["completion_tokens"]) if "completion_tokens" in usage else total + 1
                reason = choices[0].get("finish_reason")
                yield choices[0].get("text") or "", total, finish_of(reason) if reason else None

    async def _serve_one(self, job: PrefillJob) -> None:
        """A request prefilled here: decoded here too (collocated), or handed to its decode node's
        server (:meth:`_serve_prefill`, PD)."""
        if job.decode_node not in (None, "", self.node_id) and self.cfg.pd:
            await self._serve_prefill(job)
            return
        rid = job.request
        ids = self._request_ids(job)
        cached = self.predicted_cached(job, len(ids))
        max_tokens = self._fits(job, ids)
        if max_tokens is None:
            self._finish(job, self.node_id, 0, f"prompt of {len(ids)} tokens does not fit vLLM's "
                                               f"max_model_len {self.max_model_len}")
            return
        total, sent, finish = 0, 1, "length"
        try:
            async for text, total, reason in self._stream(rid, self._body(job, ids, max_tokens)):
                finish = reason or finish
                if rid not in self.started:
                    self._first(job, self.node_id, cached, text)
                elif text or total > sent:
                    self._token(request=rid, kind="chunk", tokens=max(0, total - sent), total=total, text=text)
                    sent = max(sent, total)
            total = self._usage_total.pop(rid, total)
            self._finish(job, self.node_id, total, None, finish)
            if rid in self._usage:
                self._compare_cached(rid, cached, self._usage.pop(rid))
            if (self._silence_check is None and self.cfg.kv_events_endpoints and not self.kv_events_seen
                    and len(ids) >= self.server_block_size):
                self._silence_check = asyncio.create_task(self._check_events_arrive(), name="vllm-kv-silence")
                self._bg.append(self._silence_check)
        except (asyncio.CancelledError, aiohttp.ClientConnectorError):
            raise
        except Exception as exc:  # noqa: BLE001 - one failed request never stops the node
            log.error("vllm_request_failed", request=rid, error=str(exc))
            self._finish(job, self.node_id, total, str(exc))

    # ------------------------------------------------------------------ KV events
    def _followed(self, ev) -> bool:
        """Events of the KV-cache group we follow (module docstring, 3)."""
        group = getattr(ev, "group_idx", None)
        if group is None or group == self.kv_group:
            return True
        if (self.kv_group is None and type(ev).__name__ == "BlockStored"
                and ev.kv_cache_spec_kind in (None, "full_attention")):
            self.kv_group = group
            return True
        self.skipped[f"group_{group}"] += 1
        return False

    def apply_kv(self, batch) -> None:
        self.kv_events_seen += len(batch.events)
        batch.events = [ev for ev in batch.events if self._followed(ev)]
        self._observe(self.pagemap.apply(batch))

    # ------------------------------------------------------------------ role switch
    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        asyncio.get_running_loop().call_soon(self._switch, to_role, mechanism)
