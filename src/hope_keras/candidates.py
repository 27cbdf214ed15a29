"""Bounded merge candidates of a ``"neurons"`` group: the engine's pair table.

A greedy step needs the group's cheapest merge, and every pair's cost moves when the
group's live capacity ``C`` changes (at every step in the group). Rescanning all
n²/2 pairs per step does not scale to wide layers, so each neuron keeps only its
``k`` best partners, ranked by a quantity that does not depend on ``C``: the merge
residual ``R = 2A − B²`` (``A = ‖f_i‖² + ‖f_j‖²``, ``B`` the merge objective).
Two facts about the paper's merge cost (`hope_keras.costs.j_merge`) make this exact
rather than a heuristic:

* with ``t = 2·C_rem + B``, ``J_merge = n·sqrt(2R / (t² + R))``: increasing in
  ``R``, decreasing in ``t``; and ``B ≤ ‖f_i + f_j‖ ≤ ‖f_i‖ + ‖f_j‖`` (the parent
  direction is a unit vector of the same function space), so
  ``t ≤ 2C − ‖f_i‖`` and ``R ≥ ‖f_i − f_j‖²``. Each row keeps a lower bound
  ``nc`` of ``R`` over the partners it does not hold, hence a lower bound of the
  cost of every pair it does not hold; when that bound could beat the best
  candidate, the row is rescanned in full (O(n) kernel work).
* for fixed pair values, ``J_merge`` only grows when ``C`` shrinks: a row's best
  cost computed at an earlier step (times ``n / n_then`` for the paper's cost) is a
  lower bound of its cost now, so only rows whose bound reaches the best are
  re-priced (lazy evaluation).

So a step touches O(n) bounds and a few rows of ``k`` entries; a merge recomputes
the parent's row against all n neurons (O(n) kernel work, as before) and patches
the rows that hold it. For the built-in costs the table selects exactly the pair an
exhaustive scan selects (same floating-point values, same tie-break: the smallest
``(i, j)``). For other costs it prices the candidates of every row at each step
(no bounds: the result is the best pair among the candidates).

``k=None`` keeps every partner (n × n entries) and prices all of them at every step:
the exhaustive scan, kept for checking.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hope_keras import costs

# Rows per chunk when a table is (re)built: bounds the (rows × n) temporaries.
CHUNK_ROWS = 256
# Safety margin of the bounds (relative): rows within it are priced exactly.
_TOL = 1e-9


class MergeTable:
    """The merge candidates of one group and their lazy per-row bookkeeping.

    Args:
        cache: The group's `hope_keras.cache.GroupCache` (read, never written).
        k: Candidates kept per neuron, or None for every partner (exhaustive).
        bound: How the run's cost moves, for the bounds: ``"paper"``
            (``DR = n·J₁(C)/P``), ``"hope"`` (``DR = J₁(C)``) or None (unknown:
            every candidate is priced at every step, no certificate).
        p_init: The group's static per-slot footprints (the paper's ``P``).
        ok: Which neurons can pair (active, non-zero input vector).
        preselect: Partners priced exactly per row when a table is first built (the
            rest are ranked by the cheap bound ``R ≥ ‖f_i − f_j‖²``).

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.graph import walk
    >>> from hope_keras.neurons import extract_group
    >>> from hope_keras.cache import build_group_cache
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> cache = build_group_cache(extract_group(model, next(iter(walk(model).groups.values()))))
    >>> table = MergeTable(cache, 4, "hope", np.ones(16), np.ones(16, bool))
    >>> table.cand.shape
    (16, 4)
    """

    def __init__(self, cache, k: Optional[int], bound: Optional[str], p_init: np.ndarray,
                 ok: np.ndarray, preselect: Optional[int] = None):
        if bound not in (None, "paper", "hope"):
            raise ValueError(f"bound must be None, 'paper' or 'hope'. Received: bound={bound!r}")
        self.cache = cache
        n = cache.size
        self.n = n
        self.exhaustive = k is None or k >= n - 1
        self.k = n if self.exhaustive else int(k)
        self.bound = None if self.exhaustive else bound
        self.p_init = np.asarray(p_init, dtype=np.float64)
        self.p_max = float(self.p_init.max()) if n else 1.0
        self.preselect = preselect
        self.stamp = np.full(n, -1, dtype=np.int64)  # refresh order (pair orientation)
        self.clock = 0
        self._init_storage()
        self.fill_all(ok)

    # --------------------------------------------------------------- storage
    def _init_storage(self) -> None:
        n, k = self.n, self.k
        if self.exhaustive:
            self.cand = np.broadcast_to(np.arange(n, dtype=np.int32), (n, n))
        else:
            self.cand = np.full((n, k), -1, dtype=np.int32)
        self.B = np.zeros((n, k))
        self.kc = np.zeros((n, k))
        self.gu = np.zeros((n, k))
        self.R = np.full((n, k), np.inf)
        self.nc = np.full(n, np.inf)  # R of every live partner not held is ≥ nc
        self.row_dr = np.full(n, -np.inf)  # best DR among the row's candidates, then
        self.row_C = np.full(n, np.inf)
        self.row_n = np.ones(n)
        self.dirty = np.ones(n, dtype=bool)

    def _orient(self, r, l):
        """(first, second) of each pair: the most recently refreshed neuron first,
        else the smaller index (the order in which its values were computed)."""
        r, l = np.broadcast_arrays(np.asarray(r, dtype=np.intp), np.asarray(l, dtype=np.intp))
        sr, sl = self.stamp[r], self.stamp[l]
        r_first = (sr > sl) | ((sr == sl) & (r < l))
        return np.where(r_first, r, l), np.where(r_first, l, r)

    def _values(self, r, l):
        first, second = self._orient(r, l)
        pv = self.cache.pair_values(first.ravel(), second.ravel())
        shape = first.shape
        return (pv.B.reshape(shape), pv.k_cross.reshape(shape), pv.gram_u.reshape(shape))

    def _residual(self, r, l, B):
        cap = self.cache.capacity
        return 2.0 * (cap[r] ** 2 + cap[l] ** 2) - B * B

    # ------------------------------------------------------------- building
    def fill_all(self, ok: np.ndarray) -> None:
        """(Re)builds every row from the cache (all pair values recomputed)."""
        n = self.n
        self.stamp[:] = -1
        self._init_storage()
        for start in range(0, n, CHUNK_ROWS):
            rows = np.arange(start, min(n, start + CHUNK_ROWS))
            if self.exhaustive:
                cols = np.broadcast_to(np.arange(n), (rows.size, n))
                B, kc, gu = self._values(rows[:, None], cols)
                self.B[rows], self.kc[rows], self.gu[rows] = B, kc, gu
                self.R[rows] = self._residual(rows[:, None], cols, B)
            else:
                self._fill_rows(rows, ok, preselect=True)

    def _fill_rows(self, rows: np.ndarray, ok: np.ndarray, preselect: bool = False):
        """Chooses the candidates of `rows` among all their partners.

        Returns the exact pair values ``(B, kc, gu, R)`` of `rows` × all neurons
        (R = inf for pairs that cannot merge) when every pair was priced exactly,
        else None (``preselect``: only the best partners by the cheap bound were).
        """
        n, k = self.n, self.k
        rows = np.asarray(rows, dtype=np.intp)
        cols = np.arange(n)
        valid = ok[None, :] & ok[rows, None] & (cols[None, :] != rows[:, None])
        m = max(self.preselect, k + 1) if (preselect and self.preselect) else None
        if m is not None and m < n - 1 and self.cache.kernel == "approx":
            # Cheap lower bound of R for every pair; exact values for the best m.
            D = self._distance(rows, valid)
            idx = np.argpartition(D, m, axis=1)
            sel = idx[:, :m]
            # R of every partner left out is ≥ the smallest D left out.
            rest = np.take_along_axis(D, idx[:, m:m + 1], axis=1)[:, 0]
            vsel = np.take_along_axis(valid, sel, axis=1)
            exact_all = False
        else:
            sel = np.broadcast_to(cols, (rows.size, n))
            vsel = valid
            rest = np.full(rows.size, np.inf)
            exact_all = True
        B, kc, gu = self._values(rows[:, None], sel)
        R = np.where(vsel, self._residual(rows[:, None], sel, B), np.inf)
        kk = min(k, sel.shape[1])
        order = np.lexsort((sel, R), axis=1)  # smallest R first, ties by index
        top = order[:, :kk]
        pick = np.take_along_axis(R, top, axis=1)
        self.cand[rows] = -1
        self.R[rows] = np.inf
        self.cand[rows, :kk] = np.where(np.isfinite(pick),
                                        np.take_along_axis(sel, top, axis=1), -1)
        self.B[rows, :kk] = np.take_along_axis(B, top, axis=1)
        self.kc[rows, :kk] = np.take_along_axis(kc, top, axis=1)
        self.gu[rows, :kk] = np.take_along_axis(gu, top, axis=1)
        self.R[rows, :kk] = pick
        nxt = (np.take_along_axis(R, order[:, kk:kk + 1], axis=1)[:, 0]
               if order.shape[1] > kk else np.full(rows.size, np.inf))
        self.nc[rows] = np.minimum(nxt, rest)
        self.dirty[rows] = True
        return (B, kc, gu, R) if exact_all else None

    def _distance(self, rows, valid):
        """A lower bound of R for rows × all: ‖f_i − f_j‖² minus a rounding margin
        (inf for invalid pairs)."""
        c = self.cache
        n = self.n
        a = np.repeat(rows, n)
        b = np.tile(np.arange(n), rows.size)
        pv = c.pair_values(a, b, with_B=False)
        cap = c.capacity
        A = cap[a] ** 2 + cap[b] ** 2
        cross = 2.0 * pv.k_cross * pv.gram_u
        D = A - cross - _TOL * (A + np.abs(cross)) - 1e-300
        return np.where(valid, D.reshape(rows.size, n), np.inf)

    # ------------------------------------------------------------- updates
    def on_merge(self, i: int, ok: np.ndarray) -> None:
        """Slot `i` now holds a merged parent (its partner was removed)."""
        self.clock += 1
        self.stamp[i] = self.clock
        n = self.n
        if self.exhaustive:
            cols = np.arange(n)
            B, kc, gu = self._values(np.full(n, i), cols)
            R = self._residual(np.full(n, i), cols, B)
            for arr, val in ((self.B, B), (self.kc, kc), (self.gu, gu), (self.R, R)):
                arr[i, :] = val
                arr[:, i] = val
            return
        full = self._fill_rows(np.array([i]), ok)
        if full is None:  # pragma: no cover (rescans are exact)
            raise AssertionError("a parent's row must be priced exactly")
        B, kc, gu, R = (x[0] for x in full)
        others = ok.copy()
        others[i] = False
        # Rows that hold the parent: new values.
        hold_r, hold_p = np.nonzero((self.cand == i) & others[:, None])
        self.B[hold_r, hold_p] = B[hold_r]
        self.kc[hold_r, hold_p] = kc[hold_r]
        self.gu[hold_r, hold_p] = gu[hold_r]
        self.R[hold_r, hold_p] = R[hold_r]
        self.dirty[hold_r] = True
        # Rows that do not hold it: insert it where it beats their bound.
        holds = np.zeros(n, dtype=bool)
        holds[hold_r] = True
        rows = np.flatnonzero(others & ~holds & (R < self.nc))
        if rows.size:
            cand = self.cand[rows]
            live = (cand >= 0) & ok[np.maximum(cand, 0)]
            Rr = np.where(live, self.R[rows], np.inf)
            free = ~live
            slot = np.where(free.any(axis=1), np.argmax(free, axis=1), np.argmax(Rr, axis=1))
            evicted = np.where(free.any(axis=1), np.inf, Rr[np.arange(rows.size), slot])
            # Evict only a worse candidate; otherwise the parent stays out and
            # lowers the row's bound.
            insert = evicted > R[rows]
            ins, out = rows[insert], rows[~insert]
            s = slot[insert]
            self.nc[ins] = np.minimum(self.nc[ins], evicted[insert])
            self.cand[ins, s] = i
            self.B[ins, s], self.kc[ins, s], self.gu[ins, s] = B[ins], kc[ins], gu[ins]
            self.R[ins, s] = R[ins]
            self.dirty[ins] = True
            self.nc[out] = np.minimum(self.nc[out], R[out])

    # ------------------------------------------------------------ selection
    def _price_rows(self, rows, C, n_live, ok, price):
        """Prices the candidates of `rows`: per row (DR, J, partner), tie → smallest
        partner."""
        cap = self.cache.capacity
        cand = self.cand[rows]
        valid = (cand >= 0) & ok[np.maximum(cand, 0)] & (cand != rows[:, None])
        r = np.broadcast_to(rows[:, None], cand.shape)[valid]
        l = cand[valid]
        ii, jj = np.minimum(r, l), np.maximum(r, l)
        A = cap[ii] ** 2 + cap[jj] ** 2
        nss = A + 2.0 * self.kc[rows][valid] * self.gu[rows][valid]
        J, dr = price(A, self.B[rows][valid], C - cap[ii] - cap[jj], nss, self.p_init[jj])
        DR = np.full(cand.shape, np.inf)
        JJ = np.zeros(cand.shape)
        DR[valid] = dr
        JJ[valid] = J
        best = DR.min(axis=1)
        tie = (DR == best[:, None]) & np.isfinite(DR)
        partner = np.where(tie, cand, np.iinfo(np.int32).max)
        pos = np.argmin(partner, axis=1)
        at = np.arange(rows.size)
        self.row_dr[rows] = best
        self.row_C[rows] = C
        self.row_n[rows] = n_live
        self.dirty[rows] = False
        return best, JJ[at, pos], np.where(np.isfinite(best), cand[at, pos], -1)

    def _price_full(self, rows, C, n_live, ok, price):
        """Prices every partner of `rows` exactly (and refills their candidates):
        per row (DR, J, partner), tie → smallest partner."""
        B, kc, gu, R = self._fill_rows(rows, ok)
        cap = self.cache.capacity
        n = self.n
        cols = np.broadcast_to(np.arange(n), (rows.size, n))
        valid = np.isfinite(R)
        r = np.broadcast_to(rows[:, None], cols.shape)[valid]
        l = cols[valid]
        ii, jj = np.minimum(r, l), np.maximum(r, l)
        A = cap[ii] ** 2 + cap[jj] ** 2
        nss = A + 2.0 * kc[valid] * gu[valid]
        J, dr = price(A, B[valid], C - cap[ii] - cap[jj], nss, self.p_init[jj])
        DR = np.full(cols.shape, np.inf)
        JJ = np.zeros(cols.shape)
        DR[valid] = dr
        JJ[valid] = J
        best = DR.min(axis=1)
        pos = np.argmax(DR == best[:, None], axis=1)  # columns ascend: smallest partner
        at = np.arange(rows.size)
        return best, JJ[at, pos], np.where(np.isfinite(best), pos, -1)

    def _lazy_bounds(self, C, n_live, ok):
        lb = self.row_dr.copy()
        if self.bound == "paper":
            lb = lb * (n_live / self.row_n)
        lb = lb * (1.0 - _TOL) - 1e-300
        stale = self.dirty | (C > self.row_C)
        lb[stale] = -np.inf
        lb[~ok] = np.inf
        return lb

    def _nc_bounds(self, C, n_live, ok):
        """Lower bound of DR over the partners each row does not hold."""
        cap = self.cache.capacity
        x_max = float(cap[ok].max()) if ok.any() else 0.0
        t = np.maximum(2.0 * C - cap, 2.0 * costs.FLOOR + cap + x_max) * (1.0 + _TOL)
        R = np.maximum(self.nc, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            J1 = np.sqrt(np.where(np.isinf(R), 2.0, 2.0 * R / (t * t + R)))
        J1 = np.where(np.isnan(J1), 0.0, J1) * (1.0 - _TOL)
        if self.bound == "paper":
            lb = n_live * J1 / self.p_max
        else:
            lb = J1
        lb = np.where(np.isinf(self.nc), np.inf, lb)
        lb[~ok] = np.inf
        return lb

    def select(self, C: float, n_live: int, ok: np.ndarray, price: Callable):
        """The group's cheapest merge: ``(DR, J, i, j)`` with ``i < j``, or None.

        Args:
            C: The group's live capacity.
            n_live: Its live neuron count.
            ok: Which neurons can pair now.
            price: ``price(A, B, c_rem, norm_sum_sq, P) -> (J, DR)`` arrays, the
                run's cost.
        """
        rows_ok = np.flatnonzero(ok)
        if rows_ok.size < 2:
            return None
        if self.bound is None:  # exhaustive, or a cost without bounds
            dr, J, part = self._price_rows(rows_ok, C, n_live, ok, price)
            return _pick(rows_ok, dr, J, part)
        lb = self._lazy_bounds(C, n_live, ok)
        lbn = self._nc_bounds(C, n_live, ok)
        n = self.n
        fresh = np.zeros(n, dtype=bool)
        val = np.full(n, np.inf)
        Jv = np.zeros(n)
        part = np.full(n, -1)
        todo = np.isneginf(lb)
        todo[int(np.argmin(lb))] = True
        todo &= ok
        best = np.inf
        while True:
            rows = np.flatnonzero(todo)
            if rows.size:
                val[rows], Jv[rows], part[rows] = self._price_rows(rows, C, n_live, ok, price)
                fresh[rows] = True
                best = float(val[fresh].min())
            # Rows whose partners outside the table could reach the best: priced in
            # full (this also refills their candidates).
            full = np.flatnonzero((lbn <= best) & (lbn < np.inf))
            if full.size:
                val[full], Jv[full], part[full] = self._price_full(full, C, n_live, ok, price)
                fresh[full] = True
                lbn[full] = np.inf
                best = float(val[fresh].min())
            todo = ~fresh & (lb <= best) & (lb < np.inf)
            if not todo.any() and not ((lbn <= best) & (lbn < np.inf)).any():
                break
        rows = np.flatnonzero(fresh)
        return _pick(rows, val[rows], Jv[rows], part[rows])


def _pick(rows, dr, J, part):
    """The smallest DR; ties → the lexicographically smallest pair (i < j)."""
    finite = np.isfinite(dr) & (part >= 0)
    if not finite.any():
        return None
    rows, dr, J, part = rows[finite], dr[finite], J[finite], part[finite]
    ii, jj = np.minimum(rows, part), np.maximum(rows, part)
    k = np.lexsort((jj, ii, dr))[0]
    return float(dr[k]), float(J[k]), int(ii[k]), int(jj[k])
