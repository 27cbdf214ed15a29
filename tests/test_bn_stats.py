"""Tests for hope_keras.stats.bn_stats.reestimate_batchnorm_statistics."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hope_keras.stats.bn_stats import reestimate_batchnorm_statistics


def _model():
    """Conv -> BN -> ReLU -> pool -> Flatten -> Dense -> BN -> ReLU -> Dropout -> Dense."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(6, 3, padding="same", name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn_conv")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(5, name="dense")(x)
    x = keras.layers.BatchNormalization(name="bn_dense")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inputs, outputs)
    # Stale, wrong statistics and non-trivial affine parameters.
    for name in ("bn_conv", "bn_dense"):
        bn = model.get_layer(name)
        c = bn.moving_mean.shape[0]
        bn.moving_mean.assign(np.full(c, 3.0, np.float32))
        bn.moving_variance.assign(np.full(c, 0.01, np.float32))
        bn.gamma.assign(np.linspace(0.5, 1.5, c).astype(np.float32))
        bn.beta.assign(np.linspace(-0.2, 0.3, c).astype(np.float32))
    return model


def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8, 8, 2)) * 2 + 0.5).astype(np.float32)


def _training_mode_inputs(model, x):
    """Each BN layer's input, computed by hand with training-mode (batch) BN."""
    conv_out = model.get_layer("conv")(x).numpy().astype(np.float64)
    bn = model.get_layer("bn_conv")
    m, v = conv_out.mean(axis=(0, 1, 2)), conv_out.var(axis=(0, 1, 2))
    h = (conv_out - m) / np.sqrt(v + bn.epsilon) * bn.gamma.numpy() + bn.beta.numpy()
    h = np.maximum(h, 0).reshape(len(x), 4, 2, 4, 2, 6).max(axis=(2, 4))
    h = h.reshape(len(x), -1).astype(np.float32)
    dense_out = model.get_layer("dense")(h).numpy().astype(np.float64)
    return {"bn_conv": conv_out, "bn_dense": dense_out}


def test_single_batch_matches_numpy_and_training_mode():
    model = _model()
    x = _data()
    expected = _training_mode_inputs(model, x)

    result = reestimate_batchnorm_statistics(model, x, batch_size=len(x))

    assert set(result) == {"bn_conv", "bn_dense"}
    for name, inp in expected.items():
        axes = tuple(range(inp.ndim - 1))
        bn = model.get_layer(name)
        np.testing.assert_allclose(bn.moving_mean.numpy(), inp.mean(axis=axes), rtol=1e-5, atol=1e-5)
        # Biased (population) variance.
        np.testing.assert_allclose(bn.moving_variance.numpy(), inp.var(axis=axes), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(result[name][1], inp.var(axis=axes), rtol=1e-4, atol=1e-6)

    # Inference with the re-estimated statistics == training-mode BN on the
    # full batch. Dropout has to stay off, so compare against a copy of the
    # model without it.
    no_dropout = keras.Model(
        model.inputs[0], model.get_layer("head")(model.layers[-3].output)
    )
    inference = model.predict(x, batch_size=len(x), verbose=0)
    with_batch_stats = no_dropout(x, training=True).numpy()
    np.testing.assert_allclose(inference, with_batch_stats, rtol=1e-4, atol=1e-4)


def test_stats_match_submodel_inputs_after_reestimation():
    """Several batches: the first BN's input does not depend on BN statistics,
    so its statistics are exact; the second one's input is checked against the
    re-estimated model's own inference-mode inputs."""
    model = _model()
    x = _data(n=200, seed=3)
    reestimate_batchnorm_statistics(model, x, batch_size=64)
    probe = keras.Model(
        model.inputs,
        [model.get_layer("bn_conv").input, model.get_layer("bn_dense").input],
    )
    conv_in, dense_in = (t.astype(np.float64) for t in probe.predict(x, verbose=0))
    bn_conv, bn_dense = model.get_layer("bn_conv"), model.get_layer("bn_dense")
    np.testing.assert_allclose(bn_conv.moving_mean.numpy(), conv_in.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bn_conv.moving_variance.numpy(), conv_in.var(axis=(0, 1, 2)), rtol=1e-4)
    # Upstream BN used per-batch statistics during the pass: close, not exact.
    np.testing.assert_allclose(bn_dense.moving_mean.numpy(), dense_in.mean(axis=0), atol=0.05 * dense_in.std())
    np.testing.assert_allclose(bn_dense.moving_variance.numpy(), dense_in.var(axis=0), rtol=0.15)


def test_dataset_and_iterable_inputs_agree_with_array():
    x = _data(n=100)
    y = np.zeros(len(x))
    ref = reestimate_batchnorm_statistics(_model(), x, batch_size=100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(100)
    from_ds = reestimate_batchnorm_statistics(_model(), ds)
    from_list = reestimate_batchnorm_statistics(_model(), [x])
    for name in ref:
        for other in (from_ds, from_list):
            np.testing.assert_allclose(other[name][0], ref[name][0], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(other[name][1], ref[name][1], rtol=1e-6)


def test_a_model_of_two_inputs_takes_a_list_a_dict_a_labelled_tuple_or_a_dataset():
    """Every form of two inputs' data gives the statistics of the first BN of each
    branch, measured by Keras' forward pass (their inputs do not depend on BN
    statistics); the dataset of dicts is cut into other batches (float64 merging)."""
    keras.utils.set_random_seed(2)
    a, b = keras.Input((4, 4, 3), name="a"), keras.Input((5,), name="b")
    ha = keras.layers.BatchNormalization(name="bn_a")(keras.layers.Conv2D(4, 3, name="ca")(a))
    hb = keras.layers.BatchNormalization(name="bn_b")(keras.layers.Dense(3, name="db")(b))
    out = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(ha), hb])
    model = keras.Model([a, b], keras.layers.Dense(2)(out))
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(90, 4, 4, 3)).astype("float32"),
          rng.normal(size=(90, 5)).astype("float32")]
    named = {"a": xs[0], "b": xs[1]}
    conv_in, dense_in = (np.asarray(t, np.float64) for t in keras.Model(
        model.inputs, [model.get_layer("ca").output, model.get_layer("db").output])(xs))
    for data in (xs, named, (xs, np.zeros(90)),
                 tf.data.Dataset.from_tensor_slices(named).batch(16)):
        res = reestimate_batchnorm_statistics(model, data, batch_size=32)
        np.testing.assert_allclose(res["bn_a"][0], conv_in.mean(axis=(0, 1, 2)), atol=1e-5)
        np.testing.assert_allclose(res["bn_a"][1], conv_in.var(axis=(0, 1, 2)), rtol=1e-4)
        np.testing.assert_allclose(res["bn_b"][0], dense_in.mean(axis=0), atol=1e-5)
        np.testing.assert_allclose(res["bn_b"][1], dense_in.var(axis=0), rtol=1e-4)
    with pytest.raises(TypeError, match=r"named \['a', 'b'\].*\['a', 'c'\]"):
        reestimate_batchnorm_statistics(model, {"a": xs[0], "c": xs[1]})
    with pytest.raises(ValueError, match=r"\(90, 4\) \(input 1\).*\(None, 5\)"):
        reestimate_batchnorm_statistics(model, [xs[0], xs[1][:, :4]])


def test_batches_limit_and_chunked_conv_stats_exact():
    """First-BN statistics over several batches equal the whole-array ones
    (float64 merging), and `batches` limits the data used."""
    model = _model()
    x = _data(n=160, seed=5)
    res = reestimate_batchnorm_statistics(model, x, batch_size=32, batches=3)
    conv_out = model.get_layer("conv")(x[:96]).numpy().astype(np.float64)
    np.testing.assert_allclose(res["bn_conv"][0], conv_out.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["bn_conv"][1], conv_out.var(axis=(0, 1, 2)), rtol=1e-5)


def test_sequential_model():
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(name="bn")]
    )
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    reestimate_batchnorm_statistics(model, x)
    h = model.layers[0](x).numpy().astype(np.float64)
    np.testing.assert_allclose(model.get_layer("bn").moving_mean.numpy(), h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_layer("bn").moving_variance.numpy(), h.var(0), rtol=1e-5)


def test_unsupported_axis_names_layer():
    inputs = keras.Input((4, 4, 3))
    out = keras.layers.BatchNormalization(axis=1, name="channels_first_bn")(inputs)
    model = keras.Model(inputs, out)
    with pytest.raises(ValueError, match="channels_first_bn"):
        reestimate_batchnorm_statistics(model, np.zeros((2, 4, 4, 3), np.float32))


def test_empty_data_raises():
    with pytest.raises(ValueError, match="no batches"):
        reestimate_batchnorm_statistics(_model(), [])


def test_nested_backbone_statistics_match_its_own_reestimation():
    """The transfer-learning pattern: a backbone model nested in a Sequential."""
    rng = np.random.default_rng(5)

    def backbone():
        keras.utils.set_random_seed(5)
        inner_in = keras.Input((6, 6, 2))
        y = keras.layers.BatchNormalization(name="bn_a")(keras.layers.Conv2D(3, 3)(inner_in))
        y = keras.layers.ReLU()(y)
        y = keras.layers.BatchNormalization(name="bn_b")(keras.layers.Conv2D(4, 1)(y))
        return keras.Model(inner_in, y, name="backbone")

    x = rng.normal(size=(32, 6, 6, 2)).astype("float32")
    alone = backbone()
    reestimate_batchnorm_statistics(alone, x, batch_size=32)
    bb = backbone()
    outer = keras.Sequential([keras.Input((6, 6, 2)), bb,
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    stats = reestimate_batchnorm_statistics(outer, x, batch_size=32)
    assert set(stats) == {"bn_a", "bn_b"}
    for name in ("bn_a", "bn_b"):
        np.testing.assert_allclose(bb.get_layer(name).moving_mean.numpy(),
                                   alone.get_layer(name).moving_mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(bb.get_layer(name).moving_variance.numpy(),
                                   alone.get_layer(name).moving_variance.numpy(), rtol=1e-4)
