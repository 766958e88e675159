"""Real KV bytes behind a worker's pool (``--kv-bytes``, docs/kernels.md).

``KvDataPlane`` gives both tiers of one node's pool (``engine/kvpool.py``) a byte-backed
``engine.kvbytes.KvBytes`` (host buffers, pinned when CUDA is present, ``--kv-block-bytes`` per
block) and carries out every KV fact of the node with real transfers:

- ``KvStored``/``KvEvicted`` of this node: bytes written (synthesized from the block hash, so
  every node holding block ``h`` has the same bytes and checksum) or slots freed;
- ``KvFetched`` into this node (the router's fetch plan, landed by the node model): the owner
  *leases* the blocks' slots (they are not reused until released) and answers with its pool
  descriptors, slots and checksums; this node *reads* them into its L2 (one-sided, the
  transfer port's ``read_blocks``), copies them on into L1 locally, verifies every checksum
  and releases the lease;
- ``KvMoved`` into this node (prefill -> decode): this node names held L1 slots and the
  prefill node *writes* the blocks into them (``write_blocks``) and answers with their
  checksums, which this node verifies.

Bytes never change decisions: the node model emits exactly the events it emits without bytes;
the plane follows them, and a transfer that fails or a checksum that differs is counted and
logged as an error (``failed``, ``unavailable``). One thing goes back: a read whose checksums
differ from the owner's is refused by the transfer layer (``TransferCorrupt``: a transfer cut
mid-way), and ``on_refused(event, blocks)`` names the blocks of that ``KvFetched``/``KvMoved``
that have no verified bytes here, so the worker can have its request recompute them
(engine/worker/kvgate.py).

Control messages (lease, release, push) go over a small TCP channel of the plane's own
(``TcpExchange``: length-prefixed msgpack, one connection per peer), in-process over
``LocalExchange``. Its address and the transfer endpoint are published in
``NodeRegistered.transfer_endpoint`` as ``"<backend>://<endpoint>;ctl=<host:port>"``; a peer
is resolved from that registration (a descriptor that names another endpoint is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from engine.kvbytes import KvBytes, checksums
from engine.transfer.base import PoolDescriptor, TransferBackend, TransferCorrupt, TransferError
from events.catalog import Event, KvEvicted, KvFetched, KvMoved, KvStored
from kernels.layout import KvLayout, KvLayoutError
from kernels.ops import copy_blocks
from services.adapters.aio import wait_for
from services.adapters.logging import get_logger

log = get_logger("kvbytes")
TIERS = ("L1", "L2")
#: Most host memory the two byte pools of one node may reserve (virtual; pages are touched only
#: as slots are used).
MAX_POOL_BYTES = 32 << 30


def layout_for(block_tokens: int, block_bytes: int) -> KvLayout:
    """A small stand-in layout of ``block_bytes`` per block (bf16, one layer, one head): the sim
    has no model, and real sizes (MiBs per block) times a node's capacity do not fit a test box."""
    if block_bytes <= 0 or block_bytes % (2 * block_tokens):
        raise KvLayoutError(
            f"--kv-block-bytes {block_bytes}: must be a positive multiple of {2 * block_tokens} "
            f"(bf16 x {block_tokens} tokens per block)"
        )
    return KvLayout(block_tokens, 1, 1, block_bytes // (2 * block_tokens), "bf16")


def format_endpoint(backend: str, endpoint: str, ctl: str) -> str:
    return f"{backend}://{endpoint};ctl={ctl}"


def parse_endpoint(text: str) -> tuple[str, str, str]:
    """``"mooncake://h:p;ctl=h:q"`` -> ``("mooncake", "h:p", "h:q")``; a clear error otherwise."""
    backend, sep, rest = text.partition("://")
    endpoint, sep2, ctl = rest.partition(";ctl=")
    if not (sep and sep2 and backend and endpoint and ctl):
        raise TransferError(f"transfer endpoint {text!r} is not '<backend>://<endpoint>;ctl=<host:port>'")
    return backend, endpoint, ctl


# ---------------------------------------------------------------------------- control messages
class Lease(msgspec.Struct, tag=True):
    blocks: list[int]


class Release(msgspec.Struct, tag=True):
    lease: int


class Push(msgspec.Struct, tag=True):
    blocks: list[int]
    pool: PoolDescriptor
    slots: list[int]


class Reply(msgspec.Struct, tag=True):
    """``pools[where[i]]``/``slots[i]``/``checksums[i]`` for block ``i``; ``where[i] = ""``:
    the owner does not hold its bytes."""

    where: list[str] = []
    slots: list[int] = []
    checksums: list[int] = []
    pools: dict[str, PoolDescriptor] = {}
    lease: int = 0
    error: str = ""


Message = Lease | Release | Push
Handler = Callable[[Message], Awaitable[Reply]]
_ENC = msgspec.msgpack.Encoder()
_MSG = msgspec.msgpack.Decoder(Message)
_REPLY = msgspec.msgpack.Decoder(Reply)
_LEN = struct.Struct(">I")


class LocalExchange:
    """Control messages between planes of one process (tests; the loopback fabric's partner).
    ``messages``: the message union its planes speak (default this plane's ``Message``)."""

    def __init__(self, messages=None) -> None:
        self.handlers: dict[str, Handler] = {}
        self._n = itertools.count()
        self.decoder = msgspec.msgpack.Decoder(messages) if messages is not None else _MSG

    def endpoint(self) -> LocalEndpoint:
        return LocalEndpoint(self, f"local-{next(self._n)}")


class LocalEndpoint:
    def __init__(self, hub: LocalExchange, address: str) -> None:
        self.hub, self.address = hub, address

    async def start(self, handler: Handler) -> None:
        self.hub.handlers[self.address] = handler

    async def request(self, address: str, msg: Message, timeout: float) -> Reply:
        handler = self.hub.handlers.get(address)
        if handler is None:
            raise TransferError(f"no KV plane at {address}")
        return await wait_for(handler(self.hub.decoder.decode(_ENC.encode(msg))), timeout)

    async def close(self) -> None:
        self.hub.handlers.pop(self.address, None)


class TcpExchange:
    """Control messages over TCP: 4-byte length + msgpack, one connection per peer, requests
    on one connection answered in order (a lock per connection). ``messages`` / ``replies``:
    the types spoken (default this plane's ``Message`` and ``Reply``; the torch engine has its own)."""

    def __init__(self, host: str = "127.0.0.1", messages=None, replies=None) -> None:
        self.host = host
        self._msg = msgspec.msgpack.Decoder(messages) if messages is not None else _MSG
        self._reply = msgspec.msgpack.Decoder(replies) if replies is not None else _REPLY
        self.address = ""
        self._server: asyncio.Server | None = None
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Lock]] = {}
        self._handler: Handler | None = None
        self._peers: set[asyncio.StreamWriter] = set()  # connections peers opened to us

    async def start(self, handler: Handler) -> None:
        self._handler = handler
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.address = f"{self.host}:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._peers.add(writer)
        try:
            while True:
                head = await reader.readexactly(_LEN.size)
                msg = self._msg.decode(await reader.readexactly(_LEN.unpack(head)[0]))
                assert self._handler is not None
                try:
                    reply = await self._handler(msg)
                except Exception as exc:  # noqa: BLE001 - one bad request never kills the channel
                    reply = Reply(error=f"{type(exc).__name__}: {exc}")
                data = _ENC.encode(reply)
                writer.write(_LEN.pack(len(data)) + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        finally:
            writer.close()
            self._peers.discard(writer)

    async def request(self, address: str, msg: Message, timeout: float) -> Reply:
        conn = self._conns.get(address)
        if conn is None:
            host, _, port = address.rpartition(":")
            try:
                reader, writer = await wait_for(asyncio.open_connection(host, int(port)), timeout)
            except (TimeoutError, OSError, ValueError) as exc:
                raise TransferError(f"KV plane at {address} does not answer ({exc or type(exc).__name__})") from exc
            conn = self._conns[address] = (reader, writer, asyncio.Lock())
        reader, writer, lock = conn
        data = _ENC.encode(msg)
        try:
            async with lock:
                writer.write(_LEN.pack(len(data)) + data)
                await writer.drain()
                head = await wait_for(reader.readexactly(_LEN.size), timeout)
                return self._reply.decode(await wait_for(reader.readexactly(_LEN.unpack(head)[0]), timeout))
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            self._conns.pop(address, None)
            writer.close()
            raise TransferError(f"KV plane at {address}: {type(exc).__name__} {exc}") from exc

    async def close(self) -> None:
        for _, writer, _ in self._conns.values():
            writer.close()
        self._conns.clear()
        if self._server is not None:
            self._server.close()
        for writer in list(self._peers):  # their readers end: the serving tasks return
            writer.close()


# ---------------------------------------------------------------------------- the plane
@dataclass
class KvBytesConfig:
    """``--kv-bytes`` settings of one worker."""

    block_bytes: int = 1024
    transfer: str = "mooncake"  # the transfer port's backend (engine/transfer/)
    host: str = "127.0.0.1"  # address the transfer engine and the control channel listen on
    headroom: float = 0.125  # extra slots for blocks dropped while a peer still reads them
    timeout_s: float = 10.0  # a control request, and the wait for blocks still arriving
    lease_ttl_s: float = 60.0  # a lease a peer never released is dropped after this long
    fabric: object = None  # loopback: the in-process fabric shared by the workers
    exchange: LocalExchange | None = None  # in-process control channel (tests); else TCP


@dataclass
class KvCounters:
    """What the plane did (logged as ``kv_bytes``; the live test checks them)."""

    stored_blocks: int = 0  # bytes written for this node's own KvStored
    evicted_blocks: int = 0
    fetched_blocks: int = 0  # KvFetched blocks whose bytes were read from a peer
    moved_blocks: int = 0  # KvMoved blocks a peer wrote into our slots
    local_copies: int = 0  # L2 -> L1 copies of blocks that just arrived
    served_blocks: int = 0  # blocks peers read from us or we wrote to peers
    bytes_in: int = 0
    bytes_out: int = 0
    transfers: int = 0  # read_blocks / write_blocks calls
    verified: int = 0  # checksums recomputed after a transfer or copy and found equal
    failed: int = 0  # checksums that differed (the block is then kept without bytes)
    unavailable: int = 0  # blocks whose bytes the owner no longer had, or a transfer error
    transfer_s: float = 0.0  # wall time in transfers and their checksums (threads)
    errors: list[str] = field(default_factory=list)  # the first few error lines

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "errors"}
        d["transfer_s"] = round(self.transfer_s, 4)
        return d


class KvDataPlane:
    """Both tiers of one node's KV bytes, and the transfers its KV facts imply (module doc)."""

    def __init__(self, node: str, block_tokens: int, l1_blocks: int, l2_blocks: int, cfg: KvBytesConfig,
                 transfer: TransferBackend) -> None:
        self.node = node
        self.cfg = cfg
        self.layout = layout_for(block_tokens, cfg.block_bytes)
        caps = {"L1": l1_blocks, "L2": l2_blocks}
        slots = {t: c + max(64, int(c * cfg.headroom)) for t, c in caps.items()}
        total = sum(slots.values()) * self.layout.block_bytes
        if total > MAX_POOL_BYTES:
            raise KvLayoutError(
                f"--kv-bytes: {sum(slots.values())} blocks x {self.layout.block_bytes} B = {total / 2**30:.1f} GiB "
                f"of host pools is over {MAX_POOL_BYTES >> 30} GiB; use a smaller --kv-block-bytes"
            )
        self.tiers = {t: KvBytes(node, t, self.layout, slots[t]) for t in TIERS}
        self.transfer = transfer
        self.pools = {t: transfer.register_pool(self.tiers[t].pool, t) for t in TIERS}
        self.exchange = cfg.exchange.endpoint() if cfg.exchange is not None else TcpExchange(cfg.host)
        self.peers: dict[str, str] = {}  # node -> transfer_endpoint (NodeRegistered)
        self.stats = KvCounters()
        self._leases: dict[int, tuple[float, list[tuple[str, int]]]] = {}
        self._lease_ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._landed = asyncio.Event()
        #: ``(event, blocks)`` once a transfer into this node ends: the blocks of the event's
        #: that have no verified bytes here (refused, lost), ``[]`` when all landed (module doc)
        self.on_landed: Callable[[Event, list[int]], None] | None = None

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        await self.exchange.start(self._handle)

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.transfer.name, self.transfer.endpoint, self.exchange.address)

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for the transfers in flight (a clean stop)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.exchange.close()
        with contextlib.suppress(Exception):
            self.transfer.close()

    # ------------------------------------------------------------------ peers
    def peer_registered(self, node: str, endpoint: str) -> None:
        if node == self.node:
            return
        if endpoint:
            self.peers[node] = endpoint
        else:
            self.peers.pop(node, None)

    # ------------------------------------------------------------------ own events
    def observe(self, event: Event) -> None:
        """One KV fact of this node, before it is published (the worker's emit path)."""
        t = type(event)
        if t is KvStored and event.node == self.node:
            for tier in event.tiers():  # a write-through store lands in both
                kb = self.tiers[tier]
                before = len(kb.slot_of)
                kb.observe(event)
                self.stats.stored_blocks += len(kb.slot_of) - before
        elif t is KvEvicted and event.node == self.node:
            self.stats.evicted_blocks += len(event.blocks)
            self.tiers[event.tier].observe(event)
        elif t is KvFetched and event.dst_node == self.node:
            self._spawn(self._fetch(event.src_node, event.blocks, ("L2", "L1"), event=event))
        elif t is KvMoved and event.dst_node == self.node and event.src_node != self.node:
            self._spawn(self._fetch(event.src_node, event.blocks, (event.dst_tier,), push=True, event=event))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _error(self, kind: str, **kw) -> None:
        log.error(kind, node=self.node, **kw)
        if len(self.stats.errors) < 5:
            self.stats.errors.append(f"{kind} {kw}")

    # ------------------------------------------------------------------ receiving
    async def _fetch(self, src: str, blocks: Sequence[int], tiers: tuple[str, ...], push: bool = False,
                     event: Event | None = None) -> None:
        """Give ``blocks`` bytes in ``tiers`` (the first is filled from ``src``, the others by a
        local copy from it). ``push``: the owner writes (P->D), else we read (peer fetch).
        Then ``on_landed(event, blocks without verified bytes in the first tier)``."""
        first = self.tiers[tiers[0]]
        pairs = {t: self.tiers[t].expect(blocks) for t in tiers}
        if not any(pairs.values()):
            self._report(event, [])
            return
        need = [b for b, _ in pairs[tiers[0]]]
        # blocks held only in a later tier: copy source is this node's own first tier
        dst_of = dict(pairs[tiers[0]])
        want: dict[int, int] = {b: first.checksum_of[b] for t in tiers[1:] for b, _ in pairs[t]
                                if b in first.checksum_of}
        t0 = time.perf_counter()
        try:
            if need:
                got = await (self._pushed(src, need, dst_of, tiers[0]) if push
                             else self._read(src, need, dst_of, tiers[0]))
                want.update(got)
            # land the first tier, then copy on into the others from it
            await self._land(tiers[0], pairs[tiers[0]], want)
            for t in tiers[1:]:
                await self._copy_on(tiers[0], t, pairs[t], want)
        except asyncio.CancelledError:
            for t in tiers:
                for b, s in pairs[t]:
                    self.tiers[t].abandon(b, s)
            raise
        finally:
            self.stats.transfer_s += time.perf_counter() - t0
            self._landed.set()
            # also when the transfer failed or was cancelled: a job waiting for it goes on
            self._report(event, [b for b, _ in pairs[tiers[0]] if not first.has_bytes(b)])

    def _report(self, event: Event | None, missing: list[int]) -> None:
        if event is not None and self.on_landed is not None:
            try:
                self.on_landed(event, missing)
            except Exception as exc:  # noqa: BLE001 - the worker's reaction must not kill the transfer task
                self._error("kv_landed_callback_failed", error=f"{type(exc).__name__}: {exc}")

    def _peer_ctl(self, src: str) -> tuple[str, str]:
        endpoint = self.peers.get(src)
        if not endpoint:
            raise TransferError(f"peer {src} registered no transfer endpoint (started without --kv-bytes?)")
        backend, address, ctl = parse_endpoint(endpoint)
        if backend != self.transfer.name:
            raise TransferError(f"peer {src} moves bytes with {backend}, this node with {self.transfer.name}")
        return address, ctl

    def _check_pool(self, src: str, address: str, desc: PoolDescriptor) -> None:
        if desc.endpoint != address:
            raise TransferError(f"peer {src} answered with pool {desc.endpoint}, registered {address} (stale?)")

    async def _read(self, src: str, need: list[int], dst_of: dict[int, int], tier: str) -> dict[int, int]:
        """Peer fetch: lease the blocks at ``src``, read them into our slots; their checksums."""
        try:
            address, ctl = self._peer_ctl(src)
            reply = await self.exchange.request(ctl, Lease(blocks=need), self.cfg.timeout_s)
            if reply.error:
                raise TransferError(f"peer {src}: {reply.error}")
        except TransferError as exc:
            self.stats.unavailable += len(need)
            self._error("kv_fetch_failed", src=src, blocks=len(need), error=str(exc))
            return {}
        local = self.tiers[tier].pool
        try:
            groups: dict[str, tuple[list[int], list[int]]] = {}
            for b, where, slot in zip(need, reply.where, reply.slots, strict=True):
                if where:
                    rs, ls = groups.setdefault(where, ([], []))
                    rs.append(slot)
                    ls.append(dst_of[b])
            sums = dict(zip(need, reply.checksums, strict=True))
            slot_block = {dst_of[b]: b for b in need}
            refused: set[int] = set()
            for where, (rs, ls) in groups.items():
                desc = reply.pools[where]
                self._check_pool(src, address, desc)
                expect = [sums[slot_block[s]] for s in ls]
                try:  # the transfer layer checks every block against the owner's checksum
                    stats = await asyncio.to_thread(self.transfer.read_blocks, desc, rs, local, ls, expect)
                except TransferCorrupt as exc:
                    refused.update(slot_block[s] for s in exc.slots)
                    self.stats.failed += len(exc.slots)
                    self._error("kv_transfer_refused", src=src, blocks=len(exc.slots), error=str(exc))
                    stats = None
                self.stats.transfers += 1
                self.stats.bytes_in += stats.nbytes if stats is not None else 0
        except (TransferError, KvLayoutError) as exc:
            self.stats.unavailable += len(need)
            self._error("kv_fetch_failed", src=src, blocks=len(need), error=str(exc))
            return {}
        finally:
            with contextlib.suppress(TransferError):
                await self.exchange.request(ctl, Release(lease=reply.lease), self.cfg.timeout_s)
        got = {b: c for b, w, c in zip(need, reply.where, reply.checksums, strict=True) if w and b not in refused}
        self.stats.unavailable += len(need) - len(got) - len(refused)
        self.stats.fetched_blocks += len(got)
        return got

    async def _pushed(self, src: str, need: list[int], dst_of: dict[int, int], tier: str) -> dict[int, int]:
        """P->D: ask ``src`` to write the blocks into our slots; their checksums."""
        try:
            _, ctl = self._peer_ctl(src)
            reply = await self.exchange.request(
                ctl, Push(blocks=need, pool=self.pools[tier], slots=[dst_of[b] for b in need]), self.cfg.timeout_s)
            if reply.error:
                raise TransferError(f"peer {src}: {reply.error}")
        except TransferError as exc:
            self.stats.unavailable += len(need)
            self._error("kv_move_failed", src=src, blocks=len(need), error=str(exc))
            return {}
        got = {b: c for b, w, c in zip(need, reply.where, reply.checksums, strict=True) if w}
        self.stats.unavailable += len(need) - len(got)
        self.stats.moved_blocks += len(got)
        self.stats.bytes_in += len(got) * self.layout.block_bytes
        return got

    async def _land(self, tier: str, pairs: list[tuple[int, int]], want: dict[int, int]) -> None:
        kb = self.tiers[tier]
        have = [(b, s) for b, s in pairs if b in want]
        sums = await asyncio.to_thread(checksums, kb.pool, [s for _, s in have]) if have else []
        for (b, s), got in zip(have, sums, strict=True):
            self._verdict(kb.land(b, s, want[b], got), tier, b, want[b], got)
        for b, s in pairs:
            if b not in want:
                kb.abandon(b, s)

    async def _copy_on(self, src_tier: str, tier: str, pairs: list[tuple[int, int]], want: dict[int, int]) -> None:
        src, kb = self.tiers[src_tier], self.tiers[tier]
        src_slots = {b: src.slot_of[b] for b, _ in pairs if b in want and src.has_bytes(b)}
        have = [(b, s) for b, s in pairs if b in src_slots]
        if have:
            held = [src_slots[b] for b, _ in have]
            src.hold(held)
            try:
                def copy_and_sum() -> list[int]:
                    copy_blocks(src.pool, held, kb.pool, [s for _, s in have]).wait()
                    return checksums(kb.pool, [s for _, s in have])

                sums = await asyncio.to_thread(copy_and_sum)
            finally:
                src.release(held)
            self.stats.local_copies += len(have)
            for (b, s), got in zip(have, sums, strict=True):
                self._verdict(kb.land(b, s, want[b], got), tier, b, want[b], got)
        for b, s in pairs:
            if b not in src_slots:
                kb.abandon(b, s)
                if b not in want:
                    continue
                self.stats.unavailable += 1

    def _verdict(self, ok: bool, tier: str, block: int, want: int, got: int) -> None:
        if ok:
            self.stats.verified += 1
        else:
            self.stats.failed += 1
            self._error("kv_checksum_mismatch", tier=tier, block=f"{block:#x}", expected=f"{want:#x}", got=f"{got:#x}")

    # ------------------------------------------------------------------ serving peers
    async def _settle(self, blocks: Sequence[int]) -> None:
        """Wait (bounded) until none of ``blocks`` is still arriving here."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while any(b in kb.pending for kb in self.tiers.values() for b in blocks):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._landed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._landed.wait(), min(left, 0.05))

    def _locate(self, blocks: Sequence[int]) -> tuple[list[str], list[int], list[int]]:
        """Per block: the tier that has its bytes (L2 first: the host copy), slot, checksum."""
        where, slots, sums = [], [], []
        for b in blocks:
            for t in ("L2", "L1"):
                kb = self.tiers[t]
                if kb.has_bytes(b):
                    where.append(t)
                    slots.append(kb.slot_of[b])
                    sums.append(kb.checksum_of[b])
                    break
            else:
                where.append("")
                slots.append(0)
                sums.append(0)
        return where, slots, sums

    def _hold(self, where: list[str], slots: list[int]) -> list[tuple[str, int]]:
        held = [(t, s) for t, s in zip(where, slots, strict=True) if t]
        for t, s in held:
            self.tiers[t].hold([s])
        return held

    def _unhold(self, held: list[tuple[str, int]]) -> None:
        for t, s in held:
            self.tiers[t].release([s])

    async def _handle(self, msg: Message) -> Reply:
        now = time.monotonic()
        for lid, (t0, held) in list(self._leases.items()):
            if now - t0 > self.cfg.lease_ttl_s:
                del self._leases[lid]
                self._unhold(held)
                self._error("kv_lease_expired", lease=lid, slots=len(held))
        if isinstance(msg, Release):
            held = self._leases.pop(msg.lease, (0.0, []))[1]
            self._unhold(held)
            return Reply()
        await self._settle(msg.blocks)
        where, slots, sums = self._locate(msg.blocks)
        held = self._hold(where, slots)
        served = len(held)
        self.stats.served_blocks += served
        if isinstance(msg, Lease):
            lid = next(self._lease_ids)
            self._leases[lid] = (now, held)
            self.stats.bytes_out += served * self.layout.block_bytes
            return Reply(where=where, slots=slots, checksums=sums, lease=lid,
                         pools={t: self.pools[t] for t in set(where) if t})
        # Push: write what we have into the peer's slots, grouped by our tier
        try:
            for t in {w for w in where if w}:
                ours = [s for w, s in zip(where, slots, strict=True) if w == t]
                theirs = [d for w, d in zip(where, msg.slots, strict=True) if w == t]
                stats = await asyncio.to_thread(self.transfer.write_blocks, self.tiers[t].pool, ours, msg.pool, theirs)
                self.stats.transfers += 1
                self.stats.bytes_out += stats.nbytes
        finally:
            self._unhold(held)
        return Reply(where=where, slots=slots, checksums=sums)

    def summary(self) -> dict:
        return {**self.stats.as_dict(), "held_slots": sum(kb.held_slots for kb in self.tiers.values()),
                "l1_blocks": len(self.tiers["L1"].checksum_of), "l2_blocks": len(self.tiers["L2"].checksum_of)}
