"""Subclassed models: traced into Functional models of the same layers
(hope_keras.graph.tracing), compressed in place and slimmed exactly; refused clearly when
their `call` cannot be traced."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import hope_keras
from hope_keras.graph.tracing import TracingError, traced


class BlockNet(keras.Model):
    """Sequential blocks, a residual `+`, keras.ops activations, several outputs."""

    def __init__(self):
        super().__init__()
        self.stem = keras.Sequential([layers.Conv2D(16, 3, padding="same"),
                                      layers.BatchNormalization()], name="stem")
        self.body = keras.Sequential([layers.Conv2D(24, 3, padding="same"),
                                      layers.BatchNormalization(), layers.ReLU(),
                                      layers.Conv2D(16, 3, padding="same"),
                                      layers.BatchNormalization()], name="body")
        self.pool = layers.GlobalAveragePooling2D()
        self.fc = layers.Dense(32)
        self.bn = layers.BatchNormalization()
        self.head = layers.Dense(5)
        self.box = layers.Dense(4)

    def call(self, x):
        h = ops.relu(self.stem(x))
        h = ops.relu(h + self.body(h))
        h = ops.relu(self.bn(self.fc(self.pool(h))))
        return {"classes": self.head(h), "box": self.box(h)}


def _trained_like(model, rng):
    """Non-trivial BN statistics, as a trained model has."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(size=n) * 0.3)
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=n))
            layer.gamma.assign(rng.uniform(0.5, 1.5, size=n))
            layer.beta.assign(rng.normal(size=n) * 0.2)


def _outputs(model, x):
    out = model(x, training=False)
    return {k: np.asarray(v) for k, v in out.items()}


def test_subclassed_model_compresses_in_place_and_slims_exactly():
    rng = np.random.default_rng(0)
    net = BlockNet()
    x = rng.normal(size=(32, 12, 12, 3)).astype("float32")
    net(x)
    _trained_like(net, rng)
    before = _outputs(net, x)
    analysis = hope_keras.analyze(net)
    # stem (residual stream), body's inner conv and fc: the keras.ops ReLUs are seen through
    assert sorted(g.size for g in analysis.groups) == [16, 24, 32]
    result = hope_keras.compress(net, density=0.6, verbose=False)
    assert result.density <= 0.6
    after = _outputs(net, x)  # the user's own model, edited through the traced graph
    assert max(np.abs(after[k] - before[k]).max() for k in after) > 1e-3
    np.testing.assert_allclose(np.asarray(traced(net)(x)["box"]), after["box"], atol=1e-5)
    small = hope_keras.slim(net)
    assert small.count_params() < net.count_params()
    slimmed = {k: np.asarray(v) for k, v in small(x, training=False).items()}
    for k in after:
        np.testing.assert_allclose(slimmed[k], after[k], atol=1e-4, rtol=1e-4)


def test_traced_graph_shares_the_layers():
    net = BlockNet()
    net(np.zeros((1, 8, 8, 3), "float32"))
    functional = traced(net)
    mine = {id(w) for w in functional.weights}
    assert mine == {id(w) for w in net.weights}
    assert traced(net) is functional  # traced once: no extra nodes on the layers


class TFOpNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.conv = layers.Conv2D(8, 3)
        self.head = layers.Dense(2)

    def call(self, x):
        h = tf.nn.relu(self.conv(x))
        return self.head(ops.mean(h, axis=(1, 2)))


def test_non_traceable_call_is_refused_naming_the_operation():
    net = TFOpNet()
    net(np.zeros((1, 8, 8, 3), "float32"))
    weights = [w.copy() for w in net.get_weights()]
    with pytest.raises(TracingError) as info:
        hope_keras.compress(net, density=0.5, verbose=False)
    message = str(info.value)
    assert "TFOpNet" in message
    assert "tf.nn.relu(self.conv(x))" in message
    assert "Functional" in message
    for a, b in zip(weights, net.get_weights()):
        np.testing.assert_array_equal(a, b)


class PythonBranchNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(4)

    def call(self, x):
        if ops.mean(x) > 0:  # Python control flow on a tensor's value
            return self.dense(x)
        return self.dense(-x)


def test_python_control_flow_on_a_tensor_is_refused():
    net = PythonBranchNet()
    net(np.ones((1, 3), "float32"))
    with pytest.raises(TracingError, match="input shape is unknown"):
        hope_keras.analyze(net)  # Keras could not build it symbolically either
    with pytest.raises(TracingError, match=r"`if ops.mean\(x\) > 0:.*line \d+.*boolean"):
        traced(net, input_shape=(None, 3))


def test_unbuilt_subclassed_model_asks_for_a_build():
    with pytest.raises(TracingError, match="input shape is unknown"):
        hope_keras.analyze(BlockNet())


class ResizeNet(keras.Model):
    """A resize between two compressible groups (HED's side outputs, FPN-style)."""

    def __init__(self):
        super().__init__()
        self.a = keras.Sequential([layers.Conv2D(12, 3, padding="same"),
                                   layers.BatchNormalization(), layers.ReLU()])
        self.b = keras.Sequential([layers.Conv2D(10, 3, padding="same"),
                                   layers.BatchNormalization(), layers.ReLU()])
        self.up = layers.Resizing(16, 16)
        self.head = layers.Conv2D(1, 1)

    def call(self, x):
        h = ops.image.resize(self.a(x), (12, 12))
        return self.head(self.up(self.b(h)))


def test_resize_between_groups_is_seen_through():
    rng = np.random.default_rng(1)
    net = ResizeNet()
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    net(x)
    _trained_like(net, rng)
    analysis = hope_keras.analyze(net)
    assert sorted(g.size for g in analysis.groups) == [10, 12]
    hope_keras.compress(net, density=0.5, verbose=False)
    np.testing.assert_allclose(np.asarray(hope_keras.slim(net)(x)), np.asarray(net(x)),
                               atol=1e-4, rtol=1e-4)


class ReduceNet(keras.Model):
    """A global pooling written as a `keras.ops` reduction over the spatial axes."""

    def __init__(self, reduce, **kwargs):
        super().__init__()
        self.reduce, self.kwargs = reduce, kwargs
        self.conv = layers.Conv2D(12, 3, padding="same")
        self.bn = layers.BatchNormalization()
        self.fc = layers.Dense(3)

    def call(self, x):
        return self.fc(self.reduce(ops.relu(self.bn(self.conv(x))), **self.kwargs))


@pytest.mark.parametrize("reduce, kwargs", [
    (ops.mean, dict(axis=(1, 2))), (ops.sum, dict(axis=[-3, -2])),
    (ops.max, dict(axis=(1, 2))), (ops.min, dict(axis=(1, 2))),
    (ops.mean, dict(axis=(1, 2), keepdims=True)),
], ids=["mean", "sum", "max", "min", "mean-keepdims"])
def test_a_spatial_reduction_between_a_group_and_its_reader_is_seen_through(reduce, kwargs):
    rng = np.random.default_rng(2)
    net = ReduceNet(reduce, **kwargs)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    net(x)
    _trained_like(net, rng)
    analysis = hope_keras.analyze(net)
    assert [g.size for g in analysis.groups] == [12]
    result = hope_keras.compress(net, density=0.5, verbose=False)
    assert result.density == 0.5
    small = hope_keras.slim(net)
    assert small.count_params() < net.count_params()
    np.testing.assert_allclose(np.asarray(small(x)), np.asarray(net(x)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs, why", [
    (dict(axis=-1, keepdims=True), "reduces across channels"),
    (dict(axis=None, keepdims=True), "over every axis"),
    (dict(axis=(1, 2), initial=1.0), "initial=1.0"),
])
def test_a_reduction_across_channels_pins_the_group_and_says_why(kwargs, why):
    net = ReduceNet(ops.max, **kwargs)
    net(np.ones((2, 8, 8, 3), "float32"))
    summary = str(hope_keras.analyze(net).pinned)
    assert why in summary and "conv" in summary
