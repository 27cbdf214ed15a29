"""The compiled pair values (hope_keras.scoring.pair_kernels) against the vectorised
float64 formulas of cost_formulas / activations.kernels (the oracle, kept in the
library as the public `merge_solution` and the kernels): the same values to rounding
on random and degenerate pairs, and the engine's trajectories against the exhaustive
scan priced by the oracle: the same action at every step away from near-ties."""

import numpy as np
import pytest

import hope_keras
from hope_keras.activations import kernels
from hope_keras.scoring import cost_formulas
from hope_keras.scoring.cache import GroupCache, PairValues

from conftest import clustered_mlp, conv_net, plant_duplicate, small_resnet


def oracle_pair_values(cache, a, b, with_B=True):
    """`GroupCache.pair_values` (approx kernel) as NumPy expressions, in float64."""
    a, b = np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp)
    g, be, wn, ks = cache.gamma, cache.beta, cache.wnorm, cache.k_self
    gw, gv, gu = cache._gram_pair(a, b)
    den = wn[a] * wn[b]
    rho = kernels.warped_correlation(np.where(den > 0, gw / np.where(den > 0, den, 1.0), 0.0),
                                     g[a], wn[a], g[b], wn[b])
    kc = kernels.cross_kernel_approx(rho, ks[a], ks[b])
    if not with_B:
        return PairValues(rho, kc, None, gu)
    dv, du = cache.gram_diag("v"), cache.gram_diag("u")
    sol = cost_formulas.merge_solution(dv[a], dv[b], gv, du[a], du[b], gu, g[a], be[a],
                                       g[b], be[b], rho, kernel="approx", k_ii=ks[a],
                                       k_jj=ks[b])
    return PairValues(rho, kc, sol.B, gu)


def _random_cache(n, seed, degenerate):
    """A cache of `n` neurons from random vectors; `degenerate`: duplicated,
    collinear, anti-parallel, zero and dead neurons, γ = 0 and a large |β|/γ."""
    rng = np.random.default_rng(seed)
    v, w, u = rng.normal(size=(n, 7)), rng.normal(size=(n, 6)), rng.normal(size=(n, 5))
    gamma, beta = rng.uniform(0.2, 2.0, n) * rng.choice([-1, 1], n), rng.normal(size=n)
    if degenerate:
        v[1], w[1], u[1] = v[0], w[0], u[0]  # a duplicate
        v[2], w[2] = 2.5 * v[0], 2.5 * w[0]  # collinear
        v[3], w[3] = -v[0], -w[0]  # anti-parallel
        v[4], w[4], u[4] = 0.0, 0.0, 0.0  # zero
        w[5] = 0.0  # dead: no pair terms
        gamma[6] = 0.0  # a constant pre-activation
        gamma[7], beta[7] = 1e-3, -5.0  # never active
        gamma[8], beta[8] = 1e-3, 60.0  # |β|/γ past the clip
    wnorm = np.linalg.norm(w, axis=1)
    return GroupCache(gamma=gamma, beta=beta, wnorm=wnorm,
                      k_self=kernels.self_kernel(gamma, beta),
                      capacity=np.linalg.norm(u, axis=1)
                      * np.sqrt(kernels.self_kernel(gamma, beta)),
                      gram_v=v @ v.T, gram_w=w @ w.T, gram_u=u @ u.T)


@pytest.mark.parametrize("seed,degenerate", [(0, False), (1, True), (2, True)])
def test_compiled_pair_values_match_the_vectorised_formulas(seed, degenerate):
    n = 12
    cache = _random_cache(n, seed, degenerate)
    a, b = np.divmod(np.arange(n * n), n)
    got = cache.pair_values(a, b)
    ref = oracle_pair_values(cache, a, b)
    for f in ("rho", "k_cross", "B", "gram_u"):
        x, y = getattr(got, f), getattr(ref, f)
        assert x.dtype == np.float64 and np.all(np.isfinite(x)), f
        np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13, err_msg=f)
    light = cache.pair_values(a, b, with_B=False)
    assert light.B is None
    np.testing.assert_array_equal(light.rho, got.rho)
    np.testing.assert_array_equal(light.k_cross, got.k_cross)


def test_compiled_pair_values_do_not_depend_on_the_batch():
    """The tables price a pair in batches of any size and order and compare those
    values with each other: each pair's bits are the same in every batch."""
    cache = _random_cache(10, 3, True)
    a, b = np.divmod(np.arange(100), 10)
    full = cache.pair_values(a, b)
    for sl in (slice(0, 1), slice(17, 60), slice(5, 100, 7), slice(99, None, -3)):
        part = cache.pair_values(a[sl], b[sl])
        for f in ("rho", "k_cross", "B"):
            np.testing.assert_array_equal(getattr(part, f), getattr(full, f)[sl])


def test_the_merge_of_one_pair_is_the_batched_one():
    """The engine solves the merge it executes alone (`solve_pair`): B is the value
    the batch priced the pair at, to rounding."""
    cache = _random_cache(9, 4, True)
    for i, j in [(0, 1), (0, 2), (0, 3), (2, 6), (3, 8), (6, 7)]:
        batched = float(cache.pair_values([i], [j]).B[0])
        assert float(cache.solve_pair(i, j).B) == pytest.approx(batched, rel=1e-12,
                                                                abs=1e-14)


def _with_duplicates(model, pairs):
    """`model` with noisy duplicates planted: ``(producer, consumer, src, dst)``."""
    for k, (producer, consumer, src, dst) in enumerate(pairs):
        plant_duplicate(model, producer, consumer, src, dst, seed=k)
    return model


BUILDERS = {
    "mlp": lambda: clustered_mlp(3),
    "conv": lambda: _with_duplicates(conv_net(1, (16, 24, 12, 10)), [
        ("c3", "fc", 0, 1), ("c3", "fc", 2, 3), ("fc", "head", 0, 1), ("fc", "head", 2, 3)]),
    "resnet": lambda: _with_duplicates(small_resnet(2), [
        ("fc", "head", 0, 1), ("fc", "head", 2, 3), ("fc", "head", 4, 5)]),
}


def _steps(result):
    return [(s.kind, s.unit, s.i, s.j) for s in result.trajectory.steps]


def _compress(model, cost, search, **budget):
    return hope_keras.Encoder(model, cost=cost, search=search, correction=False,
                              verbose=False).compress(**budget)


@pytest.mark.parametrize("cost", ["hope", "paper"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_engine_matches_the_exhaustive_scan_priced_by_the_oracle(monkeypatch, cost, name):
    """The engine with compiled pricing and its tables against the brute force (every
    pair of every group re-priced each step by the NumPy float64 formulas): the same
    actions step by step. Two actions count as tied when their J agree to 1e-9
    relative (the rule the engine breaks exactly by the lower indices; near-ties may
    go either way when the last bits differ): the runs are compared up to the first
    such step."""
    build = BUILDERS[name]
    engine = _compress(build(), cost, {}, density=0.4)
    monkeypatch.setattr(GroupCache, "pair_values", oracle_pair_values)
    brute = _compress(build(), cost, {"merge_candidates": None}, density=0.4)
    a, b = _steps(engine), _steps(brute)
    assert sum(s[0] == "merge" for s in b) >= 2  # merges are priced and taken
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            ja, jb = engine.trajectory.steps[k].J, brute.trajectory.steps[k].J
            assert ja == pytest.approx(jb, rel=1e-9), (k, x, y, ja, jb)
            break
    else:
        assert len(a) == len(b)
    for s, t in zip(engine.trajectory.steps, brute.trajectory.steps):
        if (s.kind, s.unit, s.i, s.j) != (t.kind, t.unit, t.i, t.j):
            break
        assert s.J == pytest.approx(t.J, rel=1e-9, abs=1e-12)


def test_a_grid_of_pairs_is_priced_as_the_pairs_one_by_one():
    """`pair_grid` (whole Gram rows: the tables' bounds) and `pair_values` give the
    same bits for the same pairs."""
    cache = _random_cache(11, 5, True)
    rows, cols = np.array([0, 3, 7]), np.array([1, 2, 5, 8, 10])
    for picked in (None, cols):
        rho, kc, gu = cache.pair_grid(rows, picked)
        c = np.arange(11) if picked is None else picked
        pv = cache.pair_values(np.repeat(rows, c.size), np.tile(c, rows.size), with_B=False)
        np.testing.assert_array_equal(rho.ravel(), pv.rho)
        np.testing.assert_array_equal(kc.ravel(), pv.k_cross)
        np.testing.assert_array_equal(gu.ravel(), pv.gram_u)


def test_sketched_groups_price_exact_pairs_as_the_vectorised_formulas(monkeypatch):
    """A sketched group re-prices its selected pairs from exact Gram entries
    (`SketchCache.exact_pairs`, `exact_pair_values`) with the compiled kernels: ρ̃,
    K(i,j) and B as the NumPy formulas give them from the same entries."""
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 16)
    enc = hope_keras.Encoder(clustered_mlp(3), search=dict(merge_search="top_k"),
                             correction=False, verbose=False)
    c = enc.groups["fc0"].cache
    assert isinstance(c, cache_lib.SketchCache)
    ii, jj = np.array([0, 2, 5, 1, 8]), np.array([3, 7, 9, 4, 9])
    for p, (i, j) in enumerate(zip(ii, jj)):
        gv_ii, gv_jj, gv_ij, gw_ij, gu_ii, gu_jj, gu_ij = c.merge_terms(int(i), int(j))
        g, be, wn, ks = c.gamma, c.beta, c.wnorm, c.k_self
        den = wn[i] * wn[j]
        rho = kernels.warped_correlation(gw_ij / den if den > 0 else 0.0, g[i], wn[i],
                                         g[j], wn[j])
        kc = kernels.cross_kernel_approx(rho, ks[i], ks[j])
        B = cost_formulas.merge_solution(gv_ii, gv_jj, gv_ij, gu_ii, gu_jj, gu_ij, g[i],
                                         be[i], g[j], be[j], rho, k_ii=ks[i], k_jj=ks[j]).B
        got = c.exact_pair_values(int(i), int(j))
        for x, y in ((got.rho, rho), (got.k_cross, kc), (got.B, B), (got.gram_u, gu_ij)):
            assert x.shape == (1,)
            np.testing.assert_allclose(x[0], float(y), rtol=1e-11, atol=1e-13)
    batch = c.exact_pairs(ii, jj)
    assert all(x.shape == (ii.size,) and np.all(np.isfinite(x)) for x in batch)
