"""How the HOPE encoder searches each group for its cheapest merge.

`SearchOptions` are the user's knobs; `MergeSearch` applies them to a run: which
merge table each group gets (`hope_keras.search.candidates.MergeTable`: a dense pair table,
or k partners per neuron, certified or top-k), the tables filled in threads when
there is enough work, and, in sketched groups (`hope_keras.scoring.cache.SketchCache`), the
selected pair re-priced from exact Gram entries until the selection is stable.
`GroupState` is a group's live state during a run (active neurons, live capacity,
its merge table).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Optional

import numpy as np

from hope_keras.graph import layers as layer_rules
from hope_keras.scoring import costs
from hope_keras.search.actions import Action
from hope_keras.search._threads import cpu_count as _cpu_count  # a module attribute tests patch
from hope_keras.search._threads import one_blas_thread, release_free_memory
from hope_keras.scoring.cache_builders import build_group_cache, build_sketch_cache, extract_rows
from hope_keras.search.candidates import MergeTable
from hope_keras.search.rounding import check_round_to
from hope_keras.scoring.cache import PruneCache, SketchCache
from hope_keras.scoring.neurons import coupled_capacity, extract_group

#: Merge candidates kept per neuron by default (`Encoder`'s ``merge_candidates``).
DEFAULT_MERGE_CANDIDATES = 16

#: With ``merge_candidates="auto"`` and the certified search, groups up to this width
#: keep every pair (a dense table, each pair priced once); wider ones keep
#: `DEFAULT_MERGE_CANDIDATES` partners per neuron. Four n × n float64 tables of 1024
#: neurons are 32 MB; wider tables are compact (`merge_tables.dense.DENSE_FLOAT64_MAX`):
#: 144 MB for 4096 neurons.
DENSE_PAIRS_MAX = 4096

#: Sketched groups (`hope_keras.scoring.cache.SketchCache`): pairs re-priced from exact Gram
#: entries per selection (the selected one and the next cheapest rows' pairs).
REFINE_BATCH = 8
#: ... and in groups of `REFINE_WIDE` neurons or more, `REFINE_BATCH_WIDE` pairs: a
#: round costs mostly its fixed work, so fewer, larger rounds pay where many are
#: needed (the 4 × 8192 MLP: 1.4 rounds a step against 2.3, its run 20–24 % shorter,
#: the sum of J lower; on the trained models sketched whole, whose groups are narrow,
#: 16 pairs gave no better accuracy than 8: measured with benchmarks/sketch_search.py).
REFINE_WIDE = 6144
REFINE_BATCH_WIDE = 16
#: ``merge_search="auto"`` (the default) certifies the merge search in groups
#: narrower than this, and selects the best of each neuron's top-k partners
#: (``"top_k"``) in groups at least this wide. There the certified search's rescans
#: cost tenths of a second a step (VGG16 @64 to density 0.5: 32.6 s certified, its two
#: 4096-wide classifier groups most of it, against 12.4 s; the 4 × 8192 MLP: 181 ms a
#: step over its first 300 steps against about 6 ms), and top-k loses nothing measured:
#: on a trained 2 × 4096 BN-ReLU MLP it scored within 0.2 points of the certified
#: search at every density (`benchmarks/merge_search_wide.py`). Narrower groups are
#: where it can lose (LeNet-300-100 at density 0.2: 3.6 points), so they stay certified.
AUTO_TOP_K_WIDTH = 4096

# Merge tables built at once (`MergeSearch.set_tables`) fill in threads from this many
# pairs (sum of n² over their groups): below it a thread costs more than it saves.
PARALLEL_FILL_PAIRS = 1 << 22

#: Capacity, relative to the layer's initial capacity, below which a neuron only
#: prunes (`GroupState.pair_ok`).
NEGLIGIBLE = 1e-9

MERGE_SEARCHES = ("auto", "certified", "top_k")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How the `Encoder` walks: how it searches for the cheapest merge (the
    defaults select what the exhaustive scan selects wherever that is practical)
    and which widths it may stop at.

    Attributes:
        merge_candidates: Merge partners kept per neuron (an int ``k``), or None to
            price every pair at every step (the exhaustive scan, for checking).
            ``"auto"`` (default): for the built-in costs, whose bounds make the
            bounded scan select exactly the exhaustive scan's pair
            (`hope_keras.search.candidates`), every pair in groups of up to
            `DENSE_PAIRS_MAX` neurons (priced once, when its bound first matters)
            and `DEFAULT_MERGE_CANDIDATES` in wider ones; None for other costs
            (with an int they get the best pair among the candidates).
        merge_search: ``"certified"``: pairs (dense tables) or rows (k-partner
            tables) the bounds cannot rule out are priced exactly, so the merge
            selected is the exhaustive scan's. ``"top_k"``: each neuron keeps the k
            partners of smallest merge residual among the neurons of larger
            capacity, found when its row was filled (refilled once three quarters
            of them are gone), and the cheapest of those is selected.
            ``"auto"`` (default): ``"certified"`` in groups narrower than
            `AUTO_TOP_K_WIDTH` (4096) neurons, ``"top_k"`` in groups that wide or
            wider, where the certified search takes tenths of a second a step.
        refresh: ``"local"`` (default: after an action only the touched group's
            cache is updated, the paper's decoupled cache) or ``"neighbors"`` (also
            rebuild the caches of the producer- and consumer-side groups: 2–6×
            slower, with no consistent gain, docs/hope.md).
        round_to: Every group the run touches ends at a multiple of this many
            channels, or whole (`hope_keras.search.rounding`; docs/hope.md, "Widths
            that suit the hardware"). 1 (default): any width.

    Example:

    >>> from hope_keras import SearchOptions
    >>> SearchOptions(merge_search="top_k").merge_search
    'top_k'
    >>> SearchOptions(round_to=8).round_to
    8
    """

    merge_candidates: object = "auto"
    merge_search: str = "auto"
    refresh: str = "local"
    round_to: int = 1

    def __post_init__(self):
        k = self.merge_candidates
        if k != "auto" and k is not None and (
                isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
            raise ValueError("merge_candidates must be 'auto', None or an integer ≥ 1. "
                             f"Received: merge_candidates={k!r}")
        if self.merge_search not in MERGE_SEARCHES:
            raise ValueError(f"merge_search must be one of {MERGE_SEARCHES}. "
                             f"Received: merge_search={self.merge_search!r}")
        if self.refresh not in ("local", "neighbors"):
            raise ValueError(f"refresh must be 'local' or 'neighbors'. "
                             f"Received: refresh={self.refresh!r}")
        object.__setattr__(self, "round_to", check_round_to(self.round_to))

    @classmethod
    def get(cls, identifier) -> "SearchOptions":
        """None (the defaults), a dict of its fields or a `SearchOptions`."""
        if identifier is None:
            return cls()
        if isinstance(identifier, cls):
            return identifier
        if isinstance(identifier, dict):
            try:
                return cls(**identifier)
            except TypeError as e:
                raise ValueError(f"search: {e}. Received: search={identifier!r}") from None
        raise ValueError(f"search must be None, a dict or a hope_keras.SearchOptions. "
                         f"Received: search={identifier!r}")



class GroupState:
    """A group's live state during a run: active set, n, C, merge table."""

    def __init__(self, name, cache, p_init, num_readers: int = 1, eps: float = 1e-3):
        self.name = name
        self.eps = float(eps)  # its BatchNormalization's epsilon (a merge's dead parent)
        # Layers reading the group: its actions' J counts once per reader (costs).
        self.readers = float(num_readers)
        self.cache = cache
        self.p_init = p_init
        n = cache.size
        self.size0 = n
        self.active = np.ones(n, dtype=bool)
        self.n = n
        self.C = max(cache.layer_capacity(), costs.FLOOR)
        self.C_init = self.C
        self.frozen = False
        self.mergeable = bool(getattr(cache, "mergeable", False))
        self._table: Optional[MergeTable] = None  # set by the Encoder when merges run
        self._make_table = None  # or built at first use (`defer_table`)
        self.free_prunes = True  # False when prunes are off: negligible neurons merge
        self.version = 0

    @property
    def table(self) -> Optional[MergeTable]:
        """The group's merge table (None: the group does not merge)."""
        if self._make_table is not None:
            self._table, self._make_table = self._make_table(), None
        return self._table

    @table.setter
    def table(self, table: Optional[MergeTable]) -> None:
        self._table, self._make_table = table, None

    @property
    def merges(self) -> bool:
        return self._table is not None or self._make_table is not None

    def defer_table(self, make) -> None:
        """The table is built by ``make()`` when first read: a dense table (n × n,
        up to 144 MB) is not built for a group whose neurons are all pruned for free
        first, or never reach a merge. Only for tables whose selection does not
        depend on when they were built: the dense ones, which price every pair
        from the cache as it is, and of which nothing is re-priced before their
        first selection."""
        self._table, self._make_table = None, make

    def pair_ok(self) -> np.ndarray:
        """Which neurons can merge now: active, non-zero input vector, and capacity
        above `NEGLIGIBLE` of the layer's. A neuron below that is pruned at a cost of
        at most `NEGLIGIBLE`; merging it would only risk a parent whose self-kernel
        underflows (a dead neuron's, exp(-(beta/gamma)^2 / 2)) and whose scale
        `capacity / sqrt(K_vv)` overflows float32 (seen on calibrated VGG16)."""
        ok = self.active & (self.cache.wnorm > 0)
        if self.free_prunes:
            ok &= self.cache.capacity > NEGLIGIBLE * self.C_init
        return ok

    def remove(self, j: int) -> None:
        self.active[j] = False
        self.n -= 1

    def drop(self, dead: np.ndarray) -> None:
        """The neurons `dead` (a mask) start removed (an earlier run removed them)."""
        for i in np.flatnonzero(dead):
            self.remove(int(i))
            self.cache.clear(int(i))
        self.C = max(self.cache.layer_capacity(self.active), costs.FLOOR)

    def rebuild(self, model, group, kernel, exact_source, moments=None) -> None:
        """``refresh="neighbors"``: the cache re-extracted from `model` (the edited
        weights), its removed neurons cleared; the merge table is the caller's. A
        coupled group (a `PruneCache`) is priced as `analyze` prices it, from its
        readers' edited weights and the propagated `moments` (those of the start)."""
        if isinstance(self.cache, PruneCache):
            state = extract_group(model, group)
            cap, second = coupled_capacity(model.get_layer, group, moments)
            self.cache = PruneCache(cap, second, np.sqrt(np.maximum(state.u_sq_norms(), 0.0)),
                                    np.full(cap.shape, np.nan))
        elif isinstance(self.cache, SketchCache):
            self.cache = build_sketch_cache(model.get_layer, group, kernel=kernel)[0]
            self.cache.source = exact_source(self.name)
        else:
            self.cache = build_group_cache(extract_group(model, group), kernel=kernel)
        for j in np.flatnonzero(~self.active):
            self.cache.clear(int(j))
        self.C = max(self.cache.layer_capacity(self.active), costs.FLOOR)

    def after_prune(self, i: int) -> None:
        """Neuron `i` was pruned."""
        self.remove(i)
        self.cache.clear(i)

    def merge_parent(self, i: int, j: int, merge_scale: str, eps: float,
                     prefetch: bool = True):
        """The parent of merging neurons `i` and `j`: ``(coefficients, C after,
        dead)`` (`costs.parent_coefficients`; dead: its BN input variance is below
        the BN's `eps`, and both neurons go). A sketched cache starts computing
        the parent's rows (while the model is edited) unless `prefetch` is False.
        Raises FloatingPointError, before any edit, on coefficients that are not
        finite or overflow float32."""
        cache = self.cache
        sol = cache.solve_pair(i, j)
        cap = cache.capacity
        A = cap[i] ** 2 + cap[j] ** 2
        c_rem = self.C - cap[i] - cap[j]
        scale = sol.B if merge_scale == "sum" else costs.alpha_star(A, sol.B, c_rem)
        gv_ii, gv_jj, _, _, gu_ii, gu_jj, gu_ij = cache.merge_terms(i, j)
        pc = costs.parent_coefficients(sol, scale, gv_ii, gv_jj, gu_ii, gu_jj, gu_ij)
        coef = tuple(float(x) for x in pc)
        if not all(np.isfinite(c) and abs(c) < 1e30 for c in coef):
            raise FloatingPointError(
                f"Merging neurons {i} and {j} of group {self.name!r} would write "
                f"non-finite or float32-overflowing weights (parent coefficients "
                f"{coef}); this merge was not applied (the model holds the steps "
                f"before it). Allow prunes (actions=...) so that neurons of "
                f"negligible capacity are pruned instead.")
        dead_parent = coef[4] ** 2 < eps
        if prefetch and isinstance(cache, SketchCache) and not dead_parent \
                and self.table is not None:
            cache.prefetch_parent_rows(i, j, *coef[:4])  # while the model is edited
        c_after = max(c_rem + (0.0 if dead_parent else float(scale)), costs.FLOOR)
        return coef, c_after, dead_parent

    def after_merge(self, i: int, j: int, coef, dead_parent: bool,
                    keep_slot: bool = False) -> None:
        """Neurons `i` and `j` were merged into slot `i` (`coef`: the parent's
        coefficients), or both removed (`dead_parent`). With `keep_slot` (a dead
        parent of a group's last two) slot `i` still counts as a live, zero neuron:
        `slim` keeps one channel of a layer, and the counts say so, as under prunes."""
        cache = self.cache
        self.remove(j)
        if dead_parent:
            if not keep_slot:
                self.remove(i)
            cache.clear(i)
            cache.clear(j)
        else:
            cache.replace_with_parent(i, j, *coef)
            self.table.on_merge(i, self.pair_ok())



def _empties(gs: GroupState, i: int, j: int, cost) -> bool:
    """Whether merging `i` and `j` would leave the group no live neuron: its last two
    into a parent that never fires (both go). Not admissible: a layer keeps one live
    neuron, as under prunes; emptied, its all-zero readers of the channels before it
    would let `slim` drop those too, which the run's counts do not follow. (Overflowing
    coefficients are left for the merge itself to refuse.)"""
    if gs.n != 2:
        return False
    try:
        return gs.merge_parent(i, j, cost.merge_scale, gs.eps, prefetch=False)[2]
    except FloatingPointError:
        return False


def neighbor_map(graph, priced_groups):
    """``refresh="neighbors"``: per priced group, the priced groups on its producer
    and consumer sides, whose caches a change of it rebuilds: the groups written by
    a layer that reads it, and the groups read by a layer that writes it (every
    writer and reader of a coupled group, such as a residual stream, counts)."""
    written_by: dict = {}
    for name, g in graph.groups.items():
        for layer in g.writers:
            written_by.setdefault(layer, set()).add(name)
    out = {}
    for name, g in graph.groups.items():
        nb = set().union(*(written_by.get(c.layer, ()) for c in g.readers))
        writers = set(g.writers)
        nb |= {other for other, h in graph.groups.items()
               if any(c.layer in writers for c in h.readers)}
        out[name] = nb - {name}
    # Only the groups the run prices have caches to rebuild (a cost may leave
    # some out: "paper" all but its neuron layers, "no_streams" the streams).
    priced = set(priced_groups)
    return {name: nb & priced for name, nb in out.items() if name in priced}


def exact_source(editor, group, column_cache_bytes: int):
    """A sketched group's reader of exact rows (`SketchCache.source`): the producer
    kernel's columns through the editor's column cache (`column_cache_bytes` of
    them, at least 16 columns; none for a transposed convolution, whose filters are
    not the kernel's columns)."""
    producer = editor.layer(group.producer)
    if layer_rules.output_axis(producer) != -1:
        return functools.partial(extract_rows, editor.array, editor.layer, group)
    kernel = producer.kernel
    column = int(np.prod(kernel.shape[:-1])) * np.dtype(kernel.dtype).itemsize
    editor.cache_columns(group.producer, "kernel",
                         max(16, min(column_cache_bytes // column, group.size)))
    return functools.partial(extract_rows, editor.array, editor.layer, group,
                             columns=editor.columns)


class MergeSearch:
    """A run's merge search: each mergeable group's `MergeTable` and its best merge.

    Args:
        options: The run's `SearchOptions`.
        cost: The run's `hope_keras.costs.Cost`: the built-in costs have bounds
            (certified and dense tables); others price their candidates each step.
    """

    def __init__(self, options: SearchOptions, cost):
        merge_candidates = options.merge_candidates
        builtin = type(cost) in (costs.PaperCost, costs.HopeCost)
        self.dense_pairs = merge_candidates == "auto" and builtin
        if merge_candidates == "auto":
            merge_candidates = DEFAULT_MERGE_CANDIDATES if builtin else None
        self.merge_candidates = None if merge_candidates is None else int(merge_candidates)
        self.merge_search = options.merge_search
        self.bound = cost.name if builtin else None

    def certified(self, gs: "GroupState") -> bool:
        """Whether the group's merge search is certified (`merge_search`)."""
        if self.merge_search == "auto":
            return gs.cache.size < AUTO_TOP_K_WIDTH
        return self.merge_search == "certified"

    def dense(self, gs: "GroupState") -> bool:
        return (self.dense_pairs and self.certified(gs)
                and gs.cache.size <= DENSE_PAIRS_MAX)

    def table(self, gs: "GroupState") -> MergeTable:
        """A new merge table for `gs`, filled from its cache as it is."""
        k = self.merge_candidates
        return MergeTable(gs.cache, k, self.bound, gs.p_init, gs.pair_ok(),
                          preselect=32 if k is None else max(2 * k, 32),
                          certify=self.certified(gs), dense=self.dense(gs))

    def set_table(self, gs: "GroupState") -> None:
        """A new merge table for `gs`: dense ones (the same selection whenever they
        are built) at first use, others now."""
        if self.dense(gs):
            gs.defer_table(functools.partial(self.table, gs))
        else:
            gs.table = self.table(gs)

    def set_tables(self, states) -> None:
        """`set_table` for each of `states`; the tables built now (not deferred) are
        built in threads when there is enough work: each reads only its own group's
        cache, and NumPy releases the GIL in its loops (four 8192-wide top-k fills:
        13.7–14.8 s in one thread, 8.5–8.7 s in two)."""
        now = [gs for gs in states if not self.dense(gs)]
        for gs in states:
            if self.dense(gs):
                self.set_table(gs)
        workers = min(len(now), _cpu_count())
        if workers < 2 or sum(gs.size0 ** 2 for gs in now) < PARALLEL_FILL_PAIRS:
            for gs in now:
                gs.table = self.table(gs)
            return
        # One BLAS thread per worker: OpenBLAS's own threads would spin on the cores
        # the workers use (15.1 s instead of 8.7 s for the MLP's four fills).
        with one_blas_thread(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
            tables = list(pool.map(self.table, now))
        for gs, table in zip(now, tables):
            gs.table = table
        release_free_memory()

    def best_action(self, gs: "GroupState", cost, actions, rank_info) -> Optional[Action]:
        """The group's cheapest prune or merge under `cost`, or None (the group has
        two live neurons or more); ``rank_info(kind, p_init)``: the `costs.RankInfo`
        of its actions."""
        cache, best = gs.cache, None
        cap = cache.capacity
        if "prune" in actions:
            idx = np.flatnonzero(gs.active)
            u_norm = cache.u_norm[idx]
            J = cost.prune(costs.PruneCandidates(cap[idx], gs.C, gs.n, gs.size0,
                                                 cache.k_self[idx], u_norm, cache.gamma[idx]))
            dr = cost.rank(J, rank_info("prune", gs.p_init[idx]))
            k = int(np.argmin(dr))
            best = Action("prune", gs.name, int(idx[k]), -1, float(J[k]), float(dr[k]),
                          float(gs.p_init[idx[k]]), 1)
        if best is not None and cap[best.i] <= NEGLIGIBLE * gs.C_init:
            # A free prune (see `GroupState.pair_ok`): no merge saves a neuron for less
            # that matters, and the bounds could not certify one below it.
            return best
        if "merge" in actions and gs.table is not None:
            def price(A, B, c_rem, norm_sum_sq, P):
                J = cost.merge(costs.MergeCandidates(A, B, c_rem, norm_sum_sq, gs.n,
                                                     gs.size0))
                return J, cost.rank(J, rank_info("merge", P))

            cutoff = np.inf if best is None else best.DR
            scale = 1.0
            if gs.table.bound is not None:  # built-in costs: DR linear in J (bounds)
                scale = float(np.ravel(cost.rank(np.ones(1), rank_info("merge", np.ones(1))))[0])
            found = self.best(gs, price, cutoff, scale)
            if found is not None:
                dr, J, i, j = found
                if (best is None or dr < best.DR) and not _empties(gs, i, j, cost):
                    best = Action("merge", gs.name, i, j, J, dr, float(gs.p_init[j]), 1)
        return best

    def best(self, gs: "GroupState", price, cutoff: float, scale: float):
        """The group's cheapest merge below `cutoff`: ``(DR, J, i, j)`` or None
        (`MergeTable.select`; `price` is the run's cost)."""
        cache = gs.cache
        found = gs.table.select(gs.C, gs.n, gs.pair_ok(), price, cutoff=cutoff, scale=scale)
        if isinstance(cache, SketchCache):
            # Sketched pair values: the pair selected, and the next cheapest rows'
            # pairs with it, are re-priced from exact Gram entries until the
            # selection is stable.
            batch = REFINE_BATCH_WIDE if cache.size >= REFINE_WIDE else REFINE_BATCH
            for _ in range(64):
                if found is None or gs.table.is_exact(found[2], found[3]):
                    break
                ii, jj = gs.table.leading_pairs(batch)
                ii, jj = np.append(found[2], ii), np.append(found[3], jj)
                keep = np.ones(ii.size, dtype=bool)
                keep[1:] = (ii[1:] != found[2]) | (jj[1:] != found[3])
                ii, jj = ii[keep][:batch], jj[keep][:batch]
                gs.table.refine_pairs(ii, jj, cache.exact_pairs(ii, jj))
                found = gs.table.select(gs.C, gs.n, gs.pair_ok(), price, cutoff=cutoff,
                                        scale=scale)
        return found
