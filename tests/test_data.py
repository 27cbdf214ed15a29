"""Checks of the bundled demo fixtures (hope_keras.data)."""

import keras
import numpy as np
import pytest

from hope_keras.data import CLASS_NAMES, load_demo_data, load_demo_model


@pytest.fixture(scope="module")
def model():
    return load_demo_model()


@pytest.fixture(scope="module")
def data():
    return load_demo_data()


def test_data_shapes_and_ranges(data):
    assert data.x_test.shape == (2000, 28, 28, 1)
    assert data.x_test.dtype == np.float32
    assert data.y_test.shape == (2000,)
    assert data.x_calib.shape == (512, 28, 28, 1)
    assert data.y_calib.shape == (512,)
    for x in (data.x_test, data.x_calib):
        assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5
    assert set(np.unique(data.y_test)) == set(range(len(CLASS_NAMES)))


def test_model_architecture(model):
    assert model.name == "fmnist_cnn"
    assert model.input_shape == (None, 28, 28, 1)
    assert model.output_shape == (None, 10)
    names = {layer.name for layer in model.layers}
    for name in ("conv1", "bn1", "relu1", "conv2", "res_conv1", "res_bn1",
                 "res_relu1", "res_conv2", "res_bn2", "res_add", "res_relu",
                 "conv3", "bn3", "relu3", "fc1", "bn4", "relu4", "predictions"):
        assert name in names
    assert isinstance(model.get_layer("res_add"), keras.layers.Add)
    # Compressible neurons use separate ReLU layers, not fused activations.
    for name in ("conv1", "conv2", "res_conv1", "res_conv2", "conv3", "fc1"):
        assert model.get_layer(name).activation.__name__ == "linear"


def test_demo_accuracy(model, data):
    probs = model.predict(data.x_test, batch_size=500, verbose=0)
    acc = float(np.mean(np.argmax(probs, axis=1) == data.y_test))
    assert acc > 0.85, acc


def test_batchnorm_statistics_sane(model):
    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert len(bns) == 6
    for bn in bns:
        var = bn.moving_variance.numpy()
        mean = bn.moving_mean.numpy()
        assert np.all(np.isfinite(var)) and np.all(var > 0), bn.name
        assert np.all(np.isfinite(mean)), bn.name


def test_load_demo_model_returns_fresh_copies(model):
    other = load_demo_model()
    assert other is not model
    w = other.get_layer("conv1").kernel
    w.assign(np.zeros(w.shape, np.float32))
    assert np.any(model.get_layer("conv1").kernel.numpy() != 0)
