"""End to end on keras.applications.ResNet50 (random networks: test_fuzz.py)."""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L


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
