"""Capacities and propagated moments of every supported activation, from the raw
weights, against Monte Carlo of the Keras forward pass.

Each model is ``Dense (identity) → BatchNormalization → activation layer → Dense``.
Its inputs are drawn so that the BN's outputs follow exactly the surrogate HOPE
assumes (docs/theory.md §1: channel ``c`` is N(β_c, γ_c²)): the BN input is
``μ_c + sqrt(σ_c² + ε)·Z``. The actual Keras layers are run on them, and the
activation outputs' sample mean, variance and second moment are compared with
`hope_keras.analyze`'s propagated moments and with its capacities
``‖f_c‖ = ‖u_c‖ sqrt(E[ψ(y_c)²])`` (§1, §2: ``u_c`` the reader's kernel row), within
five standard errors of the sample.
"""

import functools

import keras
import numpy as np
import pytest

import hope_keras
from hope_keras import activations

L = keras.layers
N_SAMPLES = 200_000
# (γ, β) per channel: centred, shifted, wide, negative γ, nearly dead, saturating.
GAMMA = np.array([1.0, 0.5, 2.0, -0.8, 0.3, 3.0])
BETA = np.array([0.0, 1.5, -1.0, 0.3, -2.5, 4.0])
MEAN, VAR = np.array([0.2, -1.0, 0.5, 3.0, 0.0, -0.7]), np.array([1.0, 0.25, 4.0, 2.0, 0.5, 9.0])

# The activation layers (and activation names) the registry supports.
LAYERS = {
    "relu": lambda: L.ReLU(),
    "relu6": lambda: L.ReLU(max_value=6.0),
    "relu_threshold_slope_max": lambda: L.ReLU(max_value=4.0, negative_slope=0.1,
                                               threshold=0.5),
    "leaky_relu": lambda: L.LeakyReLU(negative_slope=0.2),
    "elu": lambda: L.ELU(alpha=0.5),
    "activation_relu_partial": lambda: L.Activation(
        functools.partial(keras.activations.relu, max_value=3.0)),
    **{f"activation_{name}": (lambda name=name: L.Activation(name)) for name in (
        "relu", "relu6", "leaky_relu", "elu", "selu", "silu", "swish", "hard_silu",
        "hard_swish", "hard_sigmoid", "gelu", "sigmoid", "tanh", "softplus", "mish",
        "linear")},
    "activation_gelu_approximate": lambda: L.Activation(
        functools.partial(keras.activations.gelu, approximate=True)),
}


def test_every_registered_activation_is_covered():
    """Each name the registry knows is one of the layers below (aliases included)."""
    covered = {activations.from_layer(make()).name for make in LAYERS.values()}
    known = {activations.get(n).name for n in activations.names()}
    assert known <= covered, known - covered


def _model(make_activation, seed):
    keras.utils.set_random_seed(seed)
    n = GAMMA.size
    inputs = keras.Input((n,))
    x = L.Dense(n, name="producer")(inputs)
    bn = L.BatchNormalization(name="bn")
    act = make_activation()
    x = act(bn(x))
    model = keras.Model(inputs, L.Dense(4, name="reader")(x))
    model.get_layer("producer").set_weights([np.eye(n, dtype="float32"),
                                             np.zeros(n, dtype="float32")])
    bn.set_weights([w.astype("float32") for w in (GAMMA, BETA, MEAN, VAR)])
    return model, act


@pytest.mark.parametrize("name", list(LAYERS))
def test_capacity_and_moments_equal_monte_carlo_of_the_keras_layers(name):
    model, act = _model(LAYERS[name], seed=len(name))
    bn = model.get_layer("bn")
    rng = np.random.default_rng(7)
    z = rng.standard_normal((N_SAMPLES, GAMMA.size))
    x = (MEAN + np.sqrt(VAR + bn.epsilon) * z).astype("float32")
    features = keras.Model(model.inputs, act.output)
    y = np.asarray(features.predict(x, batch_size=20_000, verbose=0), dtype=np.float64)
    pre = np.asarray(keras.Model(model.inputs, bn.output).predict(
        x, batch_size=20_000, verbose=0), dtype=np.float64)
    # The inputs give the BN outputs the surrogate's N(β, γ²).
    np.testing.assert_allclose(pre.mean(0), BETA, atol=5 * np.abs(GAMMA).max() / N_SAMPLES ** .5)

    analysis = hope_keras.analyze(model, verbose=False)
    report = next(g for g in analysis.groups if g.name == "producer")
    u = np.asarray(model.get_layer("reader").kernel.numpy(), dtype=np.float64)
    second = report.capacities ** 2 / (u ** 2).sum(axis=1)

    def within(value, samples, what):
        se = samples.std(axis=0) / np.sqrt(N_SAMPLES)
        bad = np.abs(value - samples.mean(axis=0)) > 5 * se + 1e-7 * (1 + np.abs(value))
        assert not bad.any(), (name, what, value, samples.mean(axis=0), se)

    within(second, y * y, "capacity² / ‖u‖²")
    mean, var = analysis.moments[analysis.graph.flat.node_of(act.name).outputs[0]]
    within(mean, y, "propagated mean")
    within(var, (y - mean) ** 2, "propagated variance")
