# cython: language_level=3, boundscheck=False, wraparound=False
"""The synthetic generators' salted block chain, compiled (pure: no I/O).

``salted_chain(parent, salt, start, count)`` returns exactly what events.hashing.salted_chain
returns: block ``i`` has the three u32 tokens ``[salt & 0xFFFFFFFF, salt >> 32 & 0xFFFFFFFF, i]``
and its hash is BLAKE2b (8-byte digest, no key) over ``parent (u64 LE) || tokens (u32 LE)``,
chained from ``parent``. Those 20 bytes are one BLAKE2b block, so each hash is one compression
of a message whose words are ``parent``, ``lo | hi << 32``, ``i`` and zeros; an 8-byte digest is
the first state word. hashlib costs ~1 us a block from Python (a state copy, a pack, an update,
a digest and an unpack), the generation of a 96-node bench's sessions ~1 CPU s (issue 40);
this loop ~0.1 us. tests/unit/replay/traces/test_chain_native.py holds it to hashlib.
"""

from cpython.long cimport PyLong_FromUnsignedLongLong
from libc.stdint cimport uint64_t

cdef extern from *:
    """
    #include <stdint.h>
    static const uint64_t B2_IV[8] = {
        0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
        0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
    static const uint8_t B2_SIGMA[12][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
        {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
        {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
        {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
        {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
        {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
        {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
        {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
        {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
        {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};
    #define B2_ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
    #define B2_G(r, i, a, b, c, d) do { \\
        a = a + b + m[B2_SIGMA[r][2 * (i)]]; d = B2_ROTR(d ^ a, 32); c = c + d; b = B2_ROTR(b ^ c, 24); \\
        a = a + b + m[B2_SIGMA[r][2 * (i) + 1]]; d = B2_ROTR(d ^ a, 16); c = c + d; b = B2_ROTR(b ^ c, 63); \\
    } while (0)
    #define B2_ROUND(r) do { \
        B2_G(r, 0, v0, v4, v8, v12); B2_G(r, 1, v1, v5, v9, v13); \
        B2_G(r, 2, v2, v6, v10, v14); B2_G(r, 3, v3, v7, v11, v15); \
        B2_G(r, 4, v0, v5, v10, v15); B2_G(r, 5, v1, v6, v11, v12); \
        B2_G(r, 6, v2, v7, v8, v13); B2_G(r, 7, v3, v4, v9, v14); \
    } while (0)

    /* BLAKE2b-64 (RFC 7693, digest 8 bytes, no key) of the 20 bytes parent || w1 || (uint32)w2:
       one last block of 20 bytes; the digest's 8 bytes little-endian are the first state word. */
    static inline uint64_t b2_salted(uint64_t parent, uint64_t w1, uint64_t w2) {
        uint64_t m[16] = {parent, w1, w2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        uint64_t h0 = B2_IV[0] ^ 0x01010008ULL;  /* depth 1, fanout 1, key 0, digest 8 */
        uint64_t v0 = h0, v1 = B2_IV[1], v2 = B2_IV[2], v3 = B2_IV[3];
        uint64_t v4 = B2_IV[4], v5 = B2_IV[5], v6 = B2_IV[6], v7 = B2_IV[7];
        uint64_t v8 = B2_IV[0], v9 = B2_IV[1], v10 = B2_IV[2], v11 = B2_IV[3];
        uint64_t v12 = B2_IV[4] ^ 20ULL, v13 = B2_IV[5], v14 = ~B2_IV[6], v15 = B2_IV[7];
        /* unrolled: the sigma indexes are constants, so the zero message words fold away */
        B2_ROUND(0); B2_ROUND(1); B2_ROUND(2); B2_ROUND(3); B2_ROUND(4); B2_ROUND(5);
        B2_ROUND(6); B2_ROUND(7); B2_ROUND(8); B2_ROUND(9); B2_ROUND(10); B2_ROUND(11);
        return h0 ^ v0 ^ v8;
    }
    """
    uint64_t b2_salted(uint64_t parent, uint64_t w1, uint64_t w2) nogil

cdef uint64_t _MASK = 0xFFFFFFFFFFFFFFFF


def salted_chain(parent, salt, long long start, long long count) -> list:
    """``count`` chained hashes of synthetic blocks ``start .. start + count - 1`` (see the module
    docstring); the same list, the same errors, as events.hashing.salted_chain."""
    if count <= 0:
        return []
    if start < 0 or start + count - 1 > 0xFFFFFFFF:
        raise ValueError(f"block indices {start}..{start + count - 1} do not fit in a u32 token")
    cdef uint64_t p = <uint64_t>(parent & _MASK)
    cdef uint64_t s = <uint64_t>(salt & _MASK)  # the two u32 tokens, as one little-endian word
    cdef list out = [None] * count
    cdef long long i
    for i in range(count):
        p = b2_salted(p, s, <uint64_t>(start + i))
        out[i] = PyLong_FromUnsignedLongLong(p)
    return out


def salted(blocks, Py_ssize_t start, uint64_t mul, uint64_t x) -> list:
    """``[(h * mul) & (2**64 - 1) ^ x for h in blocks[start:]]``, the hashes taken modulo 2**64
    (replay/sim/sessions.py's remap of a recorded session's later passes)."""
    cdef list src = list(blocks) if type(blocks) is not list else blocks
    cdef Py_ssize_t i, n = len(src)
    if start < 0:
        start = 0
    cdef list out = [None] * max(0, n - start)
    cdef uint64_t h
    for i in range(start, n):
        try:
            h = src[i]  # a uint64 hash, converted in C
        except OverflowError:  # a negative or wider int: its low 64 bits, as the Python remap
            h = <uint64_t>(src[i] & _MASK)
        out[i - start] = PyLong_FromUnsignedLongLong((h * mul) ^ x)
    return out
