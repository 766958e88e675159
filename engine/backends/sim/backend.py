"""The sim backend: :class:`SimNode` behind the engine port, for a live worker.

The node model runs on the worker's host (model time, scheduled callbacks). What the port adds
to the bare node: tokens for the gateway (the sim generates no model text: the words of
``events.wire.SIM_WORDS``, one per token, which re-tokenise to the same count) -
``first`` at the prefill's ``FirstToken``, ``chunk`` after each decode run and, while a run is
going, estimated from its iteration time at every ``progress()`` call, ``done`` at
``RequestFinished`` (none for a cancelled request: its client is gone).

The node ends a turn like a model (lengths.py): each request's output length is drawn from the
profile's ``[output]`` quantiles (or the default fitted on real Claude Code sessions), seeded by
its request id, capped by ``max_tokens``; ``osl`` sets it instead; ``ignore_eos`` true, or not
said (a trace driver's request: its budget is the recorded length), makes it the whole budget.
``done`` says ``finish_reason`` ``"stop"`` when the output ended before the budget, ``"length"``
when it reached it. A prefill node and a decode node draw the same length.

A constrained request (``sampling.constraint``: a forced tool call, a JSON schema) gets a value
that validates instead of those words (instance.py): its text is ``prefix + JSON + suffix``, one
token per :data:`CHARS_PER_TOKEN` characters; its length is that many tokens (capped by
``max_tokens``, ``"length"`` then), whatever ``ignore_eos`` says, and it ends ``"stop"`` when whole.
"""


from __future__ import annotations

from engine.backend import DecodeJob, NodeLoad, PrefillJob, Sampling, WorkerHost
from engine.backends.sim.instance import constrained_text
from engine.backends.sim.lengths import DEFAULT_OUTPUT_TOKENS, sim_output_tokens
from engine.backends.sim.node import SimNode
from engine.profiles import Profile
from events.catalog import Event, FirstToken, IterationDone, RequestFinished
from events.ids import NodeId, RequestId, Role, SwitchMechanism
from events.wire import TokenMsg, sim_text
from replay.traces.workloads import Quantiles

#: characters of a constrained output per simulated token (about a BPE token's on JSON)
CHARS_PER_TOKEN = 4


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
        self._budget: dict[str, int] = {}  # request -> its max_tokens, for the finish reason
        self._texts: dict[str, str] = {}  # request -> its constrained output's text (instance.py)
        self.output_lengths = (Quantiles(q=profile.output_tokens_q, p=profile.output_tokens_p, integer=True)
                               if profile.output_tokens_q else DEFAULT_OUTPUT_TOKENS)

    def output_tokens(self, request: str, max_tokens: int, osl: int, ignore_eos: bool | None,
                      sampling: Sampling | None = None) -> int:
        """The output length this node gives ``request`` (module docstring): a constrained
        output's tokens, else a drawn length."""
        c = sampling.constraint if sampling is not None else None
        if c is not None:
            text = self._texts.setdefault(request, constrained_text(c.json_schema, c.prefix, c.suffix))
            return min(max(1, max_tokens), -(-len(text) // CHARS_PER_TOKEN))
        return sim_output_tokens(request, max_tokens, osl=osl, ignore_eos=ignore_eos, dist=self.output_lengths)

    def _text(self, request: str, start: int, end: int) -> str:
        """The text of output tokens ``start`` to ``end``: a constrained output's characters, else
        the sim words at those positions (``sim_text``)."""
        text = self._texts.get(request)
        if text is None:
            return sim_text(end - start, start)
        return text[start * CHARS_PER_TOKEN:end * CHARS_PER_TOKEN]

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
        job.output_tokens = self.output_tokens(job.request, job.max_tokens, job.osl, job.ignore_eos, job.sampling)
        if job.decode_node == self.node_id:  # decoded here too (else the decode node's kv_arrived)
            self._budget[job.request] = max(1, job.max_tokens)
        self.node.enqueue_prefill(job)

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        job = self.node.remove_queued(request)
        if job is not None:
            self._budget.pop(request, None)
            self._texts.pop(request, None)
        return job

    def cancel(self, request: RequestId) -> bool:
        return self.node.cancel(request)

    def kv_arrived(self, job: DecodeJob) -> None:
        if job.max_tokens > 0:  # the request's budget is known: decode the drawn length (the same draw as its prefill node's)
            out = self.output_tokens(job.request, job.max_tokens, job.osl, job.ignore_eos, job.sampling)
            job.left, job.total_out = float(max(0, out - 1)), out
            self._budget[job.request] = job.max_tokens
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

    def next_progress_s(self) -> float | None:
        """Wall seconds until the decode run in progress ends its next iteration (None: no run),
        so the worker calls :meth:`progress` once per iteration and each iteration's tokens go out
        as one chunk, as vLLM and SGLang stream them: a client measures real inter-token latency
        and time to the second token instead of one chunk per ``--token-interval-s``."""
        n = self.node
        clock, scale = getattr(self.host, "clock", None), getattr(self.host, "scale", None)
        if not (n.busy and n.run_batch and n.run_iter_s > 0) or clock is None or not scale:
            return None
        t = clock()
        done = int((t - n.run_start_s) / n.run_iter_s)
        if done >= n.run_iters:
            return None
        return max(0.0, (n.run_start_s + (done + 1) * n.run_iter_s - t) / scale)

    # ------------------------------------------------------------------ tokens
    def _token(self, **kw) -> None:
        self.host.token(TokenMsg(node=self.node_id, ts=self.host.now, simulated=True, **kw))

    def _tokens_for(self, e: Event) -> None:
        t = type(e)
        if t is FirstToken:
            self._token(request=e.request, kind="first", tokens=1, total=1, text=self._text(e.request, 0, 1))
            if e.request not in self._budget:  # decoded elsewhere: this node's part is done
                self._texts.pop(e.request, None)
        elif t is IterationDone and e.phase == "decode":
            for job in self.node.running.values():
                self._chunk(job, int(job.total_out - job.left + 1e-9))
        elif t is RequestFinished:
            sent = self._reported.pop(e.request, 1)
            budget = self._budget.pop(e.request, 0)
            text = self._texts.get(e.request)
            if e.error:
                self._texts.pop(e.request, None)
                return
            rest = max(0, e.output_tokens - sent)
            whole = text is not None and e.output_tokens * CHARS_PER_TOKEN >= len(text)
            finish = "stop" if whole or 0 < e.output_tokens < budget else "length"
            delta = self._text(e.request, sent, e.output_tokens)
            self._texts.pop(e.request, None)
            self._token(request=e.request, kind="done", tokens=rest, total=e.output_tokens,
                        text=delta, finish_reason=finish)

    def _chunk(self, job: DecodeJob, produced: int) -> None:
        sent = self._reported.get(job.request, 1)
        produced = min(produced, job.total_out)
        if produced > sent:
            self._reported[job.request] = produced
            self._token(request=job.request, kind="chunk", tokens=produced - sent, total=produced,
                        text=self._text(job.request, sent, produced))
