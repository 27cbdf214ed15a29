"""End to end on keras.applications.ResNet50, and property-based random networks."""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hope_keras
from conftest import L, randomize_bn


@pytest.mark.slow
def test_resnet50_compress_half_density_then_slim():
    model = keras.applications.ResNet50(weights=None)
    rng = np.random.default_rng(0)
    # Non-trivial BN statistics: a calibration pass on random images, random γ/β.
    hope_keras.reestimate_batchnorm_statistics(
        model, rng.uniform(0, 255, (4, 224, 224, 3)).astype("float32"), batch_size=4)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.3, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
    x = keras.applications.resnet50.preprocess_input(
        rng.uniform(0, 255, (2, 224, 224, 3)).astype("float32"))
    result = hope_keras.compress(model, density=0.5, verbose=False)
    assert result.density == pytest.approx(0.5, abs=1 / 7616)
    small = hope_keras.slim(model)
    assert small.count_params() < 0.8 * model.count_params()
    assert small.count_params() == round(result.params_ratio * model.count_params())
    ya, yb = model.predict(x, verbose=0), small.predict(x, verbose=0)
    np.testing.assert_allclose(yb, ya, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ property
@st.composite
def network_specs(draw):
    """Random architectures: Dense/Conv, pooling, Flatten, residual adds, forks."""
    conv = draw(st.booleans())
    blocks = draw(st.lists(st.tuples(st.sampled_from(["plain", "residual", "fork"]),
                                     st.integers(1, 6), st.booleans()),
                           min_size=1, max_size=3))
    return {"seed": draw(st.integers(0, 10_000)), "conv": conv,
            "width": draw(st.integers(2, 6)), "blocks": blocks,
            "flatten": draw(st.booleans()), "fc": draw(st.integers(2, 5)),
            "density": draw(st.floats(0.2, 0.95))}


def build(spec):
    """A Functional BN network with several consumers where the spec forks."""
    keras.utils.set_random_seed(spec["seed"])
    conv = spec["conv"]
    inputs = keras.Input((8, 8, 2) if conv else (5,))
    layer = (lambda n: L.Conv2D(n, 3, padding="same")) if conv else L.Dense
    width = spec["width"]
    x = L.ReLU()(L.BatchNormalization()(layer(width)(inputs)))
    outputs = []
    for kind, w, pool in spec["blocks"]:
        if kind == "residual":
            y = L.ReLU()(L.BatchNormalization()(layer(w)(x)))
            y = L.BatchNormalization()(layer(width)(y))
            x = L.ReLU()(L.Add()([x, y]))
            continue
        if kind == "fork":
            outputs.append(layer(2)(x))  # a second consumer of x's channels
        width = w
        x = L.ReLU()(L.BatchNormalization()(layer(w)(x)))
        if conv and pool:
            x = L.MaxPooling2D()(x)
    if conv:
        x = L.Flatten()(x) if spec["flatten"] else L.GlobalAveragePooling2D()(x)
    x = L.ReLU()(L.BatchNormalization()(L.Dense(spec["fc"])(x)))
    outputs.append(L.Dense(3)(x))
    model = keras.Model(inputs, outputs if len(outputs) > 1 else outputs[0])
    return randomize_bn(model, spec["seed"])


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(network_specs())
def test_random_networks_analyze_compress_and_slim(spec):
    model, density, seed = build(spec), spec["density"], spec["seed"]
    analysis = hope_keras.analyze(model)
    assert analysis.num_neurons > 0
    x = np.random.default_rng(seed).normal(size=(3,) + tuple(model.inputs[0].shape[1:]))
    try:
        result = hope_keras.compress(model, density=density, verbose=False)
    except ValueError as e:  # budgets already met or out of reach are legitimate
        assert "already met" in str(e) or "out of reach" in str(e)
        return
    assert result.density <= density + 1e-12
    small = hope_keras.slim(model)
    ya, yb = model(x.astype("float32")), small(x.astype("float32"))
    for a, b in zip(keras.tree.flatten(ya), keras.tree.flatten(yb)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
