"""The wide groups' merge searches (hope_keras.search.merge_tables): top-k candidate rows
select the cheapest pair they hold and refill exactly, sketched groups select exactly
priced merges and edit exactly, and the tables filled or prefetched on threads give the
runs computed in turn. The certified dense tables: tests/test_candidates.py."""

import keras
import numpy as np
import pytest
import threadpoolctl

import hope_keras
from conftest import clustered_mlp, mlp, small_resnet
from hope_keras.scoring import costs
from hope_keras.scoring import cache_builders
from hope_keras.scoring.cache_builders import build_group_cache
from hope_keras.search.candidates import MergeTable
from hope_keras.search.encoder import Encoder
from hope_keras.graph.walker import walk
from hope_keras.search.merge_tables import top_k as top_k_tables
from hope_keras.scoring.neurons import extract_group


def _merge_J(gs, i, j, cost):
    """The run's cost of merging (i, j) now, priced afresh from the cache."""
    c, cap = gs.cache, gs.cache.capacity
    pv = c.pair_values(np.array([i]), np.array([j]))
    A = cap[i] ** 2 + cap[j] ** 2
    J = cost.merge(costs.MergeCandidates(A, pv.B, gs.C - cap[i] - cap[j],
                                         A + 2.0 * pv.k_cross * pv.gram_u, gs.n, gs.size0))
    return float(np.ravel(J)[0])


def _assert_rows_hold_partners(table, ok):
    """Every live row holds a live partner; in an oriented table, every live row
    but those no live neuron outranks in capacity (they have none to hold)."""
    live = np.flatnonzero(ok)
    cap = table.cache.capacity
    for r in live:
        if table.oriented and not any((cap[x], x) > (cap[r], r) for x in live):
            continue
        assert any(c >= 0 and ok[c] for c in table.cand[r]), r


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_search_selects_the_cheapest_pair_it_holds(seed):
    """merge_search="top_k" (no certificate): the merge a group offers is the cheapest
    pair among the partners its table holds (each held pair priced afresh), never
    cheaper than the exhaustive minimum over all live pairs, and every live row
    keeps a partner while its group has two live neurons."""
    # A random MLP (on clustered_mlp few partners always hold the best pair), one
    # partner per row (with two, the oriented table held the best pair here).
    enc = Encoder(mlp((24, 20), d_in=7, seed=seed), actions=("merge",), search=dict(merge_candidates=1, merge_search="top_k"))
    assert enc.trajectory.meta["options"]["merge_search"] == "top_k"
    differs = 0
    for _ in range(24):
        for name, gs in enc.groups.items():
            if gs.n < 3:
                continue
            action = enc.best_group_action(name)
            ok = gs.pair_ok()
            live = np.flatnonzero(ok)
            cand = gs.table.cand
            held = {(min(r, c), max(r, c)) for r in live for c in cand[r]
                    if c >= 0 and ok[c] and c != r}
            _assert_rows_hold_partners(gs.table, ok)
            J_held = min(_merge_J(gs, i, j, enc.cost) for i, j in held)
            J_all = min(_merge_J(gs, i, j, enc.cost)
                        for a, i in enumerate(live) for j in live[a + 1:])
            assert action.J == pytest.approx(J_held, rel=1e-9, abs=1e-12)
            assert action.J >= J_all * (1 - 1e-9)
            differs += action.J > J_all * (1 + 1e-6)
        enc.execute(enc.next_action())
    assert differs > 0  # one partner per row: the search is not exhaustive here


def _top_k_misses(seed, k, oriented, monkeypatch):
    """Selections of a top-k merge run that cost more than the exhaustive minimum."""
    from hope_keras.search import candidates

    monkeypatch.setattr(candidates, "ORIENTED", oriented)
    enc = Encoder(mlp((24, 20), d_in=7, seed=seed), actions=("merge",), search=dict(merge_candidates=k, merge_search="top_k"))
    misses = 0
    for _ in range(24):
        for name, gs in enc.groups.items():
            if gs.n < 3:
                continue
            assert gs.table.oriented == oriented
            action = enc.best_group_action(name)
            live = np.flatnonzero(gs.pair_ok())
            J_all = min(_merge_J(gs, i, j, enc.cost)
                        for a, i in enumerate(live) for j in live[a + 1:])
            misses += action.J > J_all * (1 + 1e-6)
        enc.execute(enc.next_action())
    return misses


@pytest.mark.slow  # 8 runs of both searches (the top-k search is tested above)
def test_oriented_top_k_tables_miss_the_cheapest_merge_less_often(monkeypatch):
    """Holding each pair in the row of its smaller-capacity neuron (the default)
    spends the k slots of a row on partners that are not everyone's: with one or two
    partners per row, the top-k search selects a merge dearer than the exhaustive
    minimum less often than rows that hold their k best partners of any capacity
    (48 selections per run; measured 3 / 9 / 0 / 0 against 30 / 23 / 25 / 11)."""
    for k in (1, 2):
        for seed in (0, 1):
            oriented = _top_k_misses(seed, k, True, monkeypatch)
            plain = _top_k_misses(seed, k, False, monkeypatch)
            assert oriented < plain, (k, seed, oriented, plain)


def test_top_k_search_runs_stay_exact_and_validate_the_option():
    """A top-k run on a residual net edits the model as its trajectory says (slim
    equals the model edited in place), and a bad merge_search is refused."""
    model = small_resnet(seed=3)
    result = hope_keras.Encoder(model, search=dict(merge_search="top_k"), verbose=False).compress(density=0.4)
    assert sum(s.kind == "merge" for s in result.trajectory.steps) >= 3
    x = np.random.default_rng(0).normal(size=(4, 10, 10, 3)).astype("float32")
    np.testing.assert_allclose(hope_keras.slim(model)(x), model(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="merge_search.*Received"):
        Encoder(small_resnet(seed=3), search=dict(merge_search="fast"))


def test_auto_merge_search_is_top_k_only_in_the_widest_groups(monkeypatch):
    """merge_search="auto" (the default) certifies the search in groups narrower than
    `search.AUTO_TOP_K_WIDTH` and keeps top-k tables in groups at least that wide:
    with no group that wide its run is the certified run, with every group that wide
    the top-k run, and in between each group gets its own."""
    from hope_keras.search import merge_search as search_lib

    def run(search=None):
        # One partner per row: there the two searches differ (see above).
        kwargs = {} if search is None else {"merge_search": search}
        enc = Encoder(mlp((24, 20), d_in=7, seed=0), search=dict(merge_candidates=1, **kwargs))
        certify = {name: gs.table.certify for name, gs in enc.groups.items()
                   if gs.merges}
        enc.run(density=0.5, verbose=False)
        return enc, certify, [(s.kind, s.unit, s.i, s.j, s.J) for s in enc.trajectory.steps]

    enc, certify, auto = run()
    assert enc.merges.merge_search == "auto"
    assert enc.trajectory.meta["options"]["merge_search"] == "auto"
    assert certify == {"fc0": True, "fc1": True}
    assert sum(s[0] == "merge" for s in auto) >= 3
    assert auto == run("certified")[2]
    monkeypatch.setattr(search_lib, "AUTO_TOP_K_WIDTH", 20)
    _, certify, auto = run()
    assert certify == {"fc0": False, "fc1": False}
    assert auto == run("top_k")[2] != run("certified")[2]
    monkeypatch.setattr(search_lib, "AUTO_TOP_K_WIDTH", 22)  # fc0 (24 neurons) only
    assert run()[1] == {"fc0": False, "fc1": True}


@pytest.mark.parametrize("search", ["certified", "top_k"])
def test_sketched_groups_select_exactly_priced_merges_and_edit_exactly(monkeypatch, search):
    """The sketch tier (groups of 6144+ neurons), forced on small groups: estimated
    Gram entries are within a few 1/sqrt(SKETCH_DIM) of the exact ones, every merge
    the engine executes was re-priced from exact entries first, and the edited model
    equals its slimmed copy."""
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    model = clustered_mlp(3)
    analysis = hope_keras.analyze(model)
    sketched = [n for n, c in analysis.caches.items() if isinstance(c, cache_lib.SketchCache)]
    assert sketched == ["fc0", "fc1"]
    c = analysis.caches["fc0"]
    exact = build_group_cache(extract_group(model, walk(model).groups["fc0"]))
    n = c.size
    a, b = np.triu_indices(n, 1)
    for which in ("w", "u"):
        est = c.entries(which, a, b)
        ref = getattr(exact, "gram_" + which)[a, b]
        scale = np.sqrt(exact.gram_diag(which)[a] * exact.gram_diag(which)[b])
        assert np.all(np.abs(est - ref) <= 5.0 / np.sqrt(cache_lib.SKETCH_DIM) * scale + 1e-9)
    enc = Encoder(model, analysis=analysis, search=dict(merge_search=search))
    merges = 0
    while enc.active > 0.4 * enc.num_neurons:
        action = enc.next_action()
        if action.kind == "merge":
            assert enc.groups[action.unit].table.is_exact(action.i, action.j)
            merges += 1
        enc.execute(action)
    enc.editor.commit()
    assert merges >= 3
    x = np.random.default_rng(0).normal(size=(16, 7)).astype("float32")
    np.testing.assert_allclose(hope_keras.slim(model)(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("oriented", [True, False])
def test_top_k_refill_prices_a_subset_and_leaves_every_row_partners(monkeypatch, oriented):
    """An uncertified ("top_k") table whose most-held neurons are gone (as when the
    shared best partners, the smallest-capacity ones, are merged or pruned): rows
    left without partners are refilled from their partners' partners and the
    smallest-capacity live neurons only (not all n; oriented tables: their
    partners' partners), every live row then holds a live partner (oriented: but
    those no live neuron outranks), and the selection is the cheapest held pair,
    never cheaper than the exhaustive minimum."""
    from hope_keras.search import candidates

    monkeypatch.setattr(candidates, "ORIENTED", oriented)
    monkeypatch.setattr(top_k_tables, "REFILL_HUBS", 4)
    monkeypatch.setattr(top_k_tables, "REFILL_SUBSET_RATIO", 2)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(96)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    cache = build_group_cache(extract_group(model, next(iter(walk(model).groups.values()))))
    n = cache.size
    ok = np.ones(n, dtype=bool)
    table = MergeTable(cache, 4, "hope", np.ones(n), ok, certify=False)
    subset = []
    keep_best = top_k_tables.TopKRows._keep_best

    def spy(self, rr, cols, D, m, rest=None):
        if rest is not None:
            subset.append((rr.size, cols.shape[1]))
        return keep_best(self, rr, cols, D, m, rest)

    monkeypatch.setattr(top_k_tables.TopKRows, "_keep_best", spy)
    held = np.bincount(table.cand[table.cand >= 0], minlength=n)
    ok = ok.copy()
    ok[np.argsort(-held, kind="stable")[:24]] = False  # the 24 most-held neurons die
    depleted = ok & ~((table.cand >= 0) & ok[np.maximum(table.cand, 0)]).any(axis=1)
    assert depleted.sum() >= 3  # the fixture empties rows
    price = lambda A, B, c_rem, nss, P: (costs.j_merge_residual(nss, B, c_rem, 1.0),) * 2
    C = cache.layer_capacity(ok)
    dr, J, i, j = table.select(C, int(ok.sum()), ok, price)
    assert subset and all(w < n for _, w in subset)  # refilled against a subset only
    live = np.flatnonzero(ok)
    cand = table.cand
    _assert_rows_hold_partners(table, ok)

    def J_of(a, b):
        pv = cache.pair_values(np.array([a]), np.array([b]))
        cap = cache.capacity
        A = cap[a] ** 2 + cap[b] ** 2
        return float(price(A, pv.B, C - cap[a] - cap[b], A + 2.0 * pv.k_cross * pv.gram_u,
                           1.0)[0][0])

    pairs = {(min(r, c), max(r, c)) for r in live for c in cand[r] if c >= 0 and ok[c]}
    assert J == pytest.approx(min(J_of(a, b) for a, b in pairs), rel=1e-9)
    J_all = min(J_of(a, b) for x, a in enumerate(live) for b in live[x + 1:])
    assert J >= J_all * (1 - 1e-9)


def test_index_helpers_match_numpy():
    """The table's `_nonzero2` and the cache's `sorted_unique` (faster paths) return
    exactly what `np.nonzero` and `np.unique` return, empty inputs included."""
    from hope_keras.scoring.cache import sorted_unique as _unique
    from hope_keras.search.candidates import _nonzero2

    rng = np.random.default_rng(0)
    for shape, p in (((7, 11), 0.3), ((1, 5), 0.0), ((0, 4), 0.5), ((40, 33), 0.9)):
        mask = rng.random(shape) < p
        for got, want in zip(_nonzero2(mask), np.nonzero(mask)):
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype
    for keys in (rng.integers(0, 50, 200), np.array([], dtype=np.int64), np.array([3])):
        np.testing.assert_array_equal(_unique(keys.astype(np.int64)), np.unique(keys))


def _row_min_by_sort(pos, l, dr, J, nrows):
    """Reference: per row, the pairs sorted by (DR, partner), the first one kept."""
    best, Jb, part = np.full(nrows, np.inf), np.zeros(nrows), np.full(nrows, -1)
    for r in range(nrows):
        at = np.flatnonzero(pos == r)
        at = at[np.isfinite(dr[at])]
        if at.size:
            k = at[np.lexsort((l[at], dr[at]))[0]]
            best[r], Jb[r], part[r] = dr[k], J[k], l[k]
    return best, Jb, part


def test_row_min_matches_a_sort_with_ties_infinities_and_any_order():
    """`_row_min` (unbuffered reductions) picks each row's smallest DR, ties → the
    smallest partner (its first pair), skipping infinite and NaN values, whatever the
    order of the pairs."""
    from hope_keras.search.candidates import _row_min

    rng = np.random.default_rng(0)
    for nrows, per in ((40, 6), (3, 50), (1, 1), (5, 0)):
        pos = np.repeat(np.arange(nrows), per)
        l = rng.integers(0, 30, pos.size)
        dr = rng.integers(0, 4, pos.size).astype(float)  # many ties
        dr[rng.random(pos.size) < 0.2] = np.inf
        dr[rng.random(pos.size) < 0.05] = np.nan
        J = rng.random(pos.size)
        perm = rng.permutation(pos.size)
        got = _row_min(pos[perm], l[perm], dr[perm], J[perm], nrows)
        want = _row_min_by_sort(pos[perm], l[perm], dr[perm], J[perm], nrows)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_sketches_are_the_same_projection_on_tensorflow_and_numpy(monkeypatch):
    """The sketch's projections run where the Gram products do (`GRAM_BACKEND`):
    TensorFlow with a GPU, NumPy's BLAS on a CPU. Both project on the same Ω: the
    sketches agree to float32 rounding, the exact diagonals bit for bit."""
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    monkeypatch.setattr(cache_lib, "SKETCH_DIM", 4)  # shorter than the vectors: projected
    model = clustered_mlp(3)
    graph = walk(model)
    group = graph.groups["fc0"]
    built = {}
    for backend in ("tensorflow", "numpy"):
        monkeypatch.setattr(cache_lib, "GRAM_BACKEND", backend)
        built[backend], _ = cache_builders.build_sketch_cache(graph.layer, group)
    tf_cache, np_cache = built["tensorflow"], built["numpy"]
    assert np_cache.sk_w.shape[1] == np_cache.sk_u.shape[1] == 4
    for a, b in ((tf_cache.sk_w, np_cache.sk_w), (tf_cache.sk_u, np_cache.sk_u)):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    np.testing.assert_array_equal(tf_cache.dw, np_cache.dw)
    np.testing.assert_array_equal(tf_cache.du, np_cache.du)


def test_sketched_products_agree_across_paths_and_batched_exact_pairs(monkeypatch):
    """A `SketchCache` estimates a pair the same (to float32 rounding) from whole rows
    of ``S Sᵀ`` or pair by pair, and `exact_pairs` prices a batch of pairs as
    `exact_pair_values` prices each one (to float32 rounding: the batch reads float32
    rows and takes their pairs' products in float32; one pair reads float64); `leading_pairs`
    offers the last selection's cheapest pairs not yet re-priced, cheapest first."""
    from hope_keras.scoring import cache as cache_lib
    from hope_keras.search.merge_search import REFINE_BATCH

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    model = clustered_mlp(3)
    enc = Encoder(model, search=dict(merge_search="top_k"))
    gs = enc.groups["fc0"]
    c = gs.cache
    assert isinstance(c, cache_lib.SketchCache)
    n = c.size
    a, b = np.repeat(np.arange(n), n), np.tile(np.arange(n), n)
    for threshold in (1, 10 ** 9):  # every pair from rows, then every pair alone
        monkeypatch.setattr(cache_lib, "PRODUCT_ROW_PAIRS", threshold)
        est = c._products(c.sk_w, a, b)
        if threshold == 1:
            by_rows = est
    np.testing.assert_allclose(est, by_rows, rtol=1e-5, atol=1e-6 * np.abs(by_rows).max())
    ii, jj = np.array([0, 2, 5, 1]), np.array([3, 7, 9, 4])
    batch = c.exact_pairs(ii, jj)
    for p, (i, j) in enumerate(zip(ii, jj)):
        one = c.exact_pair_values(int(i), int(j))
        for x, y in zip(batch, one):
            np.testing.assert_allclose(x[p:p + 1], y, rtol=1e-5, atol=1e-6 * np.abs(y).max())
    table = enc.merges.table(gs)  # fresh: nothing re-priced yet
    found = table.select(gs.C, gs.n, gs.pair_ok(), lambda A, B, c_rem, nss, P: (
        costs.j_merge_residual(nss, B, c_rem, 1.0),) * 2)
    assert found is not None
    li, lj = table.leading_pairs(REFINE_BATCH)
    assert 1 <= li.size <= REFINE_BATCH and np.all(li < lj)
    assert len(set(zip(li.tolist(), lj.tolist()))) == li.size
    assert (found[2], found[3]) == (li[0], lj[0])  # the selected pair leads
    table.refine(int(li[0]), int(lj[0]), c.exact_pair_values(int(li[0]), int(lj[0])))
    li2, lj2 = table.leading_pairs(REFINE_BATCH)
    assert (li[0], lj[0]) not in set(zip(li2.tolist(), lj2.tolist()))


def test_wide_sketched_groups_re_price_more_pairs_a_round(monkeypatch):
    """Sketched groups of `search.REFINE_WIDE` neurons or more re-price up to
    `search.REFINE_BATCH_WIDE` pairs a round, narrower ones up to `REFINE_BATCH`
    (the pairs each `SketchCache.exact_pairs` call of the run receives)."""
    from hope_keras.scoring import cache as cache_lib
    from hope_keras.search import merge_search as search_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    monkeypatch.setattr(search_lib, "REFINE_BATCH", 3)
    monkeypatch.setattr(search_lib, "REFINE_BATCH_WIDE", 7)
    monkeypatch.setattr(search_lib, "REFINE_WIDE", 22)  # fc0 (24 neurons) only
    rounds = {24: [], 20: []}
    original = cache_lib.SketchCache.exact_pairs

    def spy(self, i, j):
        rounds[self.size].append(np.size(i))
        return original(self, i, j)

    monkeypatch.setattr(cache_lib.SketchCache, "exact_pairs", spy)
    enc = Encoder(clustered_mlp(5), search=dict(merge_search="top_k"))
    enc.run(density=0.5, verbose=False)
    assert max(rounds[24]) == 7 and max(rounds[20]) == 3


def test_sum_residual_bounds_by_capacity_match_the_scan_over_every_partner():
    """For the library's cost the bound over a row's partners grows with the
    partner's capacity, so `_fine_bounds` takes it at the smallest other capacity and
    a rescan's partners under a cut are a capacity prefix found by bisection: never
    above the O(n) computation (a bound stays a bound, no partner is missed) and
    within its rounding margin (1e-7 of the capacities) of it."""
    model = clustered_mlp(5, widths=(40, 30))
    enc = Encoder(model, search=dict(merge_candidates=4))
    gs = enc.groups["fc0"]
    table = enc.merges.table(gs)
    assert table.sum_residual and not table.dense
    ok = gs.pair_ok()
    live = np.flatnonzero(ok)
    rows = live
    cap2 = gs.cache.capacity ** 2
    scale = cap2[rows] + cap2[live].max()
    slow = np.array([min(table._sv_bound(np.array([r]), cap2[live[live != r]][None, :])[0])
                     for r in rows])
    fast = table._sum_fine_residual(rows, live)
    assert np.all(fast <= slow + 1e-12 * scale)
    assert np.all(fast >= slow - 2e-7 * scale)
    table.nc[rows] = 0.0  # let the capacity bound decide
    q = table._q(rows)
    below = table._below_by_capacity(rows, ok)
    for cut in np.quantile(q[:, live], [0.2, 0.5, 0.8]) * (1 + 1e-9) + 1e-300:
        cuts = np.full(rows.size, cut)
        mask = below(cuts)
        under = (q < cut) & ok[None, :]
        assert np.all(mask[under])  # no partner missed
        over = mask & ~under
        assert np.all(q[over] < cut + 2e-7 * scale[np.nonzero(over)[0]])
        assert under.sum() > 0


def test_exact_store_matches_a_dict(monkeypatch):
    """The two-level store of exactly re-priced pairs returns what a dict of the
    same puts returns (stamps checked, overwrites, merges of the small level into
    the large one, clean-ups)."""
    from hope_keras.search.candidates import _ExactStore

    monkeypatch.setattr(_ExactStore, "RECENT", 7)
    rng = np.random.default_rng(0)
    store, ref = _ExactStore(), {}
    for step in range(60):
        keys = np.unique(rng.integers(0, 200, rng.integers(1, 9))).astype(np.int64)
        rng.shuffle(keys)
        stamps = rng.integers(0, 3, (keys.size, 2))
        vals = rng.normal(size=(keys.size, 3))
        store.put(keys, stamps, vals)
        for k, s, v in zip(keys.tolist(), stamps, vals):
            ref[k] = (tuple(s), v)
        if step % 17 == 16:  # clean-up: keep the even keys
            store.keep(lambda k, st: k % 2 == 0)
            ref = {k: x for k, x in ref.items() if k % 2 == 0}
            assert store.live == len(ref)
        q = rng.integers(0, 200, 50).astype(np.int64)
        sa, sb = rng.integers(0, 3, 50), rng.integers(0, 3, 50)
        hit, got = store.get(q, sa, sb)
        for x, a, b, h, g in zip(q.tolist(), sa, sb, hit, got):
            want = x in ref and ref[x][0] == (a, b)
            assert h == want
            if want:
                np.testing.assert_array_equal(g, ref[x][1])
    assert store.size == len(ref)


@pytest.mark.parametrize("sketched", [False, True])
def test_a_parents_bound_row_equals_the_pairwise_bounds(monkeypatch, sketched):
    """`MergeTable._distance_row` (one Gram row against every neuron, what a merged
    parent's row is built from) gives `_distance` of the same pairs: bit for bit from
    an exact cache; from a sketched one to float32 rounding (a matrix product, where
    a few pairs are summed pair by pair, in another order)."""
    from hope_keras.scoring import cache as cache_lib

    if sketched:
        monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    enc = Encoder(clustered_mlp(2), search=dict(merge_search="top_k"))
    for gs in enc.groups.values():
        assert isinstance(gs.cache, cache_lib.SketchCache) == sketched
        n = gs.cache.size
        for i in (0, n // 2, n - 1):
            cols = np.flatnonzero(np.arange(n) != i)[::-1]
            for x, y in zip(gs.table._distance(np.full(cols.size, i), cols),
                            gs.table._distance_row(i, cols)):
                if sketched:
                    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7 * np.abs(y).max())
                else:
                    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("convolutional", [False, True])
def test_sketched_runs_read_the_same_weights_through_the_column_cache(monkeypatch,
                                                                      convolutional):
    """The exact re-pricing of sketched groups reads producer-kernel columns through
    the editor's column cache (`engine.COLUMN_CACHE_BYTES`): with room for a few
    columns only (evicted and read again), or without the cache, the run takes the
    same steps with the same costs (Dense groups; Conv2D groups of a residual
    network, every group sketched)."""
    import functools

    from hope_keras.scoring import cache as cache_lib
    from hope_keras.search import encoder as engine

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 2 if convolutional else 16)
    if convolutional:
        monkeypatch.setattr(cache_lib, "SKETCH_WORK", 1)

    def run():
        model = small_resnet(seed=3) if convolutional else clustered_mlp(4)
        enc = Encoder(model, search=dict(merge_search="top_k"))
        enc.run(density=0.4, verbose=False)
        return enc

    monkeypatch.setattr(engine, "COLUMN_CACHE_BYTES", 1)  # 16 columns a group
    small = run()
    assert sum(c.hits for c in small.editor._columns.values()) > 0
    assert sum(c.misses for c in small.editor._columns.values()) > 0

    def uncached(editor, group, cache_bytes):
        return functools.partial(cache_builders.extract_rows, editor.array, editor.layer, group)

    monkeypatch.setattr(engine, "exact_source", uncached)
    plain = run()
    assert not plain.editor._columns
    a, b = small.trajectory.steps, plain.trajectory.steps
    assert [(s.kind, s.unit, s.i, s.j) for s in a] == [(s.kind, s.unit, s.i, s.j) for s in b]
    np.testing.assert_allclose([s.J for s in a], [s.J for s in b], rtol=1e-9, atol=1e-15)


def test_top_k_tables_filled_in_threads_give_the_same_run(monkeypatch):
    """The Encoder fills the groups' top-k tables in threads when there is enough work
    (`search.PARALLEL_FILL_PAIRS`): each table reads only its own group's cache, so
    the run takes the same steps with the same costs as with tables filled one after
    another (sketched groups: the fill's Gram products run in each thread)."""
    from hope_keras.scoring import cache as cache_lib
    from hope_keras.search import merge_search as search_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    monkeypatch.setattr(search_lib, "_cpu_count", lambda: 2)
    threads = []

    def run(pairs):
        monkeypatch.setattr(search_lib, "PARALLEL_FILL_PAIRS", pairs)
        enc = Encoder(clustered_mlp(5, widths=(24, 20, 22)), search=dict(merge_search="top_k"))
        enc.run(density=0.4, verbose=False)
        return enc

    import concurrent.futures

    real = concurrent.futures.ThreadPoolExecutor

    class Counting(real):
        def __init__(self, *args, **kwargs):
            threads.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", Counting)
    parallel = run(0)
    assert threads == [(2,)]  # three groups, two threads
    serial = run(10 ** 12)
    assert threads == [(2,)]
    a, b = parallel.trajectory.steps, serial.trajectory.steps
    assert len(a) > 10
    assert [(s.kind, s.unit, s.i, s.j, s.J) for s in a] == \
        [(s.kind, s.unit, s.i, s.j, s.J) for s in b]


def test_parent_rows_computed_in_the_background_are_the_ones_computed_after(monkeypatch):
    """A sketched group's merged parent gets its Gram rows from a product started on a
    background thread before the model is edited (`SketchCache.prefetch_parent_rows`):
    the run takes the same steps with bit-for-bit the same costs as one that computes
    them after the merge, and the background rows are the ones read."""
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    used = []
    real = cache_lib.SketchCache._prefetched

    def counting(self, which, rows, cols):
        out = real(self, which, rows, cols)
        used.append(out is not None)
        return out

    def run():
        # Wider than a row's preselection (32), so the bound row is read; its values
        # are compared directly by the next test.
        enc = Encoder(clustered_mlp(6, widths=(96, 80)), search=dict(merge_search="top_k"))
        enc.run(density=0.4, verbose=False)
        return [(s.kind, s.unit, s.i, s.j, s.J, s.coef) for s in enc.trajectory.steps]

    monkeypatch.setattr(cache_lib.SketchCache, "_prefetched", counting)
    background = run()
    merges = sum(s[0] == "merge" for s in background)
    assert merges > 5 and sum(used) >= 2 * merges  # w and u rows of every parent
    monkeypatch.setattr(cache_lib.SketchCache, "prefetch_parent_rows", lambda *a: None)
    used.clear()
    after = run()
    assert not any(used)
    assert background == after


def test_prefetched_parent_rows_equal_the_rows_after_the_merge(monkeypatch):
    """`prefetch_parent_rows` then `replace_with_parent`: the Gram rows of the parent
    read from the background product are bit for bit those computed afterwards; a
    prefetch for another pair, or one overtaken by another change, is not read."""
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    enc = Encoder(clustered_mlp(7, widths=(40, 36)), search=dict(merge_search="top_k"))
    c = enc.groups["fc0"].cache
    assert isinstance(c, cache_lib.SketchCache)
    coef = (0.7, 0.45, 1.1, 0.8, 1.3, -0.2)
    c.prefetch_parent_rows(3, 8, *coef[:4])
    c.replace_with_parent(3, 8, *coef)
    assert c._prefetched("w", np.array([3]), None) is not None
    got = [c.gram_rows(w, np.array([3])) for w in ("w", "u")]
    c._prefetch = None
    for g, w in zip(got, ("w", "u")):
        np.testing.assert_array_equal(g, c.gram_rows(w, np.array([3])))
    c.prefetch_parent_rows(5, 9, *coef[:4])
    c.replace_with_parent(5, 10, *coef)  # another pair: the prefetch is dropped
    assert c._prefetched("w", np.array([5]), None) is None
    c.prefetch_parent_rows(6, 11, *coef[:4])
    c.replace_with_parent(6, 11, *coef)
    c.clear(12)  # a later change of the cache: the rows are computed again
    assert c._prefetched("u", np.array([6]), None) is None


def test_overlapping_one_thread_limits_restore_the_setting_once_all_are_out():
    """Two encoders in two threads hold the one-thread limit at overlapping times and
    may leave in either order: the limit stays while either holds it, and the setting
    from before comes back when the last one leaves (not the first one's view of it,
    one thread, which nested limits would restore last)."""
    from hope_keras.search import _threads

    def blas_threads():
        return {m["num_threads"] for m in threadpoolctl.threadpool_info()
                if m["user_api"] == "blas"}

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        # NumPy's wheels bundle OpenBLAS, which threadpoolctl (a dependency) controls.
        assert blas_threads(), "threadpoolctl sees no BLAS under NumPy"
        first, second = _threads.one_blas_thread(), _threads.one_blas_thread()
        first.__enter__()
        second.__enter__()
        assert blas_threads() == {1}
        first.__exit__(None, None, None)  # the first in leaves first
        assert blas_threads() == {1}
        second.__exit__(None, None, None)
        assert blas_threads() == {2}


@pytest.mark.parametrize("sketch", [True, False])
def test_runs_with_sketched_groups_use_one_blas_thread_and_restore_it(monkeypatch, sketch):
    """A run whose sketched groups merge computes their parents' rows on a background
    thread: its loop holds BLAS to one thread (OpenBLAS's others would take the main
    thread's core) and gives the setting back afterwards, even when a step fails;
    runs without sketched groups leave it alone."""
    from hope_keras.scoring import cache as cache_lib

    def blas_threads():
        return {m["num_threads"] for m in threadpoolctl.threadpool_info()
                if m["user_api"] == "blas"}

    if sketch:
        monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    seen = []
    execute = Encoder.execute

    def watched(self, action):
        seen.append(blas_threads())
        return execute(self, action)

    monkeypatch.setattr(Encoder, "execute", watched)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        # NumPy's wheels bundle OpenBLAS, which threadpoolctl (a dependency) controls.
        assert blas_threads(), "threadpoolctl sees no BLAS under NumPy"
        model = clustered_mlp(3)
        enc = Encoder(model, search=dict(merge_search="top_k"))
        assert any(isinstance(gs.cache, cache_lib.SketchCache)
                   for gs in enc.groups.values()) == sketch
        enc.run(steps=6, verbose=False)
        assert blas_threads() == {2}
        assert len(seen) == 6 and all(s == ({1} if sketch else {2}) for s in seen)

        def failing(self, action):
            raise RuntimeError("a failing step")

        monkeypatch.setattr(Encoder, "execute", failing)
        with pytest.raises(RuntimeError, match="a failing step"):
            enc.run(steps=10, verbose=False)
        assert blas_threads() == {2}
