"""Compatibility name: the simulated node lives in :mod:`engine.backends.sim.node` now."""

from engine.backends.sim.node import (  # noqa: F401 - re-exported for replay/ and older imports
    COLLOCATED_DECODE_SLICE_S,
    EVICT_BATCH,
    FETCH_MODES,
    DecodeJob,
    NodeHost,
    PrefillJob,
    SimNode,
)
