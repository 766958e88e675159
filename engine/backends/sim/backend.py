"""The sim backend: :class:`SimNode` behind the engine port, for a live worker.

The node model runs on the worker's host (model time, scheduled callbacks). What the port adds
to the bare node: tokens for the gateway (the sim generates no text: ``"tok "`` per token) -
``first`` at the prefill's ``FirstToken``, ``chunk`` after each decode run and, while a run is
going, estimated from its iteration time at every ``progress()`` call, ``done`` at
``RequestFinished`` (none for a cancelled request: its client is gone).
"""

from __future__ import annotations

from engine.backend import DecodeJob, NodeLoad, PrefillJob, WorkerHost
from engine.backends.sim.node import SimNode
from engine.profiles import Profile
from events.catalog import Event, FirstToken, IterationDone, RequestFinished
from events.ids import NodeId, RequestId, Role, SwitchMechanism
from events.wire import TokenMsg, sim_text


class SimBackend:
    """``EngineBackend`` over the simulated node (module docstring)."""

    name = "sim"

    def __init__(self, host: WorkerHost, node: str, role: Role, profile: Profile, *, seed: int = 0,
                 fetch_mode: str = "async") -> None:
        self.host = host
        self.node_id = NodeId(node)
        self.profile = profile
        self.node = SimNode(self.node_id, role, profile, self, seed, fetch_mode)
        self._reported: dict[str, int] = {}  # request -> tokens sent to the gateway

    # ------------------------------------------------------------------ NodeHost for SimNode
    @property
    def now(self) -> float:
        return self.host.now

    def schedule(self, t: float, fn, *args) -> None:
        self.host.schedule(t, fn, *args)

    def choose_eviction(self, node, tier, tokens, pinned):
        return self.host.choose_eviction(node, tier, tokens, pinned)

    def peer(self, node):
        return self.node if node == self.node_id else self.host.peer(node)

    def emit(self, event: Event) -> None:
        self.host.emit(event)
        self._tokens_for(event)

    # ------------------------------------------------------------------ the port
    @property
    def role(self) -> Role:
        return self.node.role

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def enqueue_prefill(self, job: PrefillJob) -> None:
        self.node.enqueue_prefill(job)

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        return self.node.remove_queued(request)

    def cancel(self, request: RequestId) -> bool:
        return self.node.cancel(request)

    def kv_arrived(self, job: DecodeJob) -> None:
        self.node.kv_arrived(job)

    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        self.node.order_switch(to_role, mechanism)

    def queued(self) -> list[RequestId]:
        return [j.request for j in self.node.pqueue if not j.started]

    def load(self) -> NodeLoad:
        n = self.node
        return NodeLoad(role=n.role, running=len(n.running), queued=len(n.pqueue) + len(n.dwaiting),
                        l1_used_tokens=n.pool.used_tokens("L1"), l2_used_tokens=n.pool.used_tokens("L2"))

    def progress(self) -> None:
        """Chunks for the decode run in progress, estimated from its iteration time (never more
        than the run will have produced at its end)."""
        n = self.node
        if not (n.busy and n.run_batch and n.run_iter_s > 0):
            return
        clock = getattr(self.host, "clock", None)
        t = clock() if clock is not None else self.host.now
        done = min(n.run_iters, int((t - n.run_start_s) / n.run_iter_s))
        for job in n.running.values():
            est = job.total_out - job.left + min(job.left, done * self.profile.t_acc)
            self._chunk(job, int(est + 1e-9))

    # ------------------------------------------------------------------ tokens
    def _token(self, **kw) -> None:
        self.host.token(TokenMsg(node=self.node_id, ts=self.host.now, simulated=True, **kw))

    def _tokens_for(self, e: Event) -> None:
        t = type(e)
        if t is FirstToken:
            self._token(request=e.request, kind="first", tokens=1, total=1, text=sim_text(1))
        elif t is IterationDone and e.phase == "decode":
            for job in self.node.running.values():
                self._chunk(job, int(job.total_out - job.left + 1e-9))
        elif t is RequestFinished:
            sent = self._reported.pop(e.request, 1)
            if e.error:
                return
            rest = max(0, e.output_tokens - sent)
            self._token(request=e.request, kind="done", tokens=rest, total=e.output_tokens,
                        text=sim_text(rest), finish_reason="length")

    def _chunk(self, job: DecodeJob, produced: int) -> None:
        sent = self._reported.get(job.request, 1)
        produced = min(produced, job.total_out)
        if produced > sent:
            self._reported[job.request] = produced
            self._token(request=job.request, kind="chunk", tokens=produced - sent, total=produced,
                        text=sim_text(produced - sent))
