"""Prefill on one vLLM server, decode on another (``--vllm-pd``), a mixin of ``VllmBackend``.

Both servers run a KV connector with ``kv_role: kv_both`` over one store (vLLM's
``ExampleConnector``: the KV of every prompt written to a shared folder, keyed by its token
ids), so either can prefill for the other or decode what the other prefilled, and a role switch
is a change of what the worker asks, in place (no restart, no KV dropped).

1. Prefill node (a job whose ``decode_node`` is another node): the prompt with ``max_tokens``
   1; its server computes it and stores its KV; the one token streamed is the request's first
   (``RequestStarted(prefill)``, ``FirstToken``, the ``first`` token message). Nothing else: the
   request is the decode node's from here.
2. Decode node (the worker's ``kv_arrived`` on that ``FirstToken``): the same prompt, the same
   sampling (a non-greedy request without a seed gets one from its id, so both servers draw the
   same first token), the whole budget; the server loads the prompt's KV from the store
   (``cached_tokens`` counts it) instead of computing it and regenerates the first token, which is
   not sent again; the rest streams from here (``RequestStarted(decode)``, chunks, ``done``,
   ``RequestFinished``). The blocks it loaded reach the directory as this node's own
   ``KvStored``, from its server's KV events, like any block it caches.
3. vLLM's connector looks the prompt up by its first ``(len - 2) // block`` whole blocks and
   stores it under ``(len - 1) // block`` of them: a prompt of ``k * block + 1`` tokens misses
   and the decode server computes the prompt itself - the same output, no transfer.
Greedy output is token-identical to one server's (tests/vllm/); a first chunk that carries
two tokens at once would send the first token's text twice (vLLM streams one token per chunk).
"""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp

from engine.backend import DecodeJob, PrefillJob
from engine.backends.attached import prompt_ids
from events.catalog import AnomalyReported, FirstToken, RequestStarted, RoleSwitched
from events.ids import Role, SwitchMechanism
from services.adapters.logging import get_logger

log = get_logger("vllm")


def request_seed(request: str) -> int:
    """A seed both servers derive alike from a request id (vLLM takes a 63-bit int)."""
    return int.from_bytes(hashlib.blake2b(request.encode(), digest_size=8).digest(), "big") >> 1


class VllmPd:
    """The PD half of ``VllmBackend`` (module docstring)."""

    async def _serve_prefill(self, job: PrefillJob) -> None:
        rid = job.request
        ids = self._request_ids(job)
        cached = self.predicted_cached(job, len(ids))
        if self._fits(job, ids) is None:
            self._finish(job, self.node_id, 0, f"prompt of {len(ids)} tokens does not fit vLLM's "
                                               f"max_model_len {self.max_model_len}")
            return
        async for text, _total, _reason in self._stream(rid, self._body(job, ids, 1)):
            if rid in self.started:
                continue
            self.started.add(rid)
            now = self._now()
            self.host.emit(RequestStarted(ts=now, src=self.node_id, request=rid, node=self.node_id, phase="prefill",
                                          cached_tokens=min(cached, max(0, job.prompt_tokens - 1))))
            self.host.emit(FirstToken(ts=now, src=self.node_id, request=rid, node=self.node_id))
            self._token(request=rid, kind="first", tokens=1, total=1, text=text)
        self._usage_total.pop(rid, None)
        if rid in self._usage:
            self._compare_cached(rid, cached, self._usage.pop(rid))
        self.jobs.pop(rid, None)
        self.tasks.pop(rid, None)
        self.started.discard(rid)
        self.handed_off += 1

    def kv_arrived(self, job: DecodeJob) -> None:
        """Decode here what ``job.src_node`` prefilled (module docstring, 2)."""
        if job.src_node == self.node_id or not self.cfg.pd:
            return
        self.jobs[job.request] = job
        self.started.add(job.request)  # running, never queued: a reroute cannot take it
        self.tasks[job.request] = asyncio.create_task(self._serve_decode(job), name=f"vllm-decode-{job.request}")

    async def _serve_decode(self, job: DecodeJob) -> None:
        rid = job.request
        total, sent, finish = 0, 1, "length"
        try:
            ids = list(job.tokens) if job.tokens is not None else prompt_ids(job.blocks, job.prompt_tokens, self.bt, rid)
            max_tokens = self._fits(job, ids)
            if max_tokens is None:
                raise RuntimeError(f"prompt of {len(ids)} tokens does not fit vLLM's max_model_len {self.max_model_len}")
            self.host.emit(RequestStarted(ts=self._now(), src=self.node_id, request=rid, node=self.node_id,
                                          phase="decode"))
            async for text, total, reason in self._stream(rid, self._body(job, ids, max_tokens)):
                finish = reason or finish
                if total > sent:  # the first token was sent by the prefill node
                    self._token(request=rid, kind="chunk", tokens=total - sent, total=total, text=text)
                    sent = total
            total = self._usage_total.pop(rid, total)
            self.loaded_tokens += self._usage.pop(rid, 0)
            self._finish(job, self.node_id, max(1, total), None, finish)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, RuntimeError, OSError, ValueError) as exc:
            log.error("vllm_decode_failed", request=rid, error=str(exc))
            self._finish(job, self.node_id, total, f"{type(exc).__name__}: {exc}")

    def _switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        """In place with ``--vllm-pd`` (both servers take both roles); refused otherwise."""
        now = self._now()
        refused = to_role != self._role and not self.cfg.pd
        if refused:
            detail = (f"ordered {mechanism} to {to_role}; refused: this vLLM server runs no KV connector "
                      "(--vllm-pd), so it serves collocated only")
            log.warning("switch_refused", node=self.node_id, to_role=to_role, why=detail)
            self.host.emit(AnomalyReported(ts=now, src=self.node_id, component="engine.vllm",
                                           kind="role_switch_refused", ref=self.node_id, detail=detail))
        else:
            self._role = to_role
        self.host.emit(RoleSwitched(ts=now, src=self.node_id, node=self.node_id, role=self._role, drained=0,
                                    duration_s=0.0, kv_dropped=False, mechanism="refused" if refused else ""))
