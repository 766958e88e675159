"""The planner's warm-up fitting samples, packed: one node and phase's rows in a float64 array.

A row kept as a list of Python floats costs ~130-185 bytes (the list and a 24-byte object per
value); packed, 24-32 (plus the buffer's doubling slack). Pure: no I/O, no clock.
"""

from __future__ import annotations

import numpy as np


def width_of(key: str) -> int:
    """Floats per fitting sample of a "node|phase" key (the rows of _prefill_sample, _decode_sample)."""
    return 4


class Samples:
    """One node and phase's fitting samples: ``n`` rows of ``width`` float64 values in a buffer
    that doubles when full (the same values, in the same order, as a list of rows)."""

    __slots__ = ("buf", "n")

    def __init__(self, width: int, capacity: int = 64) -> None:
        self.buf = np.empty((capacity, width), dtype=np.float64)
        self.n = 0

    @classmethod
    def of(cls, rows: list[list[float]], width: int) -> Samples:
        s = cls(width, max(64, len(rows)))
        if rows and len(rows[0]) == 3 and width == 4:
            # a decode row of a snapshot taken before the context term: (batch, t_fwd, duration)
            rows = [[r[0], r[1], 0.0, r[2]] for r in rows]
        if rows:
            s.buf[: len(rows)] = rows
            s.n = len(rows)
        return s

    def append(self, row: list[float]) -> None:
        if self.n == len(self.buf):
            grown = np.empty((2 * len(self.buf), self.buf.shape[1]), dtype=np.float64)
            grown[: self.n] = self.buf
            self.buf = grown
        self.buf[self.n] = row
        self.n += 1

    def thin(self) -> None:
        """Keep every second row, the odd ones (what ``del rows[::2]`` keeps of a list)."""
        kept = self.buf[1 : self.n : 2]
        self.n = len(kept)
        self.buf[: self.n] = kept.copy()

    def view(self) -> np.ndarray:
        return self.buf[: self.n]


def _row_dtype(width: int) -> np.dtype:
    """One row as msgpack: a fixarray header, then ``width`` float64 values (0xcb, big endian)."""
    fields = [("head", "u1")]
    for i in range(width):
        fields += [(f"m{i}", "u1"), (f"v{i}", ">f8")]
    return np.dtype(fields)


def packed_msgpack(samples: Samples) -> bytes:
    """The msgpack encoding of ``samples.view().tolist()`` (an array of float arrays, floats as
    float64, what msgspec writes), built from the packed buffer: a snapshot of the store never
    materializes its rows as Python lists (transient objects that raised the planner's memory
    high-water mark with every snapshot as the store filled)."""
    rows = samples.view()
    n, width = rows.shape
    assert width <= 15, "a row is a msgpack fixarray"
    out = np.empty(n, dtype=_row_dtype(width))
    out["head"] = 0x90 | width
    for i in range(width):
        out[f"m{i}"] = 0xCB
        out[f"v{i}"] = rows[:, i]
    if n <= 15:
        head = bytes([0x90 | n])
    elif n <= 0xFFFF:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + out.tobytes()
