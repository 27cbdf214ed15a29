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
`hope_keras.search.merge_search.DENSE_PAIRS_MAX` neurons) keeps every pair instead: an n × n table
of the residual's lower bound (`MergeTable._distance`, Gram entries only), each entry
replaced by the exact residual the first time its bound could beat the best (and kept
until one of its neurons changes), and per row a lower bound over its live entries. A
step prices only the pairs whose bound is below what the best needs, and ranks only
those whose exact residual is; a merge resets the parent's row and column to bounds.
No pair is priced twice while its neurons stand, which the k-partner rows cannot
promise: where many pairs cost nearly the same, their rescans re-price the pairs they
dropped (ResNet-50 @224 to density 0.5: 12.5 s with 16 partners, 4.7 s dense, the same
trajectory). Tables wider than `merge_tables.dense.DENSE_FLOAT64_MAX` are compact: the bound and ``B``
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
a few likely partners, not all n (`TopKRows._refill_rows`): the row's partners'
partners (two hops, as in NN-descent; unoriented, also the `REFILL_HUBS` live
neurons of smallest capacity, the partners that rows share).

The tables are small classes behind `MergeTable`'s interface (``select``,
``on_merge``, ``fill_all``, ``is_exact``, ``leading_pairs``, ``refine_pairs``),
in `hope_keras.search.merge_tables`: `DenseTable` (every pair), `PartnerRows` (k partners per
neuron; every partner: the exhaustive scan) and its two searches, `CertifiedRows`
(bounds over the partners left out) and `TopKRows` (the best pair held), sharing the
pair values and bounds (`merge_tables.bounds`) and the exact re-pricing of sketched
pairs (`merge_tables.refinement`). ``MergeTable(...)`` builds the kind its arguments
ask for.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hope_keras.scoring.cache import SketchCache
from hope_keras.search.merge_tables.bounds import PairBounds
# Also given here as `candidates._nonzero2`, `candidates._row_min` (tests reach them).
from hope_keras.search.merge_tables.bounds import nonzero2 as _nonzero2  # noqa: F401
from hope_keras.search.merge_tables.bounds import row_min as _row_min  # noqa: F401
from hope_keras.search.merge_tables.refinement import ExactRefinement, ExactStore as _ExactStore

# Uncertified tables hold each pair in the row of its smaller-capacity neuron only
# (`PartnerRows._holds_up`): a neuron of small capacity is a cheap partner for most
# rows, and rows that all held it lost it together (see above for why).
ORIENTED = True


def _table_class(cache, k, bound, p_init=None, ok=None, preselect=32, certify=True,
                 dense=False):
    """The `MergeTable` kind for `MergeTable`'s arguments."""
    from hope_keras.search.merge_tables.certified import CertifiedRows
    from hope_keras.search.merge_tables.dense import DenseTable
    from hope_keras.search.merge_tables.rows import PartnerRows
    from hope_keras.search.merge_tables.top_k import TopKRows

    exhaustive = k is None or k >= cache.size - 1
    certified = bool(certify) and not exhaustive and bound is not None
    if certified:
        return DenseTable if dense else CertifiedRows
    return PartnerRows if exhaustive else TopKRows


class MergeTable(PairBounds, ExactRefinement):
    """The merge candidates of one group and their lazy per-row bookkeeping.

    ``MergeTable(...)`` is a `DenseTable` (``dense`` and a bound), a
    `CertifiedRows` (``certify`` and a bound), a `TopKRows` (``k`` partners, not
    certified) or a `PartnerRows` (every partner: ``k`` None or ``k ≥ n − 1``).

    Args:
        cache: The group's `hope_keras.scoring.cache.GroupCache` (read, never written).
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
    >>> from hope_keras.graph.walker import walk
    >>> from hope_keras.scoring.neurons import extract_group
    >>> from hope_keras import costs
    >>> from hope_keras.scoring.cache_builders import build_group_cache
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

    def __new__(cls, *args, **kwargs):
        if cls is MergeTable:  # the kind the arguments ask for
            cls = _table_class(*args, **kwargs)
        return super().__new__(cls)

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
        # Dense: every pair's lower bound kept, each pair priced once (`DenseTable`).
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

    def fill_all(self, ok: np.ndarray) -> None:
        """(Re)starts the table from the cache: every pair value is recomputed."""
        self.stamp[:] = -1
        self._fill(ok)

    def on_merge(self, i: int, ok: np.ndarray) -> None:
        """Slot `i` now holds a merged parent (its partner was removed)."""
        self.clock += 1
        self.stamp[i] = self.clock
        self._on_merge(i, ok)

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
        return self._select(C, n_live, ok, price, cutoff, rows_ok)

    # Each kind's own (`hope_keras.search.merge_tables`).
    def _fill(self, ok) -> None:
        raise NotImplementedError

    def _on_merge(self, i: int, ok: np.ndarray) -> None:
        raise NotImplementedError

    def _select(self, C, n_live, ok, price, cutoff, rows_ok):
        raise NotImplementedError
