"""One test per layer pattern the walker understands: remove channels of every group
(HOPE's own run, and random channels by hand), slim, and compare outputs; the live
parameter count must equal the slim model's, and the slim model must reload in safe
mode. A new layer rule is one more entry in PATTERNS."""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L
from hope_keras.graph import adapter as kg
from hope_keras.edit.editor import ModelEditor
from hope_keras.deploy.profile import model_flops


def _randomize(model, seed=0):
    """Non-trivial BN statistics and biases everywhere (nested layers included)."""
    rng = np.random.default_rng(seed)
    for layer in kg.flatten(model).layers.values():
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            values = {"gamma": rng.uniform(0.5, 1.5, n), "beta": rng.normal(0, 0.5, n),
                      "moving_mean": rng.normal(0, 0.3, n),
                      "moving_variance": rng.uniform(0.5, 2.0, n)}
            for w in layer.weights:
                w.assign(values[w.name].astype("float32"))
        elif isinstance(layer, L.LayerNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
        elif getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.2, layer.bias.shape).astype("float32"))
    return model


def bn_relu(x):
    return L.ReLU()(L.BatchNormalization()(x))


def bn_after_activation(x):
    x = L.BatchNormalization()(L.Conv2D(6, 3, padding="same", activation="relu")(x))
    x = L.BatchNormalization()(L.ReLU()(L.Conv2D(5, 3, padding="same")(x)))
    return L.Conv2D(4, 3)(x)


def pre_activation(x):
    """ResNet-V2 style: BN → ReLU → conv branches added to a raw stream, with a
    pooled-identity shortcut."""
    x = L.Conv2D(6, 3, padding="same", name="stem")(x)
    for k in range(2):
        pre = bn_relu(x)
        y = bn_relu(L.Conv2D(4, 1, use_bias=False)(pre))
        y = L.Conv2D(6, 3, padding="same")(y)
        shortcut = L.MaxPooling2D(1, strides=1)(x) if k else x
        x = L.Add()([shortcut, y])
    return L.Conv2D(3, 1)(bn_relu(x))


def depthwise(x):
    x = bn_relu(L.Conv2D(6, 1, use_bias=False)(x))
    x = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same")(x)))
    x = L.BatchNormalization()(L.Conv2D(5, 1, use_bias=False)(x))
    y = bn_relu(L.Conv2D(8, 1)(x))
    y = bn_relu(L.DepthwiseConv2D(3, padding="same", use_bias=False)(y))
    y = L.BatchNormalization()(L.Conv2D(5, 1)(y))
    x = L.Add()([x, y])  # MobileNetV2's inverted residual
    return L.Conv2D(3, 1)(x)


def separable(x):
    x = bn_relu(L.Conv2D(6, 3, padding="same")(x))
    x = bn_relu(L.SeparableConv2D(7, 3, padding="same", depth_multiplier=2)(x))
    x = bn_relu(L.SeparableConv2D(5, 3, padding="same")(x))
    return L.Dense(3)(L.Flatten()(x))


def concatenate(x):
    a = bn_relu(L.Conv2D(4, 1)(x))
    b = bn_relu(L.Conv2D(3, 3, padding="same")(x))
    c = L.AveragePooling2D(3, strides=1, padding="same")(bn_relu(L.Conv2D(2, 1)(x)))
    x = L.Concatenate()([a, b, c])
    x = bn_relu(L.Conv2D(5, 1)(x))
    # DenseNet: each new feature map joins the stream, read through a BN of its own.
    for _ in range(2):
        y = L.Conv2D(3, 3, padding="same", use_bias=False)(bn_relu(x))
        x = L.Concatenate()([x, y])
    return L.Conv2D(3, 1)(bn_relu(x))


def squeeze_excite(x):
    x = bn_relu(L.Conv2D(8, 1)(x))
    se = L.GlobalAveragePooling2D()(x)
    se = L.Reshape((1, 1, 8))(se)
    se = L.Conv2D(3, 1, activation="relu")(se)
    se = L.Conv2D(8, 1, activation="sigmoid")(se)
    x = L.Multiply()([x, se])
    x = L.BatchNormalization()(L.Conv2D(4, 1)(x))
    return L.Conv2D(3, 1)(x)


def keras_ops(x):
    """MobileNetV3's hard-sigmoid gate, built from Keras operations."""
    x = bn_relu(L.Conv2D(6, 1)(x))
    se = L.GlobalAveragePooling2D(keepdims=True)(x)
    se = L.ReLU()(L.Conv2D(2, 1)(se))
    se = L.ReLU(6.0)(L.Conv2D(6, 1)(se) + 3.0) * (1.0 / 6.0)
    x = L.Multiply()([x, se])
    return L.Conv2D(3, 1)(L.BatchNormalization()(L.Conv2D(4, 1)(x)))


def residual_stream(x):
    """ResNet-V1: a projection block and an identity block share one stream."""
    x = bn_relu(L.Conv2D(4, 3, padding="same")(x))
    s = L.BatchNormalization()(L.Conv2D(6, 1)(x))
    y = bn_relu(L.Conv2D(3, 3, padding="same")(x))
    y = L.BatchNormalization()(L.Conv2D(6, 1)(y))
    x = L.ReLU()(L.Add()([s, y]))
    y = bn_relu(L.Conv2D(3, 3, padding="same")(x))
    y = L.BatchNormalization()(L.Conv2D(6, 1)(y))
    x = L.ReLU()(L.Add()([x, y]))
    return L.Dense(3)(L.GlobalAveragePooling2D()(x))


def channels_first_flatten(x):
    x = bn_relu(L.Conv2D(5, 3)(x))
    x = L.Flatten(data_format="channels_first")(x)
    return L.Dense(3)(bn_relu(L.Dense(6)(x)))


def nested(x):
    inner_in = keras.Input(x.shape[1:])
    y = bn_relu(L.Conv2D(5, 3, padding="same")(inner_in))
    y = L.BatchNormalization()(L.Conv2D(5, 3, padding="same")(y))
    backbone = keras.Model(inner_in, L.ReLU()(L.Add()([y, bn_relu(L.Conv2D(5, 1)(inner_in))])),
                           name="backbone")
    return L.Dense(3)(L.GlobalAveragePooling2D()(backbone(x)))


def convnext(x):
    """ConvNeXt: a residual stream read through LayerNormalization (stem, every
    block, the downsampling layer), a per-channel layer scale, and a pooled head
    normalised again."""
    layer_scale = kg.optional_classes("applications.convnext", ("LayerScale",))["LayerScale"]
    x = L.LayerNormalization(epsilon=1e-6)(L.Conv2D(6, 2, strides=2)(x))
    for depthwise in (L.Conv2D(6, 3, padding="same", groups=6),  # as keras.applications
                      L.DepthwiseConv2D(3, padding="same")):
        y = L.LayerNormalization(epsilon=1e-6)(depthwise(x))
        y = L.Dense(6)(L.Activation("gelu")(L.Dense(12)(y)))
        x = x + layer_scale(0.5, 6)(y)
    x = L.Conv2D(5, 2, strides=2)(L.LayerNormalization(epsilon=1e-6)(x))
    x = L.LayerNormalization(epsilon=1e-6)(L.GlobalAveragePooling2D()(x))
    return L.Dense(3)(x)


def transposed(x):
    """A U-Net decoder: transposed convolutions write and read groups (strided, with
    and without bias), and one joins an encoder map through a Concatenate."""
    skip = bn_relu(L.Conv2D(5, 3, padding="same")(x))
    y = bn_relu(L.Conv2D(6, 3, strides=2, padding="same")(skip))
    y = bn_relu(L.Conv2DTranspose(4, 3, strides=2, padding="same", use_bias=False)(y))
    y = L.Concatenate()([y, skip])
    y = bn_relu(L.Conv2DTranspose(5, 2, padding="same")(y))
    return L.Conv2D(3, 1)(y)


def inception_resnet(x, scales=(0.2, 0.5)):
    """Inception-ResNet: the stream is a concatenation of two branches, and each block
    adds a 1 × 1 convolution of its own concatenated branches to it, scaled
    (keras.applications' CustomScaleLayer): the convolutions' channels split where
    the stream's concatenation does, into two stream groups."""
    scaled = kg.optional_classes("applications.inception_resnet_v2", ("CustomScaleLayer",))
    x = L.Concatenate()([bn_relu(L.Conv2D(3, 3, padding="same")(x)), bn_relu(L.Conv2D(4, 1)(x))])
    for scale in scales:
        b = L.Concatenate()([bn_relu(L.Conv2D(2, 1)(x)),
                             bn_relu(L.Conv2D(3, 3, padding="same")(x))])
        x = L.ReLU()(scaled["CustomScaleLayer"](scale)([x, L.Conv2D(7, 1)(b)]))
    return L.Dense(3)(L.GlobalAveragePooling2D()(x))


PATTERNS = [bn_after_activation, pre_activation, depthwise, separable, concatenate,
            squeeze_excite, keras_ops, residual_stream, channels_first_flatten, nested,
            convnext, transposed, inception_resnet]


def _model(pattern, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    return _randomize(keras.Model(inputs, pattern(inputs), name=pattern.__name__), seed)


def _x(model, n=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n,) + tuple(model.inputs[0].shape[1:])
                                              ).astype("float32")


def _same(a, b, x, rtol=1e-4):
    ya, yb = np.asarray(a(x)), np.asarray(b(x))
    return float(np.abs(ya - yb).max()) <= 1e-6 + rtol * max(1.0, float(np.abs(ya).max()))


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.__name__)
def test_pattern_is_compressible_and_slim_is_exact(pattern, tmp_path):
    model = _model(pattern, seed=1)
    analysis = hope_keras.analyze(model)
    assert analysis.groups, analysis.pinned_summary()
    x = _x(model)
    result = hope_keras.compress(model, density=0.6, verbose=False)
    small = hope_keras.slim(model)
    assert _same(model, small, x)
    assert small.count_params() == round(result.params_ratio * model.count_params())
    assert small.count_params() < model.count_params()
    # The engine's FLOPs counter agrees with profile's count of the slim model.
    assert result.flops_ratio == pytest.approx(model_flops(small) / model_flops(model))
    path = str(tmp_path / "small.keras")
    small.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert _same(small, reloaded, x, rtol=1e-6)


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.__name__)
def test_removing_random_channels_of_every_group_then_slim(pattern):
    model = _model(pattern, seed=2)
    graph = hope_keras.walk(model)
    editor = ModelEditor(model, graph)
    rng = np.random.default_rng(3)
    removed = 0
    for name, group in graph.groups.items():
        for i in rng.choice(group.size, size=max(1, group.size // 2), replace=False)[:-1]:
            with editor.step():
                editor.prune(name, int(i))
            removed += 1
    editor.commit()
    assert removed
    small = hope_keras.slim(model)
    assert _same(model, small, _x(model))
    assert small.count_params() < model.count_params()


def test_pattern_group_kinds():
    kinds = {p.__name__: {g.kind for g in hope_keras.walk(_model(p, 0)).groups.values()}
             for p in PATTERNS}
    assert kinds["bn_after_activation"] == {"coupled"}
    assert "coupled" in kinds["depthwise"] and "coupled" in kinds["squeeze_excite"]
    # The decoder's groups merge when plain (producer → BN → ReLU → readers), a
    # transposed convolution on either side; the concatenated ones prune.
    g = hope_keras.walk(_model(transposed, 0))
    by_writer = {type(g.layer(grp.writers[0])).__name__: grp.kind for grp in g.groups.values()
                 if grp.kind == "neurons"}
    assert by_writer == {"Conv2D": "neurons", "Conv2DTranspose": "neurons"}, by_writer
    assert kinds["transposed"] == {"neurons", "coupled"}
    g = hope_keras.walk(_model(pre_activation, 0))
    assert sum(b.evictable for b in g.blocks) == 2
    assert all(b.final_bn is None and b.input_reader_bn for b in g.blocks)


def test_a_scaled_sum_is_a_block_whose_branch_counts_with_its_scale():
    """Inception-ResNet's ``x + scale · r`` is an evictable block; its eviction prices
    the branch as the sum adds it: scale × the same model's unscaled branch RMS."""
    g = hope_keras.walk(_model(inception_resnet, 0))
    assert [(b.branch_scale, b.evictable) for b in g.blocks] == [(0.2, True), (0.5, True)]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    unscaled = _randomize(keras.Model(inputs, inception_resnet(inputs, scales=(1.0, 1.0))), 0)
    scaled = hope_keras.analyze(_model(inception_resnet, 0)).blocks
    plain = hope_keras.analyze(unscaled).blocks
    assert [b.c_branch for b in scaled] == pytest.approx(
        [0.2 * plain[0].c_branch, 0.5 * plain[1].c_branch], rel=1e-6)
    assert plain[0].c_branch > 0


def test_a_split_writer_takes_each_groups_elasticity_at_its_positions():
    """DEFT: a convolution whose outputs two stream groups share (Inception-ResNet's)
    is scaled per output channel by the elasticity of the group that channel is in."""
    from hope_keras.deft import application

    model = _model(inception_resnet, 0)
    graph = hope_keras.walk(model)
    elasticity = {name: np.linspace(0.1, 1.0, g.size) for name, g in graph.groups.items()}
    layer_e, _ = application.elasticities_and_drift(model, graph, elasticity, "dense", 0.0)
    split = [c for g in graph.groups.values() for c in g.couplings
             if c.role == "out" and c.positions.size < model.get_layer(c.layer).filters]
    assert len({c.layer for c in split}) == 2  # each block's 1 × 1 convolution
    for name, g in graph.groups.items():
        for c in g.couplings:
            if c in split:
                np.testing.assert_allclose(layer_e[c.layer][c.positions[:, 0]],
                                           elasticity[name])


def test_channels_first_pooling_on_channels_last_tensors_pins_with_a_reason():
    inputs = keras.Input((6, 6, 3))
    x = bn_relu(L.Conv2D(4, 3, name="c")(inputs))
    x = L.GlobalAveragePooling2D(data_format="channels_first")(x)
    model = keras.Model(inputs, L.Dense(2)(x))
    analysis = hope_keras.analyze(model)
    assert not analysis.groups
    reasons = {p.layer: p.reason for p in analysis.pinned}
    assert "channels_first" in reasons["c"]
    with pytest.raises(ValueError, match="no compressible"):
        hope_keras.compress(model, density=0.5, verbose=False)


def test_a_wrapped_convolution_is_listed_as_pinned_with_its_wrapper():
    """TimeDistributed(Conv2D) writes channels hope_keras cannot edit: the wrapper is
    named in `pinned` (it was absent, and the refusal named only the output layer)."""
    inputs = keras.Input((3, 6, 6, 2))
    x = bn_relu(L.TimeDistributed(L.Conv2D(4, 3), name="td")(inputs))
    model = keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling3D()(x)))
    reasons = {p.layer: p.reason for p in hope_keras.analyze(model).pinned}
    assert "TimeDistributed" in reasons["td"]
    with pytest.raises(ValueError, match="no compressible neuron group.*'td': TimeDistributed"):
        hope_keras.compress(model, density=0.5, verbose=False)


@pytest.mark.parametrize("pattern", [concatenate, residual_stream, channels_first_flatten],
                         ids=lambda p: p.__name__)
def test_baselines_on_coupled_patterns_slim_exactly(pattern):
    from hope_keras.search import baselines

    for method in ("l1_input", "bn_scale", "neuron_merging"):
        model = _model(pattern, seed=4)
        if method == "neuron_merging":
            baselines.neuron_merging(model, density=0.6)
        else:
            baselines.prune(model, density=0.6, method=method, mean_compensation=True)
        small = hope_keras.slim(model)
        assert _same(model, small, _x(model)), method
        assert small.count_params() < model.count_params()


def test_convnext_stream_channels_go_and_slim_counts_them_in_layer_norms(tmp_path):
    """Stream channels pruned through every LayerNormalization: slim's copies count
    them as zeros (`ZeroPaddedLayerNormalization`), outputs equal, and the model
    reloads in safe mode. A channel that only looks unread but is not zero stays."""
    from hope_keras.graph.layers import ZeroPaddedLayerNormalization

    model = _model(convnext, seed=5)
    graph = hope_keras.walk(model)
    (stream,) = [g for g in graph.groups.values() if g.stream]
    assert sum(isinstance(graph.layer(c.layer), L.LayerNormalization)
               for c in stream.couplings if c.role == "channel") == 4
    x = _x(model)
    editor = ModelEditor(model, graph)
    for i in (1, 4):
        with editor.step():
            editor.prune(stream.name, i)
    editor.commit()
    small = hope_keras.slim(model)
    assert _same(model, small, x)
    norms = [layer for layer in small.layers if isinstance(layer, L.LayerNormalization)]
    padded = [layer.zero_channels for layer in norms
              if isinstance(layer, ZeroPaddedLayerNormalization)]
    assert sorted(padded) == [2, 2, 2, 2]
    path = str(tmp_path / "convnext.keras")
    small.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert _same(small, reloaded, x, rtol=1e-6)
    # Zeroing a stream channel's readers only (it still flows): slim keeps it.
    model = _model(convnext, seed=5)
    editor = ModelEditor(model, graph := hope_keras.walk(model))
    (stream,) = [g for g in graph.groups.values() if g.stream]
    with editor.step():
        for c in stream.readers:
            editor._zero_coupling(c, 2)
    editor.commit()
    small = hope_keras.slim(model)
    assert _same(model, small, x)
    assert not any(isinstance(layer, ZeroPaddedLayerNormalization) for layer in small.layers)


def _convnext_gated(gate):
    """A LayerNorm stream whose last tensor is scaled by a squeeze-and-excitation
    gate (`hard_sigmoid(0) = 0.5`: a removed channel's gate is not zero), the gate's
    activation fused into its convolution, a layer of its own, or Keras operations
    (`relu6(x + 3) / 6`, as MobileNetV3 writes it)."""
    def pattern(x):
        x = L.LayerNormalization(epsilon=1e-6)(L.Conv2D(6, 2, strides=2)(x))
        y = L.LayerNormalization(epsilon=1e-6)(L.DepthwiseConv2D(3, padding="same")(x))
        x = x + L.Dense(6)(L.Activation("gelu")(L.Dense(12)(y)))
        x = L.LayerNormalization(epsilon=1e-6)(x)
        g = L.Reshape((1, 1, 6))(L.GlobalAveragePooling2D()(x))
        g = L.Conv2D(3, 1, activation="relu")(g)
        if gate == "fused":
            g = L.Conv2D(6, 1, activation="hard_sigmoid")(g)
        elif gate == "layer":
            g = L.Activation("hard_sigmoid")(L.Conv2D(6, 1)(g))
        else:
            g = keras.ops.relu6(L.Conv2D(6, 1)(g) + 3.0) / 6.0
        x = L.Multiply()([x, g])
        return L.Dense(3)(L.GlobalAveragePooling2D()(x))
    pattern.__name__ = f"convnext_gated_{gate}"
    return pattern


@pytest.mark.parametrize("gate", ["fused", "layer", "ops"])
def test_a_gated_layer_norm_stream_slims_its_removed_channels(gate):
    """A removed stream channel is zero wherever the stream flows, but the gate that
    scales it holds hard_sigmoid(0) there: slim drops it all the same (the product is
    zero; the LayerNormalizations count it as a zero), so the engine's parameter
    count is slim's (they differed: slim kept every channel of such a stream)."""
    from hope_keras.graph.layers import ZeroPaddedLayerNormalization

    model = _model(_convnext_gated(gate), seed=6)
    graph = hope_keras.walk(model)
    (stream,) = [g for g in graph.groups.values() if g.stream]
    x = _x(model)
    count0 = model.count_params()
    result = hope_keras.compress(model, density=0.4, actions=("prune",), verbose=False)
    assert any(s.unit == stream.name for s in result.trajectory)
    small = hope_keras.slim(model)
    assert _same(model, small, x)
    assert small.count_params() == round(result.params_ratio * count0)
    removed = [layer.zero_channels for layer in small.layers
               if isinstance(layer, ZeroPaddedLayerNormalization)]
    assert len(removed) == 3 and min(removed) > 0


def test_zero_padded_layer_norm_equals_layer_norm_on_the_padded_input():
    """Against a float64 NumPy LayerNormalization of the input with the zeros put back."""
    from hope_keras.graph.layers import ZeroPaddedLayerNormalization

    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, (4, 3, 5)).astype("float32")
    layer = ZeroPaddedLayerNormalization(zero_channels=3, epsilon=1e-3)
    layer.build(x.shape)
    layer.gamma.assign(rng.uniform(0.5, 1.5, 5).astype("float32"))
    layer.beta.assign(rng.normal(0, 1, 5).astype("float32"))
    padded = np.concatenate([x, np.zeros((4, 3, 3))], axis=-1).astype(np.float64)
    mean = padded.mean(axis=-1, keepdims=True)
    var = padded.var(axis=-1, keepdims=True)
    ref = ((padded - mean) / np.sqrt(var + 1e-3))[..., :5] * layer.gamma.numpy() \
        + layer.beta.numpy()
    np.testing.assert_allclose(np.asarray(layer(x)), ref, rtol=1e-5, atol=1e-5)
    again = ZeroPaddedLayerNormalization.from_config(layer.get_config())
    assert again.zero_channels == 3 and again.epsilon == layer.epsilon
    with pytest.raises(ValueError, match="zero_channels must be >= 0. Received: -1"):
        ZeroPaddedLayerNormalization(zero_channels=-1)


def test_layer_norm_group_keeps_channels_that_an_activation_makes_non_zero():
    """A removed channel must be exactly zero at a LayerNormalization's input: after a
    depthwise convolution with a sigmoid (sigmoid(0) = 0.5) it is not, so `slim`
    keeps it (and stays exact)."""
    inputs = keras.Input((6, 6, 3))
    x = L.Conv2D(5, 1, name="p")(inputs)
    x = L.DepthwiseConv2D(1, activation="sigmoid")(x)
    x = L.Conv2D(2, 1)(L.LayerNormalization()(x))
    model = _randomize(keras.Model(inputs, x), seed=6)
    graph = hope_keras.walk(model)
    editor = ModelEditor(model, graph)
    with editor.step():
        editor.prune("p", 1)
    editor.commit()
    small = hope_keras.slim(model)
    assert _same(model, small, _x(model))
    assert small.count_params() == model.count_params()
