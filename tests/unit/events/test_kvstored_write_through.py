"""``KvStored.write_through`` (schema 1.1): on the wire only when set, so a single-tier
store is byte-identical to one written before; a payload without it reads as a single-tier
store (old logs); ``tiers()`` is what every consumer folds."""

from __future__ import annotations

import msgspec

from events import codec
from events.catalog import KvStored


def test_a_single_tier_store_has_no_new_key_on_the_wire():
    ev = KvStored(ts=1.5, src="p0", node="p0", tier="L1", blocks=[1, 2], request="r")
    assert b"write_through" not in codec.encode(ev) and b"write_through" not in codec.to_json(ev)
    assert codec.to_json(ev) == (b'{"type":"KvStored","ts":1.5,"src":"p0","node":"p0","tier":"L1",'
                                 b'"blocks":[1,2],"request":"r","branch":null}')


def test_a_write_through_store_round_trips_and_lands_in_both_tiers():
    ev = KvStored(ts=1.5, src="p0", node="p0", tier="L1", blocks=[1, 2], request="r", write_through=True)
    assert codec.decode(codec.encode(ev)) == ev and codec.from_json(codec.to_json(ev)) == ev
    assert ev.tiers() == ("L1", "L2")


def test_a_payload_from_before_the_field_reads_as_one_tier():
    old = codec.from_json(b'{"type":"KvStored","ts":0.0,"src":"","node":"p0","tier":"L2","blocks":[7]}')
    assert old.write_through is msgspec.UNSET and old.tiers() == ("L2",)
    assert KvStored(ts=0.0, node="p0", tier="L2", blocks=[7], write_through=True).tiers() == ("L2",)  # L1 only
    assert KvStored(ts=0.0, node="p0", tier="L1", write_through=False).tiers() == ("L1",)
