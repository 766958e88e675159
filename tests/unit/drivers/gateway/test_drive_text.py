"""Synthetic prompt text of ``evolving drive``: exact length, and the trace's prefix structure
reappears in the gateway's own block hashes (byte-level tokenizer)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from events.hashing import block_hashes
from replay.traces.format import Branch, End, Fork, Request, Session
from services.drivers.gateway.drive import block_text, last_request_steps, synth_prompt, tail_text
from services.drivers.gateway.tokenizer import ByteTokenizer


def test_block_text_is_ascii_of_the_right_length_and_deterministic():
    t = block_text(123, 64)
    assert len(t) == 64 and t.isascii() and t == block_text(123, 64)
    assert block_text(124, 64) != t
    assert len(block_text(5, 200)) == 200 and len(block_text(5, 16)) == 16
    assert tail_text("r", 0) == "" and len(tail_text("r", 10)) == 10 and tail_text("r", 10)[0] == "#"


def _gw_hashes(blocks, tail, request):
    text = synth_prompt(blocks, tail, 64, request)
    ids = ByteTokenizer().encode(text)
    assert len(ids) == len(blocks) * 64 + tail
    return block_hashes(ids, 64)


@given(a=st.lists(st.integers(0, 5), min_size=0, max_size=6),
       b=st.lists(st.integers(0, 5), min_size=0, max_size=6),
       ta=st.integers(0, 63), tb=st.integers(0, 63))
def test_gateway_hashes_share_exactly_the_trace_prefix(a, b, ta, tb):
    # trace blocks are chained: model that by making each hash depend on its prefix
    ca = [hash(tuple(a[: i + 1])) & 0xFFFFFFFF for i in range(len(a))]
    cb = [hash(tuple(b[: i + 1])) & 0xFFFFFFFF for i in range(len(b))]
    ga, gb = _gw_hashes(ca, ta, "ra"), _gw_hashes(cb, tb, "rb")
    shared_trace = next((i for i, (x, y) in enumerate(zip(ca, cb, strict=False)) if x != y), min(len(ca), len(cb)))
    shared_gw = next((i for i, (x, y) in enumerate(zip(ga, gb, strict=False)) if x != y), min(len(ga), len(gb)))
    assert shared_gw == shared_trace
    assert len(ga) == len(ca) and len(gb) == len(cb)


def test_last_request_steps():
    s = Session(id="s", branches=[
        Branch(id="root", steps=[Request(blocks=[1], output_tokens=1), Fork(branch="k"),
                                 Request(blocks=[1, 2], output_tokens=1), End()]),
        Branch(id="k", parent="root", mode="fork", steps=[Request(blocks=[1], output_tokens=1),
                                                          Fork(branch="k2")]),
        Branch(id="k2", parent="k", mode="fork", steps=[Request(blocks=[1], output_tokens=1)]),
    ])
    assert last_request_steps(s) == {"root": 2, "k": None, "k2": 0}
