"""The prompt store port: a prompt's token ids, keyed by request id, from the gateway to the
engine that prefills it (docs/engines.md, "Prompts"), its codec and its in-process twin.

Why a store and not the event: ``RequestSubmitted`` is folded by every service and recorded
for good, while the ids are needed once, by one engine, for minutes; on the event they would
grow the log by 2-4 bytes a token (400 KB for 100K tokens) and let every account read the
prompt. The store is a JetStream KV bucket ``EI_PROMPTS_<P>`` (``nats_prompts.NatsPromptStore``)
with a TTL, written by the gateway only and read by the engines only (services/adapters/bus/
security.py); the measured costs are in docs/engines.md (``evolving bench prompts``).

Codec (:func:`encode_tokens`): a 12-byte header (``b"EIP"``, version 1, the width of an id in
bytes, 2 when every id fits in 16 bits, else 4, three reserved bytes, the number of ids as
u32), then the ids little-endian. An encoded prompt larger than one value (NATS's max payload,
1 MB by default: 262,144 ids of 4 bytes do not fit) is split into chunks (:func:`split`): the
head value is the header plus the first chunk and names how many follow (u16 in the reserved
bytes), chunk ``i`` is stored under ``<key>.<i>``. Both twins store the same values, so the
contract tests (tests/contract/test_prompts.py) cover the codec on each.

Keys are ``blake2b(request id, 16 bytes)`` in hex (:func:`prompt_key`): a request id may hold
characters a KV key may not (``/``, spaces, unicode).

Layer 2 (adapter). May import: stdlib.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

MAGIC = b"EIP"
VERSION = 1
HEADER = struct.Struct("<3sBBBHI")  # magic, version, width, reserved, chunks after the head, ids
DEFAULT_TTL_S = 600.0
MAX_TOKEN_ID = 2**32 - 1


class PromptCodecError(ValueError):
    """A stored value that is not an encoded prompt (what is wrong with it in the message)."""


@runtime_checkable
class PromptStore(Protocol):
    """Token ids by request id. ``put`` by the gateway before it publishes the request;
    ``get`` by the engine a ``RouteDecided`` names: the ids, or None when there are none (never
    stored, e.g. a replayed trace; expired; its bucket absent)."""

    async def put(self, request: str, tokens: Sequence[int]) -> int:
        """Store the ids of ``request`` (replacing any); returns the bytes stored."""

    async def get(self, request: str) -> list[int] | None: ...

    async def warm(self, within_s: float) -> float:
        """Make the store take writes before the first request needs it (create the bucket,
        wait out its leader election) for up to ``within_s``; the seconds it took. Raises the
        last error when it could not."""

    async def close(self) -> None: ...


def prompt_key(request: str) -> str:
    return hashlib.blake2b(request.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """The header and the ids (the module docstring); an id outside [0, 2**32) is a ValueError."""
    try:
        arr = array("I", tokens if isinstance(tokens, list | array) else list(tokens))
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
        arr.byteswap()
    body = arr.tobytes()
    width = 4
    if not body[2::4].strip(b"\0") and not body[3::4].strip(b"\0"):  # every id in 16 bits (C-speed test)
        width, body = 2, memoryview(body).cast("H")[::2].tobytes()  # the low half of each u32
    return HEADER.pack(MAGIC, VERSION, width, 0, 0, len(arr)) + body


def decode_tokens(data: bytes) -> list[int]:
    """The ids of one whole encoded prompt (head and chunks joined)."""
    if len(data) < HEADER.size:
        raise PromptCodecError(f"a stored prompt is {len(data)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, width, _, _, n = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or width not in (2, 4):
        raise PromptCodecError(f"not an encoded prompt (magic {magic!r}, version {version}, width {width})")
    body = memoryview(data)[HEADER.size:]
    if len(body) != n * width:
        raise PromptCodecError(f"a stored prompt says {n} ids of {width} bytes but holds {len(body)} bytes")
    arr = array("H" if width == 2 else "I")
    arr.frombytes(body)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def split(data: bytes, value_bytes: int) -> list[bytes]:
    """``data`` as the values to store: the head (header with the number of chunks after it,
    then the first bytes) and the chunks, each at most ``value_bytes`` long."""
    if value_bytes <= HEADER.size:
        raise ValueError(f"value_bytes must be larger than the {HEADER.size}-byte header, got {value_bytes}")
    rest = data[value_bytes:]
    chunks = [rest[i:i + value_bytes] for i in range(0, len(rest), value_bytes)]
    if len(chunks) > 0xFFFF:
        raise ValueError(f"a prompt of {len(data)} bytes needs {len(chunks)} chunks of {value_bytes} (max 65535)")
    head = bytearray(data[:value_bytes])
    struct.pack_into("<H", head, 6, len(chunks))
    return [bytes(head), *chunks]


def chunks_after(head: bytes) -> int:
    """How many chunks follow a head value (:func:`split`)."""
    if len(head) < HEADER.size or head[:3] != MAGIC:
        raise PromptCodecError("not the head of an encoded prompt")
    return struct.unpack_from("<H", head, 6)[0]


def join(values: Sequence[bytes]) -> bytes:
    """The inverse of :func:`split` (the reserved chunk count is zeroed again)."""
    head = bytearray(values[0])
    struct.pack_into("<H", head, 6, 0)
    return bytes(head) + b"".join(values[1:])


class InMemoryPromptStore:
    """The in-process twin: the same values and keys as the NATS bucket, a TTL on the clock
    given (``time.monotonic`` by default), ``value_bytes`` per value as NATS's max payload."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, *, value_bytes: int = 1024 * 1024 - 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.value_bytes, self.clock = ttl_s, value_bytes, clock
        self._values: dict[str, tuple[float, bytes]] = {}

    async def put(self, request: str, tokens: Sequence[int]) -> int:
        key, now = prompt_key(request), self.clock()
        self._expire(now)
        values = split(encode_tokens(tokens), self.value_bytes)
        for i, v in enumerate(values[1:], 1):
            self._values[f"{key}.{i}"] = (now + self.ttl_s, v)
        self._values[key] = (now + self.ttl_s, values[0])
        return sum(len(v) for v in values)

    async def get(self, request: str) -> list[int] | None:
        key = prompt_key(request)
        self._expire(self.clock())
        head = self._values.get(key)
        if head is None:
            return None
        n = chunks_after(head[1])
        rest = [self._values.get(f"{key}.{i}") for i in range(1, n + 1)]
        if any(r is None for r in rest):
            return None
        return decode_tokens(join([head[1], *(r[1] for r in rest)]))

    async def warm(self, within_s: float) -> float:
        return 0.0  # a dict takes writes at once

    def _expire(self, now: float) -> None:
        for k in [k for k, (t, _) in self._values.items() if t <= now]:
            del self._values[k]

    async def close(self) -> None:
        pass
