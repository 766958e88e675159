"""Typed events of the Evolving Infra control plane (the only contract between services)."""

from events.catalog import *  # noqa: F401,F403
from events.catalog import AnyEvent, Event, EVENT_TYPES, EVENT_BY_NAME  # noqa: F401
from events.codec import (  # noqa: F401
    SCHEMA_VERSION,
    CodecError,
    SchemaVersionError,
    decode,
    decode_message,
    encode,
)
from events.hashing import block_hashes, hash_block_tokens, namespaced_hash  # noqa: F401
from events.ids import *  # noqa: F401,F403
