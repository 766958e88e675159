# cython: language_level=3
"""What other compiled modules cimport from ``_native`` (engine/_kvscan.pyx probes a node's tier
sets and pin counts with the uint64 hashes, issue 24): the cell layout, the classes' C fields and
methods, and the probe itself, inline (no call per block). ``_native.pyx`` documents the table."""

from cpython.long cimport PyLong_CheckExact
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint64_t

ctypedef struct Cell:
    uint64_t key
    int64_t val


cdef extern from *:
    """
    /* An exact non-negative int below 2**64 read from its digits (CPython < 3.12's layout:
       ob_size digits of 30 bits): 1 and *out set, or 0 where it is no such int, or -1 where
       it is not an exact int or this layout is not the one compiled against (the general
       conversion decides then). */
    static inline int u64_digits(PyObject* o, uint64_t* out) {
    #if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
        if (!PyLong_CheckExact(o)) return -1;
        const digit* d = ((PyLongObject*)o)->ob_digit;
        switch (Py_SIZE(o)) {
            case 0: *out = 0; return 1;
            case 1: *out = (uint64_t)d[0]; return 1;
            case 2: *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30); return 1;
            case 3:
                if (d[2] >> 4) return 0;  /* 2**64 or more */
                *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
                return 1;
            default: return 0;  /* negative, or more than 3 digits */
        }
    #else
        (void)o; (void)out;
        return -1;
    #endif
    }
    """
    int u64_digits(PyObject* o, uint64_t* out) noexcept


cdef inline bint as_u64_slow(object o, uint64_t* out):
    """The general conversion: an int subclass, a numpy integer (anything with ``__index__``),
    or an exact int where the digit layout is not 3.11's (Cython's own digit reader)."""
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


cdef inline bint u64_of(PyObject* o, uint64_t* out):
    """``o`` as a uint64 hash; False (no error left set) if it is not one. An exact int's 30-bit
    digits are read in place (``u64_digits``: a random 64-bit hash has 3 of them, ~1-2 ns
    against ~11 ns through Cython's reader; CPython's ``PyLong_AsUnsignedLongLong`` goes
    through ``_PyLong_AsByteArray`` above 2**30, ~3x a set probe); anything else, or another
    layout, through ``as_u64_slow``. The one conversion of services/cores/directory/_native.pyx
    and engine/_kvscan.pyx: the same truth values for negatives, bools, 2**64 and up, numpy
    integers (tests/unit/engine/test_kvscan_typed.py, tests/unit/cores/directory)."""
    cdef int r = u64_digits(o, out)
    if r >= 0:
        return r
    return as_u64_slow(<object>o, out)


cdef inline bint as_u64(object o, uint64_t* out):
    """:func:`u64_of` of a Python object."""
    return u64_of(<PyObject*>o, out)


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
