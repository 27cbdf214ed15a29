"""`fold_batchnorm`: each foldable BN moved into the layer before it, same outputs.

Expected weights are computed by hand in float64 from the BN formula; outputs are
compared with the unfolded model's; what must not fold is listed pattern by pattern.
"""

import keras
import numpy as np
import pytest

import hope_keras
from hope_keras.deploy.fold import foldable_pairs

L = keras.layers


def _randomize_bns(model, seed=0):
    """Non-trivial γ, β and moving statistics in every BN (a trained model's are)."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            _randomize_bns(layer, seed + 1)
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            if layer.scale:
                layer.gamma.assign(rng.uniform(0.3, 2.0, n).astype("float32"))
            if layer.center:
                layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_mean.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.2, 3.0, n).astype("float32"))
    return model


def _same_outputs(a, b, x, rtol=1e-5):
    ya, yb = (np.asarray(m(x, training=False), np.float64) for m in (a, b))
    scale = max(float(np.max(np.abs(ya))), 1e-6)
    assert np.max(np.abs(ya - yb)) <= rtol * scale, np.max(np.abs(ya - yb)) / scale


def _bn_names(model):
    return [layer.name for layer in model.layers if isinstance(layer, L.BatchNormalization)]


@pytest.mark.parametrize("make", [
    lambda: L.Conv2D(6, 3, use_bias=False, name="p"),
    lambda: L.Conv2D(6, 3, padding="same", name="p"),
    lambda: L.DepthwiseConv2D(3, name="p"),
    lambda: L.DepthwiseConv2D(3, use_bias=False, name="p"),
    lambda: L.SeparableConv2D(6, 3, use_bias=False, name="p"),
    lambda: L.SeparableConv2D(6, 3, depth_multiplier=2, name="p"),
    lambda: L.Conv2D(4, 3, groups=4, name="p"),  # grouped depthwise (ConvNeXt's)
    lambda: L.Dense(6, name="p"),
], ids=["conv", "conv_bias", "depthwise_bias", "depthwise", "separable",
        "separable_dm2_bias", "grouped_depthwise", "dense"])
@pytest.mark.parametrize("bn_kw", [{}, {"scale": False}, {"center": False}],
                         ids=["affine", "no_scale", "no_center"])
def test_each_producer_folds_with_the_same_outputs(make, bn_kw):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((7, 7, 4))
    producer = make()
    x = L.BatchNormalization(name="bn", **bn_kw)(producer(inputs))
    model = _randomize_bns(keras.Model(inputs, L.ReLU(name="relu")(x)))
    folded = hope_keras.fold_batchnorm(model)
    assert _bn_names(folded) == []
    assert folded.get_layer("p").use_bias
    x = np.random.default_rng(1).normal(size=(3, 7, 7, 4)).astype("float32")
    _same_outputs(model, folded, x)


def test_folded_weights_are_the_formula_in_float64():
    """Hand-computed kernel and bias: a = γ/√(σ² + ε), W·a, a·(b − μ) + β."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5, 5, 3))
    x = L.BatchNormalization(epsilon=0.01, name="bn")(L.Conv2D(4, 3, name="p")(inputs))
    model = _randomize_bns(keras.Model(inputs, x), seed=3)
    conv, bn = model.get_layer("p"), model.get_layer("bn")
    g, b, m, v = (np.asarray(w.numpy(), np.float64) for w in
                  (bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance))
    a = g / np.sqrt(v + 0.01)
    kernel = np.asarray(conv.kernel.numpy(), np.float64) * a
    bias = a * (np.asarray(conv.bias.numpy(), np.float64) - m) + b
    new = hope_keras.fold_batchnorm(model).get_layer("p")
    np.testing.assert_array_equal(new.kernel.numpy(), kernel.astype(np.float32))
    np.testing.assert_array_equal(new.bias.numpy(), bias.astype(np.float32))


def test_what_must_not_fold_stays():
    """An activation inside the producer, a second reader of its output, a model
    output, a shared producer, a BN on another axis, a BN after an Add or after an
    activation: each BN stays, and the outputs are unchanged."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6, 6, 4))
    a = L.BatchNormalization(name="bn_after_relu_conv")(
        L.Conv2D(4, 3, padding="same", activation="relu", name="relu_conv")(inputs))
    c = L.Conv2D(4, 1, name="two_readers")(a)
    b1 = L.BatchNormalization(name="bn_two_readers")(c)
    s = L.Add(name="add")([b1, c])
    b2 = L.BatchNormalization(name="bn_after_add")(s)
    b3 = L.BatchNormalization(name="bn_after_act")(L.Activation("tanh")(b2))
    shared = L.Conv2D(4, 1, name="shared")
    b4 = L.BatchNormalization(name="bn_shared")(shared(b3))
    b5 = shared(b4)
    d = L.Dense(5, name="dense_axis1")(L.Reshape((36, 4))(b5))
    b6 = L.BatchNormalization(axis=1, name="bn_axis1")(d)
    out_conv = L.Conv2D(3, 1, name="out_conv")(b5)
    b7 = L.BatchNormalization(name="bn_of_model_output")(out_conv)
    model = _randomize_bns(keras.Model(inputs, [L.Flatten()(b6), b7, out_conv]))
    assert foldable_pairs(model) == {}
    folded = hope_keras.fold_batchnorm(model)
    assert sorted(_bn_names(folded)) == sorted(_bn_names(model))
    x = np.random.default_rng(5).normal(size=(2, 6, 6, 4)).astype("float32")
    for ya, yb in zip(model(x), folded(x)):
        np.testing.assert_allclose(np.asarray(yb), np.asarray(ya), rtol=1e-5, atol=1e-6)


def test_an_application_folds_every_bn_and_is_left_untouched():
    """MobileNetV2: each of its BNs follows a convolution read only by it."""
    keras.utils.set_random_seed(6)
    model = _randomize_bns(keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35))
    before = [w.numpy().copy() for w in model.weights]
    folded = hope_keras.fold_batchnorm(model)
    assert len(foldable_pairs(model)) == len(_bn_names(model)) > 50
    assert _bn_names(folded) == []
    assert len(folded.layers) == len(model.layers) - len(_bn_names(model))
    for w, b in zip(model.weights, before):
        np.testing.assert_array_equal(w.numpy(), b)
    x = np.random.default_rng(7).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
    _same_outputs(model, folded, x, rtol=1e-4)


def test_nested_sequential_and_round_trip(tmp_path):
    keras.utils.set_random_seed(8)
    inner = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(5, 3, name="c"),
                              L.BatchNormalization(name="bn"), L.ReLU(name="r")],
                             name="inner")
    inputs = keras.Input((8, 8, 3))
    x = L.BatchNormalization(name="head_bn")(L.Dense(4, name="head")(
        L.GlobalAveragePooling2D()(inner(inputs))))
    model = _randomize_bns(keras.Model(inputs, x))
    assert foldable_pairs(model) == {"bn": "c", "head_bn": "head"}
    folded = hope_keras.fold_batchnorm(model)
    assert _bn_names(folded) == []
    x = np.random.default_rng(9).normal(size=(2, 8, 8, 3)).astype("float32")
    _same_outputs(model, folded, x)
    path = tmp_path / "folded.keras"
    folded.save(path)
    _same_outputs(folded, keras.models.load_model(path), x, rtol=0)


def test_after_compress_and_slim_the_deployed_model_keeps_the_outputs():
    from hope_keras.data import load_demo_model

    model = load_demo_model()
    hope_keras.compress(model, density=0.7, verbose=False)
    small = hope_keras.slim(model)
    folded = hope_keras.fold_batchnorm(small)
    assert _bn_names(small) and _bn_names(folded) == []
    assert folded.count_params() < small.count_params()
    x = np.random.default_rng(10).uniform(0, 1, (8,) + tuple(model.inputs[0].shape[1:]))
    _same_outputs(small, folded, x.astype("float32"))


def test_bad_statistics_are_refused_naming_the_layer():
    inputs = keras.Input((4,))
    x = L.BatchNormalization(name="bad_bn")(L.Dense(3)(inputs))
    model = keras.Model(inputs, x)
    model.get_layer("bad_bn").moving_variance.assign(np.array([1.0, np.nan, 1.0], "float32"))
    with pytest.raises(ValueError, match="bad_bn"):
        hope_keras.fold_batchnorm(model)


def test_cli_compress_fold_batchnorm(tmp_path):
    """`hope-keras compress --fold-batchnorm` saves the slimmed model folded."""
    from hope_keras import cli
    from hope_keras.data import load_demo_model

    path, plain, folded = (str(tmp_path / n) for n in ("m.keras", "p.keras", "f.keras"))
    load_demo_model().save(path)
    for out, extra in ((plain, []), (folded, ["--fold-batchnorm"])):
        assert cli.main(["compress", path, "--density", "0.8", "--out", out, "--quiet",
                         *extra]) in (0, None)
    plain, folded = keras.models.load_model(plain), keras.models.load_model(folded)
    assert _bn_names(plain) and _bn_names(folded) == []
    x = np.random.default_rng(11).uniform(0, 1, (4,) + tuple(plain.inputs[0].shape[1:]))
    _same_outputs(plain, folded, x.astype("float32"))


def test_a_subclassed_model_is_traced_and_folded():
    """As `slim` does, a subclassed model's `call` is traced into a Functional model."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = L.Conv2D(4, 3, name="conv")
            self.bn = L.BatchNormalization(name="bn")
            self.head = L.Dense(2, name="head")

        def call(self, x):
            return self.head(L.Flatten()(keras.ops.relu(self.bn(self.conv(x)))))

    model = Net()
    x = np.random.default_rng(12).uniform(0, 1, (2, 8, 8, 3)).astype("float32")
    model(x)
    _randomize_bns(model, seed=13)
    folded = hope_keras.fold_batchnorm(model)
    assert isinstance(folded, keras.Model) and _bn_names(folded) == []
    _same_outputs(model, folded, x)
