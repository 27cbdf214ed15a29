"""`DenseTable`: every pair of a group, each priced exactly once while its neurons
stand (the engine's table for groups of up to `hope_keras.search.merge_search.DENSE_PAIRS_MAX`
neurons under a built-in cost).

An n × n table holds each pair's lower bound of the residual (Gram entries only),
replaced by the exact residual the first time its bound could beat the best, and
per row a lower bound over its live entries. A selection prices only the pairs whose
bound is below what the best needs, and ranks those whose exact residual is; a merge
resets the parent's row and column to bounds. Tables wider than `DENSE_FLOAT64_MAX`
are compact (float32 bounds and ``B``); the pairs that could be selected are then
re-priced exactly (`DenseTable._rank_compact`), so the selection is the same.
"""

from __future__ import annotations

import numpy as np

from hope_keras.scoring.cache import sorted_unique
from hope_keras.search.candidates import MergeTable
from hope_keras.search.merge_tables import kernels
from hope_keras.search.merge_tables.bounds import CHUNK_ROWS, FILL_PAIRS

# Best pairs re-priced first at the next selection (an upper bound).
HINTS = 8
# Dense tables wider than this are compact: the residual's bound (rounded down) and
# ``B`` (rounded to nearest) in float32, 9 bytes a pair against 33 (a 4096-wide group:
# 144 MB against 528 MB); the pairs that could be selected are re-priced exactly
# (`DenseTable._rank_compact`), so the selection is the same.
DENSE_FLOAT64_MAX = 1024
# Relative error of a float32 ``B`` (rounding to nearest: 2**-24), with a margin.
_F32_REL = 2.0 ** -22


class DenseTable(MergeTable):
    """A certified merge table over every pair (``MergeTable(..., dense=True)``)."""

    def _fill(self, ok) -> None:
        self._fill_dense(ok)

    def _fill_dense(self, ok) -> None:
        """Dense table: every pair's lower bound of the residual (`_distance`, Gram
        entries only); exact values are computed when a pair first matters. Wider
        than `DENSE_FLOAT64_MAX`: compact (float32 bounds and ``B``, no ``K(i,j)``,
        ``⟨u_i, u_j⟩``)."""
        n = self.n
        self.compact = n > DENSE_FLOAT64_MAX
        cols = np.arange(n)
        # The residual's lower bound, or its value once exact (compact: rounded down).
        self.lo = np.empty((n, n), dtype=np.float32 if self.compact else np.float64)
        self.rowlo = np.full(n, np.inf)  # per row, a lower bound of `lo` over live partners
        step = min(CHUNK_ROWS, max(1, FILL_PAIRS // max(n, 1)))  # temporaries ≤ 4 MB
        for start in range(0, n, step):
            rr = np.arange(start, min(n, start + step))
            _, kc, gu = self.cache.pair_grid(rr)
            D = self._stored(self._distance_from(rr[:, None], cols[None, :], kc, gu))
            D[np.arange(rr.size), rr] = np.inf
            self.lo[rr] = D
            self.rowlo[rr] = np.where(ok[None, :], D, np.inf).min(axis=1)
        self.rowlo[~ok] = np.inf
        if self.compact:
            self.B, self.kc, self.gu = np.zeros((n, n), dtype=np.float32), None, None
        else:
            self.B, self.kc, self.gu = np.zeros((n, n)), np.zeros((n, n)), np.zeros((n, n))
        self.exact = np.zeros((n, n), dtype=bool)
        self._ok_seen = ok.copy()
        self._hint = (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp))

    def _stored(self, R):
        """`R` (float64 bounds or residuals) as `lo` holds it: compact tables round
        down to float32, so an entry stays a lower bound. A NaN is stored as +inf
        (a pair never selected; the compiled scan orders values as integers)."""
        R = np.where(np.isnan(R), np.inf, R)
        if not self.compact:
            return R
        R32 = np.asarray(R, dtype=np.float32)
        return np.where(R32 > R, np.nextafter(R32, np.float32(-np.inf)), R32)

    def _price_exact(self, r, l) -> None:
        """Computes the exact values of pairs (r, l) (each unordered pair once) and
        stores them both ways."""
        a, b = np.minimum(r, l), np.maximum(r, l)
        key = sorted_unique(a.astype(np.int64) * self.n + b)
        a, b = key // self.n, key % self.n
        B, kc, gu = self._values(a, b)
        self._store_dense(a, b, B, kc, gu, self._residual(a, b, B, kc * gu))

    def _store_dense(self, a, b, B, kc, gu, R):
        """Writes exact values of the distinct pairs (a, b) both ways; returns `R` as
        stored."""
        a, b = np.ravel(a).astype(np.intp), np.ravel(b).astype(np.intp)

        def flat(x, dtype=np.float64):
            x = np.asarray(x, dtype=dtype)
            return np.ascontiguousarray(x if x.shape == a.shape else np.broadcast_to(x, a.shape))

        R = flat(self._stored(np.broadcast_to(R, a.shape)), self.lo.dtype)
        if self.compact:
            kernels.put_symmetric(self.lo, a, b, R)
            kernels.put_symmetric(self.B, a, b, flat(B))
            kernels.mark_symmetric(self.exact, a, b)
        else:  # one compiled call for the five tables
            kernels.store_exact(self.lo, self.B, self.kc, self.gu, self.exact, a, b, R,
                                flat(B), flat(kc), flat(gu))
        return R

    def _price_held(self, r, l, C, price):
        """DR and J of exactly priced pairs (r, l): from the stored values, or,
        compact, priced again (the same values: `_values` is deterministic)."""
        if self.compact:
            B, kc, gu = self._values(r, l)
            return self._price(r, l, B, kc, gu, C, price)
        return self._price(r, l, self.B[r, l], self.kc[r, l], self.gu[r, l], C, price)

    def _rank_compact(self, r, l, C, price):
        """A compact table's exactly priced pairs (r, l) that could be the best:
        ``(dr, J, ii, jj)`` of those re-priced exactly, every pair whose lower bound
        of DR (from the float32 ``R`` and ``B``: DR grows with ``R`` and shrinks with
        ``B`` for both built-in costs) is at most the best exact DR among them."""
        # A pair may come twice (from both its rows): priced twice, picked once.
        a, b = np.minimum(r, l), np.maximum(r, l)
        R = np.maximum(self.lo[a, b].astype(np.float64) * (1.0 - 1e-9), 0.0)
        B = self.B[a, b].astype(np.float64)
        B_lo, B_hi = B - np.abs(B) * _F32_REL, B + np.abs(B) * _F32_REL
        # ‖f_i + f_j‖² = E + B² for the sum residual: a lower bound (the paper's cost
        # does not read it).
        B2 = np.where((B_lo <= 0.0) & (B_hi >= 0.0), 0.0, np.minimum(B_lo ** 2, B_hi ** 2))
        cap = self.cache.capacity
        A = cap[a] ** 2 + cap[b] ** 2
        nss = (R + B2) * (1.0 - 1e-12)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            lower = price(A, B_hi, C - cap[a] - cap[b], nss, self.p_init[b])[1]
        lower = np.where(np.isnan(lower), -np.inf, lower)
        # The HINTS smallest bounds priced first give a best; then every pair whose
        # bound is at most that best (the final best can only be lower).
        first = (np.argpartition(lower, HINTS - 1)[:HINTS] if lower.size > HINTS
                 else np.arange(lower.size))
        dr, J = self._price(a[first], b[first], *self._values(a[first], b[first]), C, price)
        best = float(np.nanmin(dr, initial=np.inf))
        more = lower <= best
        more[first] = False
        rest = np.flatnonzero(more)
        out = [(dr, J, a[first], b[first])]
        if rest.size:
            dr, J = self._price(a[rest], b[rest], *self._values(a[rest], b[rest]), C, price)
            out.append((dr, J, a[rest], b[rest]))
        return tuple(np.concatenate(x) for x in zip(*out))

    def _on_merge(self, i: int, ok: np.ndarray) -> None:
        """Slot `i` holds a merged parent: its pairs' bounds anew, none exact."""
        cols = np.flatnonzero(ok)
        cols = cols[cols != i]
        D = np.full(self.n, np.inf)
        if cols.size:
            D[cols] = self._stored(self._distance_row(i, cols)[0])
        kernels.reset_cross(self.lo, self.exact, self.rowlo, int(i), D)

    def _select(self, C, n_live, ok, price, cutoff, rows_ok):
        """`select` on a dense table: the pairs whose bound could beat the best are
        priced exactly (each once until a neuron changes), then all that could win
        are ranked. Same selection as the exhaustive scan."""
        if (ok & ~self._ok_seen).any():  # a neuron came back: its rows' bounds anew
            self.rowlo[:] = -np.inf
        self._ok_seen = ok.copy()
        f = self._factor(n_live)
        t = self._t_max(C, ok)
        best = float(cutoff)
        # An upper bound first, to tighten the cut: the best pairs of the last
        # selection still live and exact (their pair values have not changed).
        hi, hj = self._hint
        live = ok[hi] & ok[hj] & self.exact[hi, hj]
        if live.any():
            hi, hj = hi[live], hj[live]
            dr = self._price_held(hi, hj, C, price)[0]
            best = min(best, float(np.min(dr)))
        while not best < np.inf:
            # Nothing to compare with: the pair of smallest bound, priced exactly.
            rl = np.where(ok, self.rowlo, np.inf)
            r0 = int(np.argmin(rl))
            if rl[r0] == np.inf:
                return None
            row = np.where(ok, self.lo[r0], np.inf)
            l0 = int(np.argmin(row))
            if row[l0] == np.inf:  # a stale row bound: no live partner
                self.rowlo[r0] = np.inf
                continue
            r, l = np.array([r0]), np.array([l0])
            if not self.exact[r0, l0]:
                self._price_exact(r, l)
            best = float(self._price_held(r, l, C, price)[0][0])
            if not best < np.inf:
                return None
        cut = self._r_cut(best, f, t)
        rows = np.flatnonzero(ok & (self.rowlo <= cut))
        # x ≤ cut ⇔ x ≤ cut rounded down, for float32 x.
        r, l, rest = kernels.dense_scan(self.lo, ok, rows, self._stored(cut))
        new = ~self.exact[r, l]
        if new.any():
            self._price_exact(r[new], l[new])  # exact now: tighter row bounds, fewer rows later
        keep = kernels.tighten_rows(self.lo, self.rowlo, rows, rest, r, l, cut)
        r, l = r[keep], l[keep]
        if not r.size:
            return None
        if self.compact:
            dr, J, ii, jj = self._rank_compact(r, l, C, price)
        else:
            dr, J = self._price(r, l, self.B[r, l], self.kc[r, l], self.gu[r, l], C, price)
            ii, jj = np.minimum(r, l), np.maximum(r, l)
        finite = np.isfinite(dr)
        if not finite.any():
            return None
        dr, J, ii, jj = dr[finite], J[finite], ii[finite], jj[finite]
        # The smallest (DR, i, j), and the HINTS best pairs; no full sort.
        tie = np.flatnonzero(dr == dr.min())
        k = tie[np.lexsort((jj[tie], ii[tie]))[0]] if tie.size > 1 else tie[0]
        top = np.argpartition(dr, HINTS - 1)[:HINTS] if dr.size > HINTS else np.arange(dr.size)
        self._hint = ii[top], jj[top]
        if self._estimates:  # the pairs `leading_pairs` offers for exact re-pricing
            lead = (np.argpartition(dr, 4 * HINTS - 1)[:4 * HINTS] if dr.size > 4 * HINTS
                    else np.arange(dr.size))
            self._last = (ii[lead], dr[lead], jj[lead])
        if not dr[k] < cutoff:
            return None
        return float(dr[k]), float(J[k]), int(ii[k]), int(jj[k])

    def _store_refined(self, ii, jj, B, kc, gu, R) -> None:
        # The pairs' entries, both ways; a row's bound may go down.
        R = self._store_dense(ii, jj, B, kc, gu, R)
        np.minimum.at(self.rowlo, ii, R)
        np.minimum.at(self.rowlo, jj, R)
