"""Capacity/pair cache: symmetries, Monte-Carlo capacity, degenerate pairs, chunking."""

import keras
import numpy as np
import pytest

from conftest import L, mlp, randomize_bn
from hope_keras.scoring import cache as cache_lib
from hope_keras.scoring import cache_builders
from hope_keras.scoring import costs
from hope_keras.graph.walker import walk
from hope_keras.scoring.neurons import extract_group


def _cache(model, name, kernel="approx"):
    return cache_builders.build_group_cache(extract_group(model, walk(model).groups[name]), kernel)


def _set(layer, attr, fn):
    var = getattr(layer, attr)
    var.assign(fn(var.numpy()).astype("float32"))


def test_capacity_matches_monte_carlo(rng):
    model = mlp((5,), seed=3)
    c = _cache(model, "fc0")
    state = extract_group(model, walk(model).groups["fc0"])
    for i in range(5):
        y = rng.normal(state.beta[i], abs(state.gamma[i]), size=400_000)
        mc = np.sqrt(np.mean(np.maximum(y, 0) ** 2)) * np.linalg.norm(state.u[i])
        assert c.capacity[i] == pytest.approx(mc, rel=1e-2)


def test_capacity_invariant_to_rescaling_symmetry():
    model = mlp((6, 5), seed=1)
    before = _cache(model, "fc0")
    k, scale = 2, 3.7
    bn, nxt = model.get_layer("fc0_bn"), model.get_layer("fc1")
    # relu is positively homogeneous: (γ, β) × c on the neuron, its output slice × 1/c.
    _set(bn, "gamma", lambda g: np.where(np.arange(6) == k, g * scale, g))
    _set(bn, "beta", lambda b: np.where(np.arange(6) == k, b * scale, b))
    _set(nxt, "kernel", lambda w: np.where((np.arange(6) == k)[:, None], w / scale, w))
    after = _cache(model, "fc0")
    np.testing.assert_allclose(after.capacity, before.capacity, rtol=1e-5)
    np.testing.assert_allclose(after.B, before.B, rtol=1e-4, atol=1e-6)


def test_capacity_invariant_to_scaling_raw_weights_before_bn(rng):
    model = mlp((6,), seed=2)
    model.get_layer("fc0").bias.assign(rng.normal(size=6).astype("float32"))
    before = _cache(model, "fc0")
    c = 5.0
    p, bn = model.get_layer("fc0"), model.get_layer("fc0_bn")
    _set(p, "kernel", lambda w: w * c)
    _set(p, "bias", lambda b: b * c)
    _set(bn, "moving_mean", lambda m: m * c)
    _set(bn, "moving_variance", lambda v: v * c * c)
    bn.epsilon *= c * c  # BN's ε sits inside sqrt(σ² + ε): scale it too for exact invariance
    after = _cache(model, "fc0")
    np.testing.assert_allclose(after.capacity, before.capacity, rtol=1e-5)
    np.testing.assert_allclose(after.B, before.B, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(after.rho, before.rho, atol=1e-6)


def test_pair_table_equals_explicit_vector_path():
    model = mlp((7,), seed=4)
    state = extract_group(model, walk(model).groups["fc0"])
    c = cache_builders.build_group_cache(state)
    v, u, w = state.v, state.u, state.w_eff
    for i, j in [(0, 1), (2, 5), (6, 3)]:
        cos = w[i] @ w[j] / np.linalg.norm(w[i]) / np.linalg.norm(w[j])
        from hope_keras.activations.kernels import warped_correlation

        rho = warped_correlation(cos, abs(state.gamma[i]), np.linalg.norm(w[i]),
                                 abs(state.gamma[j]), np.linalg.norm(w[j]))
        sol = costs.merge_solution(v[i] @ v[i], v[j] @ v[j], v[i] @ v[j], u[i] @ u[i],
                                   u[j] @ u[j], u[i] @ u[j], state.gamma[i], state.beta[i],
                                   state.gamma[j], state.beta[j], rho)
        assert c.rho[i, j] == pytest.approx(float(rho), abs=1e-10)
        assert c.B[i, j] == pytest.approx(float(sol.B), rel=1e-9)
        assert c.B[j, i] == pytest.approx(c.B[i, j], rel=1e-9)


def test_duplicated_and_dead_neurons_give_finite_correct_values():
    model = mlp((5,), seed=5)
    p, bn, nxt = model.get_layer("fc0"), model.get_layer("fc0_bn"), model.get_layer("head")
    _set(p, "kernel", lambda w: w[:, [0, 0, 2, 3, 4]])
    _set(nxt, "kernel", lambda w: w[[0, 0, 2, 3, 4]])
    for attr in ("gamma", "beta", "moving_mean", "moving_variance"):
        _set(bn, attr, lambda a: a[[0, 0, 2, 3, 4]])
    _set(bn, "gamma", lambda g: np.where(np.arange(5) == 4, 0.0, g))
    _set(bn, "beta", lambda b: np.where(np.arange(5) == 4, 0.0, b))
    c = _cache(model, "fc0")
    for table in (c.B, c.rho, c.k_cross, c.capacity):
        assert np.all(np.isfinite(table))
    assert c.rho[0, 1] == pytest.approx(1.0)
    # Duplicates: the best parent is the child itself, doubled.
    assert c.B[0, 1] == pytest.approx(2 * c.capacity[0], rel=1e-6)
    assert c.capacity[4] == 0 and c.wnorm[4] == 0
    # Merging with a dead neuron: the best parent is the live child alone.
    np.testing.assert_allclose(c.B[4, :4], c.capacity[:4], rtol=1e-6)


def test_chunked_cache_equals_unchunked(monkeypatch):
    model = mlp((300,), d_in=20, seed=6)
    state = extract_group(model, walk(model).groups["fc0"])
    full = cache_builders.build_group_cache(state)
    monkeypatch.setattr(cache_lib, "CHUNK_ROWS", 37)
    chunked = cache_builders.build_group_cache(state)
    np.testing.assert_allclose(chunked.B, full.B, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cache_lib.gram(state.u, chunk_rows=17), state.u @ state.u.T,
                               rtol=1e-12, atol=1e-12)


def test_exact_kernel_equals_approx_when_biases_are_zero():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    x = L.ReLU()(L.BatchNormalization(center=False, name="bn")(L.Dense(5, name="p")(inputs)))
    model = randomize_bn(keras.Model(inputs, L.Dense(3)(x)))
    approx, exact = _cache(model, "p"), _cache(model, "p", kernel="exact")
    np.testing.assert_allclose(exact.k_cross, approx.k_cross, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(exact.B, approx.B, rtol=1e-6, atol=1e-9)


def test_replace_with_parent_matches_fresh_cache_of_edited_vectors():
    model = mlp((6,), seed=8)
    state = extract_group(model, walk(model).groups["fc0"])
    c = cache_builders.build_group_cache(state)
    sol = c.solve_pair(1, 4)
    pc = costs.parent_coefficients(sol, sol.B, c.gram_v[1, 1], c.gram_v[4, 4],
                                   c.gram_u[1, 1], c.gram_u[4, 4], c.gram_u[1, 4])
    c.replace_with_parent(1, 4, *pc)
    v = state.v.copy()
    v[1] = pc.a1 * v[1] + pc.a2 * v[4]
    u = state.u.copy()
    u[1] = pc.m1 * u[1] + pc.m2 * u[4]
    np.testing.assert_allclose(c.gram_v[1], v @ v[1] * (np.arange(6) != 4), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(c.gram_u[1], u @ u[1] * (np.arange(6) != 4), rtol=1e-9,
                               atol=1e-12)
    assert c.capacity[1] == pytest.approx(float(sol.B), rel=1e-9)


def test_gram_backends_agree_and_the_option_is_checked(monkeypatch):
    """TensorFlow (the GPU path) and NumPy (the CPU path) give the same Gram matrix,
    in one product and in mirrored row chunks, float64 and float32."""
    x = np.random.default_rng(1).normal(size=(37, 11))
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-4)):
        for chunk in (64, 8):
            a = cache_lib.gram(x, chunk_rows=chunk, dtype=dtype, backend="tensorflow")
            b = cache_lib.gram(x, chunk_rows=chunk, dtype=dtype, backend="numpy")
            assert a.dtype == b.dtype == dtype
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
            np.testing.assert_allclose(b, x @ x.T, rtol=tol, atol=tol)
            np.testing.assert_array_equal(b, b.T)
    monkeypatch.setattr(cache_lib, "GRAM_BACKEND", "numpy")
    np.testing.assert_array_equal(cache_lib.gram(x), cache_lib.gram(x, backend="numpy"))
    with pytest.raises(ValueError, match="backend must be .* Received: backend='cuda'"):
        cache_lib.gram(x, backend="cuda")


def test_wide_float32_cache_equals_the_float64_formulas_bit_for_bit(monkeypatch):
    # Wide groups (float32 tables) round w_eff and b bᵀ a chunk at a time and keep
    # u in the readers' dtype: the same bits as rounding the float64 arrays whole.
    from hope_keras.scoring import neurons

    model = mlp((40, 12), seed=11)
    group = walk(model).groups["fc0"]
    reference = extract_group(model, group)  # float64 u (narrower than NATIVE_U_WIDTH)
    assert reference.u.dtype == np.float64
    monkeypatch.setattr(neurons, "NATIVE_U_WIDTH", 32)
    monkeypatch.setattr(cache_lib, "FLOAT32_WIDTH", 32)
    monkeypatch.setattr(cache_lib, "CHUNK_ROWS", 7)  # several chunks, a ragged last one
    state = extract_group(model, group)
    assert state.u.dtype == np.float32
    np.testing.assert_array_equal(state.u, reference.u)
    np.testing.assert_array_equal(state.u_sq_norms(), reference.u_sq_norms())
    c = cache_builders.build_group_cache(state)
    w32 = reference.w_eff.astype(np.float32)  # the whole float64 array, rounded once
    gram_w = cache_lib.gram(w32, dtype=np.float32)
    b = reference.b_eff
    assert c.gram_w.dtype == np.float32
    np.testing.assert_array_equal(c.gram_w, gram_w)
    np.testing.assert_array_equal(c.gram_v, gram_w + np.outer(b, b).astype(np.float32))
    np.testing.assert_array_equal(c.gram_u, cache_lib.gram(reference.u, dtype=np.float32))


@pytest.mark.parametrize("order", ["C", "F"])
def test_scaled_rows_rounds_like_the_whole_product(order, monkeypatch):
    monkeypatch.setattr(cache_lib, "CHUNK_ROWS", 1)  # blocks of 27 columns, a ragged last
    rng = np.random.default_rng(0)
    w = np.asarray(rng.normal(size=(37, 300)).astype(np.float32), order=order)
    scale = rng.uniform(0.1, 3.0, 37)
    out = cache_builders._scaled_rows(scale, w, np.float32)
    np.testing.assert_array_equal(out, (scale[:, None] * w).astype(np.float32))
    assert out.flags["F_CONTIGUOUS" if order == "F" else "C_CONTIGUOUS"]
