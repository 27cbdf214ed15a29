"""`TopKRows`: the best pair among each row's k partners (``merge_search="top_k"``).

Every row is filled up front with its ``k`` partners of smallest residual (the
``preselect`` of smallest bound priced exactly), refilled once under a quarter of
them is left, and a merged parent is priced only against its ``preselect`` nearest
and the rows that hold its slot. The selection is the best pair held, not
necessarily the exhaustive scan's. Rows are *oriented*
(`hope_keras.search.candidates.ORIENTED`): a row holds only partners of larger capacity, so
each pair has one row, its smaller neuron's (why: `hope_keras.search.candidates`). A refill
bounds only a few likely partners (`TopKRows._refill_rows`).
"""

from __future__ import annotations

import numpy as np

from hope_keras.search.merge_tables.bounds import FILL_PAIRS, nonzero2
from hope_keras.search.merge_tables.rows import PartnerRows

# Uncertified refills ("top_k"): the smallest-capacity live neurons every refilled
# row is priced against, besides its partners' partners; the refill looks at all n
# columns unless that subset is at most 1/REFILL_SUBSET_RATIO of the live neurons.
REFILL_HUBS = 64
REFILL_SUBSET_RATIO = 8


class TopKRows(PartnerRows):
    """Rows of the best partners found when filled (``certify=False``, or a cost
    without bounds and ``k`` partners)."""

    def _start_rows(self, ok) -> None:
        n = self.n
        # Refill checks: the table state each row was last checked at.
        self._seen, self._state = (None, -1), 0
        self._checked = {True: np.full(n, -1), False: np.full(n, -1)}
        self._fill_rows(np.flatnonzero(ok), ok)

    def _count_up(self, rows, live):
        """Per row of `rows` (live neurons), how many live neurons it may hold."""
        cap = self.cache.capacity
        rank = np.empty(live.size, dtype=np.intp)
        rank[np.lexsort((live, cap[live]))] = np.arange(live.size)
        return live.size - 1 - rank[np.searchsorted(live, rows)]

    def _fill_rows(self, rows, ok) -> None:
        """Uncertified fill: each row's ``preselect`` partners of smallest bound
        (`_distance`, Gram entries only) are priced exactly and the ``k`` of smallest
        residual kept; ``nc`` keeps a lower bound over the rest."""
        n = self.n
        m = min(self.preselect, n)
        step = max(1, FILL_PAIRS // max(n, 1))
        rows = np.asarray(rows, dtype=np.intp)
        if self.oriented:
            # Rows in capacity order, each chunk against the live neurons from its
            # smallest row up: the pairs a row may hold, about half of all.
            live = np.flatnonzero(ok)
            up = live[np.lexsort((live, self.cache.capacity[live]))]
            rank = np.full(n, -1)
            rank[up] = np.arange(up.size)
            rows = rows[np.argsort(rank[rows], kind="stable")]
        for s0 in range(0, len(rows), step):
            rr = rows[s0:s0 + step]
            if self.oriented:
                cols = up[max(int(rank[rr].min()), 0):]
                valid = self._holds_up(rr[:, None], cols[None, :])
            else:
                cols = np.arange(n)
                valid = ok[None, :] & (cols[None, :] != rr[:, None])
            _, kc, gu = self.cache.pair_grid(rr, cols)
            D = np.where(valid, self._distance_from(rr[:, None], cols[None, :], kc, gu),
                         np.inf)
            self._keep_best(rr, np.broadcast_to(cols, D.shape), D, m)

    def _keep_best(self, rr, cols, D, m, rest=None) -> None:
        """Rows `rr` get the `k` partners of smallest exact residual among their `m`
        columns of smallest bound `D` (rows × columns, inf: not a partner); ``nc``
        becomes a lower bound over the rest (`rest`: per row, one over columns
        outside `cols`)."""
        m = min(m, D.shape[1])
        top = np.argpartition(D, m - 1, axis=1)[:, :m]
        finite = np.isfinite(np.take_along_axis(D, top, axis=1))
        pr, pc = nonzero2(finite)
        r, l = rr[pr], np.take_along_axis(cols, top, axis=1)[pr, pc]
        B, kc, gu = self._values(r, l)
        R = self._residual(r, l, B, kc * gu)
        _, keep = self._store_rows(rr, pr, r, l, B, kc, gu, R)
        nxt = np.full(rr.size, np.inf)
        np.minimum.at(nxt, pr[~keep], R[~keep])
        np.put_along_axis(D, top, np.inf, axis=1)  # D is the caller's temporary
        nc = np.minimum(nxt, np.maximum(D.min(axis=1), 0.0))
        self.nc[rr] = nc if rest is None else np.minimum(nc, rest)
        self.dirty[rr] = True

    def _refill_rows(self, rows, ok) -> None:
        """Uncertified refill: like `_fill_rows`, but each row's bounds are computed
        only for a few likely partners, not all n: the neurons its partners hold
        (dead ones included) and theirs (two hops, as in NN-descent), and, unless
        the table is oriented, the `REFILL_HUBS` live neurons of smallest capacity
        (the partners many rows share; their loss is what depletes rows together).
        All n when that subset is not much smaller (narrow groups), or holds none
        of a row's possible partners."""
        live = np.flatnonzero(ok)
        k = self.cand.shape[1]
        # Oriented, a row holds only larger partners: the smallest are not theirs.
        h = 0 if self.oriented else min(REFILL_HUBS, live.size)
        width = k + k * k + h
        if width * REFILL_SUBSET_RATIO > live.size:
            self._fill_rows(rows, ok)
            return
        cap = self.cache.capacity
        hubs = live[np.argpartition(cap[live], h - 1)[:h]] if h else live[:0]
        # (rows × width) pairs per chunk: a sketched cache gathers 2 × r floats per pair.
        step = max(1, (1 << 16) // width)
        for s0 in range(0, len(rows), step):
            rr = np.asarray(rows[s0:s0 + step], dtype=np.intp)
            hop1 = self.cand[rr]
            hop2 = np.where((hop1 >= 0)[:, :, None], self.cand[np.maximum(hop1, 0)], -1)
            cols = np.concatenate([hop1, hop2.reshape(rr.size, k * k),
                                   np.broadcast_to(hubs, (rr.size, h))], axis=1)
            cols = np.sort(cols, axis=1)
            valid = (cols >= 0) & ok[np.maximum(cols, 0)] & (cols != rr[:, None])
            valid[:, 1:] &= cols[:, 1:] != cols[:, :-1]  # each partner once
            up = live.size - 1
            if self.oriented:
                valid &= self._holds_up(rr[:, None], np.maximum(cols, 0))
                up = self._count_up(rr, live)
                # Rows that may hold none of the subset but have partners: all n.
                none = ~valid.any(axis=1) & (up > 0)
                if none.any():
                    self._fill_rows(rr[none], ok)
                    rr, cols, valid, up = rr[~none], cols[~none], valid[~none], up[~none]
                    if not rr.size:
                        continue
            pr, pc = nonzero2(valid)
            D = np.full(cols.shape, np.inf)
            D[pr, pc] = self._distance(rr[pr], cols[pr, pc])[0]
            # Live partners never looked at: nothing is known of them (R ≥ 0).
            rest = np.where(valid.sum(axis=1) < up, 0.0, np.inf)
            self._keep_best(rr, cols, D, min(self.preselect, self.n), rest)

    def _table_state(self, ok) -> int:
        """A number that changes whenever the live mask or a merge may have changed
        which partners the rows hold live."""
        seen, clock = self._seen
        if seen is None or clock != self.clock or not np.array_equal(seen, ok):
            self._state += 1
            self._seen = (ok.copy(), self.clock)
        return self._state

    def _refill_depleted(self, ok, rows=None, few: bool = True) -> None:
        """Uncertified tables: refills those of `rows` (default: all) left with under
        a quarter of their partners (``few``) or with none (``few=False``). Rows
        already checked since the last change of `ok` or merge are skipped (a step
        selects several times: one check each would cost O(n·k) every time)."""
        state = self._table_state(ok)
        mark = self._checked[bool(few)]
        if rows is None:
            rows = np.flatnonzero(mark != state)
            cand = self.cand if rows.size == self.n else self.cand[rows]
        else:
            rows = np.asarray(rows)
            rows = rows[mark[rows] != state]
            cand = self.cand[rows]
        if not rows.size:
            return
        mark[rows] = state
        # Live partners per row: ok with a False appended, so that -1 (no partner)
        # reads it; np.take and a product, several times faster than a masked sum.
        held = np.take(np.append(ok, False), cand)
        live = (held.astype(np.float32) @ np.ones(held.shape[1], np.float32)).astype(np.int64)
        want = min(self.k, int(ok.sum()) - 1)
        low = (4 * live < want) if few else (live == 0)
        due = ok[rows] & low & (self.nc[rows] < np.inf)
        if self.oriented:
            # A row that held every larger partner and lost them all: refilled if a
            # neuron grew past it since (a merged parent), that is, unless it is the
            # live neuron of largest (capacity, index), which has none to hold.
            stuck = np.flatnonzero(ok[rows] & (live == 0) & ~(self.nc[rows] < np.inf))
            if stuck.size:
                lv = np.flatnonzero(ok)
                cap = self.cache.capacity[lv]
                top = lv[np.flatnonzero(cap == cap.max())[-1]]
                due[stuck] = rows[stuck] != top
        rows = rows[due]
        if rows.size:
            self._refill_rows(rows, ok)

    def _select(self, C, n_live, ok, price, cutoff, rows_ok):
        # Rows without partners cannot be priced: refill them now.
        self._refill_depleted(ok, few=self.bound is None)
        if self.bound is None:  # a cost without bounds: every row priced
            return self._select_all(C, n_live, ok, price, cutoff, rows_ok)
        return self._select_bounded(C, n_live, ok, price, cutoff)

    def _before_pricing(self, ok, rows) -> None:
        # The rows priced get their lost partners back.
        self._refill_depleted(ok, rows)
