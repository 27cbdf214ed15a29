"""Exact re-pricing of sketched pairs (`ExactRefinement`).

In a sketched group (`hope_keras.scoring.cache.SketchCache`) a table's pair values are
estimates; the engine re-prices the pairs it is about to select from exact Gram
entries (`hope_keras.search.merge_search.MergeSearch.best`), and the table uses those values from
then on, until one of the pair's neurons changes.
"""

from __future__ import annotations

import numpy as np


class ExactStore:
    """Pairs re-priced from exact entries, by key ``i·n + j`` (``i < j``): the
    neurons' stamps then, and ``(B, K(i,j), ⟨u_i, u_j⟩)``. Two sorted levels: new
    keys enter a small one, merged into the large one once it holds `RECENT` keys,
    so that a batch of re-pricings does not copy every entry (one `np.insert` on
    the whole store cost 2 ms a step late in a 4 × 8192 MLP's run)."""

    RECENT = 1024

    def __init__(self):
        self.levels = [self._empty(), self._empty()]  # [large, recent]
        self.live = 0  # entries after the last clean-up

    @staticmethod
    def _empty():
        return np.zeros(0, np.int64), np.zeros((0, 2), np.int64), np.zeros((0, 3))

    @property
    def size(self) -> int:
        return sum(k.size for k, _, _ in self.levels)

    @staticmethod
    def _find(k, keys):
        if not k.size:
            return np.zeros(keys.size, np.intp), np.zeros(keys.size, dtype=bool)
        pos = np.minimum(np.searchsorted(k, keys), k.size - 1)
        return pos, k[pos] == keys

    def get(self, keys, stamp_a, stamp_b):
        """(hit, values): whether each key is held with these stamps, its values."""
        hit = np.zeros(keys.size, dtype=bool)
        vals = np.zeros((keys.size, 3))
        for k, st, v in self.levels:
            pos, found = self._find(k, keys)
            h = found & (st[pos, 0] == stamp_a) & (st[pos, 1] == stamp_b) if k.size else found
            vals[h] = v[pos[h]]
            hit |= h
        return hit, vals

    def put(self, keys, stamps, vals) -> None:
        """Stores distinct `keys` (overwriting a key held, whatever its stamps)."""
        new = np.ones(keys.size, dtype=bool)
        for k, st, v in self.levels:
            pos, found = self._find(k, keys)
            found &= new
            st[pos[found]], v[pos[found]] = stamps[found], vals[found]
            new &= ~found
        idx = np.flatnonzero(new)
        if idx.size:
            idx = idx[np.argsort(keys[idx], kind="stable")]
            self.levels[1] = self._inserted(self.levels[1], (keys[idx], stamps[idx], vals[idx]))
            if self.levels[1][0].size >= self.RECENT:
                self._merge()

    @staticmethod
    def _inserted(into, new):
        at = np.searchsorted(into[0], new[0])
        return tuple(np.insert(a, at, b, axis=0) for a, b in zip(into, new))

    def _merge(self) -> None:
        self.levels = [self._inserted(*self.levels), self._empty()]

    def keep(self, mask_of) -> None:
        """Keeps the entries ``mask_of(keys, stamps)`` selects (one level after)."""
        self._merge()
        k, st, v = self.levels[0]
        m = mask_of(k, st)
        self.levels[0] = (k[m], st[m], v[m])
        self.live = int(m.sum())


class ExactRefinement:
    """Pairs re-priced from exact entries (mixed into
    `hope_keras.search.candidates.MergeTable`; each table stores them with
    ``_store_refined``)."""

    def _exact_lookup(self, a, b):
        """Whether each pair (a, b), a < b (1-D), was re-priced from exact entries
        with its neurons unchanged since, and those values ``(B, K(i,j), ⟨u_i, u_j⟩)``."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        return self._exact.get(a * self.n + b, self.stamp[a], self.stamp[b])

    def is_exact(self, i: int, j: int) -> bool:
        """Whether pair (i, j) was re-priced by `refine` since either neuron changed."""
        if not self._exact.size:
            return False
        return bool(self._exact_lookup(np.array([i]), np.array([j]))[0][0])

    def leading_pairs(self, m: int):
        """Up to `m` pairs ``(i, j)``, ``i < j``, not yet re-priced by `refine`: the
        cheapest of the last `select`, one per row priced, cheapest first (ties by
        pair). Re-pricing a few at once saves selections (sketched caches)."""
        if self._last is None:
            return np.zeros(0, np.intp), np.zeros(0, np.intp)
        rows, val, part = self._last
        keep = np.isfinite(val) & (part >= 0)
        rows, val, part = rows[keep], val[keep], part[keep]
        ii, jj = np.minimum(rows, part), np.maximum(rows, part)
        order = np.lexsort((jj, ii, val))
        key = ii[order].astype(np.int64) * self.n + jj[order]
        _, first = np.unique(key, return_index=True)
        order = order[np.sort(first)]
        ii, jj = ii[order], jj[order]
        if self._exact.size:
            fresh = ~self._exact_lookup(ii, jj)[0]
            ii, jj = ii[fresh], jj[fresh]
        return ii[:m], jj[:m]

    def refine(self, i: int, j: int, pv) -> None:
        """Replaces the values of pair (i, j), ``i < j`` (estimates of a
        `hope_keras.scoring.cache.SketchCache`), by `pv`: its exact
        `hope_keras.scoring.cache.PairValues`, used from now on wherever the pair is priced."""
        self.refine_pairs([i], [j], pv)

    def refine_pairs(self, ii, jj, pv) -> None:
        """`refine` of the distinct pairs ``(ii[p], jj[p])``, ``ii < jj``, at once;
        `pv`: their `hope_keras.scoring.cache.PairValues`, one entry per pair (as
        `hope_keras.scoring.cache.SketchCache.exact_pairs` gives them)."""
        ii, jj = np.asarray(ii, dtype=np.intp), np.asarray(jj, dtype=np.intp)
        B, kc, gu = (np.asarray(x, dtype=np.float64).reshape(ii.shape)
                     for x in (pv.B, pv.k_cross, pv.gram_u))
        R = self._residual(ii, jj, B, kc * gu)
        store = self._exact
        if store.size > 2 * store.live + 64:  # drop stale entries, amortised
            def current(key, st):
                a, b = key // self.n, key % self.n
                keep = (st[:, 0] == self.stamp[a]) & (st[:, 1] == self.stamp[b])
                return keep & self._ok[a] & self._ok[b] if self._ok is not None else keep

            store.keep(current)
        store.put(ii.astype(np.int64) * self.n + jj,
                  np.stack([self.stamp[ii], self.stamp[jj]], axis=1),
                  np.stack([B, kc, gu], axis=1))
        self._store_refined(ii, jj, B, kc, gu, R)

    def _store_refined(self, ii, jj, B, kc, gu, R) -> None:
        """The table's entries of the refined pairs ``(ii, jj)`` take these values."""
        raise NotImplementedError
