"""Data-free BN statistics correction (`hope_keras.correct_statistics`), checked
against Monte Carlo where the Gaussian surrogate is exact."""

import keras
import numpy as np
import pytest

import hope_keras

L = keras.layers


def _exact_surrogate_model(seed=0, width=6, d_in=6):
    """x ~ N(0, I) → Dense with orthonormal columns, no bias → BN (moving stats the
    true ones: mean 0, variance 1) → ReLU → Dense → BN2. BN outputs are then exactly
    independent N(β, γ²), as `hope_keras.moments` assumes."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    inputs = keras.Input((d_in,))
    h = L.Dense(width, use_bias=False, name="fc0")(inputs)
    h = L.ReLU()(L.BatchNormalization(epsilon=1e-9, name="bn0")(h))
    y = L.BatchNormalization(name="bn1")(L.Dense(4, name="fc1")(h))
    model = keras.Model(inputs, L.Dense(3, name="head")(y))
    q, _ = np.linalg.qr(rng.normal(size=(d_in, width)))
    model.get_layer("fc0").kernel.assign(q.astype("float32"))
    bn0 = model.get_layer("bn0")
    bn0.gamma.assign(rng.uniform(0.5, 1.5, width).astype("float32"))
    bn0.beta.assign(rng.normal(0.3, 0.5, width).astype("float32"))
    bn0.moving_mean.assign(np.zeros(width, "float32"))
    bn0.moving_variance.assign(np.ones(width, "float32"))
    return model


def _bn1_input_moments(model, n=400_000, seed=1):
    """Monte Carlo mean and variance of bn1's input."""
    sub = keras.Model(model.inputs, model.get_layer("fc1").output)
    x = np.random.default_rng(seed).normal(size=(n, model.inputs[0].shape[-1]))
    z = np.asarray(sub.predict(x.astype("float32"), batch_size=65536, verbose=0),
                   dtype=np.float64)
    return z.mean(axis=0), z.var(axis=0), z.std(axis=0) / np.sqrt(n)


def test_corrected_statistics_match_monte_carlo_after_pruning():
    model = _exact_surrogate_model()
    m0, v0, _ = _bn1_input_moments(model)
    bn1 = model.get_layer("bn1")
    bn1.moving_mean.assign(m0.astype("float32"))
    bn1.moving_variance.assign(v0.astype("float32"))
    analysis = hope_keras.analyze(model)
    hope_keras.compress(model, steps=2, actions=("prune",), verbose=False,
                        analysis=analysis)
    m1, v1, se = _bn1_input_moments(model)
    assert np.max(np.abs(m1 - m0) / se) > 50  # the pruning moved bn1's input
    new = hope_keras.correct_statistics(model, analysis)
    mean, var = new["bn1"]
    np.testing.assert_allclose(mean, m1, atol=5 * se.max())
    np.testing.assert_allclose(var, v1, rtol=0.02)
    np.testing.assert_allclose(bn1.moving_mean.numpy(), m1, atol=5 * se.max() + 1e-6)


def test_uncompressed_model_is_unchanged_and_other_models_are_refused():
    model = _exact_surrogate_model(seed=2)
    analysis = hope_keras.analyze(model)
    before = [w.copy() for w in model.get_weights()]
    hope_keras.correct_statistics(model, analysis)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="another model"):
        hope_keras.correct_statistics(_exact_surrogate_model(seed=2), analysis)
