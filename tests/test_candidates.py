"""Certified merge candidates (hope_keras.search.candidates, the dense tables): the bounded
scan selects what the exhaustive scan selects, its tables stay consistent with a rebuild,
its bounds are lower bounds. The wide groups' searches (top-k rows, sketched groups,
threads): tests/test_merge_search_wide.py."""

import numpy as np
import pytest

import hope_keras
from conftest import clustered_mlp, mlp, small_resnet
from hope_keras.scoring import costs
from hope_keras.scoring.cache_builders import build_group_cache
from hope_keras.search.candidates import MergeTable
from hope_keras.search.encoder import Encoder
from hope_keras.graph.walker import walk
from hope_keras.search.merge_tables import dense as dense_tables
from hope_keras.scoring.neurons import extract_group


def _steps(result):
    return [(s.kind, s.unit, s.i, s.j, s.J, s.DR) for s in result.trajectory.steps]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("cost", ["hope", "paper"])
@pytest.mark.parametrize("options", [{}, {"merge_scale": "paper"}, {"actions": ("merge",)},
                                     {"kernel": "exact"}, {"budget": "flops"}])
def test_bounded_scan_reproduces_the_exhaustive_trajectory(seed, cost, options):
    """Same actions, bit for bit the same J and DR, at every step: with k = 1 and 3
    the bounds force rescans, reinsertions of merged parents and lazy re-pricing
    (under a FLOPs budget the default cost ranks a merge by J / sqrt(FLOPs));
    "auto" uses the dense tables (every pair's bound, priced once)."""
    options = dict(options)
    budget = {"flops": 0.3} if options.pop("budget", None) else {"density": 0.35}
    runs = {}
    for k in (None, 1, 3, "auto"):
        model = clustered_mlp(seed)
        analysis = hope_keras.analyze(model, kernel=options.get("kernel", "approx"))
        actions = options.get("actions", ("prune", "merge", "evict"))
        priced = hope_keras.costs.get({"name": cost, **{
            key: value for key, value in options.items() if key != "actions"}})
        runs[k] = hope_keras.Encoder(model, cost=priced, actions=actions, analysis=analysis,
                                     verbose=False,
                                     search=dict(merge_candidates=k)).compress(**budget)
    ref = _steps(runs[None])
    assert sum(s[0] == "merge" for s in ref) >= 5  # the fixture exercises merges
    for k in (1, 3, "auto"):
        assert _steps(runs[k]) == ref
        for a, b in zip(runs[k].trajectory.steps, runs[None].trajectory.steps):
            np.testing.assert_array_equal(a.coef, b.coef)


@pytest.mark.parametrize("cost,options", [("hope", {}), ("paper", {}),
                                          ("hope", {"budget": "flops"}),
                                          ("hope", {"kernel": "exact", "seed": 1}),
                                          ("paper", {"merge_scale": "paper", "seed": 1})])
def test_compact_dense_tables_reproduce_the_exhaustive_trajectory(monkeypatch, cost, options):
    """Dense tables stored compact (float32 bounds and B, as groups wider than
    `DENSE_FLOAT64_MAX` are): the pairs that could win are re-priced exactly, so the
    trajectory is the exhaustive scan's bit for bit."""
    options = dict(options)
    seed = options.pop("seed", 0)
    budget = {"flops": 0.3} if options.pop("budget", None) else {"density": 0.35}
    runs, tables = {}, []
    for k in (None, "auto"):
        if k == "auto":
            monkeypatch.setattr(dense_tables, "DENSE_FLOAT64_MAX", 0)
            monkeypatch.setattr(dense_tables.DenseTable, "_fill_dense", _recording(
                dense_tables.DenseTable._fill_dense, tables))
        model = clustered_mlp(seed)
        analysis = hope_keras.analyze(model, kernel=options.get("kernel", "approx"))
        actions = options.get("actions", ("prune", "merge", "evict"))
        priced = hope_keras.costs.get({"name": cost, **{
            key: value for key, value in options.items() if key != "actions"}})
        runs[k] = hope_keras.Encoder(model, cost=priced, actions=actions, analysis=analysis,
                                     verbose=False,
                                     search=dict(merge_candidates=k)).compress(**budget)
    assert tables and all(t.compact and t.lo.dtype == np.float32 and t.kc is None
                          for t in tables)
    ref = _steps(runs[None])
    assert sum(s[0] == "merge" for s in ref) >= 5
    assert _steps(runs["auto"]) == ref
    for a, b in zip(runs["auto"].trajectory.steps, runs[None].trajectory.steps):
        np.testing.assert_array_equal(a.coef, b.coef)


def _recording(fill, tables):
    def wrapped(self, ok):
        fill(self, ok)
        tables.append(self)
    return wrapped


def test_dense_tables_are_built_when_a_merge_is_first_priced():
    """A group whose neurons are first pruned for free (dead ones) holds no dense
    table (n × n) until a merge is priced; the trajectory is the one of tables
    built up front (the certified selection does not depend on when)."""
    def dead_first():
        model = clustered_mlp(4)
        bn = model.get_layer("fc1_bn")
        gamma, beta = bn.gamma.numpy(), bn.beta.numpy()
        gamma[:6], beta[:6] = 1e-3, -10.0  # six neurons whose ReLU is never on
        bn.gamma.assign(gamma)
        bn.beta.assign(beta)
        return model

    enc = Encoder(dead_first())
    gs = enc.groups["fc1"]
    assert gs.merges and gs._table is None and enc.groups["fc0"]._table is not None
    kinds = []
    while gs._table is None:
        action = enc.next_action()
        kinds.append((action.kind, action.unit))
        enc.execute(action)
    assert kinds.count(("prune", "fc1")) == 6
    ref = Encoder(dead_first())
    ref.groups["fc1"].table  # built now, before any step
    for e in (enc, ref):
        e.run(density=0.4, verbose=False)
    assert _steps_of(ref) == _steps_of(enc)


def _steps_of(enc):
    return [(s.kind, s.unit, s.i, s.j, s.J, s.DR) for s in enc.trajectory.steps]


def test_bounded_scan_on_a_residual_net_matches_the_exhaustive_one():
    runs = [hope_keras.Encoder(small_resnet(seed=3), search=dict(merge_candidates=k), verbose=False).compress(density=0.4) for k in (None, 2, "auto")]
    assert _steps(runs[0]) == _steps(runs[1]) == _steps(runs[2])


def _after_merges(count, **options):
    """A one-hidden-layer clustered MLP after `count` merges of the greedy engine
    (edits committed): ``(model, encoder)``."""
    model = clustered_mlp(2, widths=(30,))
    enc = Encoder(model, search=options)
    merges = 0
    while merges < count:
        action = enc.next_action()
        enc.execute(action)
        merges += action.kind == "merge"
    enc.editor.commit()
    return model, enc


def test_dense_tables_hold_exact_values_and_lower_bounds_after_merges():
    """The dense table (merge_candidates="auto"): after merges, its exactly priced
    pairs equal a cache rebuilt from the edited weights, every other pair's entry is
    below the true residual, and each row's bound is below its live entries."""
    model, enc = _after_merges(8)
    for name, gs in enc.groups.items():
        table = gs.table
        assert table.dense
        fresh = build_group_cache(extract_group(model, walk(model).groups[name]))
        live = np.flatnonzero(gs.pair_ok())
        r, l = np.meshgrid(live, live, indexing="ij")
        off = r != l
        r, l = r[off], l[off]
        pv = fresh.pair_values(np.minimum(r, l), np.maximum(r, l))
        cap = fresh.capacity
        A = cap[r] ** 2 + cap[l] ** 2
        E = A + 2 * pv.k_cross * pv.gram_u - pv.B ** 2
        ex = table.exact[r, l]
        assert ex.sum() >= 10 and (~ex).sum() >= 10  # both kinds of entries checked
        np.testing.assert_allclose(table.B[r, l][ex], pv.B[ex], rtol=1e-3, atol=1e-5)
        err = np.abs(table.lo[r, l][ex] - E[ex])
        assert np.all(err <= 1e-3 * np.abs(E[ex]) + 1e-4 * A[ex])
        assert np.all(table.lo[r, l][~ex] <= E[~ex] + 1e-4 * A[~ex])
        assert np.all(table.rowlo[r] <= table.lo[r, l])


def test_tables_match_a_rebuild_of_the_edited_model_and_bounds_hold():
    """After merges, the stored pair values equal those of a cache rebuilt from the
    edited weights, and every live partner outside a row satisfies its bounds (one
    hidden layer: with refresh="local" a group's cache is, by design, not updated
    for its neighbours' edits)."""
    model, enc = _after_merges(8, merge_candidates=3)
    for name, gs in enc.groups.items():
        table = gs.table
        fresh = build_group_cache(extract_group(model, walk(model).groups[name]))
        ok = gs.pair_ok()
        live = np.flatnonzero(ok)
        np.testing.assert_allclose(fresh.capacity[live], gs.cache.capacity[live], rtol=1e-4)
        for r in live:
            held = {int(c) for c in table.cand[r] if c >= 0 and ok[c]}
            for p, c in enumerate(table.cand[r]):
                if c < 0 or not ok[c]:
                    continue
                i, j = min(r, c), max(r, c)
                pv = fresh.pair_values([i], [j])
                assert table.B[r, p] == pytest.approx(pv.B[0], rel=1e-3, abs=1e-5)
                assert table.kc[r, p] * table.gu[r, p] == pytest.approx(
                    pv.k_cross[0] * pv.gram_u[0], rel=1e-3, abs=1e-5)
            others = [int(c) for c in live if c != r and c not in held]
            if not others:
                continue
            pv = fresh.pair_values(np.full(len(others), r), others)
            cap = fresh.capacity
            # The default cost orders rows by E = ‖f_r + f_l‖² − B².
            E = (cap[r] ** 2 + cap[others] ** 2 + 2 * pv.k_cross * pv.gram_u - pv.B ** 2)
            assert table.sum_residual
            assert np.all(E >= table.nc[r] - 1e-4 * (cap[r] ** 2 + cap[others] ** 2))
            den = cap[r] * cap[others]
            cos = np.where(den > 0, pv.k_cross * pv.gram_u / np.where(den > 0, den, 1), 0)
            assert np.all(cos <= table.ncos[r] + 1e-4)
            kk = np.sqrt(fresh.k_self[r] * fresh.k_self[others])
            kappa = np.where(kk > 0, pv.k_cross / np.where(kk > 0, kk, 1), 0)
            assert np.all(kappa <= table.nkap[r] + 1e-4)
            un = fresh.u_norm
            cu = np.abs(pv.gram_u) / np.maximum(un[r] * un[others], 1e-300)
            assert np.all(cu <= table.ncu[r] + 1e-4)


@pytest.mark.parametrize("kernel", ["approx", "exact"])
def test_pair_bound_is_below_the_merge_residual(kernel):
    """Paper's order: R = 2A − B² ≥ the singular-value bound ≥ ‖f_i − f_j‖²; the
    default cost's: E = ‖f_i + f_j‖² − B² ≥ the smaller squared singular value, and
    ≥ the row bounds from capacities, nkap and ncu; on every pair of a fixture with
    duplicated, dead and near-collinear neurons."""
    model = clustered_mlp(4, noise=0.0)
    bn = model.get_layer("fc0_bn")
    g = bn.gamma.numpy()
    g[5] = 0.0  # a dead neuron
    bn.gamma.assign(g)
    bn.beta.assign(np.where(np.arange(g.size) == 5, -1.0, bn.beta.numpy()).astype("float32"))
    for name in ("fc0", "fc1"):
        cache = build_group_cache(extract_group(model, walk(model).groups[name]), kernel)
        n = cache.size
        table = MergeTable(cache, 2, "paper", np.ones(n), np.ones(n, bool))
        r, l = np.nonzero(~np.eye(n, dtype=bool))
        bound, kc, gu = table._distance(r, l)
        cross = kc * gu
        pv = cache.pair_values(np.minimum(r, l), np.maximum(r, l))
        A = cache.capacity[r] ** 2 + cache.capacity[l] ** 2
        R = 2 * A - pv.B ** 2
        assert np.all(R >= bound)
        assert np.all(bound >= A - 2 * cross - 1e-6 * A - 1e-12)
        assert np.median((R - bound) / np.maximum(A, 1e-12)) < 0.2  # and it is tight
        # The default cost's residual and its bounds.
        ok = np.ones(n, bool)
        hope = MergeTable(cache, 2, "hope", np.ones(n), ok)
        E = A + 2 * cross - pv.B ** 2
        lam2 = hope._distance(r, l)[0]
        assert np.all(E >= lam2)
        assert np.median((E - lam2) / np.maximum(A, 1e-12)) < 0.2
        cap = cache.capacity
        row = hope._sv_bound(r, cap[l] ** 2)[:, 0]  # κ ≤ nkap, |cos u| ≤ ncu from the start
        assert np.all(E >= row)
        E = np.maximum(E, 0.0)  # the cost clamps it; the row bounds are ≥ 0
        assert np.all(E >= hope._nc_residual(ok)[r])
        assert np.all(E >= hope._q(np.arange(n))[r, l])
        assert np.all(pv.B <= cap[r] + cap[l] + 1e-9)  # t_max: C_rem + B ≤ C


def test_closed_form_of_the_merge_cost():
    """J_merge = n·sqrt(2R/(t² + R)) with R = 2A − B², t = 2·C_rem + B (the bounds
    rely on it)."""
    rng = np.random.default_rng(0)
    A = rng.uniform(0.1, 3.0, 200)
    B = np.sqrt(2 * A) * rng.uniform(0, 1, 200)
    c = rng.uniform(0.01, 10.0, 200)
    R, t = 2 * A - B * B, 2 * c + B
    np.testing.assert_allclose(costs.j_merge(A, B, c, 3), 3 * np.sqrt(2 * R / (t * t + R)),
                               rtol=1e-10)


def test_closed_form_of_the_default_merge_cost():
    """The default cost is sqrt(E)/(C_rem + B), E = ‖f_i + f_j‖² − B²: increasing in E,
    at least sqrt(E)/C when B ≤ ‖f_i‖ + ‖f_j‖ (the bounds rely on it)."""
    rng = np.random.default_rng(1)
    xi, xj = rng.uniform(0.1, 2.0, (2, 200))
    nss = (xi + xj) ** 2 * rng.uniform(0, 1, 200)
    B = np.sqrt(nss) * rng.uniform(0, 1, 200)
    C = xi + xj + rng.uniform(0.0, 5.0, 200)
    J = costs.get("hope").merge(costs.MergeCandidates(xi ** 2 + xj ** 2, B, C - xi - xj,
                                                      nss, 5, 5))
    E = nss - B * B
    np.testing.assert_allclose(J, np.sqrt(E) / (C - xi - xj + B), rtol=1e-12)
    assert np.all(J >= np.sqrt(E) / C * (1 - 1e-12))


def test_merge_candidates_option():
    model = mlp((6, 5), seed=3)
    hope = costs.get("hope")
    custom = costs.Cost.from_functions("custom", hope.prune, hope.merge, hope.evict,
                                       hope.rank)
    assert Encoder(model).merges.merge_candidates == 16
    assert Encoder(model, cost=custom).merges.merge_candidates is None  # no bounds: exhaustive
    enc = Encoder(model, cost=custom, search=dict(merge_candidates=2))
    assert enc.groups["fc0"].table.bound is None and enc.groups["fc0"].table.k == 2
    assert enc.next_action() is not None
    for bad in (0, -1, 2.5, True, "all"):
        with pytest.raises(ValueError, match="merge_candidates.*Received"):
            Encoder(model, search=dict(merge_candidates=bad))
    result = hope_keras.Encoder(model, search=dict(merge_candidates=None), verbose=False).compress(steps=2)
    assert result.trajectory.meta["options"]["merge_candidates"] is None


def test_cache_copy_shares_grams_until_a_merge():
    model = mlp((6,), seed=8)
    cache = build_group_cache(extract_group(model, walk(model).groups["fc0"]))
    before = cache.gram_u.copy()
    c2 = cache.copy()
    c2.clear(3)
    assert cache.capacity[3] > 0 and c2.capacity[3] == 0
    assert c2.gram_u is cache.gram_u  # a prune does not copy the tables
    sol = c2.solve_pair(1, 4)
    pc = costs.parent_coefficients(sol, sol.B, c2.gram_v[1, 1], c2.gram_v[4, 4],
                                   c2.gram_u[1, 1], c2.gram_u[4, 4], c2.gram_u[1, 4])
    c2.replace_with_parent(1, 4, *pc)
    assert c2.gram_u is not cache.gram_u
    np.testing.assert_array_equal(cache.gram_u, before)


def test_wide_groups_keep_float32_grams():
    from hope_keras.scoring import cache as cache_lib

    model = mlp((40,), d_in=5, seed=1)
    state = extract_group(model, walk(model).groups["fc0"])
    narrow = build_group_cache(state)
    old = cache_lib.FLOAT32_WIDTH
    try:
        cache_lib.FLOAT32_WIDTH = 32
        wide = build_group_cache(state)
    finally:
        cache_lib.FLOAT32_WIDTH = old
    assert narrow.gram_w.dtype == np.float64 and wide.gram_w.dtype == np.float32
    np.testing.assert_allclose(wide.B, narrow.B, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cost", ["hope", "paper"])
def test_select_with_a_rank_factor_matches_the_exhaustive_scan(cost):
    """DR = scale·J (the default cost under a FLOPs budget ranks by J / sqrt(FLOPs)):
    the bounded selection, told the factor, picks the exhaustive scan's pair, with and
    without a cutoff and at several live capacities."""
    model = clustered_mlp(5, widths=(30,))
    cache = build_group_cache(extract_group(model, walk(model).groups["fc0"]))
    n = cache.size
    p_init = np.random.default_rng(0).uniform(1.0, 3.0, n)
    cst = costs.get(cost)
    ok = np.ones(n, bool)
    ok[[3, 7]] = False
    C0 = float(cache.capacity[ok].sum())
    for scale in (1e-3, 0.2, 7.0):
        def price(A, B, c_rem, nss, P):
            J = cst.merge(costs.MergeCandidates(A, B, c_rem, nss, int(ok.sum()), n))
            return J, scale * (J / P if cost == "paper" else J)

        ref = MergeTable(cache, None, cost, p_init, ok)
        for C in (C0, 0.6 * C0):
            want = ref.select(C, int(ok.sum()), ok, price)
            for cutoff in (np.inf, want[0] * 1.5):
                table = MergeTable(cache, 1, cost, p_init, ok)
                got = table.select(C, int(ok.sum()), ok, price, cutoff=cutoff, scale=scale)
                assert got == want, (scale, C, cutoff)
