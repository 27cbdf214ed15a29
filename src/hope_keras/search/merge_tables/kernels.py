"""The merge tables' per-step loops, compiled with numba.

A greedy step reads a few rows of a table and touches a few entries: in NumPy each
of those is a handful of calls with temporaries (a copy of the rows read, a mask, its
indices), and over thousands of steps the calls cost more than the arithmetic. These
kernels run the same loops over the tables' own arrays, without copies, and give the
same values as the NumPy expressions they replace (comparisons and minima only: no
floating-point arithmetic is reordered).

Compiled functions are cached on disk where numba can (`hope_keras._jit`).
"""

from __future__ import annotations

import numba
import numpy as np

from hope_keras._jit import jit_options


_JIT = jit_options(__file__)


# Dense tables are scanned in blocks of this many columns: a block's comparisons and
# minimum are vectorized, and only blocks holding a pair are read again for positions
# (700 rows × 2048 columns, 0.6 % of entries found: 1.3 ms with 32, 1.7 ms with 64,
# 3.3 ms with 16).
_BLOCK = 32


def order_keys(x: np.ndarray) -> np.ndarray:
    """Integer keys of float32 or float64 values (not NaN) in the same order:
    ``x <= y`` iff ``key(x) <= key(y)``, with −0.0 below +0.0 (so `cut_keys`
    adds +0.0 to a cut). Integer minima vectorize where float ones do not."""
    bits = x.view(np.int32 if x.dtype == np.float32 else np.int64)
    shift = bits.dtype.itemsize * 8 - 1
    return bits ^ ((bits >> shift) & np.iinfo(bits.dtype).max)


def from_keys(k: np.ndarray, dtype) -> np.ndarray:
    """The float64 values of `order_keys` keys of `dtype` values."""
    shift = k.dtype.itemsize * 8 - 1
    return (k ^ ((k >> shift) & np.iinfo(k.dtype).max)).view(dtype).astype(np.float64)


@numba.njit(inline="always")
def _key32(b, floor):
    """`order_keys` of float32 bits (int32), at least `floor` (the column's: the
    smallest int32 if live, the largest, above every cut, if not)."""
    k = np.int32(b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF)))
    return k if k > floor else floor


@numba.njit(inline="always")
def _key64(b, floor):
    """`_key32` for float64 bits (int64)."""
    k = np.int64(b ^ ((b >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF)))
    return k if k > floor else floor


@numba.njit(inline="always")
def _scan_rows(key, bits, floor, rows, cut_keys, inf_key, dead):
    n = bits.shape[1]
    full = n // _BLOCK
    nb = full + (1 if n % _BLOCK else 0)
    rest = np.empty(rows.shape[0], dtype=bits.dtype)
    per_block = np.empty(nb, dtype=np.int64)
    found = 0
    r_out = np.empty(256, dtype=np.intp)
    l_out = np.empty(256, dtype=np.intp)
    for a in range(rows.shape[0]):
        r = rows[a]
        line = bits[r]
        ck = cut_keys[r]
        m = inf_key
        count = 0
        # Pass 1: per block, the entries at most the cut (counted) and the minimum
        # of the others (constant trip counts: the loop is vectorized).
        for blk in range(full):
            s0 = blk * _BLOCK
            c = np.int32(0)
            for j in range(_BLOCK):
                k = key(line[s0 + j], floor[s0 + j])
                hit = k <= ck
                c += np.int32(hit)
                k = dead if hit else k
                m = k if k < m else m
            per_block[blk] = c
            count += c
        if full < nb:
            c = np.int32(0)
            for x in range(full * _BLOCK, n):
                k = key(line[x], floor[x])
                hit = k <= ck
                c += np.int32(hit)
                k = dead if hit else k
                m = k if k < m else m
            per_block[full] = c
            count += c
        rest[a] = m
        if count == 0:
            continue
        # Pass 2: the positions, from the blocks that hold some.
        # Element loops, not slice assignments: numba compiles a slice assignment's
        # broadcasting checks and their messages, 1.5 of a fresh compile's 2.4 s.
        if found + count > r_out.shape[0]:
            size = 2 * (found + count)
            r_new = np.empty(size, dtype=np.intp)
            l_new = np.empty(size, dtype=np.intp)
            for t in range(found):
                r_new[t] = r_out[t]
                l_new[t] = l_out[t]
            r_out, l_out = r_new, l_new
        for t in range(found, found + count):
            r_out[t] = r
        for blk in range(nb):
            left = per_block[blk]
            x = blk * _BLOCK
            while left:
                if key(line[x], floor[x]) <= ck:
                    l_out[found] = x
                    found += 1
                    left -= 1
                x += 1
    return r_out[:found].copy(), l_out[:found].copy(), rest


@numba.njit(**_JIT)
def _dense_scan32(bits, floor, rows, cut_keys, inf_key, dead):
    return _scan_rows(_key32, bits, floor, rows, cut_keys, inf_key, dead)


@numba.njit(**_JIT)
def _dense_scan64(bits, floor, rows, cut_keys, inf_key, dead):
    return _scan_rows(_key64, bits, floor, rows, cut_keys, inf_key, dead)


def dense_scan(lo, ok, rows, cut):
    """The pairs of a dense table's rows `rows` that could be the best, and the
    minimum of each row's other live entries, in one pass over those rows.

    Args:
        lo: The table (n × n, float32 or float64, no NaN).
        ok: Live neurons (bool, n): the columns read.
        rows: The rows to scan (increasing).
        cut: Per neuron, the largest entry its row may hold to be returned, in
            `lo`'s dtype (not NaN on `rows`).

    Returns:
        ``(r, l, rest)``: the pairs ``(r, l)`` with ``ok[l]`` and ``lo[r, l] <=
        cut[r]``, in row-major order (as ``np.nonzero`` of the rows × live-columns
        mask gives them); per row of `rows`, the minimum (float64) of its live
        entries not returned (inf when none).

    Example:

    >>> lo = np.array([[np.inf, 1.0, 3.0], [1.0, np.inf, 2.0], [3.0, 2.0, np.inf]])
    >>> r, l, rest = dense_scan(lo, np.ones(3, bool), np.array([0, 2]), np.full(3, 2.0))
    >>> r.tolist(), l.tolist(), rest.tolist()
    ([0, 2], [1, 1], [3.0, 3.0])
    """
    single = lo.dtype == np.float32
    bits = lo.view(np.int32 if single else np.int64)
    # +0.0: a cut of −0.0 keys below the entries +0.0 it equals.
    cut_keys = order_keys(np.asarray(cut, dtype=lo.dtype) + lo.dtype.type(0.0))
    inf_key = order_keys(np.array([np.inf], dtype=lo.dtype))[0]
    info = np.iinfo(bits.dtype)
    floor = np.where(ok, info.min, info.max).astype(bits.dtype)
    scan = _dense_scan32 if single else _dense_scan64
    r, l, rest = scan(bits, floor, np.asarray(rows, dtype=np.intp), cut_keys, inf_key,
                      bits.dtype.type(info.max))
    return r, l, from_keys(rest, lo.dtype)


@numba.njit(**_JIT)
def tighten_rows(lo, rowlo, rows, rest, r, l, cut):
    """After `dense_scan` and the pricing of its pairs ``(r, l)``: ``rowlo[rows]``
    becomes each row's minimum of `rest` and its pairs' entries of `lo` (no NaN);
    returns which pairs have ``lo[r, l] <= cut[r]`` (float64 `cut`)."""
    n = rowlo.shape[0]
    low = np.full(n, np.inf)
    for a in range(rows.shape[0]):
        low[rows[a]] = rest[a]
    keep = np.empty(r.shape[0], dtype=np.bool_)
    for p in range(r.shape[0]):
        x = r[p]
        v = np.float64(lo[x, l[p]])
        if v < low[x]:
            low[x] = v
        keep[p] = v <= cut[x]
    for a in range(rows.shape[0]):
        rowlo[rows[a]] = low[rows[a]]
    return keep


@numba.njit(**_JIT)
def put_symmetric(table, a, b, values):
    """``table[a, b] = table[b, a] = values``, elementwise (distinct pairs; values
    cast to the table's dtype as NumPy casts them)."""
    for p in range(a.shape[0]):
        table[a[p], b[p]] = values[p]
        table[b[p], a[p]] = values[p]


@numba.njit(**_JIT)
def mark_symmetric(flags, a, b):
    """``flags[a, b] = flags[b, a] = True``, elementwise."""
    for p in range(a.shape[0]):
        flags[a[p], b[p]] = True
        flags[b[p], a[p]] = True


@numba.njit(**_JIT)
def store_exact(lo, B, kc, gu, exact, a, b, R, Bv, kcv, guv):
    """A float64 dense table's exact values of the distinct pairs (a, b), both ways:
    `put_symmetric` into `lo`, `B`, `kc` and `gu`, `mark_symmetric` into `exact`."""
    for p in range(a.shape[0]):
        i, j = a[p], b[p]
        lo[i, j] = lo[j, i] = R[p]
        B[i, j] = B[j, i] = Bv[p]
        kc[i, j] = kc[j, i] = kcv[p]
        gu[i, j] = gu[j, i] = guv[p]
        exact[i, j] = exact[j, i] = True


@numba.njit(**_JIT)
def reset_cross(lo, exact, rowlo, i, D):
    """Neuron `i` of a dense table changed: its row and column of `lo` become `D`
    (float64 values the table's dtype holds exactly, no NaN), none exact;
    ``rowlo[i] = min(D)`` and every row's bound is lowered to its entry of `D`."""
    m = np.inf
    for x in range(D.shape[0]):
        v = D[x]
        lo[i, x] = v
        lo[x, i] = v
        exact[i, x] = False
        exact[x, i] = False
        if v < m:
            m = v
    rowlo[i] = m
    for x in range(D.shape[0]):
        if D[x] < rowlo[x]:
            rowlo[x] = D[x]
