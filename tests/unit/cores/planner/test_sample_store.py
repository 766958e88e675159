"""The warm-up sample store: packed rows (the soak saw the planner grow with
it), the same values, thinning and fits as the list of rows it replaces, and it survives a
snapshot."""

from __future__ import annotations

import random
import tracemalloc

import msgspec
import numpy as np

from events.catalog import IterationDone, ModelFitted, NodeRegistered, Tick
from services.cores.planner.base import SNAPSHOT_ENCODER, _Snapshot
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.samples import Samples, packed_msgpack

NODES = ("n0", "n1")


def iterations(n: int, seed: int = 1) -> list:
    """``n`` prefill and ``n`` decode reports per node, with plausible durations."""
    rnd = random.Random(seed)
    out, ts = [], 1.0
    for _ in range(n):
        for node in NODES:
            t_uc = rnd.randint(100, 8000)
            out.append(IterationDone(ts=ts, node=node, phase="prefill", sum_t_uc=t_uc, sum_A=t_uc * 900.0,
                                     sum_t_rst=rnd.randint(0, 500), duration_s=0.002 + t_uc * 3e-6 * rnd.uniform(0.9, 1.1)))
            b = rnd.randint(1, 64)
            out.append(IterationDone(ts=ts, node=node, phase="decode", batch=b, t_fwd=1.0,
                                     duration_s=0.01 + b * 1e-4 * rnd.uniform(0.9, 1.1)))
        ts += 0.01
    return out


def planner(**kw) -> EvolvingPlanner:
    p = EvolvingPlanner(warmup_s=1e9, **kw)
    for node in NODES:
        p.apply(NodeRegistered(ts=0.0, node=node, role="collocated"))
    return p


def reference_rows(events, max_samples: int) -> dict[str, list[list[float]]]:
    """What the store held as lists of rows (before it was packed)."""
    ref: dict[str, list[list[float]]] = {}
    for ev in events:
        if ev.phase == "prefill":
            row = [float(ev.sum_t_uc), float(ev.sum_A), float(ev.sum_t_rst), ev.duration_s]
        else:
            row = [float(ev.batch), ev.t_fwd, float(ev.sum_t_c), ev.duration_s]
        rows = ref.setdefault(f"{ev.node}|{ev.phase}", [])
        rows.append(row)
        if len(rows) > max_samples:
            del rows[::2]
    return ref


def test_packed_rows_are_the_rows_a_list_held_thinned_alike():
    events = iterations(700)
    p = planner(max_samples=256)
    for ev in events:
        p.apply(ev)
    ref = reference_rows(events, 256)
    assert {k: s.view().tolist() for k, s in p._samples.items()} == ref
    assert all(len(rows) <= 256 for rows in ref.values()) and min(map(len, ref.values())) > 128


def test_sample_store_costs_under_48_bytes_a_row():
    """A row as a list of Python floats costs 150-185 bytes; packed, 24-32 (plus the buffer's
    doubling slack)."""
    events = iterations(3000)
    p = planner()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for ev in events:
            p.apply(ev)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    rows = sum(s.n for s in p._samples.values())
    assert rows == len(events)
    assert grown / rows < 48, f"{grown / rows:.0f} bytes per sample"


def test_snapshot_keeps_the_rows_and_the_fits_stay_bit_identical():
    events = iterations(400)
    whole = planner(max_samples=300, fit_interval_s=1.0)
    restored = planner(max_samples=300, fit_interval_s=1.0)
    out_whole, out_restored = [], []
    half = len(events) // 2
    for i, ev in enumerate(events):
        out_whole += whole.apply(ev)
        out_restored += restored.apply(ev)
        if i == half:
            restored = EvolvingPlanner.from_snapshot(restored.snapshot())
            assert restored.snapshot() == whole.snapshot()
    out_whole += whole.apply(Tick(ts=10.0))
    out_restored += restored.apply(Tick(ts=10.0))
    fitted = [e for e in out_whole if isinstance(e, ModelFitted)]
    assert fitted and out_restored == out_whole
    assert {k: s.view().tolist() for k, s in restored._samples.items()} == reference_rows(events, 300)


def test_a_snapshot_taken_before_the_context_term_restores_with_context_zero():
    """Decode rows were (batch, t_fwd, duration) before the decode model's context term; such a
    snapshot restores with a context of 0 in each row and fits as before."""
    events = [e for e in iterations(200) if e.phase == "decode"]
    p = planner(max_samples=300)
    for ev in events:
        p.apply(ev)
    snap = msgspec.msgpack.decode(p.snapshot(), type=_Snapshot)
    old_rows = {k: [[r[0], r[1], r[3]] for r in rows] for k, rows in snap.state.samples.items()}
    old = SNAPSHOT_ENCODER.encode(_Snapshot(snap.cls, snap.config,
                                            msgspec.structs.replace(snap.state, samples=old_rows), snap.slices))
    restored = EvolvingPlanner.from_snapshot(old)
    assert {k: s.view().tolist() for k, s in restored._samples.items()} == \
        {k: [[r[0], r[1], 0.0, r[2]] for r in rows] for k, rows in old_rows.items()}


def test_a_snapshot_encodes_the_rows_as_lists_would_without_building_them():
    """The snapshot's samples are msgspec's encoding of the rows as lists of floats, byte for
    byte (old snapshots restore, new ones decode as before), written from the packed buffer: the
    snapshot's peak memory is about its own size, not the 150-185 bytes a row of Python floats
    costs (which every 5-second snapshot allocated again, raising the high-water mark)."""
    events = iterations(3000)
    p = planner()
    for ev in events:
        p.apply(ev)
    rows = sum(s.n for s in p._samples.values())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        data = p.snapshot()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(data), f"snapshot of {len(data)} bytes peaked at {peak} ({peak / rows:.0f} per row)"
    snap = msgspec.msgpack.decode(data, type=_Snapshot)
    assert snap.state.samples == reference_rows(events, p.cfg.max_samples)
    as_lists = msgspec.structs.replace(snap.state, samples=reference_rows(events, p.cfg.max_samples))
    assert SNAPSHOT_ENCODER.encode(as_lists) == SNAPSHOT_ENCODER.encode(snap.state)


def test_packed_msgpack_is_msgspecs_encoding_at_every_array_size():
    for n in (0, 1, 15, 16, 65535, 65536):
        for width in (3, 4):
            s = Samples(width)
            values = np.arange(n * width, dtype=np.float64).reshape(n, width) * 1.5e-3 - 7.0
            for row in values:
                s.append(list(row))
            assert packed_msgpack(s) == SNAPSHOT_ENCODER.encode(values.tolist()), (n, width)
