"""The data-free moment propagation against Monte Carlo, where its rules are exact:
BatchNormalization with the true input statistics, activations of Gaussians, linear
maps and sums of independent inputs (scaled too), Concatenate, Flatten, scalar
operations."""

import keras
import numpy as np
import pytest

import hope_keras
from hope_keras.graph import adapter as kg
from hope_keras.scoring import moments as moments_lib
from hope_keras.scoring.neurons import coupled_capacity

L = keras.layers
N = 200_000


def _set_bn(bn, mean, var, gamma, beta):
    for w, v in zip((bn.moving_mean, bn.moving_variance, bn.gamma, bn.beta),
                    (mean, var, gamma, beta)):
        w.assign(np.asarray(v, dtype="float32"))


def test_propagated_moments_match_monte_carlo():
    rng = np.random.default_rng(0)
    a_in, b_in = keras.Input((3,), name="a"), keras.Input((4, 4, 2), name="b")
    c_in = keras.Input((2,), name="c")
    # Branch a: BN with the input's true statistics, then GELU, Dense (linear).
    bn_a = L.BatchNormalization(name="bn_a")
    ya = L.Activation("gelu", name="gelu")(bn_a(a_in))
    da = L.Dense(2, name="da")(ya)
    # Branch b: BN, ReLU6, depthwise conv, +3 then ×0.5, Flatten.
    bn_b = L.BatchNormalization(name="bn_b")
    yb = L.ReLU(6.0, name="relu6")(bn_b(b_in))
    yb = L.DepthwiseConv2D(3, padding="valid", name="dw")(yb)
    yb = (yb + 3.0) * 0.5
    flat = L.Flatten(name="flat")(yb)
    # Independent branches meet: Add and Concatenate. (A Dense over `flat` would read
    # overlapping, hence correlated, depthwise windows: not an exact case.)
    s = L.Add(name="sum")([L.Dense(2, name="dc")(c_in), da])
    # Inception-ResNet's scaled sum, x + 0.3 · r (keras.applications' CustomScaleLayer).
    scaled = kg.optional_classes("applications.inception_resnet_v2", ("CustomScaleLayer",))
    ss = scaled["CustomScaleLayer"](0.3, name="scaled_sum")([L.Dense(2, name="dc2")(c_in), da])
    out = L.Concatenate(name="cat")([s, da, flat, ss])
    model = keras.Model([a_in, b_in, c_in], out)
    mu_a, sd_a = np.array([0.5, -1.0, 2.0]), np.array([1.0, 0.5, 2.0])
    mu_b, sd_b = np.array([0.3, -0.2]), np.array([1.5, 0.7])
    _set_bn(bn_a, mu_a, sd_a ** 2 - 1e-3, [1.2, 0.8, 0.5], [0.1, -0.4, 0.3])
    _set_bn(bn_b, mu_b, sd_b ** 2 - 1e-3, [2.0, 1.0], [1.0, 3.0])
    xa = (mu_a + sd_a * rng.standard_normal((N, 3))).astype("float32")
    xb = (mu_b + sd_b * rng.standard_normal((N, 4, 4, 2))).astype("float32")
    xc = rng.standard_normal((N, 2)).astype("float32")  # the placeholder moments: N(0, 1)
    fg = kg.flatten(model)
    table = moments_lib.propagate(fg)
    probe_layers = ["gelu", "da", "dw", "flat", "sum", "scaled_sum", "cat"]
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in probe_layers])
    values = probe.predict([xa, xb, xc], batch_size=20_000, verbose=0)
    # Every call's output tensor key, by layer name.
    key_of = {n.key: n.outputs[0] for n in fg.nodes}
    for name, v in zip(probe_layers, values):
        v = np.asarray(v, dtype=np.float64).reshape(N, -1, v.shape[-1])
        mean, var = table[key_of[name]]
        emp_mean = v.mean(axis=(0, 1))
        emp_var = v.var(axis=(0, 1))
        if name in ("flat", "cat"):  # positions: compare per position
            emp_mean, emp_var = v.reshape(N, -1).mean(0), v.reshape(N, -1).var(0)
        se = np.sqrt(np.maximum(emp_var, 1e-12) / N)
        assert np.all(np.abs(mean - emp_mean) <= 6 * se + 1e-3), (name, mean, emp_mean)
        np.testing.assert_allclose(var, emp_var, rtol=0.03, atol=1e-3, err_msg=name)


@pytest.mark.parametrize("strides", [1, 2])
def test_a_transposed_convolution_scatters_its_mean_and_phase_averaged_variance(strides):
    """Kernel 2 and stride 2 tile the output: each position receives one tap, so the
    channel's mean over positions is exact, and so is its variance averaged over the
    stride's phases (what the propagation keeps per channel; the phases' means differ
    too). Stride 1: every tap at every position, borders aside."""
    rng = np.random.default_rng(1)
    inputs = keras.Input((6, 6, 2))
    bn = L.BatchNormalization(name="bn")
    y = L.ReLU(name="relu")(bn(inputs))
    y = L.Conv2DTranspose(3, 2, strides=strides, padding="same", name="up")(y)
    model = keras.Model(inputs, y)
    mu, sd = np.array([0.3, -0.2]), np.array([1.5, 0.7])
    _set_bn(bn, mu, sd ** 2 - 1e-3, [2.0, 1.0], [1.0, 0.5])
    up = model.get_layer("up")
    up.bias.assign(np.array([0.2, -0.1, 0.4], dtype="float32"))
    x = (mu + sd * rng.standard_normal((N // 10, 6, 6, 2))).astype("float32")
    v = np.asarray(model.predict(x, batch_size=5000, verbose=0), dtype=np.float64)
    fg = kg.flatten(model)
    mean, var = moments_lib.propagate(fg)[fg.node_of("up").outputs[0]]
    if strides == 1:
        v = v[:, 1:, 1:]  # the first row and column miss a tap
    np.testing.assert_allclose(mean, v.mean(axis=(0, 1, 2)), rtol=0.01, atol=2e-3)
    phases = v.reshape(v.shape[0], -1, strides, v.shape[2] // strides, strides, 3)
    phase_var = phases.var(axis=(0, 1, 3)).mean(axis=(0, 1))
    np.testing.assert_allclose(var, phase_var, rtol=0.02)


def test_anchored_flags_need_a_normalisation_upstream():
    inputs = keras.Input((4,))
    h = L.Dense(5, activation="relu", name="free")(inputs)
    g = L.ReLU()(L.BatchNormalization(name="bn")(L.Dense(3, name="p")(inputs)))
    model = keras.Model(inputs, L.Concatenate()([h, g]))
    fg = kg.flatten(model)
    anchored = {}
    moments_lib.propagate(fg, anchored=anchored)
    cat = fg.outputs[0]
    assert anchored[cat].tolist() == [False] * 5 + [True] * 3


def test_coupled_capacity_reduces_to_the_neuron_capacity_on_a_neuron_layer():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(5, 3, name="p")(inputs)))
    a = L.Conv2D(3, 1, name="a")(x)
    b = L.Dense(2, name="b")(L.Flatten()(L.MaxPooling2D()(x)))
    model = keras.Model(inputs, [a, b])
    from conftest import randomize_bn

    randomize_bn(model, 3)
    analysis = hope_keras.analyze(model)
    group = analysis.graph.groups["p"]
    cap, second = coupled_capacity(analysis.graph.layer, group, analysis.moments)
    np.testing.assert_allclose(cap, analysis.caches["p"].capacity, rtol=1e-12)
    np.testing.assert_allclose(second, analysis.caches["p"].k_self, rtol=1e-12)


@pytest.mark.parametrize("act", ["relu", "silu", "tanh"])
def test_activation_moments_match_monte_carlo(act):
    rng = np.random.default_rng(1)
    m, v = np.array([0.4, -1.0]), np.array([1.3, 0.2])
    mean, var = moments_lib.activation_moments(act, m, v)
    z = m + np.sqrt(v) * rng.standard_normal((N, 2))
    y = np.asarray(keras.activations.get(act)(z.astype("float32")), dtype=np.float64)
    se = y.std(0) / np.sqrt(N)
    assert np.all(np.abs(mean - y.mean(0)) <= 6 * se)
    np.testing.assert_allclose(var, y.var(0), rtol=0.02)


class _Shift(keras.layers.Layer):
    """An elementwise layer registered below with a rule that fails on it."""

    def call(self, x):
        return x + 1.0


def test_a_layer_whose_moments_fail_is_read_as_unknown_with_a_warning_naming_it():
    from hope_keras import layers as hl

    hl.register(_Shift, hl.ChannelwiseRule(activation=lambda layer: layer.no_such_attribute))
    try:
        inputs = keras.Input((4,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2)(_Shift(name="shift")(h)))
        with pytest.warns(moments_lib.UnknownMomentsWarning,
                          match=r"'shift' \(_Shift\).*AttributeError.*no_such_attribute"):
            out = moments_lib.propagate(kg.flatten(model))
        key = kg.flatten(model).nodes[-2].outputs[0]  # the shift's output
        np.testing.assert_array_equal(out[key][0], 0.0)
        np.testing.assert_array_equal(out[key][1], 1.0)
    finally:
        hl._REGISTRY.pop(_Shift, None)
