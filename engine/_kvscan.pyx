# cython: language_level=3, boundscheck=False, wraparound=False
"""The node KV pool's block scans over its tiers and pin counts, compiled (pure: no I/O).

A request's prompt (~1,500 block hashes on the calibrated CC workload) is tested against a
node's L1 and L2 tiers at enqueue, prefill start, store and decode admission, and an eviction's
candidates against the tier and the pins (engine/kvpool.py). One C loop reads the list in place.
The tiers are ``BlockSet``s and the pins a ``BlockCounts`` (uint64 open-addressing tables,
services/cores/directory/_native.pyx): each block is converted to its uint64 hash and the table
probed inline (issue 24: a Python ``set`` of ~10^5 ints costs the set slot and the int object
per probe, this one cache line). Any other container is asked as Python would (a set through
``PySet_Contains``, a dict its keys, anything else ``in``): the same answers for the same keys
(tests/unit/engine/test_kvscan_typed.py). A block that is not a uint64 hash is in no table.
"""

from cpython.object cimport Py_EQ, PyObject_RichCompareBool
from cpython.ref cimport PyObject
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport uint64_t

from services.cores.directory._native cimport CHUNK, SlotMap, held, u64_of

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


cdef inline int _contains(object container, int kind, object key) except -1:
    """``key in container`` for a set (kind 0), a dict (1, its keys), any container (2) or a
    uint64 table (3: a BlockSet's members, a BlockCounts' counted blocks)."""
    cdef uint64_t k = 0
    if kind == 3:
        return u64_of(<PyObject*>key, &k) and held(<SlotMap>container, k)
    if kind == 0:
        return PySet_Contains(container, key)
    if kind == 1:
        return PyDict_Contains(container, key)
    return PySequence_Contains(container, key)


cdef inline int _kind(object container):
    if isinstance(container, SlotMap):
        return 3
    if isinstance(container, (set, frozenset)):
        return 0
    if isinstance(container, dict):
        return 1
    return 2


cdef struct Seen:
    # an insert-only uint64 set for one call's de-duplication: ``used[p]`` marks cell p
    uint64_t* keys
    unsigned char* used
    uint64_t mask
    int bits


cdef int _seen_init(Seen* s, Py_ssize_t n) except -1:
    cdef int bits = 4
    while (<Py_ssize_t>1 << bits) < 2 * n:
        bits += 1
    s.bits = bits
    s.mask = (<uint64_t>1 << bits) - 1
    s.keys = <uint64_t*>PyMem_Calloc(<size_t>1 << bits, sizeof(uint64_t))
    s.used = <unsigned char*>PyMem_Calloc(<size_t>1 << bits, 1)
    if s.keys == NULL or s.used == NULL:
        PyMem_Free(s.keys)
        PyMem_Free(s.used)
        raise MemoryError()
    return 0


cdef inline bint _seen_add(Seen* s, uint64_t k) noexcept nogil:
    """Add ``k``; False if it was there already."""
    cdef uint64_t p = (k * <uint64_t>0x9E3779B97F4A7C15ULL) >> (64 - s.bits)
    while s.used[p]:
        if s.keys[p] == k:
            return False
        p = (p + 1) & s.mask
    s.used[p] = 1
    s.keys[p] = k
    return True


cdef inline bint _seen_has(Seen* s, uint64_t k) noexcept nogil:
    cdef uint64_t p = (k * <uint64_t>0x9E3779B97F4A7C15ULL) >> (64 - s.bits)
    while s.used[p]:
        if s.keys[p] == k:
            return True
        p = (p + 1) & s.mask
    return False


cdef inline Py_ssize_t _convert(PyObject** items, Py_ssize_t i, Py_ssize_t m, uint64_t* ks,
                                unsigned char* ok):
    """``items[i:i+m]`` as hashes into ``ks``, ``ok[j]`` 0 where one is not a uint64 hash."""
    cdef Py_ssize_t j
    for j in range(m):
        ok[j] = u64_of(items[i + j], &ks[j])
    return m


def prefix_len(blocks, Py_ssize_t start, store):
    """End of the run of ``blocks[start:]`` held in ``store`` (a BlockSet or a set)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef Py_ssize_t j, m
    cdef uint64_t ks[CHUNK]
    cdef unsigned char ok[CHUNK]
    cdef SlotMap t
    if start < 0:
        start = 0
    if isinstance(store, SlotMap):
        t = <SlotMap>store
        i = start
        while i < n:
            m = _convert(items, i, min(<Py_ssize_t>CHUNK, n - i), ks, ok)
            for j in range(m):
                if not (ok[j] and held(t, ks[j])):
                    return i + j
            i += m
        return n if start < n else start
    if not isinstance(store, (set, frozenset)):
        raise TypeError(f"prefix_len: store must be a BlockSet or a set, got {type(store).__name__}")
    for i in range(start, n):
        if not PySet_Contains(store, <object>items[i]):
            return i
    return n if start < n else start


def missing_after(blocks, Py_ssize_t start, store):
    """Blocks of ``blocks[start:]`` not in ``store``, in order, without duplicates. ``store``: a
    BlockSet or a BlockCounts (probed with the hashes), a set, a dict (its keys) or any container
    (``in``)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef set seen
    cdef object b
    cdef int kind = _kind(store)
    cdef Py_ssize_t j, m
    cdef uint64_t ks[CHUNK]
    cdef unsigned char ok[CHUNK]
    cdef unsigned char hit[CHUNK]
    cdef SlotMap t
    cdef Seen s
    start = max(start, 0)
    if kind == 3:
        if start >= n:
            return out
        t = <SlotMap>store
        seen = None  # the blocks that are not uint64 hashes (in no table), as a set would see them
        _seen_init(&s, n - start)
        try:
            i = start
            while i < n:
                m = _convert(items, i, min(<Py_ssize_t>CHUNK, n - i), ks, ok)
                for j in range(m):
                    hit[j] = ok[j] and held(t, ks[j])
                for j in range(m):
                    if hit[j]:
                        continue
                    b = <object>items[i + j]
                    if ok[j]:
                        if _seen_add(&s, ks[j]):
                            out.append(b)
                    else:
                        if seen is None:
                            seen = set()
                        if not PySet_Contains(seen, b):
                            PySet_Add(seen, b)
                            out.append(b)
                i += m
        finally:
            PyMem_Free(s.keys)
            PyMem_Free(s.used)
        return out
    seen = set()
    for i in range(start, n):
        b = <object>items[i]
        if _contains(store, kind, b) or PySet_Contains(seen, b):
            continue
        PySet_Add(seen, b)
        out.append(b)
    return out


def held_unpinned(blocks, store, pinned):
    """Blocks of ``blocks`` in ``store`` and not in ``pinned``, in order (an eviction's victims).
    ``store``: a BlockSet or a set; ``pinned``: a BlockCounts or a BlockSet (probed with the
    hashes), a set, a dict (its keys) or any container (``in``)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef object b
    cdef int kind = _kind(pinned)
    cdef uint64_t k = 0
    cdef Py_ssize_t j, m
    cdef uint64_t ks[CHUNK]
    cdef unsigned char ok[CHUNK]
    cdef unsigned char hit[CHUNK]
    cdef SlotMap t, p
    if isinstance(store, SlotMap):
        t = <SlotMap>store
        if kind == 3:
            p = <SlotMap>pinned
            i = 0
            while i < n:
                m = _convert(items, i, min(<Py_ssize_t>CHUNK, n - i), ks, ok)
                for j in range(m):
                    hit[j] = ok[j] and held(t, ks[j]) and not held(p, ks[j])
                for j in range(m):
                    if hit[j]:
                        out.append(<object>items[i + j])
                i += m
            return out
        for i in range(n):
            b = <object>items[i]
            if u64_of(<PyObject*>b, &k) and held(t, k) and not _contains(pinned, kind, b):
                out.append(b)
        return out
    if not isinstance(store, (set, frozenset)):
        raise TypeError(f"held_unpinned: store must be a BlockSet or a set, got {type(store).__name__}")
    for i in range(n):
        b = <object>items[i]
        if PySet_Contains(store, b) and not _contains(pinned, kind, b):
            out.append(b)
    return out


def common_prefix(a, b):
    """Length of the common prefix of two sequences (``is``, then ``==``, per element)."""
    cdef object fa = PySequence_Fast(a, "a must be a sequence")
    cdef object fb = PySequence_Fast(b, "b must be a sequence")
    cdef Py_ssize_t i, n = min(PySequence_Fast_GET_SIZE(fa), PySequence_Fast_GET_SIZE(fb))
    cdef PyObject** ia = PySequence_Fast_ITEMS(fa)
    cdef PyObject** ib = PySequence_Fast_ITEMS(fb)
    for i in range(n):
        if ia[i] != ib[i] and not PyObject_RichCompareBool(<object>ia[i], <object>ib[i], Py_EQ):
            return i
    return n


def meets(a, b):
    """Whether some block of ``b`` is one of ``a`` (``not set(a).isdisjoint(b)``): the pool's
    check that an eviction's candidates hold none of a call's own prompt (KvPool._without; a
    ~1,000-block answer against a ~1,700-block prompt, 3,800 times in 10 simulated minutes). ``a``'s
    hashes go into a table of this call, ``b``'s are probed: no Python set of ``a`` built. A
    list ``a`` with anything but uint64 hashes is asked as Python sets would be."""
    cdef object fa = PySequence_Fast(a, "a must be a sequence")
    cdef object fb = PySequence_Fast(b, "b must be a sequence")
    cdef Py_ssize_t i, na = PySequence_Fast_GET_SIZE(fa), nb = PySequence_Fast_GET_SIZE(fb)
    cdef PyObject** ia = PySequence_Fast_ITEMS(fa)
    cdef PyObject** ib = PySequence_Fast_ITEMS(fb)
    cdef uint64_t k = 0
    cdef Seen s
    cdef bint found = False
    if na == 0 or nb == 0:
        return False
    _seen_init(&s, na)
    try:
        for i in range(na):
            if not u64_of(ia[i], &k):
                return not set(a).isdisjoint(b)
            _seen_add(&s, k)
        for i in range(nb):
            if u64_of(ib[i], &k) and _seen_has(&s, k):
                found = True
                break
    finally:
        PyMem_Free(s.keys)
        PyMem_Free(s.used)
    return found
