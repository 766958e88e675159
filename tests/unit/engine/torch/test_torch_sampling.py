"""Sampling and stopping in the torch engine (engine/backends/torch/sampling.py), on the tiny
random checkpoint: the same seed gives the same output (on one node, and prefilled on one node,
decoded on another), temperature 0 and top_k 1 are greedy, a stop string and the end-of-sequence
token end the output with finish_reason "stop", ignore_eos runs to max_tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.backend import Sampling
from engine.backends.torch.loader import Checkpoint
from engine.backends.torch.sampling import Stops, pick, sample_row, token_seed
from events.catalog import RequestFinished
from tests.unit.engine.torch.cluster import TINY, Cluster, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-sampling") / "tiny.gguf")


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab, (n,), generator=g).tolist()


def done(c: Cluster, rid: str):
    return next(m for m in c.tokens if m.request == rid and m.kind == "done")


def fin(c: Cluster, rid: str) -> RequestFinished:
    return next(e for e in c.events if type(e) is RequestFinished and e.request == rid)


HOT = Sampling(temperature=50.0, top_p=0.99, top_k=200, seed=7)  # the random model is peaked: flatten it


async def test_the_same_seed_gives_the_same_output_on_any_node(ckpt):
    c = await Cluster(ckpt, {"a": "prefill", "b": "decode", "m": "collocated"}).start()
    try:
        p = prompt(1, 100)
        c.submit("m", "s1", p, 24, sampling=HOT)
        c.submit("m", "s2", p, 24, sampling=HOT)
        c.submit("m", "other", p, 24, sampling=replace(HOT, seed=8))
        c.submit("m", "greedy", p, 24)
        c.submit("a", "pd", p, 24, decode="b", sampling=HOT)  # first token on a, the rest on b
        outs = {r: await c.finished(r) for r in ("s1", "s2", "other", "greedy", "pd")}
        assert outs["s1"] == outs["s2"] == outs["pd"] and len(outs["s1"]) == 24
        assert outs["other"] != outs["s1"] and outs["greedy"] != outs["s1"]
    finally:
        await c.stop()


async def test_temperature_zero_and_top_k_one_are_greedy(ckpt):
    c = await Cluster(ckpt, {"m": "collocated"}).start()
    try:
        p = prompt(2, 80)
        c.submit("m", "greedy", p, 16)
        c.submit("m", "t0", p, 16, sampling=Sampling(temperature=0.0, seed=3))
        c.submit("m", "k1", p, 16, sampling=Sampling(temperature=1.0, top_k=1, seed=3))
        outs = [await c.finished(r) for r in ("greedy", "t0", "k1")]
        assert outs[0] == outs[1] == outs[2]
    finally:
        await c.stop()


async def test_a_stop_string_ends_the_output_before_it(ckpt):
    c = await Cluster(ckpt, {"m": "collocated"}).start()
    try:
        p = prompt(3, 90)
        c.submit("m", "ref", p, 20)
        ref = await c.finished("ref")
        full = c.text("ref")
        stop = f"{ref[6]} {ref[7]} "  # the tiny checkpoint has no tokenizer: its text is "id " per token
        cut = full.find(stop)
        c.submit("m", "cut", p, 20, sampling=Sampling(stop=(stop, "never")))
        await c.finished("cut")
        assert c.text("cut") == full[:cut]
        assert done(c, "cut").finish_reason == "stop" and done(c, "ref").finish_reason == "length"
        assert fin(c, "cut").output_tokens == len(full[:cut + len(stop)].split()) < 20
    finally:
        await c.stop()


async def test_eos_ends_the_output_unless_ignored(ckpt):
    c0 = await Cluster(ckpt, {"m": "collocated"}).start()
    try:
        p = prompt(4, 70)
        c0.submit("m", "ref", p, 12)
        ref = await c0.finished("ref")
    finally:
        await c0.stop()
    eos = ref[-1]  # a greedy token becomes the EOS (the random model repeats itself: maybe the first)
    ck = Checkpoint(cfg=replace(ckpt.cfg, eos=eos), weights=ckpt.weights, tokenizer=None, path=ckpt.path)
    c = await Cluster(ck, {"m": "collocated"}).start()  # TorchConfig.ignore_eos True: trace replays
    try:
        c.submit("m", "turn", p, 12, ignore_eos=False)  # a gateway request
        c.submit("m", "bench", p, 12, ignore_eos=True)
        c.submit("m", "trace", p, 12)  # not said: the engine's default
        await c.finished("turn"), await c.finished("bench"), await c.finished("trace")
        first = ref.index(eos)
        assert fin(c, "turn").output_tokens == first + 1 and done(c, "turn").finish_reason == "stop"
        assert c.output("turn") == ref[:first + 1]  # no tokenizer: the ids as text, the EOS's too
        assert fin(c, "bench").output_tokens == fin(c, "trace").output_tokens == 12
        assert done(c, "bench").finish_reason == done(c, "trace").finish_reason == "length"
    finally:
        await c.stop()


def test_pick_draws_from_the_top_p_set_only():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    s = Sampling(temperature=1.0, top_p=0.5, seed=1)
    assert {pick(logits, [("r", replace(s, seed=i), 0)])[0] for i in range(30)} == {0}
    wide = {sample_row(logits[0], Sampling(temperature=1.0), token_seed(None, "r", i)) for i in range(60)}
    assert wide == {0, 1}
    assert token_seed(5, "a", 3) == token_seed(5, "b", 3) != token_seed(5, "a", 4)
    assert token_seed(None, "a", 3) != token_seed(None, "b", 3)


def test_stops_hold_back_what_may_begin_a_stop_string():
    st = Stops(eos=2, ignore_eos=False, stop=("END", "xy"))
    assert st.hold("abc EN") == 4 and st.hold("abc x") == 4 and st.hold("abc") == 3
    assert st.cut("abc ENDxy") == 4 and st.cut("abc") is None
    assert st.at_eos(2) and not Stops(2, True).at_eos(2)
