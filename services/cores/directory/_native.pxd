# cython: language_level=3
"""What other compiled modules cimport from ``_native`` (engine/_kvscan.pyx probes a node's tier
sets and pin counts with the uint64 hashes, issue 24): the cell layout, the classes' C fields and
methods, and the probe itself, inline (no call per block). ``_native.pyx`` documents the table."""

from cpython.long cimport PyLong_CheckExact
from libc.stdint cimport int64_t, uint64_t

ctypedef struct Cell:
    uint64_t key
    int64_t val


cdef inline bint as_u64(object o, uint64_t* out):
    """``o`` as a uint64 hash; False (no error left set) if it is not one. An exact int is
    converted by Cython's own digit reader (CPython's ``PyLong_AsUnsignedLongLong`` goes through
    ``_PyLong_AsByteArray`` for any int above 2**30: ~3x the cost of a set probe)."""
    if not PyLong_CheckExact(o):
        try:
            o = o.__index__()
        except Exception:
            return False
    try:
        out[0] = o
    except (OverflowError, TypeError):
        return False
    return True


cdef inline int64_t cell_get(const Cell* cells, int bits, uint64_t mask, uint64_t k) noexcept nogil:
    """The value of ``k`` (> 0) in a table, 0 if absent: Fibonacci hashing, linear probing."""
    cdef uint64_t p = (k * <uint64_t>0x9E3779B97F4A7C15ULL) >> (64 - bits)
    cdef const Cell* c
    while True:
        c = &cells[p]
        if c.val == 0:
            return 0
        if c.key == k and c.val > 0:
            return c.val
        p = (p + 1) & mask


cdef class SlotMap:
    cdef Cell* cells
    cdef int bits
    cdef uint64_t mask
    cdef Py_ssize_t used, deleted

    cdef int _alloc(self, int bits) except -1
    cdef int64_t _get(self, uint64_t k) noexcept nogil
    cdef Cell* _cell_for(self, uint64_t k) noexcept nogil
    cdef void _claim(self, Cell* c, uint64_t k, int64_t v) noexcept nogil
    cdef void _put(self, uint64_t k, int64_t v) noexcept nogil
    cdef bint _drop(self, uint64_t k) noexcept nogil
    cdef int _add_from(self, blocks, Py_ssize_t start, str who, bint count) except -1
    cdef void _add_keys(self, const uint64_t* ks, Py_ssize_t n, bint count) noexcept nogil
    cdef int _reserve(self, Py_ssize_t extra) except -1


cdef class BlockCounts(SlotMap):
    cdef uint64_t* _rel
    cdef Py_ssize_t _rel_n, _rel_cap, _epoch

    cdef int _released(self, uint64_t k) except -1


cdef class BlockSet(SlotMap):
    pass


cdef extern from *:
    void __builtin_prefetch(const void* addr) nogil

cdef enum:
    # how many keys ahead a write loop prefetches the home cell of
    PREFETCH_AHEAD = 8
    # blocks a scan converts to hashes before probing them: the probes of a chunk are
    # independent loads the CPU overlaps (probed as converted, each waits for its own miss)
    CHUNK = 64


cdef inline void prefetch(SlotMap t, uint64_t k) noexcept nogil:
    """Start loading the cell ``k``'s probe begins at (a write loop over a converted key array
    overlaps its cache misses this way, each write otherwise waits for its own)."""
    __builtin_prefetch(&t.cells[(k * <uint64_t>0x9E3779B97F4A7C15ULL) >> (64 - t.bits)])


cdef inline bint held(SlotMap t, uint64_t k) noexcept nogil:
    """``k`` is a key of ``t`` (a BlockSet's member, a BlockCounts' counted block)."""
    return cell_get(t.cells, t.bits, t.mask, k) > 0
