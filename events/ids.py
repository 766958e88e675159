"""Identifier and hash types shared by every event and core.

All ids are plain ``str`` / ``int`` at run time; the ``NewType`` wrappers document intent
and let type checkers catch a request id passed where a node id is expected.
"""

from __future__ import annotations

from typing import Annotated, Literal, NewType

import msgspec

BranchId = NewType("BranchId", str)
RequestId = NewType("RequestId", str)
NodeId = NewType("NodeId", str)
#: Chained 64-bit hash of one full token block (covers its parent hash and its tokens).
BlockHash = NewType("BlockHash", int)
#: A block hash as events carry it: decoding rejects a negative one (msgspec ``ValidationError``
#: -> ``CodecError`` -> dead letter), and msgpack cannot carry more than 64 bits; the JSON reader
#: (the DuckDB log) checks the upper bound in ``events.codec.from_json``. Cores therefore never
#: see a hash outside ``[0, 2**64)`` from the bus and do not check it again.
WireBlockHash = Annotated[BlockHash, msgspec.Meta(ge=0, description="unsigned 64-bit chained block hash")]
MAX_BLOCK_HASH = 2**64 - 1

Phase = Literal["prefill", "decode"]
#: A node's role: one phase, or both during warm-up ("collocated").
Role = Literal["prefill", "decode", "collocated"]
Tier = Literal["L1", "L2"]
BranchMode = Literal["root", "fork", "subagent"]
#: How a node changes role: in place keeping KV (ours), by restart losing KV (Dynamo),
#: in place dropping the node's KV (Arrow).
SwitchMechanism = Literal["in_place", "restart", "in_place_drop_kv"]

PHASES: tuple[Phase, ...] = ("prefill", "decode")
TIERS: tuple[Tier, ...] = ("L1", "L2")
