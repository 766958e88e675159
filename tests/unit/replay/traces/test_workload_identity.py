"""The fast session generator generates exactly what the per-block numpy version did.

The digests below were computed with the generator as it was before the fast path
(``hash_block_tokens`` per block through numpy, ``np.searchsorted`` + ``np.linspace`` per
quantile draw, commit 6e4c85e): a changed hash, draw, pause or output length changes them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import hash_block_tokens, salted_chain
from replay.traces import _chain
from replay.traces.format import encode_session
from replay.traces.workloads import LogNormal, Quantiles, generate
from tests.hyp import examples

PINNED = {
    ("cc", 0, 12, None): "9cf03e1786ef313ea5b3a7355f77fecf4838ce4b76e0602385c7a671d6290ffb",
    ("cc", 5, 8, None): "5304e1e85897a389ca78f1ff68dc01fc4360009dab1c73043cc661235dc8e40e",
    ("cc", 2, 5, 3.0): "770be9ec69f7f7185b3eea2b11682e6d343792b933cff5a9d692cd056511193a",
    ("putnam", 0, 20, None): "3907ce95be119cc5bc4a6692fe15c054bbc8a3682235fa3361864cc75a400fbd",
    ("osworld", 0, 20, None): "db140b094278725242313b71b027ece28b559bb05d82262a690ae31073dae9c9",
}


@pytest.mark.parametrize(("name", "seed", "agents", "rate"), list(PINNED))
def test_generated_sessions_are_byte_identical_to_the_numpy_generator(name, seed, agents, rate):
    h = hashlib.sha256()
    for s in generate(name, seed=seed, agents=agents, rate_per_min=rate):
        h.update(encode_session(s))
    assert h.hexdigest() == PINNED[(name, seed, agents, rate)]


# events.hashing's chain and the generators' compiled one (replay/traces/_chain.pyx)
CHAINS = pytest.mark.parametrize("chain", [salted_chain, _chain.salted_chain], ids=["python", "compiled"])


@CHAINS
@settings(max_examples=examples(300), deadline=None)
@given(parent=st.integers(0, 2**64 - 1), salt=st.integers(0, 2**64 - 1), start=st.integers(0, 2**32 - 41),
       count=st.integers(0, 40))
def test_salted_chain_is_hash_block_tokens_chained(chain, parent, salt, start, count):
    want, p = [], parent
    for i in range(start, start + count):
        p = hash_block_tokens(p, [salt & 0xFFFFFFFF, salt >> 32 & 0xFFFFFFFF, i])
        want.append(p)
    assert chain(parent, salt, start, count) == want


@CHAINS
def test_salted_chain_takes_parent_and_salt_modulo_2_64(chain):
    """Wider or negative ints: the low 64 bits, as the struct packing of the Python chain."""
    for parent, salt in [(2**64 + 5, 7), (-1, 2**70 + 3), (3, -(2**40))]:
        assert chain(parent, salt, 9, 4) == salted_chain(parent & (2**64 - 1), salt & (2**64 - 1), 9, 4)


@CHAINS
def test_salted_chain_refuses_indices_that_are_not_u32(chain):
    with pytest.raises(ValueError, match="u32"):
        chain(1, 2, 2**32 - 1, 2)
    with pytest.raises(ValueError, match="u32"):
        chain(1, 2, -1, 1)
    assert chain(1, 2, 5, 0) == []
    assert chain(1, 2, 2**32 - 1, 1) == salted_chain(1, 2, 2**32 - 1, 1)


def _reference_at(qd: Quantiles, u: float) -> float:
    """Quantiles.at before the fast path (numpy per draw)."""
    probs = qd.p or tuple(np.linspace(0, 1, len(qd.q)))
    u = min(max(u, 0.0), 1.0)
    i = min(max(int(np.searchsorted(probs, u, side="right")) - 1, 0), len(qd.q) - 2)
    span = probs[i + 1] - probs[i]
    f = (u - probs[i]) / span if span > 0 else 0.0
    a, b = qd.q[i], qd.q[i + 1]
    v = float(np.exp(np.log(a) + f * (np.log(b) - np.log(a)))) if a > 0 and b > 0 else a + f * (b - a)
    return float(round(v)) if qd.integer else v


values = st.floats(0.0, 1e6, allow_nan=False)


@st.composite
def quantiles(draw):
    q = sorted(draw(st.lists(st.one_of(st.just(0.0), values), min_size=2, max_size=30)))
    if draw(st.booleans()):  # explicit probabilities, increasing from 0 to 1 (ties allowed)
        inner = sorted(draw(st.lists(st.floats(0.0, 1.0), min_size=len(q) - 2, max_size=len(q) - 2)))
        p = (0.0, *inner, 1.0)
    else:
        p = ()
    return Quantiles(q=tuple(q), p=p, integer=draw(st.booleans()))


@settings(max_examples=examples(300), deadline=None)
@given(quantiles(), st.lists(st.floats(-0.5, 1.5, allow_nan=False), min_size=1, max_size=20))
def test_quantile_draws_are_bit_identical_to_the_numpy_version(qd, us):
    for u in [*us, 0.0, 1.0, 0.5]:
        got, want = qd.at(u), _reference_at(qd, u)
        assert got == want or (np.isnan(got) and np.isnan(want)), (qd, u, got, want)


@settings(max_examples=examples(50), deadline=None)
@given(st.floats(0.5, 1e5), st.floats(0.01, 3.0), st.integers(0, 2**32 - 1), st.booleans())
def test_lognormal_draws_unchanged(median, sigma, seed, integer):
    d = LogNormal(median, sigma, 1.0, 1e6, zero_p=0.1, integer=integer)
    a, b = np.random.Generator(np.random.PCG64(seed)), np.random.Generator(np.random.PCG64(seed))
    for _ in range(10):
        want = 0.0 if b.random() < d.zero_p else min(max(float(b.lognormal(np.log(median), sigma)), 1.0), 1e6)
        want = float(round(want)) if integer and want else want
        assert d.draw(a) == want
