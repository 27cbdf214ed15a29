"""`PartnerRows`: each neuron's merge partners in a row of ``k`` (every partner when
``k`` is None: the exhaustive scan, kept for checking).

Rows are ordered by the merge residual, which does not depend on the group's live
capacity ``C``; a row's best cost at an earlier step bounds its cost now (lazy
evaluation, `PartnerRows._lazy_bounds`), so a selection re-prices only the rows that
could hold the best. How rows are filled and which partners outside them are looked
for is the search's: `hope_keras.search.merge_tables.certified.CertifiedRows` and
`hope_keras.search.merge_tables.top_k.TopKRows`. A merged parent's row is recomputed against
all n neurons and patched into the rows that hold it or that it enters.
"""

from __future__ import annotations

import numpy as np

from hope_keras.search.candidates import MergeTable
from hope_keras.search.merge_tables.bounds import TOL, CHUNK_ROWS, nonzero2, pick_best, row_min


class PartnerRows(MergeTable):
    """Rows of merge partners; as such (``k=None`` or ``k ≥ n − 1``: no bounds),
    every partner of every row is priced at each selection."""

    def _fill(self, ok) -> None:
        """(Re)starts the rows: every pair value is recomputed."""
        n, k = self.n, self.k
        if self.exhaustive:
            self.cand = np.broadcast_to(np.arange(n, dtype=np.int32), (n, n))
        else:
            self.cand = np.full((n, k), -1, dtype=np.int32)
        self.B = np.zeros((n, k))
        self.kc = np.zeros((n, k))
        self.gu = np.zeros((n, k))
        self.R = np.full((n, k), np.inf)
        # Over the live partners a row does not hold: R ≥ nc, cosine ≤ ncos.
        self.nc = np.full(n, np.inf if self.exhaustive else 0.0)
        self.ncos = np.full(n, -1.0)
        # ... and their kernel ratio K(r,l)/sqrt(K(r,r)K(l,l)) ≤ nkap, |cos(u_r, u_l)| ≤ ncu.
        self.nkap = np.ones(n)
        self.ncu = np.ones(n)
        self.row_dr = np.full(n, -np.inf)  # the row's best DR when last priced, at
        self.row_C = np.full(n, np.inf)  # this C
        self.row_n = np.ones(n)  # and this live count
        self.row_g = np.ones(n)  # and this rank factor (DR per J)
        self.dirty = np.ones(n, dtype=bool)  # pair values changed since
        self._start_rows(ok)

    def _start_rows(self, ok) -> None:
        """Fills the rows: here every partner, priced."""
        n = self.n
        for start in range(0, n, CHUNK_ROWS):
            rows = np.arange(start, min(n, start + CHUNK_ROWS))
            cols = np.broadcast_to(np.arange(n), (rows.size, n))
            B, kc, gu = self._values(rows[:, None], cols)
            self.B[rows], self.kc[rows], self.gu[rows] = B, kc, gu
            self.R[rows] = self._residual(rows[:, None], cols, B, kc * gu)

    def _note_out(self, r, l, kc, gu) -> None:
        """Pairs (r, l) now outside row r's table: its bounds must cover them (only
        certified selections read those bounds)."""
        if np.size(r) == 0 or not self.certify:
            return
        r, l, kc, gu = np.broadcast_arrays(np.asarray(r), np.asarray(l), kc, gu)
        np.maximum.at(self.ncos, r, self._cos(r, l, kc * gu))
        ks = self.cache.k_self
        kk = np.sqrt(np.maximum(ks[r], 0.0) * np.maximum(ks[l], 0.0))
        kap = np.where(kk > 0, kc / np.where(kk > 0, kk, 1.0), 0.0)
        un = self.cache.u_norm
        den = un[r] * un[l]
        cu = np.where(den > 0, np.abs(gu) / np.where(den > 0, den, 1.0), 0.0)
        np.maximum.at(self.nkap, r, np.minimum(kap + 1e-6, 1.0))
        np.maximum.at(self.ncu, r, np.minimum(cu + 1e-6, 1.0))

    def _holds_up(self, r, l):
        """Whether row `r` of an oriented table may hold partner `l`: `l`'s capacity
        is larger (ties: its index is), so each pair has one row (broadcast)."""
        cap = self.cache.capacity
        return (cap[l] > cap[r]) | ((cap[l] == cap[r]) & (l > r))

    def _store_rows(self, rows, pr, r, l, B, kc, gu, R):
        """Makes the priced pairs (r = rows[pr], l) the candidates of `rows`: per row
        the `k` of smallest R (ties by partner index). Returns (rank, kept)."""
        order = np.lexsort((l, R, pr))
        counts = np.bincount(pr, minlength=len(rows))
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        rank = np.empty(order.size, dtype=np.int64)
        rank[order] = np.arange(order.size) - np.repeat(starts, counts)
        keep = rank < self.k
        self.cand[rows] = -1
        self.R[rows] = np.inf
        at = (r[keep], rank[keep])
        self.cand[at] = l[keep]
        self.B[at], self.kc[at], self.gu[at], self.R[at] = B[keep], kc[keep], gu[keep], R[keep]
        return rank, keep

    def _price_rows(self, rows, C, n_live, ok, price):
        """Prices the candidates of `rows`: per row (DR, J, partner), ties → the
        smallest partner."""
        cand = self.cand[rows]
        valid = (cand >= 0) & ok[np.maximum(cand, 0)] & (cand != rows[:, None])
        pr, pc = nonzero2(valid)
        l = cand[pr, pc]
        r = rows[pr]
        dr, J = self._price(r, l, self.B[r, pc], self.kc[r, pc], self.gu[r, pc], C, price)
        best, Jb, part = row_min(pr, l, dr, J, rows.size)
        self.row_dr[rows] = best
        self.row_C[rows] = C
        self.row_n[rows] = n_live
        self.row_g[rows] = self.scale
        self.dirty[rows] = False
        return best, Jb, part

    def _lazy_bounds(self, C, n_live, ok):
        lb = self.row_dr * (self.scale / self.row_g)
        if self.bound == "paper":
            lb = lb * (n_live / self.row_n)
        lb = lb * (1.0 - TOL) - 1e-300
        lb[self.dirty | (C > self.row_C)] = -np.inf
        lb[~ok] = np.inf
        return lb

    def _on_merge(self, i: int, ok: np.ndarray) -> None:
        n = self.n
        if self.exhaustive:
            cols = np.arange(n)
            B, kc, gu = self._values(np.full(n, i), cols)
            R = self._residual(np.full(n, i), cols, B, kc * gu)
            for arr, val in ((self.B, B), (self.kc, kc), (self.gu, gu), (self.R, R)):
                arr[i, :] = val
                arr[:, i] = val
            return
        others = ok.copy()
        others[i] = False
        hold_r, hold_p = nonzero2((self.cand == i) & others[:, None])
        self.dirty[hold_r] = True
        self.cand[i] = -1
        self.R[i] = np.inf
        self.nc[i], self.ncos[i], self.nkap[i], self.ncu[i] = np.inf, -1.0, 0.0, 0.0
        self.dirty[i] = True
        if not ok[i] or not others.any():
            self.cand[hold_r, hold_p] = -1
            return
        holds = np.zeros(n, dtype=bool)
        holds[hold_r] = True
        # The parent against every neuron: its bound, exact values where needed
        # (rows that hold it or that it might enter, and its own best partners).
        cols = np.flatnonzero(others)
        if self.cache.kernel == "approx":
            D, kc0, gu0 = self._distance_row(i, cols)
        else:
            B0, kc0, gu0 = self._values(np.full(cols.size, i), cols)
            D = self._residual(i, cols, B0, kc0 * gu0)
        # Certified: every row whose bound the parent might beat is priced exactly.
        # Uncertified: the rows that hold it and its `preselect` nearest by bound
        # (oriented: that many among the partners its row may hold, and among the
        # rows that may hold it).
        need = holds[cols] | (D < self.nc[cols]) if self.certify else holds[cols]
        up = self._holds_up(i, cols) if self.oriented else np.ones(cols.size, dtype=bool)
        m = min(self.preselect, cols.size)
        sel = need.copy()
        if self.oriented:
            for side in (up, ~up):
                key = np.where(need | ~side, np.inf, D)
                top = np.argpartition(key, m - 1)[:m] if m else np.array([], int)
                sel[top[np.isfinite(key[top])]] = True
        elif m:
            sel[np.argpartition(np.where(need, -np.inf, D), m - 1)[:m]] = True
        l = cols[sel]
        B, kc, gu = self._values(np.full(l.size, i), l)
        R = self._residual(i, l, B, kc * gu)
        # Its own row: the k smallest R; the bounds over the rest.
        own = np.flatnonzero(up[sel])
        order = own[np.lexsort((l[own], R[own]))]
        kk = min(self.k, order.size)
        keep, drop = order[:kk], order[kk:]
        self.cand[i, :kk] = l[keep]
        self.B[i, :kk], self.kc[i, :kk], self.gu[i, :kk], self.R[i, :kk] = (
            B[keep], kc[keep], gu[keep], R[keep])
        rest = D[~sel & up]
        self.nc[i] = min(float(R[drop].min()) if drop.size else np.inf,
                         float(rest.min()) if rest.size else np.inf)
        self._note_out(np.full(drop.size, i), l[drop], kc[drop], gu[drop])
        self._note_out(np.full(int((~sel).sum()), i), cols[~sel], kc0[~sel], gu0[~sel])
        # Rows that hold it: new values.
        pos_of = np.full(n, -1)
        pos_of[l] = np.arange(l.size)
        p = pos_of[hold_r]
        self.B[hold_r, hold_p], self.kc[hold_r, hold_p] = B[p], kc[p]
        self.gu[hold_r, hold_p], self.R[hold_r, hold_p] = gu[p], R[p]
        # Rows that do not: insert it where it beats their bound.
        rows = np.flatnonzero(others & ~holds & (pos_of >= 0))
        if self.oriented:
            rows = rows[self._holds_up(rows, i)]
        if self.certify:
            rows = rows[R[pos_of[rows]] < self.nc[rows]]
        if rows.size:
            Ri = R[pos_of[rows]]
            cand = self.cand[rows]
            live = (cand >= 0) & ok[np.maximum(cand, 0)]
            Rr = np.where(live, self.R[rows], np.inf)
            free = ~live
            has_free = free.any(axis=1)
            slot = np.where(has_free, np.argmax(free, axis=1), np.argmax(Rr, axis=1))
            evicted = np.where(has_free, np.inf, Rr[np.arange(rows.size), slot])
            # Evict only a worse candidate; otherwise the parent stays out and
            # lowers the row's bound.
            insert = evicted > Ri
            ins, out, s = rows[insert], rows[~insert], slot[insert]
            gone = np.isfinite(evicted[insert])
            if gone.any():
                g, sg = ins[gone], s[gone]
                self._note_out(g, self.cand[g, sg], self.kc[g, sg], self.gu[g, sg])
            self.nc[ins] = np.minimum(self.nc[ins], evicted[insert])
            q = pos_of[ins]
            self.cand[ins, s] = i
            self.B[ins, s], self.kc[ins, s], self.gu[ins, s] = B[q], kc[q], gu[q]
            self.R[ins, s] = R[q]
            self.dirty[ins] = True
            self.nc[out] = np.minimum(self.nc[out], Ri[~insert])
        if not self.certify:
            return
        # Rows the parent did not enter: it is one of the partners they leave out.
        left = others & ~(self.cand == i).any(axis=1)
        lc = np.flatnonzero(left)
        at = np.searchsorted(cols, lc)
        self._note_out(lc, np.full(lc.size, i), kc0[at], gu0[at])

    def _select(self, C, n_live, ok, price, cutoff, rows_ok):
        return self._select_all(C, n_live, ok, price, cutoff, rows_ok)

    def _select_all(self, C, n_live, ok, price, cutoff, rows_ok):
        """Every row priced (exhaustive, or a cost without bounds)."""
        dr, J, part = self._price_rows(rows_ok, C, n_live, ok, price)
        self._last = (rows_ok, dr, part)
        found = pick_best(rows_ok, dr, J, part)
        return found if found is not None and found[0] < cutoff else None

    def _select_bounded(self, C, n_live, ok, price, cutoff):
        """The rows whose lazy bound could beat the best are priced, cheapest bound
        first; with the search's hooks for the partners the rows do not hold."""
        lb = self._lazy_bounds(C, n_live, ok)
        lbn = self._outside_bounds(C, n_live, ok)
        n = self.n
        fresh = np.zeros(n, dtype=bool)
        val = np.full(n, np.inf)
        Jv = np.zeros(n)
        part = np.full(n, -1)
        best = float(cutoff)
        todo = np.isneginf(lb)
        r0 = int(np.argmin(lb))
        if lb[r0] <= best:
            todo[r0] = True
        while True:
            rows = np.flatnonzero(todo)
            if rows.size:
                self._before_pricing(ok, rows)
                val[rows], Jv[rows], part[rows] = self._price_rows(rows, C, n_live, ok, price)
                fresh[rows] = True
                best = min(best, float(val[rows].min()))
            best = self._scan_outside(lbn, best, C, n_live, ok, price, val, Jv, part, fresh)
            todo = ~fresh & (lb <= best) & (lb < np.inf)
            if not todo.any() and not self._outside_open(lbn, best):
                break
        rows = np.flatnonzero(fresh)
        self._last = (rows, val[rows], part[rows])
        found = pick_best(rows, val[rows], Jv[rows], part[rows])
        return found if found is not None and found[0] < cutoff else None

    # The searches' hooks (here: no partner outside the rows is looked for).
    def _outside_bounds(self, C, n_live, ok):
        """Per row, a lower bound of DR over the partners it does not hold."""
        return np.full(self.n, np.inf)

    def _before_pricing(self, ok, rows) -> None:
        """Called with the rows about to be priced."""

    def _scan_outside(self, lbn, best, C, n_live, ok, price, val, Jv, part, fresh):
        """Prices the partners outside rows whose bound `lbn` reaches `best`;
        returns the best DR found."""
        return best

    def _outside_open(self, lbn, best) -> bool:
        """Whether partners outside the rows could still beat `best`."""
        return False

    def _store_refined(self, ii, jj, B, kc, gu, R) -> None:
        rows, part = np.concatenate([ii, jj]), np.concatenate([jj, ii])
        pr, pc = nonzero2(self.cand[rows] == part[:, None])
        r, q = rows[pr], pr % ii.size
        self.B[r, pc], self.kc[r, pc], self.gu[r, pc], self.R[r, pc] = B[q], kc[q], gu[q], R[q]
        self.dirty[rows] = True
