"""Tests for hope_keras.activations against independent computations.

Monte Carlo (one seeded draw of 10^6 standard pairs reused for every case), scipy
adaptive quadrature, a dense tensor Gauss–Legendre grid, Keras' own activations, and
hope_keras.activations.kernels (bit-identity of ReLU).
"""

import functools
import math

import keras
import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from hope_keras import activations as A
from hope_keras.activations import kernels
from hope_keras.derivative_matching import gelu_approximate

N_MC = 1_000_000

SPECS = {
    "relu": A.get("relu"),
    "relu6": A.get("relu6"),
    "relu_clipped_threshold_leaky": A.relu(negative_slope=0.1, max_value=4.0, threshold=0.5),
    "relu_negative_threshold": A.relu(threshold=-0.5),
    "relu_threshold_above_max": A.relu(max_value=0.5, threshold=1.0),
    "leaky_relu": A.leaky_relu(0.3),
    "elu": A.elu(1.0),
    "elu_half": A.elu(0.5),
    "selu": A.get("selu"),
    "silu": A.get("silu"),
    "hard_silu": A.get("hard_silu"),
    "hard_sigmoid": A.get("hard_sigmoid"),
    "gelu": A.get("gelu"),
    "gelu_approximate": A.get("gelu_approximate"),
    "sigmoid": A.get("sigmoid"),
    "tanh": A.get("tanh"),
    "softplus": A.get("softplus"),
    "mish": A.get("mish"),
    "linear": A.get("linear"),
}

# (mu_i, sigma_i, mu_j, sigma_j, rho): generic, strong anti-correlation, |rho| -> 1,
# sigma -> 0 on one and both sides, wide pre-activations.
CASES = np.array([
    (0.3, 1.2, -0.4, 0.8, 0.5),
    (1.0, 2.0, 0.5, 0.5, -0.7),
    (-0.5, 1.0, 0.2, 1.5, 0.999),
    (0.4, 0.7, -0.3, 1.1, -0.999),
    (0.8, 1e-6, -0.2, 1.3, 0.6),
    (0.1, 1e-6, 0.3, 1e-6, 0.3),
    (2.5, 3.0, -2.0, 2.0, 0.2),
])


@pytest.fixture(scope="module")
def draws():
    rng = np.random.default_rng(20240613)
    z1 = rng.standard_normal(N_MC)
    z2 = rng.standard_normal(N_MC)
    return z1, z2


def _check_mc(value, samples, what):
    mean = samples.mean()
    se = samples.std() / np.sqrt(samples.size)
    tol = 5.0 * se + 1e-12 * (1.0 + abs(mean))
    assert abs(value - mean) <= tol, f"{what}: {value!r} vs MC {mean!r} ± {se!r}"


@pytest.mark.parametrize("name", list(SPECS))
def test_moments_match_monte_carlo(name, draws):
    act = SPECS[name]
    z1, z2 = draws
    mi, si, mj, sj, r = (CASES[:, k] for k in range(5))
    means = act.mean(mi, si)
    seconds = act.second_moment(mi, si)
    variances = act.variance(mi, si)
    crosses = act.cross(mi, si, mj, sj, r)
    for c, (a, b, c2, d, rho) in enumerate(CASES):
        x = act(a + b * z1)
        y = act(c2 + d * (rho * z1 + np.sqrt(1.0 - rho * rho) * z2))
        _check_mc(means[c], x, f"{name} mean case {c}")
        _check_mc(seconds[c], x * x, f"{name} second moment case {c}")
        # variance: compare E[(psi - E psi)^2] with the exact mean removed
        _check_mc(variances[c], (x - means[c]) ** 2, f"{name} variance case {c}")
        _check_mc(crosses[c], x * y, f"{name} cross case {c}")


def test_relu_cross_tiny_sigma():
    """kernels.cross_kernel_exact for |β| > 50|γ|: the linear limit, not a clip of
    β/|γ| at ±50 (which would be wrong there)."""
    # relu(y_i) = y_i almost surely, so K = 0.8 E[relu(y_j)] + ρ σ_i σ_j Φ(μ_j/σ_j)
    from scipy.stats import norm

    value = A.get("relu").cross(0.8, 1e-6, -0.2, 1.3, 0.6)
    expected = 0.8 * kernels.relu_mean(1.3, -0.2) + 0.6 * 1e-6 * 1.3 * norm.cdf(-0.2 / 1.3)
    assert value == pytest.approx(expected, rel=1e-9)


def test_relu_is_bit_identical_to_kernels():
    rng = np.random.default_rng(1)
    n = 64
    g = np.concatenate([rng.uniform(0.1, 2.0, n - 4), [0.0, 1e-300, 1e-6, -0.5]])
    b = rng.normal(0, 1.5, n)
    rho = np.clip(rng.normal(0, 0.6, (n, n)), -1, 1)
    rho[0, :4] = [-1.0, 1.0, 0.0, 0.999999]
    relu = A.get("relu")
    np.testing.assert_array_equal(relu.mean(b, g), kernels.relu_mean(g, b))
    np.testing.assert_array_equal(relu.second_moment(b, g), kernels.self_kernel(g, b))
    np.testing.assert_array_equal(
        relu.cross(b[:, None], g[:, None], b[None], g[None], rho),
        kernels.cross_kernel_exact(g[:, None], b[:, None], g[None], b[None], rho))
    assert A.relu() is relu and relu.positively_homogeneous


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "gelu", "elu", "hard_silu", "relu6",
                                  "softplus"])
def test_one_dimensional_moments_match_adaptive_quadrature(name):
    act = SPECS[name]
    for mu, sigma in [(0.3, 0.7), (-1.5, 2.5), (2.0, 0.2), (0.0, 6.0)]:
        pts = [(p - mu) / sigma for p in set(act.breakpoints) | {0.0} if abs(p - mu) < 12 * sigma]

        def quad(f):
            return integrate.quad(lambda z: f(act(mu + sigma * z)) * norm.pdf(z), -13, 13,
                                  points=pts or None, epsabs=1e-15, epsrel=1e-13, limit=400)[0]

        m1, m2 = quad(lambda v: v), quad(lambda v: v * v)
        assert float(act.mean(mu, sigma)) == pytest.approx(m1, rel=1e-9, abs=1e-14)
        assert float(act.second_moment(mu, sigma)) == pytest.approx(m2, rel=1e-9, abs=1e-14)
        assert float(act.variance(mu, sigma)) == pytest.approx(m2 - m1 * m1, rel=1e-7, abs=1e-14)


@functools.lru_cache(maxsize=None)
def _leggauss(n):
    return np.polynomial.legendre.leggauss(n)


def _tensor_gl_cross(act, mi, si, mj, sj, r, n=600, lim=9.0):
    """Reference E[psi(x_i) psi(x_j)] by a dense tensor Gauss–Legendre rule (smooth psi)."""
    x, w = _leggauss(n)
    x, w = lim * x, lim * w * norm.pdf(lim * x)
    s = np.sqrt(1.0 - r * r)
    fi = act(mi + si * x)
    inner = act(mj + sj * (r * x[:, None] + s * x[None, :])) @ w
    return float(np.sum(w * fi * inner))


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "silu", "gelu", "gelu_approximate",
                                  "softplus", "mish"])
def test_smooth_cross_matches_dense_quadrature(name):
    act = SPECS[name]
    cases = [(0.3, 1.0, -0.5, 0.7, 0.5), (0.3, 2.0, -0.5, 1.5, 0.95), (-1.0, 0.5, 2.0, 1.0, -0.6)]
    for c in cases:
        ref = _tensor_gl_cross(act, *c)
        scale = np.sqrt(act.second_moment(c[0], c[1]) * act.second_moment(c[2], c[3]))
        assert abs(float(act.cross(*c)) - ref) <= 1e-8 * scale, (name, c)


@pytest.mark.parametrize("name", ["tanh", "gelu", "elu", "softplus"])
def test_cross_agrees_with_the_common_factor_route(name):
    # Mehler (or the ELU closed form) against the independent common-factor quadrature
    act = SPECS[name]
    # (the common-factor route is built for |rho| near 1, where its inner sums are narrow)
    rng = np.random.default_rng(3)
    n = 40
    mi, mj = rng.normal(0, 1, n), rng.normal(0, 1, n)
    si, sj = rng.uniform(0.2, 3.0, n), rng.uniform(0.2, 3.0, n)
    r = rng.uniform(0.95, 0.995, n) * rng.choice([-1.0, 1.0], n)
    fast = act.cross(mi, si, mj, sj, r)
    slow = act._cross_common_factor(mi, si, mj, sj, r)
    scale = np.sqrt(act.second_moment(mi, si) * act.second_moment(mj, sj))
    assert np.all(np.abs(fast - slow) <= 1e-8 * scale)


@pytest.mark.parametrize("name", list(SPECS))
def test_symmetry_and_limits(name):
    act = SPECS[name]
    rng = np.random.default_rng(2)
    n = 12
    mu = rng.normal(0, 1.2, n)
    sigma = rng.uniform(0.1, 2.5, n)
    r = np.clip(rng.normal(0, 0.5, (n, n)), -1, 1)
    r = (r + r.T) / 2
    np.fill_diagonal(r, 1.0)
    k = act.cross(mu[:, None], sigma[:, None], mu[None], sigma[None], r)
    assert k.shape == (n, n) and np.all(np.isfinite(k))
    scale = np.sqrt(np.outer(act.second_moment(mu, sigma), act.second_moment(mu, sigma)))
    np.testing.assert_array_less(np.abs(k - k.T), 1e-10 * scale + 1e-15)
    # rho = 1 with equal parameters is the self-kernel
    np.testing.assert_allclose(np.diag(k), act.second_moment(mu, sigma), rtol=1e-8, atol=1e-15)
    # rho = 0: independent (exactly the product, except for ReLU's kernels formula)
    k0 = act.cross(mu[:, None], sigma[:, None], mu[None], sigma[None], 0.0)
    np.testing.assert_allclose(k0, np.outer(act.mean(mu, sigma), act.mean(mu, sigma)),
                               rtol=1e-12 if name == "relu" else 0, atol=1e-16)
    # rho = -1: y = mu_j - sigma_j Z, a one-dimensional integral (adaptive, cut at kinks)
    for i, j in [(0, 1), (2, 5)]:
        pts = [(p - mu[i]) / sigma[i] for p in act.breakpoints] + \
              [(mu[j] - p) / sigma[j] for p in act.breakpoints]
        ref = integrate.quad(
            lambda z: act(mu[i] + sigma[i] * z) * act(mu[j] - sigma[j] * z) * norm.pdf(z),
            -12, 12, points=[p for p in pts if abs(p) < 12] or None, epsabs=1e-14,
            epsrel=1e-12, limit=400)[0]
        assert float(act.cross(mu[i], sigma[i], mu[j], sigma[j], -1.0)) == pytest.approx(
            ref, rel=1e-8, abs=1e-13)


@pytest.mark.parametrize("name", list(SPECS))
def test_degenerate_inputs_are_finite_and_exact(name):
    act = SPECS[name]
    mu = np.array([-30.0, -2.0, 0.0, 0.7, 3.0, 40.0])
    # sigma = 0: psi(mu) exactly
    np.testing.assert_array_equal(act.mean(mu, 0.0), act(mu))
    np.testing.assert_array_equal(act.second_moment(mu, 0.0), act(mu) ** 2)
    np.testing.assert_array_equal(act.variance(mu, 0.0), 0.0)
    np.testing.assert_array_equal(act.cross(mu, 0.0, mu[::-1], 0.0, 0.3), act(mu) * act(mu[::-1]))
    np.testing.assert_allclose(act.cross(mu, 0.0, 0.5, 1.5, 0.7), act(mu) * act.mean(0.5, 1.5),
                               rtol=1e-15, atol=0)
    # a grid of extreme inputs: finite, broadcast
    m = np.array([-500.0, -3.0, 0.0, 2.0, 500.0])[:, None, None]
    s = np.array([0.0, 1e-300, 1e-6, 1.0, 20.0])[None, :, None]
    r = np.array([-1.0, -0.999999, 0.0, 0.5, 1.0])[None, None, :]
    k = act.cross(m, s, 0.3, 1.1, r)
    assert k.shape == (5, 5, 5) and np.all(np.isfinite(k))
    assert np.all(np.isfinite(act.mean(m, s))) and np.all(np.isfinite(act.second_moment(m, s)))
    assert np.all(act.second_moment(m, s) >= 0) and np.all(act.variance(m, s) >= 0)
    # sign of sigma is ignored, rho is clipped
    assert float(act.cross(0.2, -1.3, 0.1, 0.9, 1.5)) == float(act.cross(0.2, 1.3, 0.1, 0.9, 1.0))


def test_polynomial_from_function_is_exact():
    cube = A.GaussianActivation.from_function("cube", lambda x: x**3)
    r = np.linspace(-1, 1, 9)
    np.testing.assert_allclose(cube.cross(0.0, 1.0, 0.0, 1.0, r), 9 * r + 6 * r**3, atol=1e-12)
    # E[(1 + 2Z)^6] by the binomial theorem and E[Z^k] = (k-1)!! for even k
    ref = sum(math.comb(6, k) * 2**k * (0 if k % 2 else math.prod(range(k - 1, 0, -2)))
              for k in range(7))
    assert float(cube.second_moment(1.0, 2.0)) == pytest.approx(ref, rel=1e-12)


X_GRID = np.concatenate([np.linspace(-8, 8, 321), [-3.0, 3.0, 0.0, 6.0, 0.5, 4.0, 1.0, -0.5]])


@pytest.mark.parametrize("identifier", [
    "relu", "relu6", "leaky_relu", "elu", "selu", "silu", "swish", "hard_silu", "hard_swish",
    "hard_sigmoid", "gelu", "sigmoid", "tanh", "softplus", "mish", "linear"])
def test_forward_matches_keras(identifier):
    fn = keras.activations.get(identifier)
    ref = keras.ops.convert_to_numpy(fn(keras.ops.convert_to_tensor(X_GRID, dtype="float64")))
    act = A.get(identifier)
    assert act is A.get(fn)
    np.testing.assert_allclose(act(X_GRID), ref, rtol=1e-12, atol=1e-15)
    assert act.value_at_zero == pytest.approx(float(ref[X_GRID == 0.0][0]), abs=1e-15)


@pytest.mark.parametrize("layer,name,params", [
    (keras.layers.ReLU(), "relu", ()),
    (keras.layers.ReLU(max_value=6.0), "relu6", ()),
    (keras.layers.ReLU(negative_slope=0.1, max_value=4.0, threshold=0.5), "relu",
     (("negative_slope", 0.1), ("max_value", 4.0), ("threshold", 0.5))),
    (keras.layers.ReLU(threshold=1.0), "relu",
     (("negative_slope", 0.0), ("max_value", None), ("threshold", 1.0))),
    (keras.layers.Activation(functools.partial(keras.activations.relu, threshold=-0.5)), "relu",
     (("negative_slope", 0.0), ("max_value", None), ("threshold", -0.5))),
    (keras.layers.LeakyReLU(negative_slope=0.3), "leaky_relu", (("negative_slope", 0.3),)),
    (keras.layers.ELU(alpha=0.5), "elu", (("alpha", 0.5),)),
    (keras.layers.Activation("swish"), "silu", ()),
    (keras.layers.Activation("gelu"), "gelu", ()),
    (keras.layers.Dense(4, activation="hard_swish"), "hard_silu", ()),
    (keras.layers.Conv2D(4, 3, activation="relu6"), "relu6", ()),
    (keras.layers.Dense(4, activation=gelu_approximate), "gelu_approximate", ()),
    (keras.layers.Dense(4), "linear", ()),
    (keras.layers.Activation(functools.partial(keras.activations.relu, max_value=3.0)), "relu",
     (("negative_slope", 0.0), ("max_value", 3.0), ("threshold", 0.0))),
])
def test_from_layer(layer, name, params):
    act = A.from_layer(layer)
    assert act.name == name and act.params == params
    assert A.get(layer) is act
    if not isinstance(layer, (keras.layers.Dense, keras.layers.Conv2D)):
        # the numpy forward is the layer's function (float32 layer)
        x = X_GRID.astype("float32")[:, None]
        y = keras.ops.convert_to_numpy(layer(x))[:, 0]
        np.testing.assert_allclose(act(x[:, 0]), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layer,words", [
    (keras.layers.PReLU(name="p"), "PReLU"),
    (keras.layers.Softmax(name="sm"), "softmax"),
    (keras.layers.Activation("softmax", name="act_sm"), "softmax is not elementwise"),
    (keras.layers.Dense(3, activation=lambda x: x * 2, name="custom"), "from_function"),
    (keras.layers.Flatten(name="flat"), "applies no activation"),
])
def test_from_layer_unsupported(layer, words):
    with pytest.raises(A.UnsupportedActivationError) as info:
        A.from_layer(layer)
    assert layer.name in str(info.value) and words in str(info.value)
    assert info.value.reason


def test_registry():
    def softsign(x):
        return x / (1 + abs(x))

    spec = A.GaussianActivation.from_function("softsign", lambda x: x / (1.0 + np.abs(x)),
                                              breakpoints=(0.0,))
    A.register(softsign, spec, overwrite=True)
    assert A.get(softsign) is spec
    with pytest.raises(ValueError, match="already registered"):
        A.register(softsign, A.get("tanh"))
    with pytest.raises(ValueError, match="Received"):
        A.register(3, spec)
    with pytest.raises(A.UnsupportedActivationError, match="no_such"):
        A.get("no_such")
    assert A.get(None).name == "linear" and A.get(spec) is spec
    assert A.get(functools.partial(keras.activations.gelu, approximate=True)).name == \
        "gelu_approximate"
    assert A.get("leaky_relu").params == (("negative_slope", 0.2),)
    assert [n for n in ("relu", "gelu", "swish", "hard_swish") if n not in A.names()] == []
    homogeneous = {n for n in A.names() if A.get(n).positively_homogeneous}
    assert homogeneous == {"relu", "leaky_relu", "linear"}


# ------------------------------------------- one registry, HOPE's and DM's views

BOTH_VIEWS = ["sigmoid", "tanh", "softplus", "silu", "gelu", "gelu_approximate", "linear"]


@pytest.mark.parametrize("name", BOTH_VIEWS)
def test_one_entry_serves_hope_and_derivative_matching(name):
    """Every way Keras holds an activation resolves to the same entry for both: the
    Gaussian view (HOPE) and the analytic view (derivative matching) compute the same
    function, and the Keras function itself."""
    from hope_keras import derivative_matching as dm

    fn = gelu_approximate if name == "gelu_approximate" else keras.activations.get(name)
    identifiers = [name, fn, keras.layers.Activation(fn), keras.layers.Dense(2, activation=fn)]
    if name == "silu":
        identifiers += ["swish", keras.activations.swish]
    if name.startswith("gelu"):
        identifiers.append(functools.partial(keras.activations.gelu,
                                             approximate=name == "gelu_approximate"))
    gauss, analytic = A.get(name), dm.get_analytic_activation(name)
    for identifier in identifiers:
        assert A.get(identifier) is gauss, identifier
        assert dm.get_analytic_activation(identifier) is analytic, identifier
    ref = keras.ops.convert_to_numpy(fn(keras.ops.convert_to_tensor(X_GRID, dtype="float64")))
    # (atol: tanh-GELU's 1 + tanh(u) cancels in the far negative tail)
    np.testing.assert_allclose(gauss(X_GRID), ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(analytic.forward(X_GRID), ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("identifier", [
    "relu", keras.activations.relu6, keras.layers.ReLU(max_value=6.0),
    keras.layers.LeakyReLU(0.1), keras.layers.ELU(), "selu", "hard_silu",
    functools.partial(keras.activations.relu, max_value=6.0)])
def test_non_analytic_activations_have_the_gaussian_view_only(identifier):
    from hope_keras import derivative_matching as dm
    from hope_keras.activations.lookup import activation_name

    assert A.get(identifier).name in A.names()
    assert dm.get_analytic_activation(identifier) is None
    assert activation_name(identifier) in dm.activations.NON_ANALYTIC_ACTIVATIONS


def test_registering_one_view_keeps_the_other():
    from hope_keras import derivative_matching as dm

    cube, analytic = dm.polynomial_activation([0.0, 0.0, 0.0, 1.0], name="cube_view_test")
    dm.register_activation(cube, analytic, overwrite=True)
    assert dm.get_analytic_activation(cube) is analytic
    with pytest.raises(A.UnsupportedActivationError, match="cube_view_test"):
        A.get(cube)  # HOPE's view of the entry is still empty
    gauss = A.GaussianActivation.from_function("cube_view_test", lambda x: x ** 3)
    A.register(cube, gauss)
    assert A.get(cube) is gauss and dm.get_analytic_activation(cube) is analytic
    with pytest.raises(ValueError, match="already registered"):
        dm.register_activation(cube, dm.get_analytic_activation("tanh"))
    with pytest.raises(ValueError, match="register_activation expects a callable"):
        dm.register_activation(3, analytic)
    np.testing.assert_allclose(gauss(X_GRID), analytic.forward(X_GRID), rtol=1e-12)


@pytest.mark.parametrize("layer", [
    keras.layers.ReLU(), keras.layers.ReLU(negative_slope=0.1, max_value=4.0, threshold=0.5),
    keras.layers.ReLU(max_value=6.0), keras.layers.LeakyReLU(negative_slope=0.3),
    keras.layers.ELU(alpha=0.5)])
def test_activation_layers_name_the_keras_function_they_call(layer):
    """The layer registry gives an activation layer as the Keras function it calls
    (the partial both views read): applying it equals the layer."""
    from hope_keras.graph import layers as hl

    fn = hl.get(layer).activation(layer)
    x = X_GRID.astype("float32")[:, None]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fn(x)),
                                  keras.ops.convert_to_numpy(layer(x)))
    assert A.get(fn) is A.from_layer(layer)


# ----------------------------------------------------------------- inversion

MONOTONE = ["relu", "leaky_relu", "linear", "relu6", "elu", "sigmoid", "tanh", "softplus",
            "hard_sigmoid"]
NON_MONOTONE = ["silu", "gelu", "hard_silu"]


@pytest.mark.parametrize("name", MONOTONE + NON_MONOTONE)
def test_invert_moments_round_trip(name):
    act = A.get(name)
    mu, sigma = np.meshgrid([-1.0, -0.2, 0.4, 1.5], [0.3, 1.0, 2.5])
    mu, sigma = mu.ravel(), sigma.ravel()
    m, v = act.mean(mu, sigma), act.variance(mu, sigma)
    res = A.invert_moments(act, m, v)
    assert not res.failed.any()
    if name in MONOTONE:
        np.testing.assert_allclose(res.mu, mu, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(res.sigma, sigma, rtol=1e-6)
    # several pre-activations can give the same moments for a non-monotone psi:
    # check the moments
    assert np.all(np.abs(act.mean(res.mu, res.sigma) - m) <= 1e-6 * (np.abs(m) + np.sqrt(v)))
    np.testing.assert_allclose(np.sqrt(act.variance(res.mu, res.sigma)), np.sqrt(v), rtol=1e-6)


def test_invert_moments_degenerate_and_unattainable():
    relu, sig = A.get("relu"), A.get("sigmoid")
    res = A.invert_moments(relu, [0.0, 2.0, -1.0, -1.0, 0.5, np.nan, 1.0],
                           [0.0, 0.0, 0.0, 1.0, -1.0, 1.0, 4.0])
    assert np.all(np.isfinite(res.mu)) and np.all(np.isfinite(res.sigma))
    np.testing.assert_array_equal(res.failed, [False, False, True, True, True, True, False])
    assert (res.mu[0], res.sigma[0]) == (0.0, 0.0)  # dead channel: N(0, 0)
    assert (res.mu[1], res.sigma[1]) == (2.0, 0.0)  # constant 2
    assert float(relu.mean(res.mu[6], res.sigma[6])) == pytest.approx(1.0, rel=1e-8)
    # sigmoid: mean outside (0, 1); variance above m (1 - m); a constant 0.5
    res = A.invert_moments(sig, [1.5, 0.5, 0.5], [0.01, 0.3, 0.0])
    assert np.all(np.isfinite(res.mu)) and np.all(np.isfinite(res.sigma))
    np.testing.assert_array_equal(res.failed, [True, True, False])
    assert res.mu[2] == pytest.approx(0.0, abs=1e-12) and res.sigma[2] == 0.0
    # broadcast shape, hard sigmoid constant 1 is reached at its kink
    res = A.invert_moments("hard_sigmoid", np.ones((2, 2)), 0.0)
    assert res.mu.shape == (2, 2) and np.allclose(res.mu, 3.0) and not res.failed.any()
