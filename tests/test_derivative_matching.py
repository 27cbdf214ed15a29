"""Tests of hope_keras.derivative_matching against independent computations.

Reference values come from tf.GradientTape in float64 (nested jacobians), central
finite differences, Cauchy integrals on complex circles (FFT), brute-force
polynomial products and brute-force subset enumeration.
"""

import itertools
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import scipy.special
import tensorflow as tf

import keras
from hope_keras import derivative_matching as dm
from hope_keras.derivative_matching import jets as jets_mod
from hope_keras.derivative_matching.activations import GELU_S as _GELU_S, gelu_approximate

ANALYTIC = ["sigmoid", "tanh", "softplus", "silu", "gelu", "gelu_approximate", "linear"]


# --------------------------------------------------------------------------- helpers


def _keras_act(name):
    return gelu_approximate if name == "gelu_approximate" else keras.activations.get(name)


def _mlp(widths, acts, d_in=2, d_out=1, seed=0, dtype="float64", bias_scale=0.3,
         kernel_scale=None, functional=False):
    """Dense stack with random (non-zero) biases so no symmetry hides bugs."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [keras.layers.Dense(w, activation=a, dtype=dtype, name=f"h{i}")
              for i, (w, a) in enumerate(zip(widths, acts))]
    layers.append(keras.layers.Dense(d_out, dtype=dtype, name="out"))
    if functional:
        x = inp = keras.Input((d_in,), dtype=dtype, name="x")
        for layer in layers:
            x = layer(x)
        model = keras.Model(inp, x)
    else:
        model = keras.Sequential([keras.Input((d_in,), dtype=dtype)] + layers)
    for layer in layers:
        k, b = layer.get_weights()
        if kernel_scale is not None:
            k = rng.normal(size=k.shape) * kernel_scale / np.sqrt(k.shape[0])
        layer.set_weights([k, rng.normal(size=b.shape) * bias_scale])
    return model


def _tf_fn(model, upto=None):
    """x (batch, d) -> output of layer `upto` with plain tf ops from the model's weights."""
    steps = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            k, *b = [tf.constant(w.astype(np.float64)) for w in layer.get_weights()]
            steps.append((k, b[0] if b else None, layer.activation))
        elif isinstance(layer, keras.layers.Activation):
            k, b, _ = steps[-1]
            steps[-1] = (k, b, layer.activation)
        if layer.name == upto:
            break

    def fn(x):
        for k, b, act in steps:
            x = x @ k
            if b is not None:
                x = x + b
            x = act(x)
        return x

    return fn, steps


def _autodiff_order2(model, center, upto=None):
    """Value, gradient and Hessian of every output at `center` (tf reverse mode, eager)."""
    fn, _ = _tf_fn(model, upto)
    x = tf.constant(np.asarray(center, np.float64)[None])
    d = x.shape[1]
    with tf.GradientTape(persistent=True) as t2:
        t2.watch(x)
        with tf.GradientTape(persistent=True) as t1:
            t1.watch(x)
            y = fn(x)[0]
            ys = [y[j] for j in range(y.shape[0])]
        grads = [t1.gradient(yj, x)[0] for yj in ys]
        parts = [[g[i] for i in range(d)] for g in grads]
    hess = [[t2.gradient(gi, x)[0].numpy() for gi in row] for row in parts]
    return y.numpy(), np.stack([g.numpy() for g in grads]), np.asarray(hess)


_COMPLEX_ACT = {
    "sigmoid": lambda z: 1.0 / (1.0 + np.exp(-z)),
    "tanh": np.tanh,
    "softplus": lambda z: np.log1p(np.exp(z)),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    "gelu": lambda z: 0.5 * z * (1.0 + scipy.special.erf(_GELU_S * z / np.sqrt(2.0))),
    "gelu_approximate": lambda z: 0.5 * z * (
        1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + float(np.float32(0.044715)) * z**3))),
    "linear": lambda z: z,
}


def _cauchy_table(model, center, order, upto=None, r=0.5, n=32):
    """∂^α of every output (d_in = 2) by a 2-D Cauchy integral (FFT on a torus).

    Independent of the jets: it only evaluates the network in complex arithmetic.
    """
    _, steps = _tf_fn(model, upto)
    th = 2 * np.pi * np.arange(n) / n
    e = r * np.exp(1j * th)
    x = np.stack(np.meshgrid(center[0] + e, center[1] + e, indexing="ij"), -1).reshape(-1, 2)
    for k, b, act in steps:
        x = x @ k.numpy()
        if b is not None:
            x = x + b.numpy()
        spec = dm.get_analytic_activation(act)
        x = _COMPLEX_ACT[spec.name](x) if spec.name in _COMPLEX_ACT else spec.forward(x)
    vals = x.reshape(n, n, -1)
    coef = np.fft.fft2(vals, axes=(0, 1)) / n**2
    alphas = dm.multi_indices(2, order)
    out = np.stack([coef[a1, a2].real / r ** (a1 + a2)
                    * math.factorial(a1) * math.factorial(a2) for a1, a2 in alphas])
    return out, np.max(np.abs(vals))


def _np_forward(model, x):
    return model(np.asarray(x, np.float64)).numpy()


# --------------------------------------------------------------------------- jets


def test_multi_indices_and_product_table_sizes():
    assert dm.num_features(2, 10) == 66
    assert dm.num_features(3, 4) == 35
    idx = dm.multi_indices(3, 4)
    assert idx.shape == (35, 3)
    assert len({tuple(r) for r in idx.tolist()}) == 35
    deg = idx.sum(1)
    assert np.all(np.diff(deg) >= 0)  # graded: truncation is a prefix
    ia, ib, starts = jets_mod.product_table(2, 10)
    assert len(ia) == math.comb(14, 4) == 1001
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)


@pytest.mark.parametrize("d,k", [(1, 7), (2, 5), (3, 4)])
def test_jet_multiply_matches_brute_force(d, k):
    rng = np.random.default_rng(1)
    idx = [tuple(r) for r in dm.multi_indices(d, k).tolist()]
    a, b = rng.normal(size=(len(idx), 4)), rng.normal(size=(len(idx), 4))
    got = jets_mod.jet_multiply(a, b, d, k, chunk=3)
    want = np.zeros_like(a)
    pos = {m: i for i, m in enumerate(idx)}
    for i, m1 in enumerate(idx):
        for j, m2 in enumerate(idx):
            m = tuple(x + y for x, y in zip(m1, m2))
            if sum(m) <= k:
                want[pos[m]] += a[i] * b[j]
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("name", ANALYTIC)
def test_taylor_table_matches_autodiff(name):
    # tf's pow(x, 3) has NaN higher gradients at exactly 0 (gelu_approximate)
    z0 = np.array([-2.7, -0.6, 0.0 if name != "gelu_approximate" else 0.01, 0.35, 1.9])
    order = 5
    act = _keras_act(name)
    coeffs = dm.taylor_coefficients(act, z0, order)

    def deriv(f):
        def g(z):
            with tf.GradientTape() as tape:
                tape.watch(z)
                y = f(z)
            return tape.gradient(y, z, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return g

    z, f, got = tf.constant(z0), act, []
    for _ in range(order + 1):
        got.append(np.asarray(f(z)))
        f = deriv(f)
    got = np.stack(got)
    want = coeffs * np.array([math.factorial(m) for m in range(order + 1)])[:, None]
    np.testing.assert_allclose(want, got, rtol=1e-9, atol=1e-12)


_COMPLEX = {
    "sigmoid": lambda z: 1.0 / (1.0 + np.exp(-z)),
    "tanh": np.tanh,
    "softplus": lambda z: np.log1p(np.exp(z)),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    # Keras/TF evaluate x Φ(s x) with s = √2·fl32(1/√2) (see activations._GELU_S)
    "gelu": lambda z: 0.5 * z * (1.0 + scipy.special.erf(_GELU_S * z / np.sqrt(2.0))),
    "gelu_approximate": lambda z: 0.5 * z * (
        1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + float(np.float32(0.044715)) * z**3))),
    "linear": lambda z: z,
}


@pytest.mark.parametrize("name", ANALYTIC)
def test_taylor_table_high_order_matches_cauchy_integral(name):
    """Orders up to 14 against a Cauchy integral (FFT on a circle of radius 0.4)."""
    order, r, n = 14, 0.4, 128
    z0 = np.array([-3.1, -0.8, 0.0, 0.5, 2.2])
    theta = 2 * np.pi * np.arange(n) / n
    vals = _COMPLEX[name](z0[None, :] + r * np.exp(1j * theta)[:, None])
    want = (np.fft.fft(vals, axis=0) / n).real[: order + 1] / r ** np.arange(order + 1)[:, None]
    got = dm.taylor_coefficients(name, z0, order)
    scale = np.max(np.abs(vals)) / r ** np.arange(order + 1)[:, None]
    assert np.all(np.abs(got - want) <= 1e-12 * scale + 1e-15)


def test_gelu_default_is_exact_erf_form():
    layer = keras.layers.Dense(3, activation="gelu")
    spec = dm.get_analytic_activation(layer.activation)
    assert spec.name == "gelu"
    z = np.linspace(-3, 3, 7)
    np.testing.assert_allclose(
        spec.forward(z), keras.activations.gelu(tf.constant(z)).numpy(), rtol=1e-12)
    # the two forms really differ, so mixing them up would be caught
    assert abs(_GELU_S - 1.0) < 1e-7  # only the float32 rounding of 1/sqrt(2)
    approx = dm.get_analytic_activation(gelu_approximate).forward(z)
    assert np.max(np.abs(approx - spec.forward(z))) > 1e-4


# --------------------------------------------------------------------------- features


@pytest.mark.parametrize("functional", [False, True])
def test_derivative_features_match_autodiff_and_cauchy(functional):
    model = _mlp([6, 5], ["tanh", "gelu"], d_in=2, functional=functional)
    center = np.array([0.3, -0.2])
    phi, alphas = dm.derivative_features(model, 1, order=6, center=center)
    assert phi.shape == (28, 5)
    # orders 0..2 against tf.GradientTape (float64)
    y, g, h = _autodiff_order2(model, center, upto="h1")
    np.testing.assert_allclose(phi[0], y, rtol=1e-12)
    np.testing.assert_allclose(phi[1:3], g.T, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(phi[3], h[:, 0, 0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(phi[4], h[:, 0, 1], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(phi[5], h[:, 1, 1], rtol=1e-9, atol=1e-12)
    # all orders up to 6 against a Cauchy integral of the complex-evaluated network
    want, scale = _cauchy_table(model, center, 6, upto="h1")
    np.testing.assert_allclose(phi, want, rtol=1e-8, atol=1e-10 * scale * 720)


def test_derivative_features_match_finite_differences():
    model = _mlp([7, 6], ["softplus", "silu"], d_in=3)
    center = np.array([0.2, -0.4, 0.1])
    phi, alphas = dm.derivative_features(model, "h1", order=2, center=center)
    fn, _ = _tf_fn(model, "h1")
    f = lambda x: fn(tf.constant(x[None])).numpy()[0]  # noqa: E731
    h = 1e-4
    for r, a in enumerate(alphas):
        a = tuple(a)
        if sum(a) == 0:
            want = f(center)
        elif sum(a) == 1:
            e = np.eye(3)[a.index(1)] * h
            want = (f(center + e) - f(center - e)) / (2 * h)
        elif 2 in a:
            e = np.eye(3)[a.index(2)] * h
            want = (f(center + e) - 2 * f(center) + f(center - e)) / h**2
        else:
            i, j = [q for q, v in enumerate(a) if v == 1]
            ei, ej = np.eye(3)[i] * h, np.eye(3)[j] * h
            want = (f(center + ei + ej) - f(center + ei - ej) - f(center - ei + ej)
                    + f(center - ei - ej)) / (4 * h * h)
        np.testing.assert_allclose(phi[r], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- maxvol


def test_maxvol_rank_reconstruction_and_bounded_coefficients():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(10, 6)) @ rng.normal(size=(6, 80))
    sel = dm.maxvol_columns(z, rtol=1e-10, tol=0.01)
    assert sel.rank == 6 and len(sel.columns) == 6
    np.testing.assert_allclose(z[:, sel.columns] @ sel.coefficients, z, atol=1e-9)
    np.testing.assert_allclose(sel.coefficients[:, sel.columns], np.eye(6), atol=1e-12)
    assert sel.max_coefficient <= 1.01 + 1e-9


def test_maxvol_close_to_brute_force_volume():
    rng = np.random.default_rng(4)
    z = rng.normal(size=(3, 12)) * np.array([1.0, 1e-2, 1e-4])[:, None]
    sel = dm.maxvol_columns(z, tol=0.0)
    vol = lambda cols: abs(np.linalg.det(z[:, list(cols)]))  # noqa: E731
    best = max(vol(c) for c in itertools.combinations(range(12), 3))
    # a dominant submatrix (max|C| <= 1) is within a factor n! of the maximum
    # volume in the worst case; on this small case it should be (near) optimal
    assert vol(sel.columns) >= best / math.factorial(3)
    assert vol(sel.columns) >= 0.5 * best
    assert sel.max_coefficient <= 1.0 + 1e-9


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("act,functional,layer", [
    ("sigmoid", False, 1), ("gelu", True, 0), ("tanh", False, 0), ("silu", True, 1),
])
def test_one_layer_compression_preserves_all_derivatives(act, functional, layer):
    k = 4
    model = _mlp([40, 30], [act, act], d_in=2, d_out=2, functional=functional)
    center = np.array([0.25, -0.15])
    student, report = dm.compress_mlp(model, order=k, layers=[layer], center=center)
    (rep,) = report.layers
    assert rep.kept_width <= dm.num_features(2, k) == 15
    assert student.get_layer(f"h{layer}").units == rep.kept_width
    want, scale = _cauchy_table(model, center, k)
    got, _ = _cauchy_table(student, center, k)
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-11 * scale * 24)
    # orders <= 2 also by tf autodiff on the Keras weights
    for a, b in zip(_autodiff_order2(model, center), _autodiff_order2(student, center)):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)
    # and it is a real approximation, not a copy: the order-(k+1) terms differ
    far = dm.sup_error(model, student, radius=2.0, samples=500)
    assert far > 1e-10


@pytest.mark.parametrize("direction", ["backward", "forward"])
def test_all_layers_preserve_output_jet(direction):
    """Every step preserves the output jet to order k, so the composition does too."""
    k = 5
    model = _mlp([50, 45, 40], ["tanh", "sigmoid", "gelu"], d_in=2, d_out=2)
    student, report = dm.compress_mlp(model, order=k, direction=direction)
    idx = [l.index for l in report.layers]
    assert idx == ([2, 1, 0] if direction == "backward" else [0, 1, 2])
    for l in report.layers:
        assert l.kept_width <= 21
        assert l.l1_inflation <= l.d_k + 1e-9
        assert l.max_coefficient <= 1.01 + 1e-9

    def out_jet(m):
        w = [l.get_weights() for l in m.layers if isinstance(l, keras.layers.Dense)]
        specs = [dm.get_analytic_activation(l.activation) for l in m.layers[:-1]]
        h = dm.hidden_jets([a for a, _ in w], [b for _, b in w], specs, np.zeros(2), k, 2)[-1]
        out = h @ w[-1][0]
        out[0] += w[-1][1]
        return out

    np.testing.assert_allclose(out_jet(student), out_jet(model), rtol=1e-8, atol=1e-11)
    # cross-check the jet of the output against autodiff at order 3
    want, scale = _cauchy_table(model, np.zeros(2), k)
    fact = np.array([math.prod(math.factorial(int(v)) for v in a) for a in dm.multi_indices(2, k)])
    np.testing.assert_allclose(out_jet(model) * fact[:, None], want, rtol=1e-8,
                               atol=1e-11 * scale * 120)


def test_error_decreases_with_order():
    model = _mlp([64, 64], ["sigmoid", "sigmoid"], d_in=2, d_out=1, kernel_scale=1.0)
    errs = []
    for k in range(0, 8):
        if k == 0:  # the value at the center only: one neuron a layer, with a warning
            with pytest.warns(UserWarning, match="keeps a single neuron"):
                student, report = dm.compress_mlp(model, order=k)
            assert [l.kept_width for l in report.layers] == [1, 1]
        else:
            student, _ = dm.compress_mlp(model, order=k)
        errs.append(dm.sup_error(model, student, radius=1.0, samples=3000))
    errs = np.array(errs)
    assert np.all(errs[2:] < errs[:-2]), errs
    assert errs[7] < 1e-3 * errs[0], errs


def test_polynomial_activation_net_is_compressed_exactly():
    quad, spec = dm.polynomial_activation([0.1, 1.0, 0.5], name="quad_test")
    dm.register_activation(quad, spec, overwrite=True)
    model = _mlp([60, 50], [quad, quad], d_in=2, d_out=2, bias_scale=0.5)
    # layer 1's neurons are polynomials of degree 4 in x: k = 4 > degree - 1 is exact
    student, report = dm.compress_mlp(model, order=4)
    assert [l.kept_width for l in report.layers] == [15, 6]  # D_4 = 15; layer 0: degree 2
    scale = np.max(np.abs(_np_forward(model, dm.sample_ball(500, 2, 3.0))))
    err = dm.sup_error(model, student, radius=3.0, samples=2000)
    assert err <= 1e-9 * scale
    # one order less is not exact
    student3, _ = dm.compress_mlp(model, order=3)
    assert dm.sup_error(model, student3, radius=3.0, samples=2000) > 1e-6 * scale


def test_target_error_meets_budget_with_smallest_orders():
    model = _mlp([80, 80], ["tanh", "tanh"], d_in=2, d_out=1, kernel_scale=1.0)
    eps = 1e-3
    student, report = dm.compress_mlp(model, target_error=eps, radius=1.0, samples=2000)
    assert report.measured_error <= eps
    for l in report.layers:
        assert l.step_error <= eps / 2
        assert l.compressed and l.kept_width < 80
    # independent check on fresh points (sampling estimate: allow a small margin)
    assert dm.sup_error(model, student, radius=1.0, samples=5000, seed=7) <= 2 * eps
    # minimality: one order less for the first processed layer breaks its budget
    first = report.layers[0]
    if first.order > 0:
        s2, _ = dm.compress_mlp(model, order=first.order - 1, layers=[first.index])
        assert dm.sup_error(model, s2, radius=1.0, samples=2000) > eps / 2


def test_student_structure_dtype_and_activation_layers():
    keras.utils.set_random_seed(0)
    inp = keras.Input((2,), name="xin")
    h = keras.layers.Dense(48, name="a")(inp)
    h = keras.layers.Activation("tanh", name="a_act")(h)
    h = keras.layers.Dense(40, activation=gelu_approximate, name="b")(h)
    out = keras.layers.Dense(3, activation="softmax", name="c")(h)
    model = keras.Model(inp, out, name="teacher")
    student, report = dm.compress_mlp(model, order=3)
    assert [l.name for l in student.layers] == [l.name for l in model.layers]
    assert student.get_layer("a").units <= 10 and student.get_layer("b").units <= 10
    assert student.get_layer("c").units == 3
    assert student.get_layer("a").kernel.dtype == "float32"
    assert student.get_layer("b").activation is gelu_approximate
    assert report.params_after < report.params_before
    assert dm.sup_error(model, student, radius=0.5, samples=1000) < 1e-3
    assert "a" in str(report)


def test_kept_width_is_rank_and_keep_dk_option():
    # zero biases + sigmoid: even derivatives at 0 vanish, so rank(Z) < D_k
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(64, activation="sigmoid"),
                              keras.layers.Dense(1)])
    _, rep = dm.compress_mlp(model, order=4)
    assert rep.layers[0].rank == rep.layers[0].kept_width == 1 + 2 + 4  # orders 0, 1, 3
    assert rep.layers[0].d_k == 15
    # keep="dk" keeps up to D_k neurons (as in the paper; exactly vanishing directions
    # cannot be selected) and still matches the derivatives
    student_dk, rep_dk = dm.compress_mlp(model, order=4, keep="dk")
    assert 7 < rep_dk.layers[0].kept_width <= 15 and rep_dk.layers[0].rank == 7
    assert rep_dk.layers[0].max_coefficient <= 1.01 + 1e-9
    assert dm.sup_error(model, student_dk, radius=1.0, samples=500) < 1e-5  # float32 model


def test_rank_zero_layer_keeps_one_silent_neuron():
    # GELU(0) = 0 with zero biases: all order-0 features vanish
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(16, activation="gelu"),
                              keras.layers.Dense(2, bias_initializer="ones")])
    student, rep = dm.compress_mlp(model, order=0)
    assert rep.layers[0].rank == 0 and rep.layers[0].kept_width == 1
    np.testing.assert_array_equal(student.layers[-1].get_weights()[0], 0.0)
    np.testing.assert_allclose(np.asarray(student(np.zeros((1, 2), "float32"))), 1.0)


# --------------------------------------------------------------------------- errors


def test_relu_is_rejected_with_pointer_to_hope():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu", name="r"),
                              keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"'r'.*'relu'.*hope_keras\.compress"):
        dm.compress_mlp(model, order=2)
    inp = keras.Input((2,))
    h = keras.layers.Activation("elu", name="act_e")(keras.layers.Dense(8, name="d")(inp))
    model2 = keras.Model(inp, keras.layers.Dense(1)(h))
    with pytest.raises(ValueError, match=r"act_e.*hope_keras\.compress"):
        dm.compress_mlp(model2, order=2)
    # an activation layer is read through the layer registry: ReLU is ReLU there too
    h = keras.layers.ReLU(max_value=6.0, name="act_r")(keras.layers.Dense(8, name="d")(inp))
    model3 = keras.Model(inp, keras.layers.Dense(1)(h))
    with pytest.raises(ValueError, match=r"act_r.*'relu'.*hope_keras\.compress"):
        dm.compress_mlp(model3, order=2)


@pytest.mark.parametrize("functional", [False, True])
def test_an_output_activation_layer_is_kept_after_the_compressed_stack(functional):
    """A ReLU layer after the output Dense (any activation layer the registry knows):
    the hidden layers' selection does not depend on it, so the student is the
    student of the stack without it, followed by the same ReLU."""
    plain = _mlp([24], ["tanh"], functional=functional, seed=3)
    relu = keras.layers.ReLU(max_value=0.5, name="out_relu")
    if functional:
        capped = keras.Model(plain.inputs[0], relu(plain.outputs[0]))
    else:
        capped = keras.Sequential([keras.Input((2,), dtype="float64")] + plain.layers + [relu])
    s_plain, _ = dm.compress_mlp(plain, order=3, radius=1.0)
    s_capped, _ = dm.compress_mlp(capped, order=3, radius=1.0)
    assert [type(l).__name__ for l in s_capped.layers][-1] == "ReLU"
    pts = dm.sample_ball(200, 2, 1.0, seed=0)
    np.testing.assert_array_equal(np.asarray(s_capped(pts)),
                                  np.clip(np.asarray(s_plain(pts)), 0.0, 0.5))


def test_bad_arguments_and_unsupported_layers():
    model = _mlp([8], ["tanh"])
    with pytest.raises(ValueError, match="exactly one of order"):
        dm.compress_mlp(model)
    with pytest.raises(ValueError, match="direction"):
        dm.compress_mlp(model, order=2, direction="sideways")
    with pytest.raises(ValueError, match=r"center must have shape \(2,\)"):
        dm.compress_mlp(model, order=2, center=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="output layer"):
        dm.compress_mlp(model, order=2, layers=["out"])
    with pytest.raises(ValueError, match="sample points must be an integer ≥ 1.*Received: 0"):
        dm.compress_mlp(model, order=2, samples=0, measure=True)
    conv = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dropout(0.1, name="drop"), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="'drop'.*Dropout"):
        dm.compress_mlp(conv, order=2)
    # A BN after a Dense: refused with the way out, which then works.
    bn = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8),
                           keras.layers.BatchNormalization(), keras.layers.Activation("tanh"),
                           keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"BatchNormalization.*hope_keras\.fold_batchnorm"):
        dm.compress_mlp(bn, order=2)
    import hope_keras
    student, _ = dm.compress_mlp(hope_keras.fold_batchnorm(bn), order=2)
    x = np.random.default_rng(0).normal(size=(16, 2)).astype("float32") * 0.1
    np.testing.assert_allclose(student(x), bn(x), atol=1e-3)


def test_large_dk_is_refused_with_memory_estimate():
    model = _mlp([16], ["tanh"], d_in=12)
    with pytest.raises(ValueError, match=r"D_k=\d+.*GiB"):
        dm.compress_mlp(model, order=12, max_memory_bytes=2**30)
    with pytest.warns(RuntimeWarning, match=r"width 16 <= D_k=91"):
        dm.compress_mlp(model, order=2)


def test_sample_ball_and_sup_error():
    x = dm.sample_ball(4000, 3, 2.0, center=[1.0, 0.0, -1.0], seed=1)
    r = np.linalg.norm(x - np.array([1.0, 0.0, -1.0]), axis=1)
    assert r.max() <= 2.0 + 1e-12 and r[0] == 0.0
    # uniform in the ball: P(r <= R/2) = 1/8 in 3-D
    assert abs(np.mean(r <= 1.0) - 0.125) < 0.02
    model = _mlp([8], ["tanh"], d_in=2)
    assert dm.sup_error(model, model, radius=1.0, samples=100) == 0.0
    shifted = keras.models.clone_model(model)
    w = model.get_weights()
    w[-1] = w[-1] + 0.25
    shifted.set_weights(w)
    assert abs(dm.sup_error(model, shifted, radius=1.0, samples=100) - 0.25) < 1e-12
