"""The pool of agents a simulation draws its sessions from: :class:`SessionSource`.

Recorded sessions are cycled (each pass re-salted so copies never share KV); synthetic ones are
generated on demand. Moved out of replay/sim/simulation.py (which re-exports it) to keep that
file to the event loop.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

import msgspec
from engine._kvscan import common_prefix

from replay.traces._chain import salted
from replay.traces.format import Compact, Request, Session

_MASK = (1 << 64) - 1


def _salt_blocks(blocks: list[int], salt: int, start: int = 0) -> list[int]:
    """A bijective 64-bit remap (odd multiplier, xor) of ``blocks[start:]``: a replayed copy of
    a session gets its own block hashes, so copies never share KV that distinct agents would
    not share. ``[((h * mul) & _MASK) ^ x for h in ...]``, compiled (replay/traces/_chain.pyx)."""
    mul = 0x9E3779B97F4A7C15
    x = (salt * 0xD6E8FEB86659FD93) & _MASK
    return salted(blocks, start, mul, x)


class SessionSource:
    """The pool of agents: session ``k`` for the ``k``-th start.

    A list of recorded sessions is cycled; the ``c``-th pass (c >= 1) over it re-salts every
    block hash (``_salt_blocks``), so a few hundred real single-agent sessions make a 126-agent
    load without agents sharing each other's KV. ``make`` generates session ``k`` on demand
    (synthetic workloads: an endless pool, never a repeat).
    """

    def __init__(self, sessions: Sequence[Session] | None = None, make: Callable[[int], Session] | None = None):
        if not sessions and make is None:
            raise ValueError("a simulation needs at least one session")
        self.sessions = list(sessions or [])
        self.make = make
        self.make_s = 0.0  # wall time spent generating sessions (reported apart by the bench)
        self.make_cpu_s = 0.0  # the same in CPU time
        self._memo: dict[int, Session] | None = None
        self.frozen = False  # a run keeps the heap out of the cyclic collector (replay/sim/runs.py)

    def memoize(self) -> SessionSource:
        """Keep generated sessions: a later run on this source gets the same ones without
        generating them again (the bench's runs side by side). Returns ``self``."""
        if self.make is not None and self._memo is None:
            self._memo = {}
        return self

    def _made(self, k: int) -> Session:
        """``make(k)`` with the cyclic collector paused meanwhile. Inside a run that froze the
        heap (``frozen``, set by replay/sim/runs.py's ``_frozen_heap``) what is alive then, the
        new session with it, is frozen too: a CC-like session is ~100 lists of ~1,500 block
        hashes that every young collection walked again (a fifth of the generator's CPU on a
        96-node bench). Frozen objects are still freed by their reference counts; cyclic garbage
        waits for the run's end. (``gc.get_freeze_count`` would walk the frozen objects, as dear
        as a collection: the flag says it instead.)"""
        was = gc.isenabled()
        gc.disable()
        try:
            s = self.make(k)  # type: ignore[misc]
        finally:
            if was:
                gc.enable()
        if self.frozen:
            gc.freeze()
        return s

    def label(self, k: int) -> str:
        """The agent id of the ``k``-th start (every id of its session starts with it)."""
        return f"a{k}"

    def get(self, k: int) -> Session:
        if self.make is not None:
            if self._memo is not None and k in self._memo:
                return self._memo[k]
            t0, c0 = time.perf_counter(), time.process_time()  # measurement only: never influences the simulation
            s = self._made(k)
            self.make_s += time.perf_counter() - t0
            self.make_cpu_s += time.process_time() - c0
            if self._memo is not None:
                self._memo[k] = s
            return s
        n = len(self.sessions)
        s = self.sessions[k % n]
        c = k // n
        if c == 0:
            return s
        # A prompt extends the previous one of its branch (or, first in a branch, the last one
        # seen): its salted prefix is reused and only the blocks after it are remapped; the
        # same lists as remapping every block (_salt_blocks is elementwise).
        branches = []
        prev: list[int] = []
        prev_salted: list[int] = []
        for b in s.branches:
            steps = []
            for st in b.steps:
                if isinstance(st, (Request, Compact)):
                    m = common_prefix(prev, st.blocks)
                    remapped = prev_salted[:m] + _salt_blocks(st.blocks, c, m)
                    prev, prev_salted = st.blocks, remapped
                    st = msgspec.structs.replace(st, blocks=remapped)
                steps.append(st)
            branches.append(msgspec.structs.replace(b, steps=steps))
        return msgspec.structs.replace(s, id=f"{s.id}~{c}", branches=branches)
