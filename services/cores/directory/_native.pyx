# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The directory's block index ``uint64 block hash -> slot``, compiled (pure: C and numpy, no I/O).

Why compiled (issue 24, measured in docs/directory.md "Compiled inner loops"): a request carries
hundreds to thousands of block hashes, and every event that names blocks resolves them to table
slots. A Python ``dict`` answers one interpreter step per block and needs a numpy array built
around it (``np.fromiter``); the earlier vectorised numpy table overlapped the cache misses but
paid a dozen array passes per batch and a bulk re-sync. Here one C loop reads the hashes straight
out of the Python list (or a uint64 array) and probes an open-addressing table.

Layout: one array of ``(key, value)`` cells, 16 bytes each (a probe reads one cache line).
Value 0 marks an empty cell and -1 a deleted one (a tombstone keeps probe chains intact); stored
values (slots) are >= 1, so an unknown block resolves to slot 0, the table's sentinel. Position:
Fibonacci hashing (multiply by 2^64/phi, keep the top bits), then linear probing. The table
doubles at 1/2 load (used + deleted cells) and is rebuilt at <= 1/4 load, so chains stay short.

A hash outside ``[0, 2**64)`` (or not an integer) is in no table: it resolves to 0, and
:meth:`SlotMap.insert` refuses it (the caller converts keys to uint64 first, which raises
``OverflowError``). Nothing here depends on insertion order: lookups return the same slots as a
dict holding the same pairs (tests/property/test_directory_index.py checks it on random inputs).
"""

from cpython.long cimport PyLong_CheckExact, PyLong_FromUnsignedLongLong
from cpython.ref cimport PyObject
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport malloc
from libc.string cimport memset

import numpy as np

cdef extern from "Python.h":
    # a new reference, owned (and released) by the object it is assigned to: declared as
    # PyObject* and cast with <object>, Cython added a reference of its own and leaked every list
    object PySequence_Fast(object o, const char* m)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    PyObject** PySequence_Fast_ITEMS(object o)
    int PySet_Contains(object anyset, object key) except -1
    int PySet_Add(object set, object key) except -1
    int PyDict_Contains(object p, object key) except -1
    int PySequence_Contains(object o, object value) except -1

# Cell, the hash conversion (u64_of / as_u64: an exact int's digits read in place) and cell_get
# (the probe) are in _native.pxd, shared with engine/_kvscan.pyx
cdef uint64_t PHI = 0x9E3779B97F4A7C15ULL
#: keys a BlockCounts' release log holds before it starts a new epoch
cdef Py_ssize_t _REL_MAX = 1 << 20


cdef uint64_t* _keys(blocks, Py_ssize_t start, Py_ssize_t* n, str who) except? NULL:
    """``blocks[start:]`` (any iterable when ``start`` is 0) as a fresh uint64 array (the caller
    frees it), its length in ``n``; NULL with ``n`` 0 when empty. Every entry is checked: a bad
    hash raises ``TypeError`` (naming ``who``), nothing kept."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be an iterable")
    cdef Py_ssize_t i, size = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef uint64_t* out
    start = max(start, 0)
    n[0] = size - start
    if n[0] <= 0:
        n[0] = 0
        return NULL
    out = <uint64_t*>PyMem_Malloc(n[0] * sizeof(uint64_t))
    if out == NULL:
        raise MemoryError()
    for i in range(start, size):
        if not u64_of(items[i], &out[i - start]):
            PyMem_Free(out)
            raise TypeError(f"{who}: block {<object>items[i]!r} is not a uint64 hash (an int in [0, 2**64))")
    return out


cdef extern from "<sys/mman.h>" nogil:
    int madvise(void* addr, size_t length, int advice)
    int MADV_HUGEPAGE

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)
    void free(void* ptr)

cdef size_t _HUGE = 1 << 21


cdef Cell* _cells_alloc(size_t n) noexcept nogil:
    """``n`` zeroed cells (NULL if out of memory). A table of 2 MiB or more is aligned to 2 MiB
    and asks for transparent huge pages: its probes land anywhere in it, and with 4 KiB pages
    every probe of a node's ~10^5-block tier or index also missed the TLB (issue 24: a probe
    cost ~1.5x a Python set's, whose table is half the size). Only a hint: where the kernel
    gives no huge pages the table works the same."""
    cdef size_t size = n * sizeof(Cell)
    cdef void* p = NULL
    if size >= _HUGE:
        if posix_memalign(&p, _HUGE, size) != 0:
            return NULL
        madvise(p, size, MADV_HUGEPAGE)
    else:
        p = malloc(size)
        if p == NULL:
            return NULL
    memset(p, 0, size)
    return <Cell*>p


cdef void _cells_free(Cell* c) noexcept nogil:
    free(c)


cdef void _probe_from(SlotMap t, PyObject** items, Py_ssize_t i, Py_ssize_t m, int64_t[::1] po):
    """``po[i:m]`` = the slots of ``items[i:m]`` in ``t`` (0: absent, or no uint64 hash): a chunk
    converted, then probed (CHUNK in _native.pxd), so the probes' cache misses overlap."""
    cdef uint64_t ks[CHUNK]
    cdef unsigned char ok[CHUNK]
    cdef Py_ssize_t j, c
    while i < m:
        c = min(<Py_ssize_t>CHUNK, m - i)
        for j in range(c):
            ok[j] = u64_of(items[i + j], &ks[j])
        for j in range(c):
            po[i + j] = cell_get(t.cells, t.bits, t.mask, ks[j]) if ok[j] else 0
        i += c


cdef class SlotMap:
    """``uint64 -> slot >= 1`` with batch lookups from Python sequences and uint64 arrays."""

    def __cinit__(self, Py_ssize_t capacity=1024):
        cdef int bits = 4
        while (1 << bits) < capacity:
            bits += 1
        self.cells = NULL
        self._alloc(bits)

    def __dealloc__(self):
        if self.cells != NULL:
            _cells_free(self.cells)

    cdef int _alloc(self, int bits) except -1:
        cdef Cell* c = _cells_alloc(<size_t>1 << bits)
        if c == NULL:
            raise MemoryError()
        if self.cells != NULL:
            _cells_free(self.cells)
        self.cells = c
        self.bits = bits
        self.mask = (<uint64_t>1 << bits) - 1
        self.used = 0
        self.deleted = 0
        return 0

    cdef int64_t _get(self, uint64_t k) noexcept nogil:
        return cell_get(self.cells, self.bits, self.mask, k)

    cdef Cell* _cell_for(self, uint64_t k) noexcept nogil:
        """The cell holding ``k`` (``val > 0``), else the one a new ``k`` goes into: the first
        tombstone on its probe path (``val < 0``) or the empty cell ending it (``val == 0``)."""
        cdef uint64_t p = (k * PHI) >> (64 - self.bits)
        cdef Py_ssize_t tomb = -1
        cdef Cell* c
        while True:
            c = &self.cells[p]
            if c.val == 0:
                break
            if c.val < 0:
                if tomb < 0:
                    tomb = <Py_ssize_t>p
            elif c.key == k:
                return c
            p = (p + 1) & self.mask
        if tomb >= 0:
            return &self.cells[tomb]
        return c

    cdef void _claim(self, Cell* c, uint64_t k, int64_t v) noexcept nogil:
        """Put ``k -> v`` (v > 0) into a free cell from :meth:`_cell_for`."""
        if c.val < 0:
            self.deleted -= 1
        c.key = k
        c.val = v
        self.used += 1

    cdef void _put(self, uint64_t k, int64_t v) noexcept nogil:
        """Insert or overwrite (the table has room: callers keep load <= 1/2)."""
        cdef Cell* c = self._cell_for(k)
        if c.val > 0:
            c.val = v
        else:
            self._claim(c, k, v)

    cdef int _add_from(self, blocks, Py_ssize_t start, str who, bint count) except -1:
        """Each entry of ``blocks[start:]`` in with value 1, or +1 if there and ``count`` (a
        multiset). All checked first (``_keys``: a bad hash raises, naming ``who``, and changes
        nothing); the home cell is prefetched ``PREFETCH_AHEAD`` keys ahead."""
        cdef Py_ssize_t i, n = 0
        cdef Cell* c
        cdef uint64_t* ks = _keys(blocks, start, &n, who)
        if n == 0:
            return 0
        try:
            self._reserve(n)
            self._add_keys(ks, n, count)
        finally:
            PyMem_Free(ks)
        return 0

    cdef void _add_keys(self, const uint64_t* ks, Py_ssize_t n, bint count) noexcept nogil:
        cdef Py_ssize_t i
        cdef Cell* c
        for i in range(n):
            if i + PREFETCH_AHEAD < n:
                prefetch(self, ks[i + PREFETCH_AHEAD])
            c = self._cell_for(ks[i])
            if c.val > 0:
                if count:
                    c.val += 1
            else:
                self._claim(c, ks[i], 1)

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        """Room for ``extra`` more keys at <= 1/2 load (rebuilt at <= 1/4 load when full)."""
        cdef Cell* old
        cdef Py_ssize_t i, n_old
        cdef int bits
        if 2 * (self.used + self.deleted + extra) <= (<Py_ssize_t>1 << self.bits):
            return 0
        bits = 4
        while (<Py_ssize_t>1 << bits) < 4 * (self.used + extra):
            bits += 1
        old, n_old = self.cells, <Py_ssize_t>1 << self.bits
        self.cells = NULL
        try:
            self._alloc(bits)
        except MemoryError:
            self.cells = old
            raise
        for i in range(n_old):
            if old[i].val > 0:
                self._put(old[i].key, old[i].val)
        _cells_free(old)
        return 0

    def __len__(self):
        return self.used

    def __contains__(self, key):
        """``key`` is a key (a non-uint64 is none): a BlockSet's member, a counted block."""
        cdef uint64_t k = 0
        if not as_u64(key, &k):
            return False
        return cell_get(self.cells, self.bits, self.mask, k) > 0

    def __iter__(self):
        """The keys, in cell order (it depends on the history of writes: sort where it matters)."""
        cdef Py_ssize_t i, size = <Py_ssize_t>1 << self.bits
        out = []
        for i in range(size):
            if self.cells[i].val > 0:
                out.append(self.cells[i].key)
        return iter(out)

    def get(self, key, default=None):
        """The slot of one block, ``default`` if unknown."""
        cdef uint64_t k = 0
        cdef int64_t v
        if not as_u64(key, &k):
            return default
        v = cell_get(self.cells, self.bits, self.mask, k)
        return v if v else default

    def find_seq(self, blocks, Py_ssize_t n=-1):
        """Slots of the blocks of a sequence (0 for an unknown block or a non-uint64 hash);
        ``n``: its length if known (must match). A list or tuple is read in place."""
        cdef object fast = PySequence_Fast(blocks, "block hashes must be a sequence")
        cdef Py_ssize_t i, m = PySequence_Fast_GET_SIZE(fast)
        cdef PyObject** items = PySequence_Fast_ITEMS(fast)
        cdef Py_ssize_t j, c
        cdef uint64_t ks[CHUNK]
        cdef unsigned char ok[CHUNK]
        if n >= 0 and n != m:
            raise ValueError(f"find_seq: {m} blocks, expected {n}")
        out = np.empty(m, dtype=np.intp)
        cdef int64_t[::1] po = out
        _probe_from(self, items, 0, m, po)
        return out

    def find(self, const uint64_t[::1] keys):
        """Slots of a uint64 array of hashes (0 where unknown)."""
        cdef Py_ssize_t i, m = keys.shape[0]
        out = np.empty(m, dtype=np.intp)
        cdef int64_t[::1] po = out
        with nogil:
            for i in range(m):
                if i + PREFETCH_AHEAD < m:  # the keys are known: start their probes' misses ahead
                    prefetch(self, keys[i + PREFETCH_AHEAD])
                po[i] = cell_get(self.cells, self.bits, self.mask, keys[i])
        return out

    def insert(self, const uint64_t[::1] keys, const int64_t[::1] vals):
        """Add (or overwrite) ``keys[i] -> vals[i]``; values must be >= 1."""
        cdef Py_ssize_t i, m = keys.shape[0]
        if vals.shape[0] != m:
            raise ValueError(f"insert: {m} keys but {vals.shape[0]} values")
        for i in range(m):
            if vals[i] < 1:
                raise ValueError(f"insert: slot {vals[i]} of key {keys[i]} is not >= 1")
        self._reserve(m)
        with nogil:
            for i in range(m):
                self._put(keys[i], vals[i])

    def delete(self, const uint64_t[::1] keys):
        """Remove keys (absent ones are ignored)."""
        cdef Py_ssize_t i, m = keys.shape[0]
        with nogil:
            for i in range(m):
                self._drop(keys[i])

    cdef bint _drop(self, uint64_t k) noexcept nogil:
        """Remove ``k`` (its cell becomes a tombstone); False if it was absent."""
        cdef uint64_t p = (k * PHI) >> (64 - self.bits)
        cdef Cell* c
        while True:
            c = &self.cells[p]
            if c.val == 0:
                return False
            if c.key == k and c.val > 0:
                c.val = -1
                self.used -= 1
                self.deleted += 1
                return True
            p = (p + 1) & self.mask

    def items(self):
        """``(keys uint64, slots intp)`` of every entry, in cell order."""
        cdef Py_ssize_t i, j = 0, size = <Py_ssize_t>1 << self.bits
        ks_arr = np.empty(self.used, dtype=np.uint64)
        vs_arr = np.empty(self.used, dtype=np.intp)
        cdef uint64_t[::1] ks = ks_arr
        cdef int64_t[::1] vs = vs_arr
        for i in range(size):
            if self.cells[i].val > 0:
                ks[j] = self.cells[i].key
                vs[j] = self.cells[i].val
                j += 1
        return ks_arr, vs_arr

    @property
    def capacity(self):
        return <Py_ssize_t>1 << self.bits

    @property
    def load(self):
        """(used, deleted) cells."""
        return self.used, self.deleted


cdef class BlockCounts(SlotMap):
    """``uint64 block hash -> count >= 1``: a multiset of blocks that reads Python lists in C.

    A node's KV pins (engine/kvpool.py, issue 24): every owner's pinned list adds 1 per entry,
    unpinning takes it back, so "is this block pinned" is one probe of this table (no Python int
    objects, no set rebuilt per eviction). Also a read-only set of its keys (``in``, ``len``,
    iteration, ``==`` with a set), which is how an eviction policy receives it; the directory's
    eviction order (:func:`unpinned`) probes it with the uint64 hashes directly."""

    # the release log: every key whose count fell to 0, in order, so a reader that remembers
    # which blocks were pinned when it looked learns which of them may have been freed since
    # (the directory's eviction walk, services/cores/directory/table.py). ``_epoch`` moves when
    # the log is cleared (at _REL_MAX keys): a position of an older epoch means "start afresh".
    def __cinit__(self, *args, **kwargs):
        self._rel = NULL
        self._rel_n = self._rel_cap = self._epoch = 0

    def __dealloc__(self):
        if self._rel != NULL:
            PyMem_Free(self._rel)

    cdef int _released(self, uint64_t k) except -1:
        cdef uint64_t* grown
        cdef Py_ssize_t cap
        if self._rel_n >= _REL_MAX:
            self._rel_n = 0
            self._epoch += 1
        if self._rel_n == self._rel_cap:
            cap = max(1024, 2 * self._rel_cap)
            grown = <uint64_t*>PyMem_Realloc(self._rel, cap * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self._rel, self._rel_cap = grown, cap
        self._rel[self._rel_n] = k
        self._rel_n += 1
        return 0

    def released_since(self, Py_ssize_t epoch, Py_ssize_t pos):
        """``(epoch, position, keys)``: the keys whose count fell to 0 since ``(epoch, pos)``
        (a uint64 array, in order, repeats kept; ``None`` if that position is of an older epoch:
        the log was cleared since, so everything may have changed) and where the log ends now."""
        if epoch != self._epoch or pos > self._rel_n or pos < 0:
            return self._epoch, self._rel_n, None
        out = np.empty(self._rel_n - pos, dtype=np.uint64)
        cdef uint64_t[::1] o = out
        cdef Py_ssize_t i
        for i in range(pos, self._rel_n):
            o[i - pos] = self._rel[i]
        return self._epoch, self._rel_n, out

    def add(self, blocks, Py_ssize_t start=0):
        """+1 for each entry of ``blocks[start:]`` (all checked first: a bad hash changes nothing)."""
        self._add_from(blocks, start, "BlockCounts", True)

    def remove(self, blocks, Py_ssize_t start=0):
        """-1 for each entry of ``blocks[start:]``, a key dropped at 0. Every block must be
        counted (checked first: ``KeyError`` and nothing changed if one is not)."""
        cdef Py_ssize_t i, n = 0
        cdef uint64_t k, p
        cdef Cell* c
        cdef uint64_t* ks = _keys(blocks, start, &n, "BlockCounts")
        if n == 0:
            return
        try:
            for i in range(n):
                if i + PREFETCH_AHEAD < n:
                    prefetch(self, ks[i + PREFETCH_AHEAD])
                if cell_get(self.cells, self.bits, self.mask, ks[i]) == 0:
                    raise KeyError(ks[i])
            for i in range(n):
                if i + PREFETCH_AHEAD < n:
                    prefetch(self, ks[i + PREFETCH_AHEAD])
                k = ks[i]
                p = (k * PHI) >> (64 - self.bits)
                while True:
                    c = &self.cells[p]
                    if c.val == 0:
                        raise KeyError(k)  # a list repeating a block more often than it was added
                    if c.key == k and c.val > 0:
                        break
                    p = (p + 1) & self.mask
                c.val -= 1
                if c.val == 0:
                    c.val = -1
                    self.used -= 1
                    self.deleted += 1
                    self._released(k)
        finally:
            PyMem_Free(ks)

    def count(self, key):
        """How many times ``key`` is counted (0 if not)."""
        cdef uint64_t k = 0
        if not as_u64(key, &k):
            return 0
        return cell_get(self.cells, self.bits, self.mask, k)

    def __eq__(self, other):
        if isinstance(other, (set, frozenset, BlockCounts)):
            return frozenset(self) == frozenset(other)
        return NotImplemented

    def __ne__(self, other):
        if isinstance(other, (set, frozenset, BlockCounts)):
            return frozenset(self) != frozenset(other)
        return NotImplemented

    __hash__ = None


cdef class BlockSet(SlotMap):
    """A set of uint64 block hashes: one tier of a node's KV pool (engine/kvpool.py, issue 24).

    The set API the pool's users call (``in``, ``len``, iteration, ``add``, ``discard``,
    ``update``, ``difference_update``, ``clear``, ``copy``, ``==`` with a set), on the same
    open-addressing table as :class:`SlotMap` (value 1 marks a member), so the pool's compiled
    scans (engine/_kvscan.pyx) probe it with the uint64 hash: one cache line per probe, where a
    Python ``set`` of ~10^5 ints costs the set slot and the int object.

    Only uint64 hashes (ints in ``[0, 2**64)``) can be members: a write naming anything else
    raises ``TypeError`` and changes nothing (every entry is checked first); ``in`` answers False
    for it, as a set of hashes would. Iteration is in table order, which depends on the history
    of writes, not on insertion order alone: a caller whose output depends on the order sorts
    (``KvPool.drop_all``)."""

    def add(self, key):
        self.update((key,))

    def discard(self, key):
        self.difference_update((key,))

    def update(self, blocks):
        """Add every entry of ``blocks`` (an iterable, or another BlockSet)."""
        cdef Py_ssize_t i, size
        cdef Cell* c
        cdef BlockSet other
        if isinstance(blocks, BlockSet):
            other = <BlockSet>blocks
            size = <Py_ssize_t>1 << other.bits
            self._reserve(other.used)
            for i in range(size):
                if other.cells[i].val > 0:
                    c = self._cell_for(other.cells[i].key)
                    if c.val <= 0:
                        self._claim(c, other.cells[i].key, 1)
            return
        self._add_from(blocks, 0, "BlockSet", False)

    def difference_update(self, blocks):
        """Remove every entry of ``blocks`` (absent ones are ignored; bad hashes raise)."""
        cdef Py_ssize_t i, n = 0
        cdef uint64_t* ks = _keys(blocks, 0, &n, "BlockSet")
        if n == 0:
            return
        try:
            for i in range(n):
                if i + PREFETCH_AHEAD < n:
                    prefetch(self, ks[i + PREFETCH_AHEAD])
                self._drop(ks[i])
        finally:
            PyMem_Free(ks)

    def clear(self):
        self._alloc(10)

    def copy(self):
        cdef BlockSet out = BlockSet(max(16, 2 * self.used))
        out.update(self)
        return out

    def _covers(self, other):
        """Every member of ``other`` (a set, a BlockSet or a BlockCounts' keys) is in this set."""
        cdef uint64_t k = 0
        for x in other:
            if not as_u64(x, &k) or cell_get(self.cells, self.bits, self.mask, k) <= 0:
                return False
        return True

    def _within(self, other):
        """Every member of this set is in ``other`` (a set, a BlockSet or a BlockCounts' keys)."""
        cdef Py_ssize_t i, size = <Py_ssize_t>1 << self.bits
        cdef SlotMap t
        if isinstance(other, SlotMap):
            t = <SlotMap>other
            for i in range(size):
                if self.cells[i].val > 0 and not held(t, self.cells[i].key):
                    return False
            return True
        for i in range(size):
            if self.cells[i].val > 0 and PyLong_FromUnsignedLongLong(self.cells[i].key) not in other:
                return False
        return True

    def __eq__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return len(other) == self.used and self._within(other)
        return NotImplemented

    def __ne__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return not (len(other) == self.used and self._within(other))
        return NotImplemented

    def __le__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return self.used <= len(other) and self._within(other)
        return NotImplemented

    def __lt__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return self.used < len(other) and self._within(other)
        return NotImplemented

    def __ge__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return self.used >= len(other) and self._covers(other)
        return NotImplemented

    def __gt__(self, other):
        if isinstance(other, (set, frozenset, BlockSet, BlockCounts)):
            return self.used > len(other) and self._covers(other)
        return NotImplemented

    def issubset(self, other):
        return self._within(other if isinstance(other, (set, frozenset, SlotMap)) else set(other))

    def issuperset(self, other):
        return self._covers(other)

    def isdisjoint(self, other):
        cdef uint64_t k = 0
        for x in other:
            if as_u64(x, &k) and cell_get(self.cells, self.bits, self.mask, k) > 0:
                return False
        return True

    __hash__ = None

    def __repr__(self):
        return f"BlockSet({sorted(self)!r})"

    def __reduce__(self):
        return _block_set, (sorted(self),)


def _block_set(blocks):
    """A :class:`BlockSet` of ``blocks`` (unpickling)."""
    out = BlockSet()
    out.update(blocks)
    return out


# ----------------------------------------------------------------------------- slot allocation
cdef enum:
    # unknown positions fill_new allocates in one C pass (more: BlockTable.ensure's numpy path)
    _FILL_MAX = 64

FILL_MAX = _FILL_MAX


def fill_new(SlotMap index, blocks, int64_t[:] s, uint64_t[::1] block, list free, Py_ssize_t size):
    """BlockTable.ensure in one pass (numpy calls on 8-element arrays were ~9 of the ~12 us of an
    8-block live store; ``np.unique`` and the conversions of a branch's first prompt were 8% of
    ``bench directory``'s fold). ``s``: the slots of ``blocks`` (0: unknown when probed); each 0
    is probed again, and the blocks still unknown get slots exactly as ensure's numpy path gave
    them: the distinct new blocks in order of first occurrence when at most ``FILL_MAX``
    positions are unknown, sorted by hash when more are (``np.unique``'s order); reused slots
    first (``free``'s tail, in list order, removed from it), then ``size``, ``size + 1``, ....
    Each new block goes into ``index`` and ``block[slot]``, its slot into ``s``. Returns the new
    ``size``; or ``-need`` with nothing allocated when ``block`` has fewer than ``need`` entries
    (the caller grows the table and calls again; the slots re-probed so far are exact). A hash
    that is not a uint64 raises ``OverflowError`` (as numpy's conversion did) before anything
    is allocated."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, d, r, m = 0, nd = 0, z = 0, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef uint64_t k
    cdef int64_t v
    cdef Py_ssize_t take, nfree, need
    # per unknown position: its index in ``blocks`` and its distinct block's number; per
    # distinct block: its hash and its slot (on the stack up to FILL_MAX, else on the heap)
    cdef uint64_t keys_s[_FILL_MAX]
    cdef Py_ssize_t pos_s[_FILL_MAX]
    cdef Py_ssize_t which_s[_FILL_MAX]
    cdef int64_t slots_s[_FILL_MAX]
    cdef uint64_t* keys = keys_s
    cdef Py_ssize_t* pos = pos_s
    cdef Py_ssize_t* which = which_s
    cdef int64_t* slots = slots_s
    cdef const int64_t[::1] order = None
    cdef uint64_t[::1] kv
    cdef uint64_t* tk = NULL
    cdef Py_ssize_t* tv = NULL
    cdef uint64_t tmask, p
    cdef int tbits
    if s.shape[0] != n:
        raise ValueError(f"fill_new: {n} blocks but {s.shape[0]} slots")
    for i in range(n):
        if s[i] == 0:
            z += 1
    if z == 0:
        return size
    try:
        if z > _FILL_MAX:
            keys = <uint64_t*>PyMem_Malloc(z * sizeof(uint64_t))
            pos = <Py_ssize_t*>PyMem_Malloc(z * sizeof(Py_ssize_t))
            which = <Py_ssize_t*>PyMem_Malloc(z * sizeof(Py_ssize_t))
            slots = <int64_t*>PyMem_Malloc(z * sizeof(int64_t))
            if keys == NULL or pos == NULL or which == NULL or slots == NULL:
                raise MemoryError()
        for i in range(n):  # re-probe each 0; the rest are this list's unknown positions
            if s[i] != 0:
                continue
            if not u64_of(items[i], &k):
                raise OverflowError(f"block hash {<object>items[i]!r} is not a uint64")
            v = index._get(k)
            if v:
                s[i] = v
                continue
            pos[m] = i
            keys[m] = k  # the hash of position m for now; the distinct ones are packed below
            m += 1
        if m == 0:
            return size
        if m <= _FILL_MAX:  # a block may repeat inside one list: one slot (first occurrence)
            for i in range(m):
                k = keys[i]
                for d in range(nd):
                    if keys[d] == k:
                        break
                else:
                    d = nd
                    keys[nd] = k
                    nd += 1
                which[i] = d
        else:  # many: a scratch hash set finds the repeats, then the distinct blocks by hash
            tbits = 4
            while (<Py_ssize_t>1 << tbits) < 2 * m:
                tbits += 1
            tmask = (<uint64_t>1 << tbits) - 1
            tk = <uint64_t*>PyMem_Malloc((<Py_ssize_t>1 << tbits) * sizeof(uint64_t))
            tv = <Py_ssize_t*>PyMem_Malloc((<Py_ssize_t>1 << tbits) * sizeof(Py_ssize_t))
            if tk == NULL or tv == NULL:
                raise MemoryError()
            memset(tv, 0, (<Py_ssize_t>1 << tbits) * sizeof(Py_ssize_t))
            for i in range(m):
                k = keys[i]
                p = (k * PHI) >> (64 - tbits)
                while tv[p] != 0 and tk[p] != k:
                    p = (p + 1) & tmask
                if tv[p] == 0:
                    tk[p] = k
                    tv[p] = nd + 1
                    keys[nd] = k
                    nd += 1
                which[i] = tv[p] - 1
            # numpy's sort of the distinct hashes (vectorised; a qsort with a compare callback
            # was half of this function on a branch's first prompt); distinct, so any sort kind
            # gives the one order np.unique gave
            keys_arr = np.empty(nd, dtype=np.uint64)
            kv = keys_arr
            for d in range(nd):
                kv[d] = keys[d]
            order_arr = np.argsort(keys_arr)
            order = order_arr
        nfree = len(free)
        take = min(nd, nfree)
        need = size + nd - take
        if need > block.shape[0]:
            return -need
        # rank r (first occurrence, or hash order) gets the free list's tail first, then new slots
        for r in range(nd):
            d = r if order is None else order[r]
            slots[d] = free[nfree - take + r] if r < take else size + (r - take)
        if take:
            del free[nfree - take:]
        size = need
        index._reserve(nd)
        for r in range(nd):  # into the index in rank order, as the numpy path's insert did
            d = r if order is None else order[r]
            index._put(keys[d], slots[d])
            block[slots[d]] = keys[d]
        for i in range(m):
            s[pos[i]] = slots[which[i]]
        return size
    finally:
        if keys != keys_s:
            PyMem_Free(keys)
            PyMem_Free(pos)
            PyMem_Free(which)
            PyMem_Free(slots)
        PyMem_Free(tk)
        PyMem_Free(tv)


def refill(SlotMap index, blocks, s_arr):
    """``BlockTable.resolve`` of cached slots: ``s_arr`` itself when it has no 0, else a copy
    with each 0 probed again (a block allocated since; a non-uint64 hash stays 0), in one pass
    (it was ``flatnonzero``, a list of the unknown blocks and a probe: ~5% of the fold)."""
    cdef const int64_t[::1] s = s_arr
    cdef Py_ssize_t i, f = -1, n = s.shape[0]
    cdef uint64_t k
    for i in range(n):
        if s[i] == 0:
            f = i
            break
    if f < 0:
        return s_arr
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    if PySequence_Fast_GET_SIZE(fast) != n:
        raise ValueError(f"refill: {PySequence_Fast_GET_SIZE(fast)} blocks but {n} slots")
    out_arr = np.array(s_arr, dtype=np.intp, copy=True)
    cdef int64_t[::1] out = out_arr
    for i in range(f, n):
        if out[i] == 0 and u64_of(items[i], &k):
            out[i] = index._get(k)
    return out_arr


cdef enum:
    # how far ``picked_slots`` looks ahead in the order for a block before probing the index
    PICK_AHEAD = 64


def picked_slots(SlotMap index, blocks, const uint64_t[::1] order, const int64_t[::1] order_s):
    """The slots of ``blocks`` (``find_seq``'s answer) where they are the copies an eviction
    order just gave (``order``, with their slots ``order_s``, resolved at the table's current
    ``gen``): a ``KvEvicted`` names the pool's victims, the order's first blocks less the ones
    its pool no longer held or pinned, in the order's order. Each block is matched against the
    order from where the last match left it, up to ``PICK_AHEAD`` entries on (its slot is the
    order's: an order's blocks are distinct, and while no slot was freed a block's slot stays
    its own); a block not found there is probed in the index, so any list gets the index's
    answer (0 for an unknown block or a non-uint64 hash). Measured in docs/simulator.md
    ("Fourth pass"): the probe of each victim, a cache miss in a table of ~10^6 cells."""
    cdef object fast = PySequence_Fast(blocks, "block hashes must be a sequence")
    cdef Py_ssize_t i, p, end, m = PySequence_Fast_GET_SIZE(fast)
    cdef Py_ssize_t cur = 0, n_order = order.shape[0]
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef uint64_t k
    if order_s.shape[0] != n_order:
        raise ValueError(f"picked_slots: {n_order} blocks in the order but {order_s.shape[0]} slots")
    out = np.empty(m, dtype=np.intp)
    cdef int64_t[::1] po = out
    for i in range(m):
        if not u64_of(items[i], &k):
            po[i] = 0
            continue
        end = min(cur + <Py_ssize_t>PICK_AHEAD, n_order)
        p = cur
        while p < end and order[p] != k:
            p += 1
        if p < end:
            po[i] = order_s[p]
            cur = p + 1
        else:
            po[i] = index._get(k)
    return out


def lookup_scan(SlotMap index, blocks, prefix, const uint64_t[:, ::1] held):
    """``BlockTable.scan`` in one pass: the slots of ``blocks`` (the first ``len(prefix)`` taken
    from ``prefix``, the slots resolved for an earlier prompt this one extends, with each 0 probed
    again; the rest probed as ``find_seq`` does), the pool prefix (the blocks before the first one
    no copy bit is set in) and that prefix's ``[pool, W]`` holder words: ``(pool, masks, s)``."""
    cdef object fast = PySequence_Fast(blocks, "block hashes must be a sequence")
    cdef Py_ssize_t i, j, c, w, x, m = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef Py_ssize_t kp = 0, pool, words = held.shape[1]
    cdef const int64_t[::1] pre
    cdef uint64_t ks[CHUNK]
    cdef unsigned char ok[CHUNK]
    cdef uint64_t k, acc
    out = np.empty(m, dtype=np.intp)
    cdef int64_t[::1] po = out
    if prefix is not None:
        pre = prefix
        kp = pre.shape[0]
        if kp > m:
            raise ValueError(f"lookup_scan: a prefix of {kp} slots for {m} blocks")
        for i in range(kp):
            x = pre[i]
            if x == 0 and u64_of(items[i], &k):
                x = index._get(k)
            po[i] = x
    _probe_from(index, items, kp, m, po)
    pool = m
    for i in range(m):
        x = po[i]
        acc = 0
        for w in range(words):
            acc |= held[x, w]
        if not acc:
            pool = i
            break
    masks_arr = np.empty((pool, words), dtype=np.uint64)
    cdef uint64_t[:, ::1] masks = masks_arr
    for i in range(pool):
        x = po[i]
        for w in range(words):
            masks[i, w] = held[x, w]
    return pool, masks_arr, out


cdef inline bint _unused(const uint64_t[:, ::1] held, const int32_t[::1, :] refs, Py_ssize_t x) noexcept nogil:
    """Slot ``x`` holds no copy bit and no branch reference (it can be freed)."""
    cdef Py_ssize_t w, c
    for w in range(held.shape[1]):
        if held[x, w]:
            return False
    for c in range(refs.shape[1]):
        if refs[x, c]:
            return False
    return True


def unused(const uint64_t[:, ::1] held, const int32_t[::1, :] refs, const int64_t[:] s):
    """The slots of ``s`` (> 0) that no node holds and no branch references, in order (a repeated
    slot as often as it appears): ``BlockTable.release``'s candidates, in one pass (it was a
    2-D gather, an OR of the words, a row gather of the counts and two selections)."""
    cdef Py_ssize_t i, x, k = 0, n = s.shape[0]
    out_arr = np.empty(n, dtype=np.intp)
    cdef int64_t[::1] out = out_arr
    with nogil:
        for i in range(n):
            x = s[i]
            if x > 0 and _unused(held, refs, x):
                out[k] = x
                k += 1
    return out_arr[:k]


def refs_add(int32_t[::1] col, const int64_t[:] s, int delta, const uint64_t[:, ::1] held,
             const int32_t[::1, :] refs):
    """``delta`` (+1 / -1) on one node's reference column ``col`` (a column of ``refs``) for the
    slots ``s``, as ``col[s] = col.take(s) + delta`` (a slot repeated in ``s`` moves once). +1:
    returns ``None``. -1: ``None`` with nothing written if a slot is 0 or a count would go
    negative (the caller raises); else the slots of ``s`` now unused (:func:`unused`), which
    the caller frees. One pass each way instead of a take, an add, a scatter, two ``all`` and
    the release's five numpy calls."""
    cdef Py_ssize_t i, x, k = 0, n = s.shape[0]
    cdef int32_t* tmp = <int32_t*>PyMem_Malloc((n if n else 1) * sizeof(int32_t))
    if tmp == NULL:
        raise MemoryError()
    try:
        if delta < 0:
            for i in range(n):
                x = s[i]
                if x <= 0 or col[x] <= 0:
                    return None
        with nogil:
            for i in range(n):  # gather, then scatter: numpy's semantics for a repeated slot
                tmp[i] = col[s[i]] + delta
            for i in range(n):
                col[s[i]] = tmp[i]
        if delta > 0:
            return None
        return unused(held, refs, s)
    finally:
        PyMem_Free(tmp)


def is_suffix(a, b):
    """``b`` is the tail of ``a``: ``a[len(a) - len(b):] == b`` (identity first, then ``==``), without
    the slice (a KV event's blocks against its request's prompt, up to thousands of references)."""
    cdef object fa = PySequence_Fast(a, "blocks must be a sequence")
    cdef object fb = PySequence_Fast(b, "blocks must be a sequence")
    cdef Py_ssize_t i, na = PySequence_Fast_GET_SIZE(fa), nb = PySequence_Fast_GET_SIZE(fb)
    cdef PyObject** ia = PySequence_Fast_ITEMS(fa)
    cdef PyObject** ib = PySequence_Fast_ITEMS(fb)
    if nb > na:
        return False
    ia += na - nb
    for i in range(nb):
        if ia[i] != ib[i] and not (<object>ia[i] == <object>ib[i]):
            return False
    return True


# ----------------------------------------------------------------------------- table kernels
# Fused loops over a request's slots for BlockTable (table.py): each replaces a handful of numpy
# calls (gather, mask, compare, argmin, scatter) on arrays of ~1,500 slots with one pass. ``h`` is
# one word column of the held-bit table (a strided view above 32 nodes), ``l0``/``l1`` the
# last-access columns of a node's two tiers (column-major, so contiguous).

def mark(uint64_t[:] h, const int64_t[:] s, uint64_t bit, double[:] last, double ts):
    """Copy bit ``bit`` set and last access ``ts`` for every slot of ``s`` (a store)."""
    cdef Py_ssize_t i, x
    with nogil:
        for i in range(s.shape[0]):
            x = s[i]
            h[x] |= bit
            last[x] = ts


def touch(const uint64_t[:] h, const int64_t[:] s, uint64_t b0, uint64_t b1, double[:] l0, double[:] l1,
          double ts):
    """Last access ``ts`` on the longest run of ``s`` holding bit ``b0`` (into ``l0``) and on the
    longest holding ``b1`` (into ``l1``); returns both run lengths. One pass: each slot's holder
    word is read once for both tiers (not two scans and two writes over a request's ~1,700
    scattered slots)."""
    cdef Py_ssize_t i, n = s.shape[0], k0 = n, k1 = n
    cdef Py_ssize_t x
    cdef uint64_t w
    cdef bint on0 = True, on1 = True
    with nogil:
        for i in range(n):
            x = s[i]
            w = h[x]
            if on0:
                if w & b0:
                    l0[x] = ts
                else:
                    on0 = False
                    k0 = i
            if on1:
                if w & b1:
                    l1[x] = ts
                else:
                    on1 = False
                    k1 = i
            if not on0 and not on1:
                break
    return k0, k1


def read(const uint64_t[:] h, const int64_t[:] s, uint64_t b0, uint64_t b1, double[:] l0, double[:] l1,
         double ts, bint masks):
    """Last access ``ts`` on every copy of ``s`` (slot > 0) holding ``b0`` / ``b1``; returns
    ``(slots holding neither, mask b0, mask b1)``, the masks (bool arrays) only if ``masks``."""
    cdef Py_ssize_t i, x, n = s.shape[0], miss = 0
    cdef uint64_t w
    cdef bint hit
    m0_arr = m1_arr = None
    cdef unsigned char[:] m0
    cdef unsigned char[:] m1
    if masks:
        m0_arr = np.zeros(n, dtype=np.bool_)
        m1_arr = np.zeros(n, dtype=np.bool_)
        m0 = m0_arr.view(np.uint8)
        m1 = m1_arr.view(np.uint8)
    with nogil:
        for i in range(n):
            x = s[i]
            if x <= 0:
                miss += 1
                continue
            w = h[x]
            hit = False
            if w & b0:
                l0[x] = ts
                hit = True
                if masks:
                    m0[i] = 1
            if w & b1:
                l1[x] = ts
                hit = True
                if masks:
                    m1[i] = 1
            if not hit:
                miss += 1
    return miss, m0_arr, m1_arr


def held_prefix(const uint64_t[:, ::1] held, const int64_t[:] s):
    """Slots of ``s`` before the first one no copy bit is set in (the pool prefix)."""
    cdef Py_ssize_t i, w, x, n = s.shape[0], words = held.shape[1], k = n
    cdef uint64_t acc
    with nogil:
        for i in range(n):
            x = s[i]
            acc = 0
            for w in range(words):
                acc |= held[x, w]
            if not acc:
                k = i
                break
    return k


def runs(const uint64_t[:] col):
    """One-word holder masks along a prompt as runs of equal rows: ``(starts, rows)``."""
    cdef Py_ssize_t i, n = col.shape[0]
    cdef list starts = [], rows = []
    if not n:
        return starts, rows
    starts.append(0)
    rows.append(col[0])
    for i in range(1, n):
        if col[i] != col[i - 1]:
            starts.append(i)
            rows.append(col[i])
    return starts, rows


cdef extern from *:
    int __builtin_ctzll(unsigned long long x) nogil


cdef inline int _ends(dict out, uint64_t bits, Py_ssize_t length) except -1:
    """``out[bit] = length`` for every bit set in ``bits`` (``lookup._assign``)."""
    cdef uint64_t low
    while bits:
        low = bits & (~bits + 1)
        out[<int>__builtin_ctzll(bits)] = length
        bits ^= low
    return 0


def runs_ends(const uint64_t[:] col):
    """``lookup._runs`` and ``lookup._prefix_ends`` of one-word holder masks in one pass:
    ``(starts, rows, tiers, local)``, the runs of equal rows and, for every copy bit set on the
    first block, where its prefix ends (``tiers``: per tier bit; ``local``: per node's L1 or L2,
    keyed by its L1 bit). The running AND of the rows keeps the bits whose prefix is unbroken, so
    a bit's prefix ends at the run where it leaves the AND (a handful of runs per prompt)."""
    cdef Py_ssize_t i, n = col.shape[0]
    cdef uint64_t even = 0x5555555555555555ULL
    cdef uint64_t acc_t, acc_l, m, nt, nl, gone
    cdef bint live
    cdef list starts = [], rows = []
    cdef dict tiers = {}, local = {}
    if not n:
        return starts, rows, tiers, local
    starts.append(0)
    rows.append(col[0])
    acc_t = col[0]
    acc_l = (acc_t | acc_t >> 1) & even
    live = acc_t != 0 or acc_l != 0
    for i in range(1, n):
        if col[i] == col[i - 1]:
            continue
        starts.append(i)
        m = col[i]
        rows.append(m)
        if live:
            nt = acc_t & m
            nl = acc_l & (m | m >> 1) & even
            _ends(tiers, acc_t & ~nt, i)
            _ends(local, acc_l & ~nl, i)
            acc_t, acc_l = nt, nl
            live = acc_t != 0 or acc_l != 0
    _ends(tiers, acc_t, n)
    _ends(local, acc_l, n)
    return starts, rows, tiers, local


# ----------------------------------------------------------------------------- branch contexts
# The set arithmetic of DirectoryCore._set_context (core.py) on a new context: the same answers
# as its list comprehensions over ``dict.fromkeys`` (ordered, de-duplicated), one C loop each.

def common_prefix(a, b):
    """Length of the longest common prefix of two sequences of ints (identity first, then ``==``):
    the continuation test of a context change, and where a rewrite starts."""
    cdef object fa = PySequence_Fast(a, "blocks must be a sequence")
    cdef object fb = PySequence_Fast(b, "blocks must be a sequence")
    cdef Py_ssize_t i, n = min(PySequence_Fast_GET_SIZE(fa), PySequence_Fast_GET_SIZE(fb))
    cdef PyObject** ia = PySequence_Fast_ITEMS(fa)
    cdef PyObject** ib = PySequence_Fast_ITEMS(fb)
    for i in range(n):
        if ia[i] != ib[i] and not (<object>ia[i] == <object>ib[i]):
            return i
    return n


def fresh(blocks, counted, excluded):
    """Blocks of ``blocks`` in neither set, in order, each once."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef set seen = set()
    cdef object x
    cdef bint check_ex = len(excluded) > 0
    for i in range(n):
        x = <object>items[i]
        if PySet_Contains(counted, x) or (check_ex and PySet_Contains(excluded, x)) or PySet_Contains(seen, x):
            continue
        PySet_Add(seen, x)
        out.append(x)
    return out


def add_fresh(blocks, set counted, excluded):
    """:func:`fresh` that also adds what it returns to ``counted`` (``counted |= fresh(...)``):
    one set probe per block where ``fresh`` and the ``update`` after it took four (the blocks
    added earlier in the list are in ``counted`` by then, so no set of seen blocks is needed)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast), before
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef object x
    cdef bint check_ex = len(excluded) > 0
    for i in range(n):
        x = <object>items[i]
        if check_ex and PySet_Contains(excluded, x):
            continue
        before = len(counted)
        PySet_Add(counted, x)
        if len(counted) != before:
            out.append(x)
    return out


def dropped(old, counted, keep, excluded):
    """Blocks of ``old`` in ``counted`` that are not kept (absent from ``keep`` or in
    ``excluded``), in order, each once."""
    cdef object fast = PySequence_Fast(old, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef set seen = set()
    cdef object x
    cdef bint check_ex = len(excluded) > 0
    for i in range(n):
        x = <object>items[i]
        if not PySet_Contains(counted, x):
            continue
        if PySet_Contains(keep, x) and not (check_ex and PySet_Contains(excluded, x)):
            continue
        if PySet_Contains(seen, x):
            continue
        PySet_Add(seen, x)
        out.append(x)
    return out


# ----------------------------------------------------------------------------- eviction order
def unpinned(const uint64_t[::1] blocks, pinned):
    """The blocks of a uint64 array that ``pinned`` does not hold, in order: one membership test
    per block read (``pinned``: a :class:`BlockCounts`, probed with the hashes as they are; a set,
    a dict's keys or any container of int hashes), instead of converting and sorting every
    pinned block per eviction (issue 24: ``np.fromiter`` of a node's ~10^5 pinned blocks was the
    eviction order's largest cost)."""
    cdef Py_ssize_t i, k = 0, n = blocks.shape[0]
    cdef int kind = 0 if isinstance(pinned, (set, frozenset)) else (1 if isinstance(pinned, dict) else 2)
    cdef object key
    cdef int hit
    cdef BlockCounts bc
    out_arr = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] out = out_arr
    if type(pinned) is BlockCounts:
        bc = <BlockCounts>pinned
        with nogil:
            for i in range(n):
                if cell_get(bc.cells, bc.bits, bc.mask, blocks[i]) == 0:
                    out[k] = blocks[i]
                    k += 1
        return out_arr[:k]
    for i in range(n):
        key = PyLong_FromUnsignedLongLong(blocks[i])
        if kind == 0:
            hit = PySet_Contains(pinned, key)
        elif kind == 1:
            hit = PyDict_Contains(pinned, key)
        else:
            hit = PySequence_Contains(pinned, key)
        if not hit:
            out[k] = blocks[i]
            k += 1
    return out_arr[:k]


def bucket_pick(const uint64_t[:] h, uint64_t bit, const int32_t[:] refs, bint counted, const double[:] last,
                double key, const int64_t[:] arr, unsigned char[:] mark, const uint64_t[:] block,
                BlockCounts pinned):
    """The entries of one eviction bucket ``(counted, key)`` of a copy column that are still valid
    (held there, in that count class, last access ``key``), and of those the ones whose block
    ``pinned`` does not count, in one pass. ``mark``: an all-zero scratch byte per table slot, left
    all-zero. ``(valid, free)``, ``valid`` the still-valid slots (each once, first-occurrence order; ``None``
    when every entry is valid and distinct, so the bucket needs no compaction) and ``free`` the
    valid slots whose block ``pinned`` does not count (``pinned`` None: all), in the same order.

    Why (issue 24, docs/simulator.md "The eviction walk remembers its pinned blocks"): on the calibration
    sessions ~85% of a node's L1 copies are pinned, so an eviction reads ~44 K entries to find
    ~3 K victims; gathering, sorting and probing the pinned ones separately cost more than the
    validity pass itself. Only the unpinned slots are returned, for the caller to sort."""
    cdef Py_ssize_t i, x, y, k = 0, f = 0, n = arr.shape[0]
    cdef bint has_pins = pinned is not None
    valid_arr = np.empty(n, dtype=np.intp)
    free_arr = np.empty(n, dtype=np.intp)
    cdef int64_t[::1] out = valid_arr
    cdef int64_t[::1] fout = free_arr
    with nogil:
        for i in range(n):
            # a bucket's slots are scattered over the table: each entry's reads are cache misses,
            # started ahead (its columns 2 * PREFETCH_AHEAD entries on, its block's pin cell
            # PREFETCH_AHEAD on, once that block's hash has arrived)
            if i + 2 * PREFETCH_AHEAD < n:
                y = arr[i + 2 * PREFETCH_AHEAD]
                __builtin_prefetch(&h[y])
                __builtin_prefetch(&refs[y])
                __builtin_prefetch(&last[y])
                __builtin_prefetch(&mark[y])
                if has_pins:
                    __builtin_prefetch(&block[y])
            if has_pins and i + PREFETCH_AHEAD < n:
                prefetch(pinned, block[arr[i + PREFETCH_AHEAD]])
            x = arr[i]
            if mark[x] or not (h[x] & bit) or (refs[x] > 0) != counted or last[x] != key:
                continue
            mark[x] = 1
            out[k] = x
            k += 1
            if not has_pins or not held(pinned, block[x]):
                fout[f] = x
                f += 1
        for i in range(k):
            mark[out[i]] = 0
    return (None if k == n else valid_arr[:k]), free_arr[:f]


def held_split(const uint64_t[:] h, uint64_t bit, const int32_t[:] refs, const int64_t[:] s):
    """The slots of ``s`` holding copy bit ``bit``, split by count class: ``(counted, zero)``,
    ``refs[x] > 0`` and ``== 0``, each in the order of ``s``. What ``BlockTable._track`` did with
    a 2-D gather, a mask, a second gather and two boolean selections (five numpy calls on a
    request's ~1,800 slots, 5% of a calibration-session run's samples)."""
    cdef Py_ssize_t i, x, a = 0, b = 0, n = s.shape[0]
    one_arr = np.empty(n, dtype=np.intp)
    zero_arr = np.empty(n, dtype=np.intp)
    cdef int64_t[::1] one = one_arr
    cdef int64_t[::1] zero = zero_arr
    with nogil:
        for i in range(n):
            if i + 2 * PREFETCH_AHEAD < n:  # scattered slots (a release log's): their reads started ahead
                x = s[i + 2 * PREFETCH_AHEAD]
                __builtin_prefetch(&h[x])
                __builtin_prefetch(&refs[x])
            x = s[i]
            if not (h[x] & bit):
                continue
            if refs[x] > 0:
                one[a] = x
                a += 1
            else:
                zero[b] = x
                b += 1
    return one_arr[:a], zero_arr[:b]


def concat_u64(lists, Py_ssize_t total):
    """The hashes of ``lists`` (sequences of ints), one after the other, as one uint64 array of
    ``total`` entries: what ``np.fromiter(chain.from_iterable(lists), uint64, total)`` gives,
    without a generator step per hash (the event log writer's largest single line, 3.4% of a
    calibration-session run's samples). A hash outside ``[0, 2**64)`` raises ``OverflowError``
    and a count other than ``total`` ``ValueError``, as numpy's conversion does."""
    out_arr = np.empty(total, dtype=np.uint64)
    cdef uint64_t[::1] out = out_arr
    cdef Py_ssize_t i, m, k = 0
    cdef object fast
    cdef PyObject** items
    for blocks in lists:
        fast = PySequence_Fast(blocks, "blocks must be a sequence")
        m = PySequence_Fast_GET_SIZE(fast)
        if k + m > total:
            raise ValueError(f"concat_u64: more than {total} hashes")
        items = PySequence_Fast_ITEMS(fast)
        for i in range(m):
            if not u64_of(items[i], &out[k + i]):
                raise OverflowError(f"block hash {<object>items[i]!r} is not a uint64")
        k += m
    if k != total:
        raise ValueError(f"concat_u64: {k} hashes, not {total}")
    return out_arr


def unmark(uint64_t[:] h, const int64_t[:] s, uint64_t bit):
    """Copies dropped (an eviction): the slots of ``s`` (> 0) that hold bit ``bit``, in order (a
    repeated slot as often as it appears), and then that bit cleared on each. Two passes, so a
    repeated slot counts as held each time, as the numpy mask computed before the write did."""
    cdef Py_ssize_t i, x, k = 0, n = s.shape[0]
    out_arr = np.empty(n, dtype=np.intp)
    cdef int64_t[::1] out = out_arr
    with nogil:
        for i in range(n):
            x = s[i]
            if x > 0 and (h[x] & bit):
                out[k] = x
                k += 1
        for i in range(k):
            h[out[i]] &= ~bit
    return out_arr[:k]
