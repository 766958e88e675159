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
   any of vLLM's layouts (engine/backends/vllm/wire.py) and translated by SGLang's page map
   (engine/backends/sglang/kvmap.py) with vLLM's media: ``GPU`` -> L1, ``CPU`` -> L2, storage
   tiers skipped. Of a hybrid model's KV-cache groups (``group_idx``) only the first
   full-attention group is followed: a sliding-window group drops blocks that the full group
   still holds.
4. Role: collocated only. PD over vLLM's KV connectors and a runtime role switch are not
   built: ``order_switch`` to another role is acknowledged with the old role
   (``RoleSwitched.mechanism="refused"`` and an ``AnomalyReported``).
5. Load: this worker's requests, or vLLM's ``vllm:num_requests_running`` /
   ``vllm:num_requests_waiting`` from ``/metrics`` when larger. No iteration timing (no log).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from engine.backend import BackendUnavailable, DecodeJob, PrefillJob, WorkerHost
from engine.backends.attached import AttachedServer, finish_of, sampling_params, sse_data
from engine.backends.sglang.kvmap import PageMap
from engine.backends.vllm.wire import MEDIUM_CPU, MEDIUM_GPU, parse_frames
from engine.kvpool import KvPool
from engine.profiles import Profile
from events.catalog import AnomalyReported, RoleSwitched
from events.ids import NodeId, RequestId, Role, SwitchMechanism
from services.adapters.logging import get_logger

log = get_logger("vllm")

#: vLLM's ``medium`` -> our tier (``cpu``: the Mooncake store connector's spelling).
VLLM_TIERS = {None: "L1", MEDIUM_GPU: "L1", MEDIUM_CPU: "L2", "cpu": "L2"}


@dataclass
class VllmConfig:
    url: str = ""
    model: str | None = None  # default: the first of GET /v1/models
    api_key: str | None = None  # vLLM --api-key
    wait_s: float = 0.0
    kv_events_endpoints: list[str] = field(default_factory=list)
    kv_events_topic: str = ""
    metrics_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    retry_s: float = 60.0


def config_from_args(args) -> VllmConfig:
    eps = [e.strip() for e in (args.kv_events_endpoint or "").split(",") if e.strip() and e.strip() != "none"]
    return VllmConfig(url=args.vllm_url.rstrip("/"), model=args.vllm_model,
                      api_key=args.vllm_api_key or os.environ.get("VLLM_API_KEY") or None,
                      wait_s=args.vllm_wait_s, kv_events_endpoints=eps, kv_events_topic=args.kv_events_topic,
                      metrics_interval_s=args.metrics_interval_s, request_timeout_s=args.request_timeout_s)


class VllmBackend(AttachedServer):
    """``EngineBackend`` attached to one vLLM server (module docstring)."""

    engine_name = "vllm"
    running_metric, queued_metric = "vllm:num_requests_running", "vllm:num_requests_waiting"
    parse_frames = staticmethod(parse_frames)
    server_label, url_flag = "vLLM", "--vllm-url"

    name = "vllm"

    def __init__(self, host: WorkerHost, node: str, role: Role, profile: Profile, cfg: VllmConfig) -> None:
        self.host, self.cfg, self.profile = host, cfg, profile
        self.node_id = NodeId(node)
        if role != "collocated":
            log.warning("vllm_role_collocated", node=node, asked=role,
                        note="the vLLM backend serves collocated only (no PD pairing over vLLM's KV connectors)")
        self._role: Role = "collocated"
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
        if not self.model:
            async with self._http.get(f"{self.cfg.url}/v1/models") as r:
                data = (await r.json(content_type=None)).get("data") or []
            if r.status != 200 or not data:
                await self._http.close()
                raise BackendUnavailable(f"vLLM at {self.cfg.url} lists no model (GET /v1/models -> {r.status}); "
                                         "pass --vllm-model")
            self.model = str(data[0]["id"])
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

    def kv_arrived(self, job: DecodeJob) -> None:
        """Collocated only: never called with work to do."""

    async def _serve_one(self, job: PrefillJob) -> None:
        rid = job.request
        ids = self._request_ids(job)
        cached = self.pool.prefix_len(job.blocks, 0, self.pool.l1) * self.bt
        body = {"model": self.model, "prompt": ids, "max_tokens": max(1, job.max_tokens), "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                **sampling_params(job), "request_id": rid}
        total, sent, finish = 0, 1, "length"
        try:
            async with self._http.post(f"{self.cfg.url}/v1/completions", json=body,
                                       headers={"X-Request-Id": rid}) as r:
                if r.status != 200:
                    raise RuntimeError(f"POST {self.cfg.url}/v1/completions -> {r.status}: {(await r.text())[:200]}")
                async for out in sse_data(r.content):
                    if "error" in out and not out.get("choices"):
                        raise RuntimeError(str(out["error"].get("message", out["error"]))
                                           if isinstance(out["error"], dict) else str(out["error"]))
                    usage = out.get("usage") or {}
                    choices = out.get("choices") or []
                    if not choices:  # the closing usage chunk
                        total = int(usage.get("completion_tokens", total))
                        continue
                    text = choices[0].get("text") or ""
                    if choices[0].get("finish_reason"):
                        finish = finish_of(choices[0]["finish_reason"])
                    total = int(usage["completion_tokens"]) if "completion_tokens" in usage else total + 1
                    if rid not in self.started:
                        self._first(job, self.node_id, cached, text)
                        continue
                    if text or total > sent:
                        self._token(request=rid, kind="chunk", tokens=max(0, total - sent), total=total, text=text)
                        sent = max(sent, total)
            self._finish(job, self.node_id, total, None, finish)
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
        batch.events = [ev for ev in batch.events if self._followed(ev)]
        self._observe(self.pagemap.apply(batch))

    # ------------------------------------------------------------------ role switch
    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        asyncio.get_running_loop().call_soon(self._switch, to_role, mechanism)

    def _switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        now = self._now()
        refused = to_role != self._role
        if refused:
            detail = f"ordered {mechanism} to {to_role}; refused: the vLLM backend serves collocated only"
            log.warning("switch_refused", node=self.node_id, to_role=to_role, why=detail)
            self.host.emit(AnomalyReported(ts=now, src=self.node_id, component="engine.vllm",
                                           kind="role_switch_refused", ref=self.node_id, detail=detail))
        self.host.emit(RoleSwitched(ts=now, src=self.node_id, node=self.node_id, role=self._role, drained=0,
                                    duration_s=0.0, kv_dropped=False,
                                    mechanism="refused" if refused else ""))
