"""Bounded merge candidates of a ``"neurons"`` group: the engine's pair table.

A greedy step needs the group's cheapest merge, and every pair's cost moves when the
group's live capacity ``C`` changes (at every step in the group). Rescanning all
n²/2 pairs per step does not scale to wide layers, so each neuron keeps at most
``k`` partners, ranked by a quantity that does not depend on ``C``: the merge
residual ``R = 2A − B²`` (``A = ‖f_i‖² + ‖f_j‖²``, ``B`` the merge objective), and
two bounds on the partners it does not hold. Facts about the paper's merge cost
(`hope_keras.costs.j_merge`) make the scan exact rather than a heuristic:

* with ``t = 2·C_rem + B``, ``J_merge = n·sqrt(2R / (t² + R))``: increasing in
  ``R``, decreasing in ``t``;
* ``B ≤ ‖f_i + f_j‖ ≤ ‖f_i‖ + ‖f_j‖`` (the parent direction is a unit vector of the
  same function space), so ``t ≤ 2C − ‖f_i‖`` and
  ``R ≥ ‖f_i − f_j‖² ≥ ‖f_i‖² + ‖f_j‖² − 2·c·‖f_i‖‖f_j‖`` for any ``c`` at least
  the cosine ``⟨f_i, f_j⟩ / (‖f_i‖‖f_j‖)``, itself at most the cosine of the output
  vectors ``u_i, u_j`` (the kernel ratio ``K(i,j)/sqrt(K(i,i)K(j,j))`` is in [0, 1]).

Each row keeps ``nc`` (a lower bound of ``R``) and ``ncos`` (an upper bound of that
cosine) over the partners it does not hold: with the smallest live capacity they
give a lower bound of the cost of every such pair, at the current ``C``. A row
whose bound could beat the best merge found (or the group's best prune) is
rescanned: its partners are priced exactly where their own bound, from their
capacity, allows it, and the row's candidates and bounds are refilled. A table
starts empty (``nc = 0``, ``ncos`` from the Gram matrix of ``u``), so rows are only
priced when they could matter.

The library's default cost (`hope_keras.costs.HopeCost`) prices a merge by the
sum-scale residual ``J = sqrt(E) / (C_rem + B)`` with ``E = ‖f_i + f_j‖² − B²``; its
rows are ordered by ``E`` instead of ``R``. ``E`` is at least the smaller squared
singular value of the rank-2 operator ``f_i + f_j`` (``B²`` is at most the larger
one), which capacities and the bounds ``κ ≤ nkap``, ``|cos(u)| ≤ ncu`` bound from
below; ``C_rem + B ≤ C`` since ``B ≤ ‖f_i‖ + ‖f_j‖``, so ``J ≥ sqrt(E)/C``. The
cosine bound ``R ≥ ‖f_i − f_j‖²`` has no counterpart for ``E`` and is not used.
Both built-in costs rank a merge linearly in ``J`` (``DR = scale·J``, over ``P``
for the paper's; ``scale = 1/sqrt(FLOPs)`` for the default under a FLOPs budget):
`MergeTable.select` takes that factor.

For fixed pair values ``J_merge`` only grows when ``C`` shrinks, so a row's best
cost computed at an earlier step (times ``n / n_then`` for the paper's cost) is a
lower bound of its cost now: only rows whose bound reaches the best are re-priced
(lazy evaluation). A step therefore touches O(n) bounds and a few rows; a merge
recomputes the parent's row against all n neurons in O(n) kernel work and patches
the rows that hold it.

For the built-in costs the table selects exactly the pair an exhaustive scan
selects (same floating-point values, same tie-break: the smallest ``(i, j)``). For
other costs it prices the candidates of every row at each step, without bounds: the
result is the best pair among the candidates. ``k=None`` keeps every partner
(n × n entries) and prices all of them at every step: the exhaustive scan, kept for
checking.

``dense=True`` (the engine's default for groups of up to
`hope_keras.search.DENSE_PAIRS_MAX` neurons) keeps every pair instead: an n × n table
of the residual's lower bound (`MergeTable._distance`, Gram entries only), each entry
replaced by the exact residual the first time its bound could beat the best (and kept
until one of its neurons changes), and per row a lower bound over its live entries. A
step prices only the pairs whose bound is below what the best needs, and ranks only
those whose exact residual is; a merge resets the parent's row and column to bounds.
No pair is priced twice while its neurons stand, which the k-partner rows cannot
promise: where many pairs cost nearly the same, their rescans re-price the pairs they
dropped (ResNet-50 @224 to density 0.5: 12.5 s with 16 partners, 4.7 s dense, the same
trajectory). Tables wider than `DENSE_FLOAT64_MAX` are compact: the bound and ``B``
in float32 (9 bytes a pair); the pairs that pass the bound are re-priced exactly,
cheapest bound of their cost first, until none could beat the best (same selection).

``certify=False`` (the engine's ``merge_search="top_k"``) drops the certificate for
speed: every row is filled up front with its ``k`` partners of smallest residual
(the ``preselect`` of smallest bound priced exactly), refilled once under a quarter
of them is left, and a merged parent is priced only against its ``preselect``
nearest and the rows that hold its slot. The selection is then the best pair held,
not necessarily the exhaustive scan's.

Such a table is *oriented* (`ORIENTED`): a row holds only partners of larger
capacity, so each pair has one row, its smaller neuron's. A neuron of small
capacity is a cheap partner for nearly every neuron (merging it costs little
whatever it joins), so rows free to hold any partner all held the same few: their
``k`` slots said little beyond those, and when those were merged away thousands
of rows emptied at once. A row of the smaller neuron keeps the pair that is the
global minimum (it is that row's cheapest larger partner) and spends its other
slots on distinct partners. The largest live neuron's row is empty: it has no
partner to hold, and it is held by the rows of smaller ones. A refill bounds only
a few likely partners, not all n (`MergeTable._refill_rows`): the row's partners'
partners (two hops, as in NN-descent; unoriented, also the `REFILL_HUBS` live
neurons of smallest capacity, the partners that rows share).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hope_keras import costs, kernels
from hope_keras.cache import SketchCache, sorted_unique

# Rows per chunk for (rows × n) temporaries.
CHUNK_ROWS = 256
# Relative safety margin of the bounds: pairs within it are priced exactly.
_TOL = 1e-9
# A rescan prices the partners whose bound of R is below HEADROOM × what the
# current best needs (HEADROOM 4: a merge cost up to about twice the best).
HEADROOM = 4.0
# Best pairs a dense table re-prices first at the next selection (an upper bound).
HINTS = 8
# Uncertified refills ("top_k"): the smallest-capacity live neurons every refilled
# row is priced against, besides its partners' partners; the refill looks at all n
# columns unless that subset is at most 1/REFILL_SUBSET_RATIO of the live neurons.
REFILL_HUBS = 64
REFILL_SUBSET_RATIO = 8
# Uncertified tables hold each pair in the row of its smaller-capacity neuron only
# (`MergeTable._holds_up`): a neuron of small capacity is a cheap partner for most
# rows, and rows that all held it lost it together (see `MergeTable` for why).
ORIENTED = True
# Pairs per chunk of an uncertified fill ((rows × n) float64 temporaries of 4 MB):
# filling 2048 rows of an 8192-wide group took 0.89 s against 1.06 s with 2M-pair
# chunks and 1.43 s with 32k-pair ones.
FILL_PAIRS = 1 << 19
# Dense tables wider than this are compact: the residual's bound (rounded down) and
# ``B`` (rounded to nearest) in float32, 9 bytes a pair against 33 (a 4096-wide group:
# 144 MB against 528 MB); the pairs that could be selected are re-priced exactly
# (`MergeTable._rank_compact`), so the selection is the same.
DENSE_FLOAT64_MAX = 1024
# Relative error of a float32 ``B`` (rounding to nearest: 2**-24), with a margin.
_F32_REL = 2.0 ** -22


def _nonzero2(mask):
    """``np.nonzero`` of a 2-D mask (row-major order, the same arrays), through the
    flat indices: several times faster on the engine's (rows × n) masks."""
    flat = np.flatnonzero(mask)
    return np.divmod(flat, mask.shape[1])


class _ExactStore:
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


class MergeTable:
    """The merge candidates of one group and their lazy per-row bookkeeping.

    Args:
        cache: The group's `hope_keras.cache.GroupCache` (read, never written).
        k: Candidates kept per neuron, or None for every partner (exhaustive).
        bound: How the run's cost moves, for the bounds: ``"paper"``
            (``DR = scale·n·J₁(C)/P``, rows ordered by ``R``), ``"hope"``
            (``DR = scale·sqrt(E)/(C_rem + B)``, rows ordered by ``E``) or None
            (unknown: every candidate is priced at every step, no bounds).
        p_init: The group's static per-slot footprints (the paper's ``P``).
        ok: Which neurons can pair (active, non-zero input vector).
        preselect: Partners priced exactly when a merged parent's row is filled
            (the rest are ranked by the cheap bound ``R ≥ ‖f_i − f_j‖²``).
        certify: Whether the bounds certify the selection (the exhaustive scan's);
            False: the best pair among the rows' partners (``merge_search="top_k"``).
        dense: Keep every pair (n × n tables, each pair priced once) instead of
            ``k`` partners per row; certified tables with a bound only.

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
    >>> group = next(iter(walk(model).groups.values()))
    >>> cache = build_group_cache(extract_group(model, group))
    >>> table = MergeTable(cache, 4, "hope", np.ones(16), np.ones(16, bool))
    >>> price = lambda A, B, c_rem, nss, P: (costs.j_merge_residual(nss, B, c_rem, 1.0),) * 2
    >>> dr, J, i, j = table.select(cache.layer_capacity(), 16, np.ones(16, bool), price)
    >>> i < j
    True
    """

    def __init__(self, cache, k: Optional[int], bound: Optional[str], p_init: np.ndarray,
                 ok: np.ndarray, preselect: int = 32, certify: bool = True,
                 dense: bool = False):
        if bound not in (None, "paper", "hope"):
            raise ValueError(f"bound must be None, 'paper' or 'hope'. Received: bound={bound!r}")
        self.cache = cache
        n = cache.size
        self.n = n
        self.exhaustive = k is None or k >= n - 1
        self.k = n if self.exhaustive else int(k)
        self.bound = None if self.exhaustive else bound
        # Certified: the bounds make the selection the exhaustive scan's. Otherwise
        # each row holds the k best partners found when it was (re)filled and is
        # refilled once under a quarter of them is left ("top_k"; costs without bounds too).
        self.certify = bool(certify) and self.bound is not None
        # Dense: every pair's lower bound kept, each pair priced once (`_select_dense`).
        self.dense = bool(dense) and self.certify
        # The C-free residual that orders a row: the paper's R = 2A − B², or for the
        # library's cost the sum-scale residual E = ‖f_i + f_j‖² − B².
        self.sum_residual = bound == "hope"
        self.p_init = np.asarray(p_init, dtype=np.float64)
        self.p_max = float(self.p_init.max()) if n else 1.0
        self.preselect = max(int(preselect), self.k + 1)
        self.oriented = ORIENTED and not self.exhaustive and not self.certify
        self.stamp = np.full(n, -1, dtype=np.int64)  # refresh order (pair orientation)
        self.scale = 1.0  # the run's rank factor at the current selection
        self.clock = 0
        self._exact = _ExactStore()  # pairs re-priced from exact entries (sketches)
        self._ok = None  # the live mask of the last selection
        # Pair values are estimates, re-priced exactly by the engine (sketched caches).
        self._estimates = isinstance(cache, SketchCache)
        self._last = None  # its rows priced: (rows, DR, partner)
        self.fill_all(ok)

    # --------------------------------------------------------------- building
    def fill_all(self, ok: np.ndarray) -> None:
        """(Re)starts the table from the cache: every pair value is recomputed."""
        n, k = self.n, self.k
        self.stamp[:] = -1
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
        # Refill checks (uncertified): the table state each row was last checked at.
        self._seen, self._state = (None, -1), 0
        self._checked = {True: np.full(n, -1), False: np.full(n, -1)}
        if self.dense:
            self._fill_dense(ok)
            return
        if not self.exhaustive and not self.certify:
            self._fill_rows(np.flatnonzero(ok), ok)
            return
        for start in range(0, n, CHUNK_ROWS):
            rows = np.arange(start, min(n, start + CHUNK_ROWS))
            if self.exhaustive:
                cols = np.broadcast_to(np.arange(n), (rows.size, n))
                B, kc, gu = self._values(rows[:, None], cols)
                self.B[rows], self.kc[rows], self.gu[rows] = B, kc, gu
                self.R[rows] = self._residual(rows[:, None], cols, B, kc * gu)
            else:
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

    # ------------------------------------------------------------ pair values
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

    def _exact_lookup(self, a, b):
        """Whether each pair (a, b), a < b (1-D), was re-priced from exact entries
        with its neurons unchanged since, and those values ``(B, K(i,j), ⟨u_i, u_j⟩)``."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        return self._exact.get(a * self.n + b, self.stamp[a], self.stamp[b])

    def _residual(self, r, l, B, cross):
        """The row order: ``R = 2A − B²`` (paper) or ``E = A + 2·cross − B²``."""
        cap = self.cache.capacity
        A = cap[r] ** 2 + cap[l] ** 2
        if self.sum_residual:
            return A + 2.0 * cross - B * B
        return 2.0 * A - B * B

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

    def _q(self, rows):
        """(rows, n): the lower bound of R that (nc, ncos, nkap, ncu) give for every
        partner the row does not hold."""
        cap = self.cache.capacity
        x, y = cap[rows, None], cap[None, :]
        sv = np.maximum(self.nc[rows, None], self._sv_bound(rows, y * y))
        if self.sum_residual:  # ‖f_i − f_j‖² bounds R, not E
            return sv
        Q = x * x + y * y - 2.0 * self.ncos[rows, None] * x * y
        Q = Q - 4.0 * _TOL * (x * x + y * y) - 1e-300
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

    # ---------------------------------------------------------------- rescans
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
        hp, hc = _nonzero2((held >= 0) & ok[np.maximum(held, 0)])
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
        sp, sl = _nonzero2(valid & ~is_cand & below_cut(r_cut))
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

    def _holds_up(self, r, l):
        """Whether row `r` of an oriented table may hold partner `l`: `l`'s capacity
        is larger (ties: its index is), so each pair has one row (broadcast)."""
        cap = self.cache.capacity
        return (cap[l] > cap[r]) | ((cap[l] == cap[r]) & (l > r))

    def _count_up(self, rows, live):
        """Per row of `rows` (live neurons), how many live neurons it may hold."""
        cap = self.cache.capacity
        rank = np.empty(live.size, dtype=np.intp)
        rank[np.lexsort((live, cap[live]))] = np.arange(live.size)
        return live.size - 1 - rank[np.searchsorted(live, rows)]

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
        pr, pc = _nonzero2(finite)
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
            pr, pc = _nonzero2(valid)
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
        `hope_keras.cache.SketchCache`), by `pv`: its exact
        `hope_keras.cache.PairValues`, used from now on wherever the pair is priced."""
        self.refine_pairs([i], [j], pv)

    def refine_pairs(self, ii, jj, pv) -> None:
        """`refine` of the distinct pairs ``(ii[p], jj[p])``, ``ii < jj``, at once;
        `pv`: their `hope_keras.cache.PairValues`, one entry per pair (as
        `hope_keras.cache.SketchCache.exact_pairs` gives them)."""
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
        if self.dense:  # the pairs' entries, both ways; a row's bound may go down
            R = self._store_dense(ii, jj, B, kc, gu, R)
            np.minimum.at(self.rowlo, ii, R)
            np.minimum.at(self.rowlo, jj, R)
            return
        rows, part = np.concatenate([ii, jj]), np.concatenate([jj, ii])
        pr, pc = _nonzero2(self.cand[rows] == part[:, None])
        r, q = rows[pr], pr % ii.size
        self.B[r, pc], self.kc[r, pc], self.gu[r, pc], self.R[r, pc] = B[q], kc[q], gu[q], R[q]
        self.dirty[rows] = True

    # ------------------------------------------------------------ dense tables
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
        down to float32, so an entry stays a lower bound."""
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
        R = self._stored(R)
        for x, y in ((a, b), (b, a)):
            if self.compact:
                self.B[x, y], self.lo[x, y] = B, R
            else:
                self.B[x, y], self.kc[x, y], self.gu[x, y], self.lo[x, y] = B, kc, gu, R
            self.exact[x, y] = True
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

    def _dense_on_merge(self, i: int, ok: np.ndarray) -> None:
        """Slot `i` holds a merged parent: its pairs' bounds anew, none exact."""
        cols = np.flatnonzero(ok)
        cols = cols[cols != i]
        D = np.full(self.n, np.inf)
        if cols.size:
            D[cols] = self._stored(self._distance_row(i, cols)[0])
        self.lo[i, :] = D
        self.lo[:, i] = D
        self.exact[i, :] = False
        self.exact[:, i] = False
        self.rowlo[i] = D.min()
        np.minimum(self.rowlo, D, out=self.rowlo)

    def _r_cut(self, best, f, t):
        """Per row, the residual below which a pair's DR could be below `best`, for
        the rank factor `f` and the denominators' upper bounds `t` (see `_t_max`)."""
        c = best / f / (1.0 - _TOL)
        with np.errstate(over="ignore", invalid="ignore"):
            if self.sum_residual:  # J₁ = sqrt(E)/t' < c needs E < c²t'²
                return c * c * t * t * (1.0 + _TOL)
            # J₁ = sqrt(2R/(t² + R)) < c needs R < c²t²/(2 − c²)
            return np.where(c * c < 2.0, c * c * t * t / (2.0 - c * c) * (1.0 + _TOL), np.inf)

    def _select_dense(self, C, n_live, ok, price, cutoff):
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
        cols = np.flatnonzero(ok)
        # The live columns only (np.take twice: a third of the time of copying whole
        # rows and masking the dead columns).
        sub = np.take(np.take(self.lo, rows, axis=0), cols, axis=1)
        # x ≤ cut ⇔ x ≤ cut rounded down, for float32 x (no float64 copy of `sub`).
        pr, pc = _nonzero2(sub <= self._stored(cut[rows])[:, None])
        r, l = rows[pr], cols[pc]
        new = ~self.exact[r, l]
        if new.any():
            self._price_exact(r[new], l[new])
            sub[pr, pc] = self.lo[r, l]  # exact now: tighter row bounds, fewer rows later
        self.rowlo[rows] = sub.min(axis=1)
        keep = self.lo[r, l] <= cut[r]
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

    # ---------------------------------------------------------------- updates
    def on_merge(self, i: int, ok: np.ndarray) -> None:
        """Slot `i` now holds a merged parent (its partner was removed)."""
        self.clock += 1
        self.stamp[i] = self.clock
        n = self.n
        if self.dense:
            self._dense_on_merge(i, ok)
            return
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
        hold_r, hold_p = _nonzero2((self.cand == i) & others[:, None])
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

    # -------------------------------------------------------------- selection
    def _price(self, r, l, B, kc, gu, C, price):
        """DR and J of the pairs (r, l) under the run's cost (i = min, j = max)."""
        cap = self.cache.capacity
        ii, jj = np.minimum(r, l), np.maximum(r, l)
        A = cap[ii] ** 2 + cap[jj] ** 2
        nss = A + 2.0 * kc * gu
        J, dr = price(A, B, C - cap[ii] - cap[jj], nss, self.p_init[jj])
        return np.broadcast_to(dr, ii.shape), np.broadcast_to(J, ii.shape)

    def _price_rows(self, rows, C, n_live, ok, price):
        """Prices the candidates of `rows`: per row (DR, J, partner), ties → the
        smallest partner."""
        cand = self.cand[rows]
        valid = (cand >= 0) & ok[np.maximum(cand, 0)] & (cand != rows[:, None])
        pr, pc = _nonzero2(valid)
        l = cand[pr, pc]
        r = rows[pr]
        dr, J = self._price(r, l, self.B[r, pc], self.kc[r, pc], self.gu[r, pc], C, price)
        best, Jb, part = _row_min(pr, l, dr, J, rows.size)
        self.row_dr[rows] = best
        self.row_C[rows] = C
        self.row_n[rows] = n_live
        self.row_g[rows] = self.scale
        self.dirty[rows] = False
        return best, Jb, part

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
            out.append(_row_min(pos, l, dr, J, rr.size))
        return tuple(np.concatenate(x) for x in zip(*out))

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
            return np.maximum(C, costs.FLOOR + cap + x_max) * (1.0 + _TOL)
        return np.maximum(2.0 * C - cap, 2.0 * costs.FLOOR + cap + x_max) * (1.0 + _TOL)

    def _j_lower(self, R, t):
        """A lower bound of J₁ from a lower bound of the residual and ``t_max``."""
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if self.sum_residual:
                J1 = np.sqrt(R) / t
            else:
                J1 = np.sqrt(2.0 * R / (t * t + R))
        return np.where(np.isnan(J1), 0.0, J1) * (1.0 - _TOL)

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
        Q = Q - 4.0 * _TOL * (cap * cap + xm * xm) - 1e-300
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

    def _lazy_bounds(self, C, n_live, ok):
        lb = self.row_dr * (self.scale / self.row_g)
        if self.bound == "paper":
            lb = lb * (n_live / self.row_n)
        lb = lb * (1.0 - _TOL) - 1e-300
        lb[self.dirty | (C > self.row_C)] = -np.inf
        lb[~ok] = np.inf
        return lb

    def _nc_bounds(self, C, n_live, ok):
        """Per row, a lower bound of DR over the partners it does not hold."""
        R = np.maximum(self._nc_residual(ok), 0.0)
        lb = self._factor(n_live) * self._j_lower(R, self._t_max(C, ok))
        lb = np.where(np.isinf(self.nc), np.inf, lb)  # the row holds every partner
        lb[~ok] = np.inf
        return lb

    def select(self, C: float, n_live: int, ok: np.ndarray, price: Callable,
               cutoff: float = np.inf, scale: float = 1.0):
        """The group's cheapest merge: ``(DR, J, i, j)`` with ``i < j``, or None.

        Args:
            C: The group's live capacity.
            n_live: Its live neuron count.
            ok: Which neurons can pair now.
            price: ``price(A, B, c_rem, norm_sum_sq, P) -> (J, DR)`` arrays, the
                run's cost.
            cutoff: Only a merge with ``DR < cutoff`` matters (the group's best
                prune): with bounds, rows that cannot go below it are not priced,
                and None is returned when no merge does.
            scale: The run's rank of ``J = 1`` for this group now (with ``P = 1``):
                the built-in costs rank a merge by ``DR = scale·J`` (over ``P`` for
                the paper's), e.g. ``1/sqrt(FLOPs)`` under a FLOPs budget. The
                bounds use it; it must be positive.
        """
        self._ok = ok
        rows_ok = np.flatnonzero(ok)
        if rows_ok.size < 2:
            return None
        if not scale > 0:
            raise ValueError(f"scale must be positive. Received: scale={scale!r}")
        self.scale = float(scale)
        if self.dense:
            return self._select_dense(C, n_live, ok, price, cutoff)
        uncertified = not self.exhaustive and not self.certify
        if uncertified:  # rows without partners cannot be priced: refill them now
            self._refill_depleted(ok, few=self.bound is None)
        if self.bound is None:  # exhaustive, or a cost without bounds
            dr, J, part = self._price_rows(rows_ok, C, n_live, ok, price)
            self._last = (rows_ok, dr, part)
            found = _pick(rows_ok, dr, J, part)
            return found if found is not None and found[0] < cutoff else None
        lb = self._lazy_bounds(C, n_live, ok)
        # Uncertified: partners outside the rows are not looked for.
        lbn = self._nc_bounds(C, n_live, ok) if self.certify else np.full(self.n, np.inf)
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
                if uncertified:  # the rows priced get their lost partners back
                    self._refill_depleted(ok, rows)
                val[rows], Jv[rows], part[rows] = self._price_rows(rows, C, n_live, ok, price)
                fresh[rows] = True
                best = min(best, float(val[rows].min()))
            # Rows whose partners outside the table could reach the best: the
            # finer bound first, then a rescan.
            # (Uncertified: no bounds outside the rows, nothing to scan.)
            scan = (lbn <= best) & (lbn < np.inf) if self.certify else None
            if scan is not None and scan.any() and best < np.inf:
                rows = np.flatnonzero(scan)
                lb2 = self._fine_bounds(rows, C, n_live, ok)
                lbn[rows] = np.maximum(lbn[rows], lb2)
                scan = (lbn <= best) & (lbn < np.inf)
            if scan is not None and scan.any():
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
            todo = ~fresh & (lb <= best) & (lb < np.inf)
            if not todo.any() and not (self.certify and ((lbn <= best) & (lbn < np.inf)).any()):
                break
        rows = np.flatnonzero(fresh)
        self._last = (rows, val[rows], part[rows])
        found = _pick(rows, val[rows], Jv[rows], part[rows])
        return found if found is not None and found[0] < cutoff else None


def _row_min(pos, l, dr, J, nrows):
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


def _pick(rows, dr, J, part):
    """The smallest DR; ties → the lexicographically smallest pair (i < j)."""
    finite = np.isfinite(dr) & (part >= 0)
    if not finite.any():
        return None
    rows, dr, J, part = rows[finite], dr[finite], J[finite], part[finite]
    ii, jj = np.minimum(rows, part), np.maximum(rows, part)
    k = np.lexsort((jj, ii, dr))[0]
    return float(dr[k]), float(J[k]), int(ii[k]), int(jj[k])
