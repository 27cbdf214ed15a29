"""Tests for hope_keras.activations.kernels against independent computations (Monte Carlo, scipy)."""

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import multivariate_normal, norm

from hope_keras.activations.kernels import (
    arccos_I,
    bivariate_normal_cdf,
    cross_kernel_approx,
    cross_kernel_exact,
    relu_mean,
    self_kernel,
    warped_correlation,
)

N_MC = 2_000_000


def _mc_pair(rng, gi, bi, gj, bj, rho, n=N_MC):
    z1 = rng.standard_normal(n)
    z2 = rho * z1 + np.sqrt(max(1.0 - rho * rho, 0.0)) * rng.standard_normal(n)
    return bi + abs(gi) * z1, bj + abs(gj) * z2


def _assert_mc(value, samples, n_se=5.0, abs_floor=1e-12):
    mean = samples.mean()
    se = samples.std() / np.sqrt(samples.size)
    assert abs(value - mean) <= n_se * se + abs_floor, (value, mean, se)


# ----------------------------------------------------------------- self-kernel

@pytest.mark.parametrize("gamma,beta", [(1.0, 0.0), (0.7, 0.4), (-1.3, -0.8), (0.5, 2.0), (2.0, -3.0)])
def test_self_kernel_monte_carlo(gamma, beta):
    rng = np.random.default_rng(0)
    y = beta + abs(gamma) * rng.standard_normal(N_MC)
    _assert_mc(float(self_kernel(gamma, beta)), np.maximum(y, 0.0) ** 2)


def test_self_kernel_quadrature_and_degenerate():
    for g, b in [(0.3, 1.1), (1.7, -0.2)]:
        ref, _ = integrate.quad(lambda y: max(y, 0.0) ** 2 * norm.pdf(y, b, g), -np.inf, np.inf)
        assert self_kernel(g, b) == pytest.approx(ref, rel=1e-9)
    beta = np.array([-2.0, 0.0, 1.5])
    np.testing.assert_array_equal(self_kernel(0.0, beta), np.maximum(beta, 0) ** 2)
    # vectorised & broadcast, finite for extreme ratios
    out = self_kernel(np.array([[1e-300], [1.0]]), np.array([1e10, -1e10, 0.0]))
    assert out.shape == (2, 3) and np.all(np.isfinite(out))
    assert out[0, 0] == pytest.approx(1e20)
    assert out[0, 1] == 0.0


def test_relu_mean():
    for g, b in [(0.3, 1.1), (1.7, -0.2), (1.0, 0.0)]:
        ref, _ = integrate.quad(lambda y: max(y, 0.0) * norm.pdf(y, b, g), -np.inf, np.inf)
        assert relu_mean(g, b) == pytest.approx(ref, rel=1e-9)
    np.testing.assert_array_equal(relu_mean(0.0, np.array([-1.0, 2.0])), [0.0, 2.0])


# ----------------------------------------------------------- warped correlation

def test_warped_correlation_formula_odd_and_limits():
    rho = np.linspace(-0.99, 0.99, 41)
    gi, ni, gj, nj = 0.8, 1.3, 1.7, 0.6
    kappa = rho / (1 - rho**2) * (gi / ni) * (gj / nj)
    ref = 2 * kappa / (1 + np.sqrt(1 + 4 * kappa**2))
    out = warped_correlation(rho, gi, ni, gj, nj)
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(warped_correlation(-rho, gi, ni, gj, nj), -out)
    # sign of gamma irrelevant
    np.testing.assert_allclose(warped_correlation(rho, -gi, ni, gj, nj), out, rtol=1e-15)
    assert np.all(np.abs(out) < 1)
    assert np.all(np.diff(out) > 0)
    # limits
    assert warped_correlation(1.0, 1.0, 1.0, 1.0, 1.0) == pytest.approx(1.0, abs=1e-11)
    assert warped_correlation(-1.0, 1.0, 1.0, 1.0, 1.0) == pytest.approx(-1.0, abs=1e-11)
    near = warped_correlation(1 - np.logspace(-2, -10, 9), 1.0, 1.0, 1.0, 1.0)
    assert np.all(np.diff(near) > 0) and near[-1] > 1 - 1e-9
    # extreme ratio: no overflow, still in [-1, 1]
    ext = warped_correlation(np.array([1.0, -1.0, 0.5]), 1e200, 1e-200, 1e200, 1e-200)
    np.testing.assert_array_equal(ext, [1.0, -1.0, 1.0])


def test_warped_correlation_inactive_is_zero():
    out = warped_correlation(np.array([0.5, 0.5, 1.0]), 1.0, np.array([0.0, 1.0, 0.0]), 1.0,
                             np.array([1.0, 0.0, 0.0]))
    np.testing.assert_array_equal(out, 0.0)
    assert warped_correlation(0.5, 0.0, 1.0, 1.0, 1.0) == 0.0  # gamma 0 -> kappa 0


# --------------------------------------------------------------- arc-cosine / Phi2

def test_arccos_I_values_and_mc():
    np.testing.assert_allclose(arccos_I([-1.0, 0.0, 1.0, 1.5]), [0.0, 1 / np.pi, 1.0, 1.0])
    # I(rho) = 2 E[relu(X) relu(Y)] for standard (X, Y) with correlation rho
    rng = np.random.default_rng(1)
    for rho in (-0.6, 0.3, 0.9):
        x, y = _mc_pair(rng, 1.0, 0.0, 1.0, 0.0, rho)
        _assert_mc(float(arccos_I(rho)), 2 * np.maximum(x, 0) * np.maximum(y, 0))


def test_bivariate_normal_cdf_against_scipy_grid():
    hs = np.array([-3.0, -1.2, -0.3, 0.0, 0.4, 1.1, 2.5])
    rhos = np.array([-0.999999, -0.95, -0.5, -0.1, 0.0, 0.2, 0.6, 0.97, 0.999999])
    H, K, R = np.meshgrid(hs, hs, rhos, indexing="ij")
    ours = bivariate_normal_cdf(H, K, R)
    ref = np.empty_like(ours)
    for idx in np.ndindex(H.shape):
        r = R[idx]
        ref[idx] = multivariate_normal.cdf([H[idx], K[idx]], mean=[0, 0], cov=[[1, r], [r, 1]])
    np.testing.assert_allclose(ours, ref, atol=1e-8)


def test_bivariate_normal_cdf_special_cases():
    # h = k = 0: 1/4 + arcsin(rho)/(2 pi)
    r = np.linspace(-1, 1, 11)
    np.testing.assert_allclose(bivariate_normal_cdf(0.0, 0.0, r), 0.25 + np.arcsin(r) / (2 * np.pi),
                               atol=1e-15)
    # rho = 0: product
    h = np.array([-1.0, 0.0, 0.7])
    np.testing.assert_allclose(bivariate_normal_cdf(h, 0.3, 0.0), norm.cdf(h) * norm.cdf(0.3), atol=1e-15)
    # |rho| = 1
    np.testing.assert_allclose(bivariate_normal_cdf(h, 0.3, 1.0), norm.cdf(np.minimum(h, 0.3)), atol=1e-15)
    np.testing.assert_allclose(bivariate_normal_cdf(h, 0.3, -1.0),
                               np.maximum(norm.cdf(h) + norm.cdf(0.3) - 1, 0), atol=1e-15)
    # continuity near |rho| = 1 and symmetry
    for hh, kk in [(0.3, 0.3), (0.3, -0.2), (0.0, 1.0), (-1.0, -1.0)]:
        assert bivariate_normal_cdf(hh, kk, 1 - 1e-13) == pytest.approx(
            float(bivariate_normal_cdf(hh, kk, 1.0)), abs=1e-6)
        assert bivariate_normal_cdf(hh, kk, -1 + 1e-13) == pytest.approx(
            float(bivariate_normal_cdf(hh, kk, -1.0)), abs=1e-6)
        assert bivariate_normal_cdf(hh, kk, 0.4) == pytest.approx(float(bivariate_normal_cdf(kk, hh, 0.4)),
                                                                 abs=1e-15)
    # infinite limits
    assert bivariate_normal_cdf(np.inf, 0.5, 0.3) == pytest.approx(norm.cdf(0.5), abs=1e-14)
    assert bivariate_normal_cdf(-np.inf, 0.5, 0.3) == 0.0


# ------------------------------------------------------------------ cross-kernels

CROSS_CASES = [
    (1.0, 0.0, 1.0, 0.0, 0.5),
    (0.8, 0.5, 1.3, -0.4, 0.3),
    (1.2, -0.7, 0.6, 0.9, -0.6),
    (0.5, 1.5, 0.9, 1.0, 0.95),
    (1.0, 0.3, 1.0, 0.3, -0.97),
    (-0.7, 0.2, 1.1, 0.0, 0.0),
]


@pytest.mark.parametrize("gi,bi,gj,bj,rho", CROSS_CASES)
def test_cross_kernel_exact_monte_carlo(gi, bi, gj, bj, rho):
    rng = np.random.default_rng(2)
    yi, yj = _mc_pair(rng, gi, bi, gj, bj, rho)
    _assert_mc(float(cross_kernel_exact(gi, bi, gj, bj, rho)), np.maximum(yi, 0) * np.maximum(yj, 0))


@pytest.mark.parametrize("gi,gj,rho", [(1.0, 1.0, 0.5), (0.7, 1.9, -0.4), (1.3, 0.4, 0.9)])
def test_cross_kernel_approx_monte_carlo_zero_bias(gi, gj, rho):
    rng = np.random.default_rng(3)
    yi, yj = _mc_pair(rng, gi, 0.0, gj, 0.0, rho)
    approx = cross_kernel_approx(rho, self_kernel(gi, 0.0), self_kernel(gj, 0.0))
    _assert_mc(float(approx), np.maximum(yi, 0) * np.maximum(yj, 0))


def test_approx_equals_exact_when_beta_zero():
    rng = np.random.default_rng(4)
    gi, gj = rng.uniform(0.1, 3, 200), rng.uniform(0.1, 3, 200) * rng.choice([-1, 1], 200)
    rho = rng.uniform(-1, 1, 200)
    rho[:4] = [-1.0, 1.0, 0.0, 1 - 1e-12]
    ex = cross_kernel_exact(gi, 0.0, gj, 0.0, rho)
    ap = cross_kernel_approx(rho, self_kernel(gi, 0.0), self_kernel(gj, 0.0))
    np.testing.assert_allclose(ex, ap, rtol=1e-10, atol=1e-14)


def test_exact_equals_self_kernel_at_rho_one():
    g = np.array([0.3, 1.0, 2.0, 0.7, 1.5])
    b = np.array([-1.0, 0.0, 0.5, 2.0, -4.0])
    np.testing.assert_allclose(cross_kernel_exact(g, b, g, b, 1.0), self_kernel(g, b), rtol=1e-12, atol=1e-300)
    # approaching rho = 1 continuously
    np.testing.assert_allclose(cross_kernel_exact(g, b, g, b, 1 - 1e-10), self_kernel(g, b), rtol=1e-4)
    # approximate kernel at rho_tilde = 1 with identical params is also the self-kernel
    k = self_kernel(g, b)
    np.testing.assert_allclose(cross_kernel_approx(1.0, k, k), k, rtol=1e-15)


@pytest.mark.parametrize("gi,bi,gj,bj", [(1.0, 0.3, 0.6, -0.2), (0.8, -0.5, 1.4, 0.9), (1.0, 0.0, 1.0, 0.0)])
def test_exact_degenerate_rho_pm_one_mc(gi, bi, gj, bj):
    rng = np.random.default_rng(5)
    for rho in (1.0, -1.0):
        yi, yj = _mc_pair(rng, gi, bi, gj, bj, rho)
        val = float(cross_kernel_exact(gi, bi, gj, bj, rho))
        _assert_mc(val, np.maximum(yi, 0) * np.maximum(yj, 0))
        near = float(cross_kernel_exact(gi, bi, gj, bj, rho * (1 - 1e-9)))
        assert near == pytest.approx(val, abs=1e-4)


def test_exact_gamma_zero_closed_forms():
    bj = np.array([-1.0, 0.0, 0.8])
    gj = 1.3
    # gamma_i = 0: y_i = beta_i constant
    for bi in (-0.5, 0.0, 1.7):
        ref = max(bi, 0.0) * (bj * norm.cdf(bj / gj) + gj * norm.pdf(bj / gj))
        np.testing.assert_allclose(cross_kernel_exact(0.0, bi, gj, bj, 0.4), ref, rtol=1e-13, atol=1e-300)
        np.testing.assert_allclose(cross_kernel_exact(gj, bj, 0.0, bi, -0.9), ref, rtol=1e-13, atol=1e-300)
    # both zero
    np.testing.assert_array_equal(cross_kernel_exact(0.0, 2.0, 0.0, bj, 1.0), 2 * np.maximum(bj, 0))
    # MC for one zero
    rng = np.random.default_rng(6)
    y = 0.8 + 1.3 * rng.standard_normal(N_MC)
    _assert_mc(float(cross_kernel_exact(0.0, 1.5, 1.3, 0.8, 0.2)), 1.5 * np.maximum(y, 0))


def test_kernels_vectorised_and_finite():
    rng = np.random.default_rng(7)
    shape = (5, 7)
    g = rng.uniform(-2, 2, shape)
    g[0] = 0.0
    b = rng.normal(size=shape)
    r = rng.uniform(-1, 1, shape)
    r[1] = 1.0
    r[2] = -1.0
    out = cross_kernel_exact(g, b, g[::-1], b[::-1], r)
    assert out.shape == shape and np.all(np.isfinite(out)) and np.all(out >= 0)
    # Cauchy-Schwarz bound
    assert np.all(out <= np.sqrt(self_kernel(g, b) * self_kernel(g[::-1], b[::-1])) * (1 + 1e-9) + 1e-15)


def test_exact_cross_kernel_beyond_the_clip_takes_the_linear_limit():
    """|β| > 50|γ|: relu(y) = y (or 0) almost surely; a Monte-Carlo-free check by the
    closed-form limit and by continuity from just inside the clip."""
    from scipy.stats import norm

    k = cross_kernel_exact(0.01, 0.6, 0.01, 0.6, 0.3)  # both linear: E[y_i y_j]
    assert k == pytest.approx(0.36 + 0.3 * 1e-4, rel=1e-12)
    k = cross_kernel_exact(1e-6, 0.1, 1.0, 0.0, 0.5)  # y_i linear, y_j a ReLU
    expected = 0.1 * norm.pdf(0.0) + 0.5 * 1e-6 * norm.cdf(0.0)
    assert k == pytest.approx(expected, rel=1e-9)
    assert cross_kernel_exact(1e-6, -0.1, 1.0, 0.3, 0.5) == 0.0  # y_i dead
    inside = cross_kernel_exact(1.0, 49.9, 0.7, -0.2, 0.4)
    outside = cross_kernel_exact(1.0, 50.1, 0.7, -0.2, 0.4)
    assert outside == pytest.approx(inside * 50.1 / 49.9, rel=1e-3)
