"""The torch engine between nodes (engine/transfer/: Mooncake over TCP or the loopback fake;
control messages over the KV plane's exchange, engine/kvplane.py), a mixin of ``TorchBackend``:

- *peer fetch* while the request queues: the router's fetch plan names blocks in a peer's L2;
  this node leases them (``Lease``), reads them into its own L2 (``read_blocks``), copies them on
  into L1 and releases them; ``KvFetched``; the request becomes eligible when they have landed.
- *prefill -> decode*: the prefill node keeps the request's KV (and its first token) after
  ``FirstToken``; the decode node, when the worker calls ``kv_arrived``, sends ``Pull`` with the
  blocks it lacks and staging slots of its own; the prefill node writes the blocks there
  (``write_blocks``: full blocks from its L2, the rest through its staging pool) and answers
  with the first token id. The decode node copies them into L1 (``KvMoved``) and decodes. A
  pull larger than either node's free staging moves in chunks (``kv.Staging``), one ``Pull``
  each, one ``KvMoved`` in all. If the pull fails, the decode node recomputes the prompt:
  same tokens, same output.
- *stage orders* (``KvStageOrdered`` naming this node, the router's ``+prestage``): during
  the tool wait after a turn finished on ``src_node``, this node asks it for the turn's blocks
  (``StageLease``: the full blocks of the prompt and output it decoded, leased where its L2
  still holds them), reads those it lacks into its own L2 (the ordered tier; L1 too when the
  order says ``L1``) over the same transfer as a peer fetch, and reports
  ``KvMoved(src_phase=decode, dst_phase=prefill)``; the branch's next turn routed here then
  restores them from L2 as cached tokens. The run stops at the first block neither node
  holds, as the simulator's ``stage_in`` (engine/backends/sim/node.py, 8). An order it cannot
  carry out (its source unknown or itself, the turn forgotten or evicted there, no room, a
  transfer that fails, a duplicate) is one log line (``stage_order_skipped`` /
  ``stage_order_failed``) and nothing else.
- serving peers: ``Lease`` / ``Release`` of L2 blocks, ``StageLease`` of a finished turn's and
  ``Pull`` of a hand-off.

``DataPlane``: the worker's data-plane hooks, played by the backend (it moves its own KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec

from engine.backends.torch.state import Seq
from engine.kvplane import parse_endpoint
from engine.transfer import PoolDescriptor, TransferCorrupt, TransferError
from engine.transfer.common import slot_checksums, verify_landed
from events.catalog import KvFetched, KvMoved, KvStageOrdered
from events.ids import BlockHash, NodeId
from kernels.layout import KvLayoutError
from kernels.ops import copy_blocks
from services.adapters.logging import get_logger

log = get_logger("torch_engine")


class Lease(msgspec.Struct, tag="lease"):
    blocks: list[int]


class Release(msgspec.Struct, tag="release"):
    lease: int


class Pull(msgspec.Struct, tag="pull"):
    """The decode node asks for a request's KV: block indices (a full block, or the partial
    last one at index ``len(blocks)``) written into its staging ``slots``."""

    request: str
    indices: list[int]
    pool: PoolDescriptor
    slots: list[int]
    #: False for every chunk of a pull but the last (``_pull``): the sender keeps the KV until then
    last: bool = True


class StageLease(msgspec.Struct, tag="stage_lease"):
    """A stage order's destination asks the source for the finished turn ``request``'s KV."""

    request: str


class Reply(msgspec.Struct):
    slots: list[int] = []
    pool: PoolDescriptor | None = None
    lease: int = 0
    first_token: int = -1
    error: str = ""
    #: per block of the reply, the sender's checksums (``kernels.checksum``): of the L2 slots a
    #: ``Lease`` names, of the bytes a ``Pull`` wrote (in ``indices`` order); the receiver
    #: refuses blocks that landed otherwise (a transfer cut mid-way) and recomputes them
    checksums: list[int] = []
    #: a ``StageLease``'s answer: the turn's full blocks in order, ``slots`` aligned with them
    #: (-1: not in the sender's L2), ``checksums`` those of the held ones, in order
    blocks: list[int] = []


Message = Lease | Release | Pull | StageLease

#: finished turns whose block hashes a node keeps for stage orders (``StageLease``), newest last
TURNS_KEPT = 1024
#: stage orders a node remembers having carried out, to skip a redelivered duplicate
STAGED_KEPT = 4096


class PeerTransfers:
    """``TorchBackend``'s KV moves between nodes (module docstring); uses the backend's
    ``kv``, ``transfer``, ``exchange``, ``descs``, ``host``, ``cfg`` and scheduler hooks."""

    # ------------------------------------------------------------------ peer fetch (while queued)
    def _peer(self, node: str) -> str:
        if self.transfer is None:
            raise TransferError("this node moves no KV (transfer none)")
        endpoint = self.cfg.peers.get(node)
        if not endpoint:
            raise TransferError(f"peer {node} registered no transfer endpoint")
        backend, _, ctl = parse_endpoint(endpoint)
        if backend != self.transfer.name:
            raise TransferError(f"peer {node} moves KV with {backend}, this node with {self.transfer.name}")
        return ctl

    async def _fetch(self, s: Seq) -> None:
        """The router's fetch plan: lease the blocks in the peer's L2, read them into ours, copy
        them on into L1 (``KvFetched``); the request is eligible when done (or when it failed)."""
        t0 = time.perf_counter()
        try:
            pos = self.kv.held_prefix(s.hashes, "L1")
            for step in sorted(s.job.fetch_plan, key=lambda st: st.first_block):
                end = min(step.first_block + step.n_blocks, len(s.hashes))
                if end <= pos:
                    continue
                if step.first_block > pos or step.src_node == self.node_id:
                    break
                blocks = s.hashes[pos:end]
                got = await self._fetch_from(step.src_node, s, blocks)
                if got:
                    s.fetched_tokens += 64 * len(got)
                    dur = time.perf_counter() - t0
                    self.host.emit(KvFetched(ts=self._now(), src=self.node_id, request=s.request,
                                             src_node=step.src_node, dst_node=self.node_id, blocks=got,
                                             duration_s=dur, hidden_s=dur))
                if len(got) < len(blocks):
                    break
                pos = end
        except (TransferError, KvLayoutError, OSError) as exc:
            log.warning("torch_fetch_failed", node=self.node_id, request=s.request, error=str(exc),
                        action="prefill recomputes the missing blocks")
        finally:
            s.ready = True
            if s in self.pqueue:
                self._pin_queued(s)
            self._kick()

    async def _fetch_from(self, src: str, s: Seq, blocks: list[BlockHash]) -> list[BlockHash]:
        ctl = self._peer(src)
        reply = await self.exchange.request(ctl, Lease(blocks=list(blocks)), self.cfg.timeout_s)
        try:
            if reply.error:
                raise TransferError(f"peer {src}: {reply.error}")
            n = len(reply.slots)  # the prefix of the blocks the peer holds in L2
            blocks = blocks[:n]
            if not n:
                return []
            pinned = s.hashes
            pool = self.kv.pool
            new2 = [b for b in blocks if b not in self.kv.slot["L2"]]
            new1 = [b for b in blocks if b not in self.kv.slot["L1"]]
            if not (pool.make_room("L2", len(new2), pinned) and pool.make_room("L1", len(new1), pinned)):
                return []  # no room in one tier: the blocks are recomputed
            mine = dict(self.kv.add_l2(blocks, pinned) or [])
            todo = [(b, r) for b, r in zip(blocks, reply.slots, strict=True) if b in mine]
            sums = dict(zip(blocks, reply.checksums, strict=False)) if reply.checksums else None
            if todo:
                self.kv.pools["L2"].poison([mine[b] for b, _ in todo])  # nor bytes an evicted copy left
                try:
                    await asyncio.to_thread(self.transfer.read_blocks, reply.pool, [r for _, r in todo],
                                            self.kv.pools["L2"], [mine[b] for b, _ in todo],
                                            expect=None if sums is None else [sums[b] for b, _ in todo])
                except Exception as exc:
                    # the slots hold no (or torn) bytes of these blocks: this node does not hold them
                    self.kv.undo_l2([b for b, _ in todo])
                    if isinstance(exc, TransferCorrupt):
                        log.warning("kv_transfer_refused", node=self.node_id, request=s.request, src=src,
                                    blocks=len(exc.slots), error=str(exc))
                        log.warning("kv_recompute", node=self.node_id, request=s.request, kv_event="KvFetched",
                                    src=src, blocks=len(todo), action="prefill computes them")
                    raise
            l1 = self.kv.add_l1(blocks, pinned) or []
            if l1:
                copy_blocks(self.kv.pools["L2"], [self.kv.slot["L2"][b] for b, _ in l1],
                            self.kv.pools["L1"], [sl for _, sl in l1]).wait()
            self.counters["fetched_blocks"] += len(blocks)
            return list(blocks)
        finally:
            with contextlib.suppress(TransferError, OSError, TimeoutError):
                await self.exchange.request(ctl, Release(lease=reply.lease), self.cfg.timeout_s)

    # ------------------------------------------------------------------ prefill -> decode
    async def _pull(self, s: Seq, src: NodeId) -> None:
        """Decode admission of a request prefilled on ``src``: pull its KV and first token.

        The blocks land in private L1 slots, a chunk at a time through this node's staging
        slots (as many as ``Staging`` grants: a prompt larger than the pool, or than what other
        pulls leave free, takes several ``Pull``s, the last one ``last``); once every chunk has
        landed and verified they become shared blocks (``claim``), in one ``KvMoved``."""
        held = self.kv.held_prefix(s.hashes, "L1")
        need = list(range(held, len(s.hashes))) + ([len(s.hashes)] if s.prompt % 64 else [])
        full = [i for i in need if i < len(s.hashes)]
        self.kv.pool.pin(s.owner(), s.hashes[:held])  # the prefix already here stays while we pull
        try:
            ctl = self._peer(src)
            work = s.total_blocks(True) - len(s.hashes)  # the partial tail and the output
            private = self.kv.take_private(len(full) + work, s.hashes)
            if private is None:
                raise TransferError("no room in L1 for the request's blocks and working memory")
            s.private = set(private)
            landing, work_slots = private[:len(full)], private[len(full):]
            s.slots = [-1] * len(s.hashes) + work_slots
            dst = dict(zip(full, landing, strict=True))
            if s.prompt % 64:
                dst[len(s.hashes)] = work_slots[0]
            first = await self._pull_chunks(s, src, ctl, need, dst)
            s.private -= set(landing)  # claimed, or freed where L1 came to hold the block meanwhile
            moved = self.kv.claim([s.hashes[i] for i in full], landing)
            for i, h in enumerate(s.hashes):
                s.slots[i] = self.kv.slot["L1"][h]
            self.kv.pool.pin(s.owner(), s.hashes)
            s.n, s.out = s.prompt, [first]
            s.sent, s.sent_text = 1, self._sendable(s, self._text(s.out), False)  # as the prefill node sent it
            self.counters["pulled_blocks"] += len(need)
            self.host.emit(KvMoved(ts=self._now(), src=self.node_id, src_node=src, dst_node=self.node_id,
                                   blocks=[h for h, _ in moved], src_phase="prefill", dst_phase="decode",
                                   dst_tier="L1", request=s.request))
            self._start_decode(s)
        except (TimeoutError, TransferError, KvLayoutError, OSError) as exc:
            log.warning("torch_kv_pull_failed", node=self.node_id, request=s.request, src=src, error=str(exc),
                        action="recomputing the prompt here")
            self.counters["recomputed"] += 1
            self._release(s)
            s.slots, s.n, s.started, s.recompute = [], 0, False, True
            self.pqueue.insert(0, s)
            self._pin_queued(s)
            self._kick()

    async def _pull_chunks(self, s: Seq, src: NodeId, ctl: str, need: list[int], dst: dict[int, int]) -> int:
        """``need``'s blocks from ``src`` into the L1 slots ``dst`` names, through staging in
        chunks (``_pull``); returns the first token id. Raises as the pull fails."""
        pos, first = 0, -1
        while True:
            stage = await self.kv.staging.take(len(need) - pos, receiving=True)
            try:
                part = need[pos:pos + len(stage)]
                self.kv.pools["stage"].poison(stage)  # no earlier pull's bytes can pass as this one's
                last = pos + len(part) == len(need)
                reply = await self.exchange.request(
                    ctl, Pull(request=s.request, indices=part, pool=self.descs["stage"], slots=stage, last=last),
                    self.cfg.timeout_s)
                if reply.error:
                    raise TransferError(f"peer {src}: {reply.error}")
                if reply.checksums:  # nothing is adopted from the staging slots before this holds
                    try:
                        verify_landed(self.kv.pools["stage"], stage, reply.checksums,
                                      f"pull of {s.request} from {src}")
                    except TransferCorrupt as exc:
                        log.warning("kv_checksum_mismatch", node=self.node_id, request=s.request, src=src,
                                    blocks=len(exc.slots), error=str(exc))
                        log.warning("kv_recompute", node=self.node_id, request=s.request, kv_event="KvMoved",
                                    src=src, blocks=len(need), action="recomputed on the decode node")
                        raise
                if part:
                    copy_blocks(self.kv.pools["stage"], stage, self.kv.pools["L1"], [dst[i] for i in part]).wait()
                self.counters["pull_chunks"] += 1
                first = reply.first_token
            finally:
                self.kv.staging.give(stage, receiving=True)
            pos += len(part)
            if last:
                return first

    # ------------------------------------------------------------------ stage orders (module docstring)
    def keep_turn(self, request: str, hashes: list[BlockHash]) -> None:
        """A turn decoded here finished: its full blocks, for a later ``StageLease``."""
        self.turns[request] = hashes
        self.turns.move_to_end(request)
        while len(self.turns) > TURNS_KEPT:
            self.turns.popitem(last=False)

    def stage_in(self, order: KvStageOrdered) -> bool:
        """Carry out a stage order addressed to this node (module docstring) in a task of its
        own; False (one ``stage_order_skipped`` line) when it is not carried out at all."""
        why = self._stage_refusal(order)
        if why is not None:
            self.counters["stage_skipped"] += 1
            log.warning("stage_order_skipped", node=self.node_id, request=order.request, src=order.src_node,
                        branch=order.branch, reason=why)
            return False
        self._staging.add(order.request)
        self._spawn(self._stage(order))
        return True

    def _stage_refusal(self, order: KvStageOrdered) -> str | None:
        if order.dst_node != self.node_id:
            return f"addressed to {order.dst_node}"
        if order.src_node == self.node_id:
            return "the source is this node: the KV is here already"
        if order.request in self._staging or order.request in self._staged:
            return "duplicate: this turn's order was carried out or is under way"
        if order.tier not in ("L1", "L2"):
            return f"unknown tier {order.tier!r}"
        if self.transfer is None:
            return "this node moves no KV (transfer none)"
        if not self.cfg.peers.get(order.src_node):
            return f"unknown source node {order.src_node} (no transfer endpoint registered)"
        return None

    async def _stage(self, order: KvStageOrdered) -> None:
        src = order.src_node
        try:
            ctl = self._peer(src)
            reply = await self.exchange.request(ctl, StageLease(request=order.request), self.cfg.timeout_s)
            try:
                if reply.error:
                    raise TransferError(f"peer {src}: {reply.error}")
                got = await self._stage_read(order, reply)
            finally:
                if reply.lease:
                    with contextlib.suppress(TransferError, OSError, TimeoutError):
                        await self.exchange.request(ctl, Release(lease=reply.lease), self.cfg.timeout_s)
            if got:
                self.counters["staged_blocks"] += len(got)
                self.host.emit(KvMoved(ts=self._now(), src=self.node_id, src_node=src, dst_node=self.node_id,
                                       blocks=got, src_phase="decode", dst_phase="prefill", dst_tier=order.tier,
                                       branch=order.branch))
        except (TransferError, KvLayoutError, OSError, TimeoutError) as exc:
            self.counters["stage_failed"] += 1
            log.warning("stage_order_failed", node=self.node_id, request=order.request, src=src, branch=order.branch,
                        error=str(exc), action="the next turn fetches or recomputes what is missing")
        finally:
            self._staging.discard(order.request)
            self._staged[order.request] = None
            while len(self._staged) > STAGED_KEPT:
                self._staged.popitem(last=False)

    async def _stage_read(self, order: KvStageOrdered, reply: Reply) -> list[BlockHash]:
        """The blocks of a ``StageLease`` answer this node lacks, up to the first block neither
        holds, read into L2 (and L1 for an ``L1`` order); returns those that landed."""
        if len(reply.slots) != len(reply.blocks):
            raise TransferError("stage lease: blocks and slots differ in length")
        held_sums = iter(reply.checksums)
        want: list[tuple[BlockHash, int, int | None]] = []  # (block, its slot there, its checksum)
        for b, sl in zip(reply.blocks, reply.slots, strict=True):
            chk = next(held_sums, None) if sl >= 0 else None
            if b in self.kv.slot["L1"] or b in self.kv.slot["L2"]:
                continue
            if sl < 0:
                break  # later blocks are no prefix of anything this node could serve
            want.append((b, sl, chk))
        if not want:
            log.info("stage_order_skipped", node=self.node_id, request=order.request, src=order.src_node,
                     branch=order.branch, reason="nothing to move: this node holds the turn's blocks, or the "
                                                 "source no longer does", blocks=len(reply.blocks))
            return []
        blocks = [b for b, _, _ in want]
        mine = self.kv.add_l2(blocks, blocks)
        if mine is None:
            log.warning("stage_order_skipped", node=self.node_id, request=order.request, src=order.src_node,
                        branch=order.branch, reason="no room in L2", blocks=len(blocks))
            return []
        mine = dict(mine)
        self.kv.pools["L2"].poison([mine[b] for b in blocks])  # nor bytes an evicted copy left
        sums = [c for _, _, c in want]
        try:
            await asyncio.to_thread(self.transfer.read_blocks, reply.pool, [sl for _, sl, _ in want],
                                    self.kv.pools["L2"], [mine[b] for b in blocks],
                                    expect=None if None in sums or not reply.checksums else sums)
        except Exception:
            self.kv.undo_l2(blocks)  # the slots hold no (or torn) bytes of these blocks
            raise
        if order.tier == "L1" and (l1 := self.kv.add_l1(blocks, blocks)):
            copy_blocks(self.kv.pools["L2"], [self.kv.slot["L2"][b] for b, _ in l1],
                        self.kv.pools["L1"], [sl for _, sl in l1]).wait()
        return blocks

    def _serve_stage(self, msg: StageLease, lid: int) -> Reply:
        hashes = self.turns.get(msg.request)
        if hashes is None:
            return Reply(error=f"no finished turn {msg.request} here (not decoded here, or forgotten)")
        slots = [self.kv.slot["L2"].get(b, -1) for b in hashes]
        held = [b for b, sl in zip(hashes, slots, strict=True) if sl >= 0]
        self.kv.pool.pin(("l", lid), held)
        self.counters["served_blocks"] += len(held)
        return Reply(blocks=list(hashes), slots=slots, pool=self.descs["L2"], lease=lid,
                     checksums=slot_checksums(self.kv.pools["L2"], [sl for sl in slots if sl >= 0]))

    # ------------------------------------------------------------------ serving peers
    async def _handle(self, msg) -> Reply:
        now = time.monotonic()
        for lid, (t0, owner) in list(self._leases.items()):
            if now - t0 > self.cfg.handoff_ttl_s:
                del self._leases[lid]
                self.kv.pool.unpin(owner)
        if isinstance(msg, Release):
            owner = self._leases.pop(msg.lease, (0.0, None))[1]
            if owner is not None:
                self.kv.pool.unpin(owner)
            return Reply()
        if isinstance(msg, StageLease):
            lid = next(self._lease_ids)
            self._leases[lid] = (now, ("l", lid))
            return self._serve_stage(msg, lid)
        if isinstance(msg, Lease):
            held = []
            for b in msg.blocks:
                if b not in self.kv.slot["L2"]:
                    break
                held.append(b)
            lid = next(self._lease_ids)
            self._leases[lid] = (now, ("l", lid))
            self.kv.pool.pin(("l", lid), held)
            self.counters["served_blocks"] += len(held)
            slots = [self.kv.slot["L2"][b] for b in held]
            return Reply(slots=slots, pool=self.descs["L2"], lease=lid, checksums=slot_checksums(self.kv.pools["L2"], slots))
        return await self._serve_pull(msg)

    async def _serve_pull(self, msg: Pull) -> Reply:
        entry = self.handoffs.get(msg.request)
        if entry is None:
            return Reply(error=f"no KV of request {msg.request} here (expired or dropped)")
        s = entry[1]
        if len(msg.indices) != len(msg.slots):
            return Reply(error="pull: indices and slots differ in length")
        from_l2, l2_dst, from_l1, l1_dst = [], [], [], []
        order: list[tuple[str, int]] = []  # per index of the pull: which write carries it, at which position
        for i, d in zip(msg.indices, msg.slots, strict=True):
            if not 0 <= i < len(s.slots) or i > len(s.hashes):
                return Reply(error=f"pull: block index {i} outside the request's {len(s.hashes)} blocks")
            h = s.hashes[i] if i < len(s.hashes) else None
            if h is not None and h in self.kv.slot["L2"]:
                order.append(("L2", len(from_l2)))
                from_l2.append(self.kv.slot["L2"][h])
                l2_dst.append(d)
            else:
                order.append(("L1", len(from_l1)))
                from_l1.append(s.slots[i])
                l1_dst.append(d)
        sums: dict[str, list[int]] = {"L1": [], "L2": []}
        try:
            k = 0
            while k < len(from_l1):  # L1 -> the peer through this node's staging, a chunk at a time
                stage = await self.kv.staging.take(len(from_l1) - k, receiving=False)
                try:
                    end = k + len(stage)
                    copy_blocks(self.kv.pools["L1"], from_l1[k:end], self.kv.pools["stage"], stage).wait()
                    sums["L1"] += (await asyncio.to_thread(self.transfer.write_blocks, self.kv.pools["stage"], stage,
                                                           msg.pool, l1_dst[k:end], checksums=True)).checksums
                finally:
                    self.kv.staging.give(stage, receiving=False)
                k = end
            if from_l2:
                sums["L2"] = (await asyncio.to_thread(self.transfer.write_blocks, self.kv.pools["L2"], from_l2,
                                                      msg.pool, l2_dst, checksums=True)).checksums
        except (TransferError, KvLayoutError) as exc:
            return Reply(error=str(exc))
        self.counters["served_blocks"] += len(msg.indices)
        first = s.out[0]
        if msg.last:  # a chunked pull: the KV stays until its last chunk is served
            self._drop_handoff(msg.request)
        return Reply(first_token=first, checksums=[sums[w][k] for w, k in order])


class DataPlane:
    """The worker's data-plane hooks (engine/worker: ``kv``): the endpoint it registers, the
    peers' endpoints it folds, a summary at stop. The backend moves its own KV."""

    def __init__(self, backend) -> None:
        self.b = backend

    async def start(self) -> None:
        return None

    @property
    def endpoint(self) -> str:
        return self.b.transfer_endpoint

    def peer_registered(self, node: str, endpoint: str) -> None:
        self.b.peer_registered(node, endpoint)

    def observe(self, event) -> None:
        return None

    async def drain(self, timeout: float = 10.0) -> None:
        return None

    def summary(self) -> dict:
        return dict(self.b.counters)

    async def close(self) -> None:
        return None
