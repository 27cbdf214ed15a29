"""Pair values and lower bounds shared by every merge table (`PairBounds`).

A pair's merge residual (the paper's ``R = 2A − B²`` or the sum-scale ``E``) needs
its exact ``B``; its lower bound (`PairBounds._distance`) needs only Gram entries.
With ``t_max`` (an upper bound of the cost's denominator) a residual's bound gives a
bound of the pair's cost, and a cost to beat gives the residual a pair needs
(`PairBounds._r_cut`). The theory is in `hope_keras.search.candidates`.
"""

from __future__ import annotations

import numpy as np

from hope_keras.scoring import costs

# Rows per chunk for (rows × n) temporaries.
CHUNK_ROWS = 256
# Relative safety margin of the bounds: pairs within it are priced exactly.
TOL = 1e-9
# Pairs per chunk of an uncertified fill ((rows × n) float64 temporaries of 4 MB):
# filling 2048 rows of an 8192-wide group took 0.89 s against 1.06 s with 2M-pair
# chunks and 1.43 s with 32k-pair ones.
FILL_PAIRS = 1 << 19


def nonzero2(mask):
    """``np.nonzero`` of a 2-D mask (row-major order, the same arrays), through the
    flat indices: several times faster on the engine's (rows × n) masks."""
    flat = np.flatnonzero(mask)
    return np.divmod(flat, mask.shape[1])


def row_min(pos, l, dr, J, nrows):
    """Per row (flat pairs grouped by `pos`, in any order): the smallest DR, ties →
    the smallest partner `l` (its first pair); (inf, 0, -1) for rows without a
    finite one. Unbuffered reductions, not a sort: O(pairs)."""
    best = np.full(nrows, np.inf)
    Jb = np.zeros(nrows)
    part = np.full(nrows, -1)
    if pos.size:
        d = np.where(np.isnan(dr), np.inf, dr)
        np.minimum.at(best, pos, d)
        tie = (d == best[pos]) & (d < np.inf)
        none = np.iinfo(np.int64).max
        p = np.full(nrows, none, dtype=np.int64)
        np.minimum.at(p, pos[tie], l[tie])
        sel = np.flatnonzero(tie & (l == p[pos]))[::-1]  # the last write wins: the first pair
        Jb[pos[sel]] = J[sel]
        part = np.where(p == none, -1, p)
    return best, Jb, part


def pick_best(rows, dr, J, part):
    """The smallest DR; ties → the lexicographically smallest pair (i < j)."""
    finite = np.isfinite(dr) & (part >= 0)
    if not finite.any():
        return None
    rows, dr, J, part = rows[finite], dr[finite], J[finite], part[finite]
    ii, jj = np.minimum(rows, part), np.maximum(rows, part)
    k = np.lexsort((jj, ii, dr))[0]
    return float(dr[k]), float(J[k]), int(ii[k]), int(jj[k])


class PairBounds:
    """Pair values, residuals and their lower bounds of a table over
    ``self.cache`` (mixed into `hope_keras.search.candidates.MergeTable`)."""

    def _orient(self, r, l):
        """(first, second) of each pair: the most recently refreshed neuron first,
        else the smaller index (the order in which its values are computed)."""
        r, l = np.broadcast_arrays(np.asarray(r, dtype=np.intp), np.asarray(l, dtype=np.intp))
        sr, sl = self.stamp[r], self.stamp[l]
        r_first = (sr > sl) | ((sr == sl) & (r < l))
        return np.where(r_first, r, l), np.where(r_first, l, r)

    def _values(self, r, l):
        first, second = self._orient(r, l)
        pv = self.cache.pair_values(first.ravel(), second.ravel())
        shape = first.shape
        B, kc, gu = pv.B.reshape(shape), pv.k_cross.reshape(shape), pv.gram_u.reshape(shape)
        if self._exact.size:  # pairs re-priced from exact entries override the estimates
            hit, vals = self._exact_lookup(np.minimum(first, second).ravel(),
                                           np.maximum(first, second).ravel())
            if hit.any():
                B, kc, gu = (np.where(hit, vals[:, k], x.ravel()).reshape(shape)
                             for k, x in enumerate((B, kc, gu)))
        return B, kc, gu

    def _residual(self, r, l, B, cross):
        """The row order: ``R = 2A − B²`` (paper) or ``E = A + 2·cross − B²``."""
        cap = self.cache.capacity
        A = cap[r] ** 2 + cap[l] ** 2
        if self.sum_residual:
            return A + 2.0 * cross - B * B
        return 2.0 * A - B * B

    def _cos(self, r, l, cross):
        """⟨f_r, f_l⟩ / (‖f_r‖ ‖f_l‖) (0 when a capacity is 0), with a margin."""
        cap = self.cache.capacity
        den = cap[r] * cap[l]
        cos = np.where(den > 0, cross / np.where(den > 0, den, 1.0), 0.0)
        return np.minimum(cos, 1.0) + 1e-6

    def _distance(self, r, l):
        """A lower bound of R (minus a rounding margin), K(r,l) and ⟨u_r, u_l⟩,
        elementwise.

        ``B`` is the projection of ``f_r + f_l`` on a parent ``e_v ⊗ û`` (unit
        feature, unit output), so ``B² ≤`` the largest squared singular value of the
        rank-2 operator ``e_r ⊗ w_r + e_l ⊗ w_l`` (``w = sqrt(K)·u``): with
        ``κ = K(r,l)/sqrt(K(r,r)K(l,l))`` and ``s = ⟨w_r, w_l⟩``, that is
        ``λ = T/2 + sqrt(T²/4 − (1 − κ²)(‖w_r‖²‖w_l‖² − s²))``, ``T = ‖f_r + f_l‖²``
        (at most ``T``: so ``R ≥ 2A − λ ≥ ‖f_r − f_l‖²``).
        """
        shape = np.shape(r)
        r, l = np.ravel(r), np.ravel(l)
        pv = self.cache.pair_values(r, l, with_B=False)
        D = self._distance_from(r, l, pv.k_cross, pv.gram_u)
        return D.reshape(shape), pv.k_cross.reshape(shape), pv.gram_u.reshape(shape)

    def _distance_row(self, i: int, cols):
        """`_distance` of the pairs ``(i, cols)``: one Gram row against every
        neuron (`pair_grid`, no copy of a sketch's columns), the same values."""
        _, kc, gu = self.cache.pair_grid(np.array([i]))
        kc, gu = kc[0, cols], gu[0, cols]
        return self._distance_from(i, cols, kc, gu), kc, gu

    def _distance_from(self, r, l, kc, gu):
        """`_distance`'s bound from the pairs' K(r,l) and ⟨u_r, u_l⟩ (broadcast)."""
        c = self.cache
        cap, ks = c.capacity, c.k_self
        a, b = cap[r] ** 2, cap[l] ** 2
        A = a + b
        T = A + 2.0 * kc * gu
        kk = np.sqrt(np.maximum(ks[r], 0.0) * np.maximum(ks[l], 0.0))
        kappa = np.minimum(np.where(kk > 0, kc / np.where(kk > 0, kk, 1.0), 0.0), 1.0)
        w = kk * gu
        det = (1.0 - kappa * kappa) * np.maximum(a * b - w * w, 0.0)
        lam = 0.5 * T + np.sqrt(np.maximum(0.25 * T * T - det, 0.0))
        # E = T − B² ≥ T − λ (the smaller squared singular value).
        return (T if self.sum_residual else 2.0 * A) - lam - 1e-7 * A - 1e-300

    def _sv_bound(self, rows, b):
        """The singular-value bound of R (see `_distance`) for row neurons `rows`
        and partners of squared capacity `b` (broadcast), with κ ≤ nkap and
        |cos(u)| ≤ ncu."""
        a = self.cache.capacity[rows, None] ** 2
        k = np.clip(self.nkap[rows, None], 0.0, 1.0)
        c = np.clip(self.ncu[rows, None], 0.0, 1.0)
        T = a + b + 2.0 * k * c * np.sqrt(a * b)
        det = (1.0 - k * k) * (1.0 - c * c) * a * b
        lam = 0.5 * T + np.sqrt(np.maximum(0.25 * T * T - det, 0.0))
        # λ is largest and T − λ smallest at the corner κ = nkap, cos(u) = ncu.
        return (T if self.sum_residual else 2.0 * (a + b)) - lam - 1e-7 * (a + b) - 1e-300

    def _price(self, r, l, B, kc, gu, C, price):
        """DR and J of the pairs (r, l) under the run's cost (i = min, j = max)."""
        cap = self.cache.capacity
        ii, jj = np.minimum(r, l), np.maximum(r, l)
        A = cap[ii] ** 2 + cap[jj] ** 2
        nss = A + 2.0 * kc * gu
        J, dr = price(A, B, C - cap[ii] - cap[jj], nss, self.p_init[jj])
        return np.broadcast_to(dr, ii.shape), np.broadcast_to(J, ii.shape)

    def _factor(self, n_live):
        """DR ≥ this × the width-free cost J₁ of any pair (``n/P_max`` for the
        paper's cost), times the run's rank factor."""
        return self.scale * (n_live / self.p_max if self.bound == "paper" else 1.0)

    def _t_max(self, C, ok):
        """Per row, an upper bound of the cost's denominator over its partners:
        ``t = 2·C_rem + B`` (paper), ``C_rem + B`` (sum residual); ``B ≤ x_i + x_j``."""
        cap = self.cache.capacity
        x_max = float(cap[ok].max()) if ok.any() else 0.0
        if self.sum_residual:
            return np.maximum(C, costs.FLOOR + cap + x_max) * (1.0 + TOL)
        return np.maximum(2.0 * C - cap, 2.0 * costs.FLOOR + cap + x_max) * (1.0 + TOL)

    def _j_lower(self, R, t):
        """A lower bound of J₁ from a lower bound of the residual and ``t_max``."""
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if self.sum_residual:
                J1 = np.sqrt(R) / t
            else:
                J1 = np.sqrt(2.0 * R / (t * t + R))
        return np.where(np.isnan(J1), 0.0, J1) * (1.0 - TOL)

    def _r_cut(self, best, f, t):
        """Per row, the residual below which a pair's DR could be below `best`, for
        the rank factor `f` and the denominators' upper bounds `t` (see `_t_max`)."""
        c = best / f / (1.0 - TOL)
        with np.errstate(over="ignore", invalid="ignore"):
            if self.sum_residual:  # J₁ = sqrt(E)/t' < c needs E < c²t'²
                return c * c * t * t * (1.0 + TOL)
            # J₁ = sqrt(2R/(t² + R)) < c needs R < c²t²/(2 − c²)
            return np.where(c * c < 2.0, c * c * t * t / (2.0 - c * c) * (1.0 + TOL), np.inf)
