"""calibrate: BN-free ReLU networks become equivalent BN networks HOPE can compress."""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L, outputs_equal
from hope_keras.stats.calibration import EPSILON, calibrate, calibration_targets


def _lenet(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 1), name="image")
    x = L.Flatten(name="flatten")(inputs)
    x = L.Dense(20, activation="relu", name="fc1")(x)
    x = L.Dense(12, activation="relu", name="fc2")(x)
    return keras.Model(inputs, L.Dense(4, activation="softmax", name="out")(x),
                       name="tiny_lenet")


def _convnet(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 2), name="image")
    x = L.Conv2D(6, 3, activation="relu", name="c1")(inputs)     # fused ReLU
    x = L.Conv2D(5, 3, padding="same", name="c2")(x)             # separate ReLU
    x = L.ReLU(name="c2_relu")(x)
    x = L.MaxPooling2D(name="pool")(x)
    x = L.Flatten(name="flat")(x)
    return keras.Model(inputs, L.Dense(3, name="head")(x), name="tiny_conv")


def _separable(seed=0):
    """SeparableConv2D producers (a pointwise kernel makes the channels), one ReLU
    fused and one a layer of its own."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3), name="image")
    x = L.SeparableConv2D(6, 3, padding="same", activation="relu", name="s1")(inputs)
    x = L.SeparableConv2D(7, 3, padding="same", use_bias=False, name="s2")(x)
    x = L.ReLU(name="s2_relu")(x)
    x = L.GlobalMaxPooling2D(name="pool")(x)
    return keras.Model(inputs, L.Dense(3, name="head")(x), name="tiny_separable")


def _data(model, n=300, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


@pytest.mark.parametrize("build", [_lenet, _convnet, _separable])
def test_calibrate_preserves_outputs(build):
    model = build()
    x = _data(model)
    calibrated = calibrate(model, x[:200], batch_size=64)
    assert outputs_equal(calibrated, model, x, rtol=1e-5, atol=1e-6)
    assert len(calibrated.calibration) == 2
    # The input model is untouched and still has no BatchNormalization.
    assert not any(isinstance(layer, L.BatchNormalization) for layer in model.layers)


def test_statistics_are_numpy_mean_and_variance_of_pre_activations():
    model = _convnet(seed=1)
    x = _data(model, 150, seed=2)
    calibrated = calibrate(model, x, batch_size=40)  # 4 batches, merged exactly
    z1 = keras.Model(model.inputs[0], model.get_layer("c1").output)
    # c1's pre-activation: the same convolution without the fused ReLU.
    k, b = model.get_layer("c1").get_weights()
    pre1 = np.asarray(keras.ops.conv(x, k, padding="valid")) + b
    pre2 = np.asarray(model.get_layer("c2")(np.asarray(z1(x))))
    for rec, pre in zip(calibrated.calibration, (pre1, pre2)):
        flat = pre.reshape(-1, pre.shape[-1]).astype(np.float64)
        np.testing.assert_allclose(rec.mean, flat.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rec.var, flat.var(0), rtol=1e-4, atol=1e-6)
        bn = calibrated.get_layer(rec.bn)
        np.testing.assert_allclose(bn.moving_mean.numpy(), flat.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(bn.beta.numpy(), flat.mean(0), rtol=1e-5, atol=1e-5)
        # γ = σ (spec section 7), moving variance σ² − ε.
        np.testing.assert_allclose(bn.gamma.numpy(), flat.std(0), rtol=1e-4)
        np.testing.assert_allclose(bn.moving_variance.numpy(), flat.var(0) - EPSILON,
                                   rtol=1e-4)
    assert [r.fused for r in calibrated.calibration] == [True, False]
    assert calibrated.calibration[1].relu == "c2_relu"


def test_hope_sees_raw_weights_and_measured_moments():
    model = _lenet(seed=3)
    x = _data(model, 256, seed=4)
    calibrated = calibrate(model, x)
    a = hope_keras.analyze(calibrated)
    assert [g.name for g in a.groups] == ["fc1", "fc2"]
    st = a.states["fc1"]
    k, b = model.get_layer("fc1").get_weights()
    np.testing.assert_allclose(st.w_eff, k.T, rtol=1e-5, atol=1e-7)   # w_eff = w_raw
    np.testing.assert_allclose(st.b_eff, b, atol=1e-5)                # b_eff = c
    rec = calibrated.calibration[0]
    np.testing.assert_allclose(a.caches["fc1"].beta, rec.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.abs(a.caches["fc1"].gamma), np.sqrt(rec.var), rtol=1e-4)


def test_compress_and_slim_a_calibrated_network():
    model = _lenet(seed=5)
    x = _data(model, 256, seed=6)
    calibrated = calibrate(model, x)
    result = hope_keras.compress(calibrated, density=0.5, verbose=False)
    assert result.density == pytest.approx(0.5, abs=1 / 32)
    small = hope_keras.slim(calibrated)
    assert small.count_params() < model.count_params()
    assert outputs_equal(small, calibrated, x[:32])


def test_a_separable_network_is_calibrated_compressed_and_slimmed():
    """SeparableConv producers are split like Dense/Conv ones: both become groups
    (they were pinned as uncalibrated), and the compressed model slims exactly."""
    model = _separable(seed=3)
    assert calibration_targets(model) == {"s1": "fused", "s2": "s2_relu"}
    x = _data(model, 256, seed=4)
    calibrated = calibrate(model, x)
    assert sorted(g.name for g in hope_keras.analyze(calibrated).groups) == ["s1", "s2"]
    result = hope_keras.compress(calibrated, density=0.5, verbose=False)
    assert result.density <= 0.5
    small = hope_keras.slim(calibrated)
    assert small.get_layer("s1").filters + small.get_layer("s2").filters < 13
    assert outputs_equal(small, calibrated, x[:32])


def test_constant_channel_is_not_pinned():
    model = _lenet(seed=7)
    k, b = model.get_layer("fc1").get_weights()
    k[:, 0] = 0.0  # pre-activation of neuron 0 is the constant b[0]
    model.get_layer("fc1").set_weights([k, b])
    x = _data(model, 128, seed=8)
    calibrated = calibrate(model, x)
    bn = calibrated.get_layer(calibrated.calibration[0].bn)
    assert bn.moving_variance.numpy()[0] > 0
    assert outputs_equal(calibrated, model, x)
    assert "fc1" in [g.name for g in hope_keras.analyze(calibrated).groups]


def test_targets_and_errors():
    model = _convnet()
    assert calibration_targets(model) == {"c1": "fused", "c2": "c2_relu"}
    inputs = keras.Input((4,))
    bn_model = keras.Model(inputs, L.Dense(2)(L.ReLU()(L.BatchNormalization()(
        L.Dense(3)(inputs)))))
    with pytest.raises(ValueError, match="nothing to calibrate. Its layers with a "
                                         "BatchNormalization are compressible"):
        calibrate(bn_model, np.zeros((8, 4), "float32"))
    linear = keras.Model(inputs, L.Dense(2)(L.Dense(3)(inputs)))
    with pytest.raises(ValueError, match=r"nothing to calibrate\.$"):
        calibrate(linear, np.zeros((8, 4), "float32"))
    with pytest.raises(ValueError, match="no batches"):
        calibrate(model, np.zeros((0, 8, 8, 2), "float32"))


def test_sequential_model():
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((5,)), L.Dense(7, activation="relu"),
                              L.Dense(3)], name="seq")
    x = _data(model, 64, seed=9)
    calibrated = calibrate(model, x)
    assert outputs_equal(calibrated, model, x)
    assert len(hope_keras.analyze(calibrated).groups) == 1
