"""`CertifiedRows`: k-partner rows whose selection is the exhaustive scan's.

Each row keeps, over the partners it does not hold, a lower bound ``nc`` of the
residual and upper bounds of their cosines (``ncos``, ``nkap``, ``ncu``); with the
smallest live capacity they bound the cost of every such pair at the current ``C``.
A row whose bound could beat the best merge found (or the group's best prune) is
rescanned (`CertifiedRows._rescan`): its partners are priced exactly where their
own bound allows it, and its candidates and bounds are refilled. The theory is in
`hope_keras.search.candidates`.
"""

from __future__ import annotations

import numpy as np

from hope_keras.activations import kernels
from hope_keras.search.merge_tables.bounds import TOL, CHUNK_ROWS, nonzero2, row_min
from hope_keras.search.merge_tables.rows import PartnerRows

# A rescan prices the partners whose bound of R is below HEADROOM × what the
# current best needs (HEADROOM 4: a merge cost up to about twice the best).
HEADROOM = 4.0


class CertifiedRows(PartnerRows):
    """Rows with bounds over the partners they leave out (``certify=True``)."""

    def _start_rows(self, ok) -> None:
        """Empty rows (``nc = 0``), and the cosine bounds from the Gram matrices:
        rows are priced only when they could matter."""
        n = self.n
        for start in range(0, n, CHUNK_ROWS):
            rows = np.arange(start, min(n, start + CHUNK_ROWS))
            c = self.cache
            self.ncos[rows] = self._output_cosine(rows, ok)
            self.ncu[rows] = np.minimum(c.max_cosine(rows, ok, "u", True), 1.0) + 1e-6
            if c.kernel == "approx":  # κ = I(ρ̃), ρ̃ increasing in |cos(w_r, w_l)|
                cw = np.minimum(c.max_cosine(rows, ok, "w", True) + 1e-6, 1.0)
                ratio = np.where(c.wnorm > 0, c.gamma / np.where(c.wnorm > 0, c.wnorm, 1.0),
                                 0.0)
                rmax = float(ratio[ok].max()) if ok.any() else 0.0
                rt = kernels.warped_correlation(cw, c.gamma[rows], c.wnorm[rows], rmax, 1.0)
                self.nkap[rows] = np.minimum(kernels.arccos_I(rt) + 1e-6, 1.0)

    def _output_cosine(self, rows, ok):
        """Per row, max over partners of the cosine of the output vectors (an upper
        bound of the function-space cosine), with a margin."""
        return np.minimum(self.cache.max_cosine(rows, ok), 1.0) + 1e-6

    def _q(self, rows):
        """(rows, n): the lower bound of R that (nc, ncos, nkap, ncu) give for every
        partner the row does not hold."""
        cap = self.cache.capacity
        x, y = cap[rows, None], cap[None, :]
        sv = np.maximum(self.nc[rows, None], self._sv_bound(rows, y * y))
        if self.sum_residual:  # ‖f_i − f_j‖² bounds R, not E
            return sv
        Q = x * x + y * y - 2.0 * self.ncos[rows, None] * x * y
        Q = Q - 4.0 * TOL * (x * x + y * y) - 1e-300
        return np.maximum(Q, sv)

    def _below_by_capacity(self, rows, ok):
        """The sum residual's `_q` as a test: ``below(cut)`` is the (rows × n) mask
        of live partners whose bound may be under ``cut`` (per row). ``T − λ`` grows
        with the partner's squared capacity ``b`` (`_nc_residual`), so they are the
        row's smallest-capacity partners, found by bisection over the sorted
        capacities (O(log n) bound evaluations per row, not O(n)); the rounding
        margin ``1e-7·(a + b)``, which shrinks as ``b`` grows, is taken at the
        largest ``b``: a superset of ``_q < cut``, never a partner less."""
        live = np.flatnonzero(ok)
        b_all = self.cache.capacity ** 2
        order = live[np.argsort(b_all[live], kind="stable")]
        bs = b_all[order]
        rank = np.full(self.n, self.n, dtype=np.int64)
        rank[order] = np.arange(order.size)
        b_max = float(bs[-1]) if bs.size else 0.0
        nc = self.nc[rows]

        def below(cut):
            lo = np.zeros(rows.size, dtype=np.int64)  # first sorted partner at or over cut
            hi = np.full(rows.size, bs.size, dtype=np.int64)
            while True:
                open_ = lo < hi
                if not open_.any():
                    break
                mid = (lo + hi) // 2
                b = bs[np.minimum(mid, bs.size - 1)]
                f = self._sv_bound(rows, b[:, None])[:, 0] + 1e-7 * (b - b_max)
                under = open_ & (f < cut)
                lo = np.where(under, mid + 1, lo)
                hi = np.where(open_ & ~under, mid, hi)
            lo = np.where(nc < cut, lo, 0)  # the row's nc bound rules out every partner
            return rank[None, :] < lo[:, None]
        return below

    def _rescan(self, rows, ok, r_cut, headroom: float = 1.0):
        """Prices exactly, for each row, every partner it does not hold whose bound
        is below ``r_cut`` (per row), then refills its candidates (the k smallest R
        among those and the ones it held) and bounds.

        Returns:
            Flat arrays ``(r, l, B, kc, gu, R)``: the row's old and new candidates.
        """
        n, k = self.n, self.k
        rows = np.asarray(rows, dtype=np.intp)
        cols = np.arange(n)
        valid = ok[None, :] & ok[rows, None] & (cols[None, :] != rows[:, None])
        held = self.cand[rows]
        hp, hc = nonzero2((held >= 0) & ok[np.maximum(held, 0)])
        is_cand = np.zeros(valid.shape, dtype=bool)
        is_cand[hp, held[hp, hc]] = True
        # Partners left out whose capacity bound is below the cut; then their pair
        # bound; exact values for those still below.
        if self.sum_residual:  # the partners under a cut are a prefix by capacity
            below_cut = self._below_by_capacity(rows, ok)
        else:
            q = self._q(rows)

            def below_cut(cut):
                return q < cut[:, None]
        if headroom > 1.0:
            # Headroom where it is cheap: the cut grows to headroom × the need for the
            # rows where that adds few partners, so the row is not rescanned at every
            # step while the best cost creeps up.
            more = (valid & ~is_cand & below_cut(r_cut * headroom)).sum(axis=1)
            r_cut = np.where(more <= 4 * self.preselect, r_cut * headroom, r_cut)
        sp, sl = nonzero2(valid & ~is_cand & below_cut(r_cut))
        if sp.size:
            D = self._distance(rows[sp], sl)[0]
            below = D < r_cut[sp]
            sp, sl = sp[below], sl[below]
        B, kc, gu = self._values(rows[sp], sl)
        hr = rows[hp]
        pr = np.concatenate([hp, sp])
        r = rows[pr]
        l = np.concatenate([held[hp, hc], sl])
        B = np.concatenate([self.B[hr, hc], B])
        kc = np.concatenate([self.kc[hr, hc], kc])
        gu = np.concatenate([self.gu[hr, hc], gu])
        R = np.concatenate([self.R[hr, hc], self._residual(rows[sp], sl, B[hp.size:],
                                                            kc[hp.size:] * gu[hp.size:])])
        rank, keep = self._store_rows(rows, pr, r, l, B, kc, gu, R)
        nxt = np.full(rows.size, np.inf)
        kth = rank == k
        nxt[pr[kth]] = R[kth]
        # Partners not priced: R ≥ their bound ≥ r_cut (and ≥ the old nc).
        self.nc[rows] = np.minimum(nxt, np.maximum(self.nc[rows], r_cut))
        drop = ~keep
        if drop.any():
            self._note_out(r[drop], l[drop], kc[drop], gu[drop])
        self.dirty[rows] = True
        return r, l, B, kc, gu, R

    def _price_rescan(self, rows, C, n_live, ok, price, best):
        """Rescans `rows` and prices every partner that could cost less than `best`:
        per row (DR, J, partner)."""
        r_cut = self._r_cut(best, self._factor(n_live), self._t_max(C, ok)[rows])
        # Rows in chunks: a rescan's temporaries are (rows × n) (≤ 16 MB each here).
        step = max(1, (1 << 21) // max(self.n, 1))
        out = []
        for s0 in range(0, rows.size, step):
            rr = rows[s0:s0 + step]
            r, l, B, kc, gu, R = self._rescan(rr, ok, r_cut[s0:s0 + step], HEADROOM)
            pos = np.searchsorted(rr, r)
            dr, J = self._price(r, l, B, kc, gu, C, price)
            out.append(row_min(pos, l, dr, J, rr.size))
        return tuple(np.concatenate(x) for x in zip(*out))

    def _nc_residual(self, ok):
        """Per row, a lower bound of R over the live partners it does not hold:
        ``x_r² + x_l² − 2·ncos·x_r·x_l`` minimised over capacities ``x_l`` at least
        the smallest live one, or ``nc``, whichever is larger."""
        cap = self.cache.capacity
        x_min = float(cap[ok].min()) if ok.any() else 0.0
        if self.sum_residual:  # T − λ grows with the partner's capacity
            sv = self._sv_bound(np.arange(self.n), x_min * x_min)[:, 0]
            return np.maximum(self.nc, sv)
        rho = np.minimum(self.ncos, 1.0)
        xm = np.maximum(x_min, np.maximum(rho, 0.0) * cap)
        Q = cap * cap + xm * xm - 2.0 * rho * cap * xm
        Q = Q - 4.0 * TOL * (cap * cap + xm * xm) - 1e-300
        return np.maximum(self.nc, Q)

    def _fine_bounds(self, rows, C, n_live, ok):
        """Per row, a lower bound of DR over the partners it does not hold, from the
        singular-value bound of `_distance` with κ ≤ nkap and |cos(u)| ≤ ncu,
        evaluated at every live partner's capacity (O(n) per row). The bound of R
        is kept in ``nc``: it stays valid while partners die, and a merged parent
        is checked against it (`on_merge`), so a row pays for it once."""
        cap = self.cache.capacity
        live = np.flatnonzero(ok)
        if self.sum_residual:
            out = self._sum_fine_residual(rows, live)
        else:
            b = cap[None, live] ** 2
            out = np.empty(rows.size)
            step = max(1, (1 << 22) // max(live.size, 1))  # (rows × live) temporaries ≤ 32 MB
            for s0 in range(0, rows.size, step):
                rr = rows[s0:s0 + step]
                f = np.where(live[None, :] == rr[:, None], np.inf, self._sv_bound(rr, b))
                out[s0:s0 + step] = f.min(axis=1)
        R = np.maximum(np.maximum(out, self.nc[rows]), 0.0)
        self.nc[rows] = R
        return self._factor(n_live) * self._j_lower(R, self._t_max(C, ok)[rows])

    def _sum_fine_residual(self, rows, live):
        """`_fine_bounds`' minimum over the live partners for the sum residual, in
        O(1) per row: ``T − λ`` grows with the partner's squared capacity ``b``
        (see `_nc_residual`), so its minimum is at the smallest ``b`` other than the
        row's own; only the rounding margin ``1e-7·(a + b)`` shrinks as ``b`` grows,
        so it is taken at the largest ``b``."""
        b = self.cache.capacity[live] ** 2
        if live.size < 2:
            return np.full(rows.size, np.inf)
        two = np.argpartition(b, 1)[:2]
        two = two[np.argsort(b[two], kind="stable")]
        b_row = np.where(rows == live[two[0]], b[two[1]], b[two[0]])
        f = self._sv_bound(rows, b_row[:, None])[:, 0]
        return f - 1e-7 * (float(b.max()) - b_row)

    def _nc_bounds(self, C, n_live, ok):
        """Per row, a lower bound of DR over the partners it does not hold."""
        R = np.maximum(self._nc_residual(ok), 0.0)
        lb = self._factor(n_live) * self._j_lower(R, self._t_max(C, ok))
        lb = np.where(np.isinf(self.nc), np.inf, lb)  # the row holds every partner
        lb[~ok] = np.inf
        return lb

    def _select(self, C, n_live, ok, price, cutoff, rows_ok):
        return self._select_bounded(C, n_live, ok, price, cutoff)

    def _outside_bounds(self, C, n_live, ok):
        return self._nc_bounds(C, n_live, ok)

    def _scan_outside(self, lbn, best, C, n_live, ok, price, val, Jv, part, fresh):
        # Rows whose partners outside the table could reach the best: the finer
        # bound first, then a rescan.
        scan = (lbn <= best) & (lbn < np.inf)
        if scan.any() and best < np.inf:
            rows = np.flatnonzero(scan)
            lb2 = self._fine_bounds(rows, C, n_live, ok)
            lbn[rows] = np.maximum(lbn[rows], lb2)
            scan = (lbn <= best) & (lbn < np.inf)
        if scan.any():
            if best == np.inf:  # nothing to compare with yet: the likeliest row first
                scan[:] = False
                scan[int(np.argmin(lbn))] = True
            rows = np.flatnonzero(scan)
            d, j, p = self._price_rescan(rows, C, n_live, ok, price, best)
            # The rescan priced the row's candidates too.
            val[rows], Jv[rows], part[rows] = d, j, p
            fresh[rows] = True
            lbn[rows] = np.inf
            best = min(best, float(d.min()))
        return best

    def _outside_open(self, lbn, best) -> bool:
        return bool(((lbn <= best) & (lbn < np.inf)).any())
