"""Typed events of the Evolving Infra control plane (the only contract between services).

Layer 0 (the bottom): the catalog, wire types (``wire``), codec, hashing, ids and subjects.
May import: the standard library and msgspec only. Everything else imports it.
"""

from events.catalog import *
from events.catalog import EVENT_BY_NAME, EVENT_TYPES, AnyEvent, Event  # noqa: F401
from events.codec import (  # noqa: F401
    SCHEMA_VERSION,
    CodecError,
    SchemaVersionError,
    decode,
    decode_message,
    encode,
)
from events.hashing import block_hashes, hash_block_tokens, namespaced_hash  # noqa: F401
from events.ids import *
