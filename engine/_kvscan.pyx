# cython: language_level=3, boundscheck=False, wraparound=False
"""The node KV pool's block scans over its tier sets, compiled (pure: no I/O).

A request's prompt (~1,500 block hashes on the calibrated CC workload) is tested against a
node's L1 and L2 sets at enqueue, prefill start, store and decode admission
(engine/kvpool.py). In Python that is either a generator per block or ``set.issuperset`` of
64-block slices (a list copy per chunk); here one C loop reads the list in place and asks the
set directly (``PySet_Contains``: the same hash and equality as ``in``, so the same answers).
"""

from cpython.object cimport Py_EQ, PyObject_RichCompareBool
from cpython.ref cimport PyObject

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
    """``key in container`` for a set (kind 0), a dict (1, its keys) or any container (2)."""
    if kind == 0:
        return PySet_Contains(container, key)
    if kind == 1:
        return PyDict_Contains(container, key)
    return PySequence_Contains(container, key)


cdef inline int _kind(object container):
    if isinstance(container, (set, frozenset)):
        return 0
    if isinstance(container, dict):
        return 1
    return 2


def prefix_len(blocks, Py_ssize_t start, store):
    """End of the run of ``blocks[start:]`` held in the set ``store``."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    if not isinstance(store, (set, frozenset)):
        raise TypeError(f"prefix_len: store must be a set, got {type(store).__name__}")
    if start < 0:
        start = 0
    for i in range(start, n):
        if not PySet_Contains(store, <object>items[i]):
            return i
    return n if start < n else start


def missing_after(blocks, Py_ssize_t start, store):
    """Blocks of ``blocks[start:]`` not in ``store``, in order, without duplicates. ``store``: a
    set (asked directly), a dict (its keys) or any container (``in``: the pool's pin counts)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef set seen = set()
    cdef object b
    cdef int kind = _kind(store)
    for i in range(max(start, 0), n):
        b = <object>items[i]
        if _contains(store, kind, b) or PySet_Contains(seen, b):
            continue
        PySet_Add(seen, b)
        out.append(b)
    return out


def held_unpinned(blocks, store, pinned):
    """Blocks of ``blocks`` in ``store`` and not in ``pinned``, in order (an eviction's victims).
    ``pinned``: a set, a dict (its keys: the pool's pin counts) or any container (``in``)."""
    cdef object fast = PySequence_Fast(blocks, "blocks must be a sequence")
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(fast)
    cdef PyObject** items = PySequence_Fast_ITEMS(fast)
    cdef list out = []
    cdef object b
    cdef int kind = _kind(pinned)
    if not isinstance(store, (set, frozenset)):
        raise TypeError("held_unpinned: store must be a set")
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
