"""A batch of rows of unequal length (a prefill chunk beside a fresh prompt and a decode token)
runs packed: no linear layer or attention on padding. Each row's logits must be what that row
computes alone (the unpadded path), and the KV each row writes the same, whatever else is in the
batch; a test that fails if the packed path mixes rows, reads another row's keys, misses the
causal mask or takes the wrong query's logits."""

from __future__ import annotations

import pytest
import torch

from engine.backends.torch.model import Llama
from engine.backends.torch.state import Seq
from engine.backends.torch.step import inputs
from kernels.pool import BlockPool
from tests.unit.engine.torch.cluster import TINY, tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ck = tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return Llama(ck.cfg, ck.weights)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab, (n,), generator=g).tolist()


def _seq(name: str, ids: list[int], slots: list[int]) -> Seq:
    return Seq(request=name, ids=ids, hashes=[], prompt=len(ids), max_tokens=1, decode_node="n", slots=slots)


def _run(model: Llama, pool: BlockPool, rows) -> torch.Tensor:
    return model.forward(pool.typed(), *inputs(rows, 64, TINY.max_pos, torch.device("cpu")))


def _setup(model: Llama) -> tuple[BlockPool, dict]:
    """A pool where A has 100 of its 150 tokens computed and C 70 (then decodes one)."""
    pool = BlockPool(TINY.kv_layout(), 12)
    a, b, c = _ids(1, 150), _ids(2, 37), _ids(3, 71)
    seqs = {"a": _seq("a", a, [0, 1, 2]), "b": _seq("b", b, [3]), "c": _seq("c", c, [4, 5])}
    _run(model, pool, [(seqs["a"], a[:100], 0)])
    _run(model, pool, [(seqs["c"], c[:70], 0)])
    rows = [(seqs["a"], a[100:], 100), (seqs["b"], b, 0), (seqs["c"], c[70:], 70)]
    return pool, rows


def test_each_row_of_a_packed_batch_computes_what_it_computes_alone(model):
    pool, rows = _setup(model)
    ref_pool = BlockPool(TINY.kv_layout(), 12)
    ref_pool.typed().copy_(pool.typed())
    got = _run(model, pool, rows)  # rows of 50, 37 and 1 tokens: the packed path
    assert got.shape == (3, TINY.vocab)
    for i, row in enumerate(rows):
        alone = _run(model, ref_pool, [row])
        torch.testing.assert_close(got[i], alone[0], rtol=1e-4, atol=1e-5)
    # the KV every row wrote is the same as written alone
    torch.testing.assert_close(pool.typed(), ref_pool.typed(), rtol=1e-4, atol=1e-5)
