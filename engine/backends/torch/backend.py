"""The torch reference engine: a symmetric engine (METHOD.md §4.1) behind the engine port.

One scheduling loop (an asyncio task; the forward passes run in a thread) serves both phases
with continuous batching: between iterations new requests join, and an iteration is either a
prefill iteration (chunks of queued requests up to the token budget) or one decode step of
every running request; with both kinds waiting they alternate. KV lives in paged pools
(engine/backends/torch/kv.py): L1 on the engine's device, written through to the node's L2 host
pool, keyed by the 64-token block hashes of the real tokens (``events.hashing.block_hashes``),
so a continuation reuses every block it shares and prefills only its new tokens. The batch of
an iteration becomes the model's input tensors in ``step.py``; KV moves between nodes (peer
fetch, prefill -> decode pull, serving peers) are ``peers.PeerTransfers``, a mixin of this class.

A role switch is in place: the phase the node leaves drains, the KV stays (``in_place``), or
is dropped (``in_place_drop_kv``; ``restart`` is carried out the same way and reported so).
Every time reported is measured wall time of the iteration; events are stamped on the host's
clock (``host.catch_up()``), as the attached backends do. docs/engines.md, "The torch
reference engine".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from engine.backend import DecodeJob, NodeLoad, PrefillJob, WorkerHost
from engine.backends.attached import VOCAB, prompt_ids
from engine.backends.torch import step
from engine.backends.torch.grammar import GrammarError, Grammars
from engine.backends.torch.kv import PagedKv
from engine.backends.torch.loader import Checkpoint, load
from engine.backends.torch.model import Llama
from engine.backends.torch.peers import DataPlane, Lease, Message, PeerTransfers, Pull, Release, Reply
from engine.backends.torch.sampling import Stops, pick
from engine.backends.torch.state import Seq, TorchConfig, prio
from engine.kvplane import TcpExchange, format_endpoint
from engine.profiles import Profile
from engine.transfer import PoolDescriptor, make_transfer
from events.catalog import (
    FirstToken,
    IterationDone,
    RequestFinished,
    RequestStarted,
    RoleSwitched,
)
from events.hashing import block_hashes, hash_block_tokens
from events.ids import BlockHash, NodeId, RequestId, Role, SwitchMechanism
from events.wire import TokenMsg
from services.adapters.logging import get_logger

# the names this module has always offered (tests, benches, the worker's options)
__all__ = ["Lease", "Message", "PoolDescriptor", "Pull", "Release", "Reply", "Seq", "TorchBackend", "TorchConfig"]

log = get_logger("torch_engine")


class TorchBackend(PeerTransfers):
    """``EngineBackend`` computing with a Llama model in torch (module docstring)."""

    name = "torch"

    def __init__(self, host: WorkerHost, node: str, role: Role, profile: Profile, cfg: TorchConfig,
                 checkpoint: Checkpoint | None = None) -> None:
        self.host, self.cfg, self.profile = host, cfg, profile
        self.node_id = NodeId(node)
        self._role: Role = role
        if profile.block_tokens != 64:
            raise ValueError(f"the torch engine uses 64-token blocks; profile {profile.name} has {profile.block_tokens}")
        self.ckpt = checkpoint or load(cfg.model)
        key = (cfg.device, cfg.dtype, cfg.linear)  # nodes of one process share the (read-only) weights
        if key not in self.ckpt.models:
            self.ckpt.models[key] = Llama(self.ckpt.cfg, self.ckpt.weights, cfg.device, cfg.dtype, cfg.linear)
        self.model = self.ckpt.models[key]
        self.tok = self.ckpt.tokenizer
        # compiled constraints (grammar.py), shared by the nodes of this checkpoint like its weights
        self.grammars: Grammars = self.ckpt.models.setdefault(
            ("grammars",), Grammars(self.tok, self.ckpt.cfg.vocab, self.ckpt.cfg.eos, self.ckpt.cfg.bos))
        layout = self.ckpt.cfg.kv_layout(64, cfg.dtype)
        l1 = cfg.l1_blocks or max(1, min(profile.l1_capacity_tokens // 64, cfg.l1_bytes // layout.block_bytes))
        l2 = cfg.l2_blocks or max(1, min(profile.l2_capacity_tokens // 64, cfg.l2_bytes // layout.block_bytes))
        self.kv = PagedKv(self.node_id, layout, l1, l2, cfg.staging_blocks, cfg.device,
                          choose=lambda tier, tokens, pinned: host.choose_eviction(self.node_id, tier, tokens, pinned),
                          emit=host.emit, now=self._now)
        self.pqueue: list[Seq] = []
        self.running: dict[RequestId, Seq] = {}
        self.dwaiting: deque[Seq] = deque()
        self.handoffs: dict[RequestId, tuple[float, Seq]] = {}  # prefilled here, decoded elsewhere
        self.cancelling: set[RequestId] = set()  # started, cancelled: ended between iterations
        self.status = "up"  # up | draining
        self.switch_to: Role | None = None
        self.switch_mech: SwitchMechanism = "in_place"
        self.switch_t0 = 0.0
        self.drained = 0
        self.last_was_decode = False
        self.counters = {"pulled_blocks": 0, "served_blocks": 0, "fetched_blocks": 0, "recomputed": 0,
                         "failed": 0, "pull_chunks": 0, "staged_blocks": 0, "stage_skipped": 0, "stage_failed": 0}
        # stage orders (peers.py): the finished turns decoded here, the orders under way and done
        self.turns: OrderedDict[RequestId, list[BlockHash]] = OrderedDict()
        self._staging: set[RequestId] = set()
        self._staged: OrderedDict[RequestId, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._bg: set[asyncio.Task] = set()
        self._leases: dict[int, tuple[float, tuple]] = {}
        self._lease_ids = itertools.count(1)
        self.transfer = None
        self.exchange = None
        self.descs: dict[str, PoolDescriptor] = {}
        self.data_plane = DataPlane(self)

    def registered_profile(self) -> Profile:
        """The profile with what this node really has, for its ``NodeRegistered``: the L1/L2 tokens
        of the pools it allocated, its running-request limit and prefill token budget."""
        bt = self.kv.bt
        return dataclasses.replace(self.profile, l1_capacity_tokens=self.kv.pools["L1"].num_slots * bt,
                                   l2_capacity_tokens=self.kv.pools["L2"].num_slots * bt,
                                   prefill_token_budget=self.cfg.token_budget, max_running=self.cfg.max_running)

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        catch_up = getattr(self.host, "catch_up", None)
        return catch_up() if catch_up is not None else self.host.now

    @property
    def role(self) -> Role:
        return self._role

    def does_prefill(self) -> bool:
        return self._role in ("prefill", "collocated")

    def _ids(self, blocks, prompt_tokens: int, request: str, tokens) -> tuple[list[int], list[BlockHash]]:
        """The prompt's token ids and full-block hashes: the real ids when the request carries
        them, else ids made from its block hashes (the SGLang backend's ``prompt_ids``)."""
        if tokens is not None:
            ids = [int(t) for t in tokens]
            if any(not 0 <= t < self.ckpt.cfg.vocab for t in ids):
                raise ValueError(f"request {request}: token id outside the vocabulary (0..{self.ckpt.cfg.vocab - 1})")
            return ids, block_hashes(ids, 64)
        ids = prompt_ids(blocks, prompt_tokens, 64, request)
        vocab = self.ckpt.cfg.vocab
        if vocab < VOCAB:
            ids = [t % vocab for t in ids]
        return ids, list(blocks)

    def _kick(self) -> None:
        self._wake.set()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        cfg = self.cfg
        if cfg.transfer == "none":  # moves no KV: a pull or fetch fails and the prompt is recomputed
            self._task = asyncio.create_task(self._run(), name=f"torch-engine-{self.node_id}")
            return
        self.transfer = make_transfer(cfg.transfer, node=str(self.node_id), host=cfg.host, fabric=cfg.fabric)
        for t in ("L2", "stage"):
            self.descs[t] = self.transfer.register_pool(self.kv.pools[t], t)
        self.exchange = (cfg.exchange.endpoint() if cfg.exchange is not None
                         else TcpExchange(cfg.host, messages=Message, replies=Reply))
        await self.exchange.start(self._handle)
        self._task = asyncio.create_task(self._run(), name=f"torch-engine-{self.node_id}")

    @property
    def transfer_endpoint(self) -> str:
        if self.transfer is None:
            return ""
        return format_endpoint(self.transfer.name, self.transfer.endpoint, self.exchange.address)

    def peer_registered(self, node: str, endpoint: str) -> None:
        if node != self.node_id:
            if endpoint:
                self.cfg.peers[node] = endpoint
            else:
                self.cfg.peers.pop(node, None)

    async def close(self) -> None:
        for t in [self._task, *self._bg]:
            if t is not None:
                t.cancel()
        for t in [self._task, *self._bg]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if self.exchange is not None:
            await self.exchange.close()
        if self.transfer is not None:
            with contextlib.suppress(Exception):
                self.transfer.close()

    # ------------------------------------------------------------------ the port
    def enqueue_prefill(self, job: PrefillJob) -> None:
        try:
            ids, hashes = self._ids(job.blocks, job.prompt_tokens, job.request, job.tokens)
        except ValueError as exc:
            self._fail(job.request, str(exc))
            return
        seq = Seq(job.request, ids, hashes, len(ids), max(1, job.max_tokens), NodeId(job.decode_node), job=job,
                  sampling=job.sampling, ignore_eos=job.ignore_eos)
        if not self._guide(seq):
            return
        i = len(self.pqueue)
        while i > 0 and not self.pqueue[i - 1].started and prio(self.pqueue[i - 1]) < job.priority:
            i -= 1
        self.pqueue.insert(i, seq)
        self._pin_queued(seq)
        if job.fetch_plan:
            seq.ready = False
            seq.fetch = self._spawn(self._fetch(seq))
        self._kick()

    def remove_queued(self, request: RequestId) -> PrefillJob | None:
        for i, s in enumerate(self.pqueue):
            if s.request == request and not s.started:
                del self.pqueue[i]  # a fetch in flight still lands (its blocks stay cached here)
                self.kv.pool.unpin(s.owner())
                return s.job
        return None

    def cancel(self, request: RequestId) -> bool:
        """``RequestCancelled`` (engine/backend.py): a queued or waiting request is dropped now;
        one the loop has started (a prefill under way, a running decode) at the loop's next turn,
        between iterations (:meth:`_end_cancelled`), so no forward pass in flight is touched."""
        for s in self.pqueue:
            if s.request == request and not s.started:
                self.pqueue.remove(s)  # a fetch in flight still lands (as for a reroute)
                self.kv.pool.unpin(s.owner())
                self._cancelled(s)
                return True
        for s in self.dwaiting:
            if s.request == request:
                self.dwaiting.remove(s)
                self._register_full(s, s.n)  # its KV is kept as a finished request's
                self._release(s)
                self._cancelled(s)
                return True
        if request in self.running or any(s.request == request for s in self.pqueue):
            self.cancelling.add(request)
            self._kick()
            return True
        return False

    def _end_cancelled(self) -> None:
        """Between iterations: end the started requests cancelled meanwhile."""
        for rid in sorted(self.cancelling):
            s = self.running.pop(rid, None)
            if s is not None:
                self._register_full(s, s.n)
            else:
                s = next((q for q in self.pqueue if q.request == rid), None)
                if s is None:
                    continue  # it finished first
                self.pqueue.remove(s)  # a prefill cut short: its partial KV is dropped
            self._release(s)
            self._cancelled(s)
        self.cancelling.clear()

    def _cancelled(self, s: Seq) -> None:
        self.host.emit(RequestFinished(ts=self._now(), src=self.node_id, request=s.request, node=self.node_id,
                                       output_tokens=len(s.out), error="cancelled"))
        if self.status == "draining":
            self.drained += 1

    def kv_arrived(self, job: DecodeJob) -> None:
        if job.src_node == self.node_id:
            return  # prefilled here: the sequence went to decode at FirstToken
        try:
            ids, hashes = self._ids(job.blocks, job.prompt_tokens, job.request, job.tokens)
        except ValueError as exc:
            self._fail(job.request, str(exc))
            return
        seq = Seq(job.request, ids, hashes, len(ids), max(1, job.total_out), self.node_id,
                  sampling=job.sampling, ignore_eos=job.ignore_eos)
        if not self._guide(seq):
            return
        seq.started = True
        self._spawn(self._pull(seq, job.src_node))

    def order_switch(self, to_role: Role, mechanism: SwitchMechanism) -> None:
        if to_role == self._role and self.status == "up":
            self.host.emit(RoleSwitched(ts=self._now(), src=self.node_id, node=self.node_id, role=self._role))
            return
        self.status, self.switch_to, self.switch_mech = "draining", to_role, mechanism
        self.switch_t0, self.drained = self._now(), 0
        self._kick()

    def queued(self) -> list[RequestId]:
        return [s.request for s in self.pqueue if not s.started]

    def load(self) -> NodeLoad:
        return NodeLoad(role=self._role, running=len(self.running), queued=len(self.pqueue) + len(self.dwaiting),
                        l1_used_tokens=self.kv.pool.used_tokens("L1"), l2_used_tokens=self.kv.pool.used_tokens("L2"))

    def progress(self) -> None:
        for s in self.running.values():
            self._chunk(s)

    # ------------------------------------------------------------------ tokens
    def _text(self, ids: Sequence[int]) -> str:
        if self.tok is None:
            return "".join(f"{i} " for i in ids)
        # no end-of-turn marker in the answer: a GGUF vocabulary's control tokens are plain
        # tokens to the BPE tokenizer built from it, so bos/eos are dropped by id as well
        special = (self.ckpt.cfg.bos, self.ckpt.cfg.eos)
        return self.tok.decode([i for i in ids if i not in special], skip_special_tokens=True)

    def _token(self, **kw) -> None:
        self.host.token(TokenMsg(node=self.node_id, ts=self._now(), **kw))

    def _guide(self, s: Seq) -> bool:
        """Give a constrained request its grammar's guide (grammar.py); False (the request failed
        with the reason) when the constraint does not compile."""
        c = s.sampling.constraint if s.sampling is not None else None
        if c is None:
            return True
        try:
            s.guide = self.grammars.guide(c)
        except GrammarError as exc:
            self._fail(s.request, str(exc))
            return False
        return True

    def _allowed(self, s: Seq) -> torch.Tensor | None:
        """The mask of a constrained request's next token (None: unconstrained)."""
        return s.guide.allowed(s.out) if s.guide is not None else None

    def _stops(self, s: Seq) -> Stops:
        ignore = self.cfg.ignore_eos if s.ignore_eos is None else s.ignore_eos
        return Stops(self.ckpt.cfg.eos, ignore, s.sampling.stop if s.sampling is not None else ())

    def _ended(self, s: Seq) -> bool:
        """Whether the output ends with its last token (sampling.py): EOS, a stop string (its
        place in the text is kept in ``cut_at``) or the budget; sets ``finish``."""
        stops = self._stops(s)
        if s.out and (stops.at_eos(s.out[-1]) or (s.guide is not None and s.guide.complete(s.out))):
            s.finish = "stop"  # end of turn, or the constraint's grammar is complete
        elif stops.stop and (cut := stops.cut(self._text(s.out))) is not None:
            s.finish, s.cut_at = "stop", cut
        elif len(s.out) >= s.max_tokens:
            s.finish = "length"
        return bool(s.finish)

    def _sendable(self, s: Seq, text: str, done: bool) -> str:
        """The part of the output's text the gateway may have: before a stop string; while the
        output goes on, without a tail that may begin one."""
        if s.cut_at is not None:
            return text[:s.cut_at]
        if done or s.sampling is None or not s.sampling.stop:
            return text
        return text[:self._stops(s).hold(text)]

    def _chunk(self, s: Seq, done: bool = False) -> None:
        n = len(s.out)
        if n <= s.sent and not done:
            return
        text = self._text(s.out[:n])
        if not done and text.endswith("\ufffd"):
            return  # a character split across tokens: wait for its rest
        text = self._sendable(s, text, done)
        delta = text.removeprefix(s.sent_text)
        if done:
            self._token(request=s.request, kind="done", tokens=n - s.sent, total=n, text=delta,
                        finish_reason=s.finish or "length")
        else:
            self._token(request=s.request, kind="chunk", tokens=n - s.sent, total=n, text=delta)
        s.sent, s.sent_text = n, text

    def _fail(self, request: str, why: str) -> None:
        log.error("torch_request_failed", node=self.node_id, request=request, error=why)
        self.counters["failed"] += 1
        self._token(request=request, kind="error", error=why)
        self.host.emit(RequestFinished(ts=self._now(), src=self.node_id, request=request, node=self.node_id,
                                       output_tokens=0))

    # ------------------------------------------------------------------ pins
    def _pin_queued(self, s: Seq) -> None:
        """A queued request pins the prefix this node holds for it (the KV it will reuse)."""
        k = max(self.kv.held_prefix(s.hashes, "L1"), self.kv.held_prefix(s.hashes, "L2"))
        if s.started or not s.ready:
            self.kv.pool.pin(s.owner(), s.hashes)
        elif k:
            self.kv.pool.pin(s.owner(), s.hashes[:k])
        else:
            self.kv.pool.unpin(s.owner())

    def _release(self, s: Seq) -> None:
        self.kv.free_private(sorted(s.private))
        s.private.clear()
        self.kv.pool.unpin(s.owner())

    # ------------------------------------------------------------------ the scheduling loop
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    did = await self._iteration()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a failing iteration must not stop the node
                    log.error("torch_iteration_failed", node=self.node_id, error=f"{type(exc).__name__}: {exc}")
                    did = False
                self._expire_handoffs()
                if not did:
                    self._maybe_finish_drain()
                    break
                await asyncio.sleep(0)

    async def _iteration(self) -> bool:
        self._end_cancelled()
        self._admit()
        pre_ok = any(s.ready or s.started for s in self.pqueue)
        dec_ok = bool(self.running)
        if pre_ok and (not dec_ok or self.last_was_decode) and await self._prefill_iteration():
            self.last_was_decode = False
            return True
        if dec_ok:
            await self._decode_iteration()
            self.last_was_decode = True
            return True
        return False

    # ------------------------------------------------------------------ prefill
    def _begin(self, s: Seq) -> bool:
        """Prefill start: reuse the held prefix (L1, then L2 restored into L1), take private
        slots for the rest. False when the slots do not fit now."""
        kv = s.hashes
        l1 = self.kv.held_prefix(kv, "L1")
        l2 = self.kv.held_prefix(kv, "L2") if l1 < len(kv) else l1
        usable = min(max(l1, l2), (s.prompt - 1) // 64)  # at least the last token is computed
        restored = self.kv.restore(kv[l1:usable], kv, s.request) if usable > l1 else 0
        usable = min(self.kv.held_prefix(kv, "L1"), usable)
        local = s.decode_node == self.node_id or s.recompute
        need = s.total_blocks(with_output=local) - usable
        slots = self.kv.take_private(need, kv)
        if slots is None:
            return False
        s.slots = [self.kv.slot["L1"][h] for h in kv[:usable]] + slots
        s.private = set(slots)
        s.n = s.t_c = usable * 64
        s.t_rst = restored * 64
        s.started = True
        self.kv.pool.pin(s.owner(), kv)
        if not s.recompute:
            self.host.emit(RequestStarted(ts=self._now(), src=self.node_id, request=s.request, node=self.node_id,
                                          phase="prefill", cached_tokens=s.t_c, restored_tokens=s.t_rst,
                                          fetched_tokens=min(s.fetched_tokens, s.t_c)))
        return True

    async def _prefill_iteration(self) -> bool:
        t0 = time.perf_counter()
        budget = self.cfg.token_budget
        batch: list[tuple[Seq, int]] = []
        sum_uc = sum_rst = sum_tc = 0
        sum_A = 0.0
        for s in list(self.pqueue):
            if budget <= 0:
                break
            if not s.started:
                if not s.ready:
                    continue
                if not self._begin(s):
                    if not batch and not self.running and all(not q.started for q in self.pqueue):
                        self.pqueue.remove(s)  # can never fit
                        self._release(s)
                        self._fail(s.request, f"prompt of {s.prompt} tokens does not fit the node's L1 KV pool")
                        continue
                    break
                sum_rst += s.t_rst
            chunk = min(s.prompt - s.n, budget)
            batch.append((s, chunk))
            budget -= chunk
            sum_uc += chunk
            sum_A += chunk * s.n + chunk * (chunk + 1) / 2.0
            sum_tc += s.n
        if not batch:
            return False
        setup_s = time.perf_counter() - t0
        rows = [(s, s.ids[s.n:s.n + c], s.n) for s, c in batch]
        logits, fwd_s = await asyncio.to_thread(self._forward, rows)
        firsts = pick(logits, [(s.request, s.sampling, 0) for s, _ in batch],
                      [self._allowed(s) if s.n + c >= s.prompt else None for s, c in batch])
        for s, c in batch:
            s.n += c
        self.host.emit(IterationDone(ts=self._now(), src=self.node_id, node=self.node_id, phase="prefill",
                                     duration_s=setup_s + fwd_s, batch=len(batch), sum_t_uc=sum_uc, sum_A=sum_A,
                                     sum_t_rst=sum_rst, sum_t_c=sum_tc,
                                     queued=sum(1 for q in self.pqueue if not q.started)))
        for (s, _), first in zip(batch, firsts, strict=True):
            if s.n >= s.prompt:
                self.pqueue.remove(s)
                self._finish_prefill(s, first)
        return True

    def _register_full(self, s: Seq, upto_tokens: int) -> list[BlockHash]:
        """Hash the sequence's computed full blocks (prompt blocks, then blocks of prompt tail +
        output), adopt the private ones as shared L1 blocks and write every full block through
        to L2 (one ``KvStored(write_through=True)`` where L1 and L2 add the same blocks, as the
        simulator's nodes send: ``PagedKv.adopt``); returns all full-block hashes."""
        hashes = list(s.hashes)
        toks = s.ids + s.out
        full = upto_tokens // 64
        parent = hashes[-1] if hashes else 0
        for i in range(len(hashes), full):
            parent = hash_block_tokens(parent, toks[i * 64:(i + 1) * 64])
            hashes.append(parent)
        hashes = hashes[:full]
        cand = [(h, s.slots[i]) for i, h in enumerate(hashes) if s.slots[i] in s.private]
        adopted = self.kv.adopt([h for h, _ in cand], [sl for _, sl in cand], hashes, s.request, through=hashes)
        s.private -= adopted
        return hashes

    def _finish_prefill(self, s: Seq, first: int) -> None:
        hashes = self._register_full(s, s.prompt)  # L1, written through to L2
        s.out = [first]
        if s.recompute:  # a decode whose pull failed: the prompt is here again
            s.sent, s.sent_text = 1, self._text(s.out)
            self._start_decode(s)
            return
        if s.decode_node != self.node_id:  # kept for the decode node, which pulls it after FirstToken
            self.kv.pool.pin(("x", s.request), hashes)
            self.handoffs[s.request] = (time.monotonic(), s)
        self.host.emit(FirstToken(ts=self._now(), src=self.node_id, request=s.request, node=self.node_id))
        s.sent, s.sent_text = 1, self._sendable(s, self._text(s.out), False)
        self._token(request=s.request, kind="first", tokens=1, total=1, text=s.sent_text)
        if s.decode_node == self.node_id:
            self._start_decode(s)

    def _expire_handoffs(self) -> None:
        now = time.monotonic()
        for rid, (t0, s) in list(self.handoffs.items()):
            if now - t0 > self.cfg.handoff_ttl_s:
                log.warning("torch_handoff_expired", node=self.node_id, request=rid)
                self._drop_handoff(rid)

    def _drop_handoff(self, rid: str) -> None:
        entry = self.handoffs.pop(rid, None)
        if entry is not None:
            self._release(entry[1])
            self.kv.pool.unpin(("x", rid))

    # ------------------------------------------------------------------ decode
    def _start_decode(self, s: Seq) -> None:
        self.dwaiting.append(s)
        self._kick()

    def _admit(self) -> None:
        while self.dwaiting and len(self.running) < self.cfg.max_running:
            s = self.dwaiting.popleft()
            self.running[s.request] = s
            self.host.emit(RequestStarted(ts=self._now(), src=self.node_id, request=s.request, node=self.node_id,
                                          phase="decode"))
            if self._ended(s):  # the first token ended it (EOS, a stop string, max_tokens 1)
                self._finish_decode(s)

    async def _decode_iteration(self) -> None:
        t0 = time.perf_counter()
        seqs = list(self.running.values())
        rows = [(s, [s.out[-1]], s.n) for s in seqs]
        setup_s = time.perf_counter() - t0
        logits, fwd_s = await asyncio.to_thread(self._forward, rows)
        nxt = pick(logits, [(s.request, s.sampling, len(s.out)) for s in seqs], [self._allowed(s) for s in seqs])
        for s, t in zip(seqs, nxt, strict=True):
            s.n += 1
            s.out.append(t)
        self.host.emit(IterationDone(ts=self._now(), src=self.node_id, node=self.node_id, phase="decode",
                                     duration_s=setup_s + fwd_s, batch=len(seqs), t_fwd=1.0,
                                     sum_t_c=sum(r[2] for r in rows),  # decode: context the batch attends over
                                     accepted_tokens=len(seqs), queued=len(self.dwaiting), iterations=1))
        for s in seqs:
            if self._ended(s):
                self._finish_decode(s)

    def _finish_decode(self, s: Seq) -> None:
        del self.running[s.request]
        # written through to L2: decode nodes only write to the pool; kept for a stage order
        self.keep_turn(s.request, self._register_full(s, s.n))
        self._release(s)
        self._chunk(s, done=True)
        self.host.emit(RequestFinished(ts=self._now(), src=self.node_id, request=s.request, node=self.node_id,
                                       output_tokens=len(s.out)))
        if self.status == "draining":
            self.drained += 1

    # ------------------------------------------------------------------ the forward pass
    def _forward(self, rows: list[tuple[Seq, list[int], int]]) -> tuple[torch.Tensor, float]:
        """One batched forward (in a thread): row = (sequence, new token ids, start position)."""
        return step.forward(self.model, self.kv.typed, rows, self.kv.bt)

    # ------------------------------------------------------------------ role switch
    def _maybe_finish_drain(self) -> None:
        if self.status != "draining":
            return
        to = self.switch_to
        leaves_p = self.does_prefill() and to not in ("prefill", "collocated")
        leaves_d = self._role in ("decode", "collocated") and to not in ("decode", "collocated")
        if leaves_p and self.pqueue:
            return
        if leaves_d and (self.running or self.dwaiting):
            return
        dropped = self.switch_mech != "in_place"
        if dropped:
            if self.running or self.dwaiting or self.pqueue:
                return  # dropping KV needs an idle node
            for rid in list(self.handoffs):
                self._drop_handoff(rid)
            self.kv.drop_all()
        self._role = to or self._role
        self.status = "up"
        now = self._now()
        self.host.emit(RoleSwitched(ts=now, src=self.node_id, node=self.node_id, role=self._role,
                                    drained=self.drained, duration_s=now - self.switch_t0, kv_dropped=dropped,
                                    mechanism="in_place_drop_kv" if self.switch_mech == "restart" else ""))
        self.switch_to = None
        self._kick()
