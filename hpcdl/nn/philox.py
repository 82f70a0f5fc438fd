"""Philox4x32-10, the counter-based generator of Salmon et al. (SC'11, Random123), on NumPy and
as CUDA source for CuPy: the same bits on the CPU and the GPU for the same key and counter.

A counter-based generator needs no state between calls: the random words of element i are a
pure function of (key, counter), so a dropout mask is one elementwise pass, no generator is
built per mask, and the host and the device agree bit for bit. Layout used here (dropout):
the 64-bit key is the mask's seed, the counter of element i is (block, block >> 32, 0, 0) with
block = i // 4, and element i takes word i % 4 of its block's four. Tested against Random123's
known-answer vectors (tests/test_nn_philox.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32(counter: Any, key: tuple[int, int]) -> Any:
    """Philox4x32-10 of counter (4, n) uint32 under key (k0, k1): (4, n) uint32 words."""
    c = [np.asarray(word, dtype=np.uint64) for word in counter]
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + np.uint64(W0)) & _LOW, (k1 + np.uint64(W1)) & _LOW
        p0, p1 = np.uint64(M0) * c[0], np.uint64(M1) * c[2]
        c = [(p1 >> _SHIFT) ^ c[1] ^ k0, p1 & _LOW, (p0 >> _SHIFT) ^ c[3] ^ k1, p0 & _LOW]
    return np.stack(c).astype(np.uint32)


def words(seed: int, n: int) -> np.ndarray:
    """n uint32 random words for a mask of n elements under the 64-bit seed (module layout)."""
    block = np.arange((n + 3) // 4, dtype=np.uint64)
    zeros = np.zeros_like(block)
    counter = (block & _LOW, block >> _SHIFT, zeros, zeros)
    out = philox4x32(counter, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    return out.T.reshape(-1)[:n]  # element i: word i % 4 of block i // 4


def keep_threshold(rate: float) -> int:
    """The uint32 t such that an element is kept when its word is >= t: P(drop) = t / 2^32."""
    return min(int(round(rate * 2.0**32)), 0xFFFFFFFF)


# The same function for a CuPy ElementwiseKernel: element i computes its block and keeps
# word i % 4 (recomputing the block per element: arithmetic is cheaper than a shuffle here).
CUDA_SOURCE = r"""
__device__ __forceinline__ unsigned int hpcdl_philox_word(
        unsigned long long i, unsigned int k0, unsigned int k1) {
    unsigned long long block = i >> 2;
    unsigned int c0 = (unsigned int)block, c1 = (unsigned int)(block >> 32), c2 = 0, c3 = 0;
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
        unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0;
        unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1;
        c1 = (unsigned int)p1; c3 = (unsigned int)p0; c0 = n0; c2 = n2;
    }
    unsigned int lane = (unsigned int)(i & 3);
    return lane == 0 ? c0 : lane == 1 ? c1 : lane == 2 ? c2 : c3;
}
"""
