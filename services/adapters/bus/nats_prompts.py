"""The prompt store on NATS JetStream: :class:`NatsPromptStore`, a KV bucket ``EI_PROMPTS_<P>``
(stream ``KV_EI_PROMPTS_<P>``, subjects ``$KV.EI_PROMPTS_<P>.>``) with a TTL.

The port, the codec and the in-process twin are in :mod:`services.adapters.bus.prompts`; both
pass tests/contract/test_prompts.py. Bucket: history 1 (a retry overwrites), ``max_age`` = the
TTL (JetStream drops expired values itself), direct gets on (a read is one request to any
replica: ``$JS.API.DIRECT.GET.KV_<B>.$KV.<B>.<key>``), file storage (``memory=True``: memory,
which a server restart empties) with the event stream's replicas. Only the writer creates it (the gateway; on a secured bus its account may create
this one stream and publish into it, the engines may only read it: security.py); a reader of
an absent bucket gets None. A value is at most the server's max payload less 4 KiB (headers),
so a large prompt is stored in chunks (prompts.split): the chunks first, the head last, so a
reader that finds the head finds the rest.

Layer 2 (adapter: NATS). May import: ``events``, ``services.adapters``, nats-py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import BucketNotFoundError, NoStreamResponseError, NotFoundError

from services.adapters.aio import wait_for
from services.adapters.bus.prompts import (
    DEFAULT_TTL_S,
    chunks_after,
    decode_tokens,
    encode_tokens,
    join,
    prompt_key,
    split,
)
from services.adapters.bus.security import prompt_bucket
from services.adapters.logging import get_logger

log = get_logger("bus")
HEADROOM = 4096  # bytes of a message kept for its headers and subject


#: the request id of :meth:`NatsPromptStore.warm`'s probe (no gateway request id has a colon first)
WARM_KEY = ":warm"


class NatsPromptStore:
    """:class:`services.adapters.bus.prompts.PromptStore` on a JetStream KV bucket."""

    def __init__(self, nc, partition: str, *, ttl_s: float = DEFAULT_TTL_S, replicas: int = 1,
                 value_bytes: int | None = None, timeout_s: float = 5.0, memory: bool = False) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.bucket = prompt_bucket(partition)
        self.stream = f"KV_{self.bucket}"
        self.prefix = f"$KV.{self.bucket}."
        self.ttl_s, self.replicas, self.timeout_s, self.memory = ttl_s, replicas, timeout_s, memory
        self.value_bytes = value_bytes or max(HEADROOM, int(nc.max_payload or 1024 * 1024) - HEADROOM)
        self.retry_for_s = 10.0  # put: how long to try again while the bucket elects its leader
        self._ready = False  # the bucket is known to exist
        self._missing_until = 0.0  # a reader found no bucket: do not ask again before this

    @classmethod
    def from_bus(cls, bus, partition: str | None = None, **kw) -> NatsPromptStore:
        """The store over a :class:`~services.adapters.bus.nats_bus.NatsBus`'s connection (the
        bus's partition unless another is named; the event stream's replicas unless ``replicas``
        is given): drivers never take the connection out of the bus."""
        kw.setdefault("replicas", bus.settings.replicas)
        return cls(bus.nc, partition or bus.partition, **kw)

    async def ensure(self) -> None:
        """Create the bucket unless it exists (the writer's part; needs its permission)."""
        if self._ready:
            return
        try:
            await self.js.stream_info(self.stream)
        except NotFoundError:
            await self.js.create_key_value(api.KeyValueConfig(
                bucket=self.bucket, history=1, ttl=self.ttl_s,
                storage=api.StorageType.MEMORY if self.memory else api.StorageType.FILE,
                replicas=self.replicas, direct=True,
                description="prompt token ids by request id (docs/engines.md, Prompts)"))
            log.info("prompt_bucket_created", bucket=self.bucket, ttl_s=self.ttl_s, replicas=self.replicas)
        self._ready = True

    async def put(self, request: str, tokens: Sequence[int]) -> int:
        """Store the prompt; while the bucket has no responder or does not answer in time (its
        leader being elected: a bucket just created on a cluster, a server of it lost) the put is
        tried again for up to :attr:`retry_for_s`. A retry cannot duplicate anything: a key holds
        one value (history 1) and the same request writes the same bytes."""
        await self.ensure()
        key = self.prefix + prompt_key(request)
        values = split(encode_tokens(tokens), self.value_bytes)
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                await self._put_values(key, values)
                return sum(len(v) for v in values)
            except (NoStreamResponseError, NatsTimeoutError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("prompt_put_retry", bucket=self.bucket, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.2)

    async def warm(self, within_s: float) -> float:
        """Create the bucket and write one probe value, trying again while the bucket does not
        answer (an R3 bucket just created elects its leader; on a loaded machine the first
        write of a fresh one took longer than a request's own retry, and the compose stack's
        first chat was a 503), for up to ``within_s``. The gateway calls it before it listens,
        so its health check passes only once a prompt can be stored."""
        t0 = time.monotonic()
        deadline = t0 + within_s
        while True:
            try:
                await self.ensure()
                await self._put_values(self.prefix + prompt_key(WARM_KEY), [encode_tokens([0])])
                return time.monotonic() - t0
            except (NoStreamResponseError, NatsTimeoutError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("prompt_store_warming", bucket=self.bucket, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)

    async def _put_values(self, key: str, values: list[bytes]) -> None:
        if len(values) > 1:  # the chunks before the head (module docstring)
            futs = [await self.js.publish_async(f"{key}.{i}", v) for i, v in enumerate(values[1:], 1)]
            await wait_for(asyncio.gather(*futs), self.timeout_s)
        await self.js.publish(key, values[0], timeout=self.timeout_s)

    async def _value(self, subject: str) -> bytes | None:
        try:
            msg = await self.js.get_msg(self.stream, subject=subject, direct=True)
        except NotFoundError:
            return None
        if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data or b""

    async def get(self, request: str) -> list[int] | None:
        if not self._ready:
            if time.monotonic() < self._missing_until:
                return None
            try:
                await self.js.stream_info(self.stream)
            except (NotFoundError, BucketNotFoundError):
                self._missing_until = time.monotonic() + 1.0
                return None
            self._ready = True
        key = self.prefix + prompt_key(request)
        try:
            head = await wait_for(self._value(key), self.timeout_s)
            if head is None:
                return None
            n = chunks_after(head)
            rest = await wait_for(
                asyncio.gather(*(self._value(f"{key}.{i}") for i in range(1, n + 1))), self.timeout_s)
        except NoRespondersError:  # the bucket went away (deleted by the admin)
            self._ready = False
            return None
        if any(r is None for r in rest):
            return None  # a chunk expired before its head
        return decode_tokens(join([head, *rest]))

    async def close(self) -> None:
        pass  # the connection belongs to the caller
