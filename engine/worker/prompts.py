"""The worker's prompt fetch: a job's token ids from the prompt store before the backend gets it
(docs/engines.md, "Prompts").

A ``RouteDecided`` naming this node as prefill node makes a ``PrefillJob``; with a prompt store
(``--prompt-store``: on for every backend but ``sim``) :meth:`PromptFetch.enqueue` reads the ids
in a task of its own, so the event loop keeps folding the stream, and hands the job to the
backend with ``job.tokens`` set when they arrive. A decode job (a request prefilled elsewhere)
gets its ids the same way, fetched while its KV is in flight. No entry (a replayed trace carries
no tokens, the TTL expired, the bucket is absent) or a store that fails or does not answer
within ``timeout_s``: ``tokens`` stays None (the backend then makes ids from the block hashes)
and one structured line says why (``prompt_missing`` / ``prompt_fetch_failed``); never a crash.
A reroute away while the ids are on their way cancels the fetch (:meth:`remove_queued`).
Without a store every call goes straight to the backend, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.backend import DecodeJob, PrefillJob
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger

if TYPE_CHECKING:
    from services.adapters.bus.prompts import PromptStore

log = get_logger("worker")


class PromptFetch:
    """Between the stream and the backend (module docstring). ``worker`` gives ``backend``,
    ``host`` (``catch_up``, ``schedule``) and ``node_id``."""

    def __init__(self, worker, store: PromptStore | None, timeout_s: float = 5.0) -> None:
        self.worker, self.store, self.timeout_s = worker, store, timeout_s
        self._pending: dict[str, tuple[asyncio.Task, PrefillJob]] = {}
        self.found = self.missing = self.failed = 0

    # ------------------------------------------------------------------ prefill
    def enqueue(self, job: PrefillJob) -> None:
        """``backend.enqueue_prefill(job)``, with ``job.tokens`` from the store first."""
        if self.store is None or job.tokens is not None:
            self.worker.backend.enqueue_prefill(job)
            return
        task = asyncio.get_running_loop().create_task(self._tokens(job.request), name=f"prompt-{job.request}")
        self._pending[job.request] = (task, job)
        task.add_done_callback(lambda t, rid=job.request: self._prefill_ready(rid, t))

    def _prefill_ready(self, rid: str, task: asyncio.Task) -> None:
        entry = self._pending.get(rid)
        if entry is None or entry[0] is not task or task.cancelled():
            return  # taken back (a reroute) or replaced by a newer route
        del self._pending[rid]
        job = entry[1]
        job.tokens = task.result()
        self.worker.host.catch_up()
        self.worker.backend.enqueue_prefill(job)

    def remove_queued(self, rid: str) -> PrefillJob | None:
        """``backend.remove_queued(rid)``; a job whose ids are still on their way is taken back
        here (its fetch cancelled)."""
        entry = self._pending.pop(rid, None)
        if entry is not None:
            entry[0].cancel()
            return entry[1]
        return self.worker.backend.remove_queued(rid)

    def cancel_pending(self, rid: str) -> bool:
        """A job whose ids are still on their way is dropped (its fetch cancelled): True; else False."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            return False
        entry[0].cancel()
        return True

    def pending(self) -> list[str]:
        return sorted(self._pending)

    # ------------------------------------------------------------------ decode
    def kv_arrived_at(self, t: float, job: DecodeJob, schedule: Callable) -> None:
        """``schedule(t, backend.kv_arrived, job)``, with ``job.tokens`` fetched meanwhile; if
        they are not back at ``t`` the job waits for them (at most ``timeout_s``)."""
        if self.store is None or job.tokens is not None:
            schedule(t, self.worker.backend.kv_arrived, job)
            return
        task = asyncio.get_running_loop().create_task(self._tokens(job.request), name=f"prompt-d-{job.request}")

        def deliver(result: list[int] | None) -> None:
            job.tokens = result
            self.worker.host.catch_up()
            self.worker.backend.kv_arrived(job)

        def due() -> None:
            if task.done():
                deliver(None if task.cancelled() else task.result())
            else:
                task.add_done_callback(lambda t_: deliver(None if t_.cancelled() else t_.result()))

        schedule(t, due)

    # ------------------------------------------------------------------ the read
    async def _tokens(self, rid: str) -> list[int] | None:
        try:
            tokens = await wait_for(self.store.get(rid), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed read falls back to ids made from the hashes
            self.failed += 1
            log.warning("prompt_fetch_failed", node=self.worker.node_id, request=rid,
                        error=f"{type(exc).__name__}: {exc}".rstrip(": "), fallback="ids from block hashes")
            return None
        if tokens is None:
            self.missing += 1
            log.info("prompt_missing", node=self.worker.node_id, request=rid,
                     reason="no entry in the prompt store (a replayed trace, an expired TTL)",
                     fallback="ids from block hashes")
            return None
        self.found += 1
        return tokens
