"""`recover`: BN re-estimation + distillation through Keras `fit`.

Checks that the distillation loss goes down, that pruned neurons stay pruned (so
`slim` removes the same channels and matches the outputs afterwards), that softmax
heads are distilled on their logits and restored, that labels and errors behave, and
(in a subprocess with two logical CPUs) that MirroredStrategy matches one device.
"""

import textwrap

import keras
import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp, run_on_two_logical_cpus, small_resnet
from hope_keras.deploy.recover import Distiller

L = keras.layers


def _images(n=128, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 10, 10, 3)).astype("float32")


def _compressed(seed=4, density=0.5):
    teacher = small_resnet(seed=seed)
    model = copy_model(teacher)
    hope_keras.compress(model, density=density, verbose=False)
    return teacher, model


def _slim_shapes(model):
    return {layer.name: tuple(w.shape for w in layer.weights)
            for layer in hope_keras.slim(model).layers}


def test_distillation_loss_decreases_and_model_comes_back_compiled():
    teacher, model = _compressed()
    x = _images(256)
    history = hope_keras.recover(model, x, teacher=teacher, epochs=4, verbose=0,
                                 learning_rate=3e-3)
    kd = history.history["distillation_loss"]
    assert len(kd) == 4 and "label_loss" not in history.history
    assert kd[-1] < 0.7 * kd[0], kd
    assert model.compiled and model.loss.from_logits  # small_resnet ends in logits
    out = model.evaluate(x[:16], np.zeros(16, "int64"), verbose=0, return_dict=True)
    assert set(out) >= {"loss", "accuracy"}


def test_pruned_channels_stay_zero_and_slim_removes_the_same_channels():
    teacher, model = _compressed(density=0.4)
    zero_before = {v.path: v.numpy() == 0 for v in model.trainable_variables}
    shapes_before = _slim_shapes(model)
    start = {v.path: v.numpy().copy() for v in model.trainable_variables}
    # Random images on a random teacher: the trained weights are kept whatever
    # the agreement (the guard would put back the start, and nothing would move).
    hope_keras.recover(model, _images(), teacher=teacher, epochs=2, verbose=0,
                       revert_if_worse=False)
    moved = 0
    for v in model.trainable_variables:
        now = v.numpy()
        assert np.all(now[zero_before[v.path]] == 0), v.path
        moved += int(np.count_nonzero(now != start[v.path]))
    assert moved > 100, moved  # it did train
    assert _slim_shapes(model) == shapes_before
    small = hope_keras.slim(model)
    x = _images(32, seed=1)
    np.testing.assert_allclose(small(x, training=False), model(x, training=False),
                               rtol=1e-5, atol=1e-5)


def test_recover_on_the_slimmed_model():
    teacher, model = _compressed()
    small = hope_keras.slim(model)
    n_params = small.count_params()
    history = hope_keras.recover(small, _images(256), teacher=teacher, epochs=3,
                                 verbose=0, learning_rate=3e-3)
    kd = history.history["distillation_loss"]
    assert kd[-1] < kd[0], kd
    assert small.count_params() == n_params


def _softmax_mlp(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = L.ReLU()(L.BatchNormalization()(L.Dense(12)(inputs)))
    return keras.Model(inputs, L.Dense(4, activation="softmax", name="head")(h))


def test_softmax_head_is_distilled_on_its_logits_and_restored():
    teacher, student = _softmax_mlp(0), _softmax_mlp(1)
    x = np.random.default_rng(2).normal(size=(64, 6)).astype("float32")
    distiller = Distiller(student, teacher, temperature=3.0, batchnorm="frozen")
    distiller.compile(keras.optimizers.SGD(0.0))
    got = distiller.evaluate(x, batch_size=64, verbose=0, return_dict=True)

    def logits(m):
        return keras.Model(m.inputs, m.get_layer("head").input)(x).numpy() @ \
            m.get_layer("head").kernel.numpy() + m.get_layer("head").bias.numpy()

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(logits(teacher) / 3.0), log_softmax(logits(student) / 3.0)
    want = 9.0 * np.mean(np.sum(np.exp(lp) * (lp - lq), -1))
    np.testing.assert_allclose(got["distillation_loss"], want, rtol=1e-4)
    assert student.get_layer("head").activation.__name__ == "softmax"
    np.testing.assert_allclose(np.sum(student(x), -1), 1.0, rtol=1e-5)
    hope_keras.recover(student, x, teacher=teacher, epochs=1, verbose=0)
    assert student.get_layer("head").activation.__name__ == "softmax"
    assert not student.loss.from_logits


def test_identical_student_has_zero_distillation_loss():
    teacher = _softmax_mlp(0)
    student = copy_model(teacher)
    x = np.random.default_rng(2).normal(size=(64, 6)).astype("float32")
    history = hope_keras.recover(student, x, teacher=teacher, epochs=1, verbose=0,
                                 batchnorm="frozen", reestimate=False)
    assert history.history["distillation_loss"][0] < 1e-6


def test_labels_and_teacherless_training():
    teacher, model = _compressed()
    x = _images(128)
    y = np.argmax(teacher.predict(x, verbose=0), -1)
    history = hope_keras.recover(model, (x, y), teacher=teacher, epochs=1, verbose=0)
    assert {"distillation_loss", "label_loss"} <= set(history.history)
    history = hope_keras.recover(model, (x, y), epochs=2, verbose=0)
    assert "distillation_loss" not in history.history
    assert len(history.history["label_loss"]) == 2
    # No teacher: revert_if_worse measures label accuracy (batches of 48: the last
    # one partial); the model kept, checked by hand.
    history = hope_keras.recover(model, (x, y), epochs=1, verbose=0, batch_size=48)
    r = history.revert
    kept = r["agreement_before"] if r["reverted"] else r["agreement_after"]
    assert kept == np.mean(np.argmax(model.predict(x, verbose=0), -1) == y)


def test_dataset_input_and_bn_only():
    import tensorflow as tf

    teacher, model = _compressed()
    x = _images(128)
    ds = tf.data.Dataset.from_tensor_slices(x).batch(32)
    history = hope_keras.recover(model, ds, teacher=teacher, epochs=1, verbose=0,
                                 revert_if_worse=True)
    assert len(history.history["distillation_loss"]) == 1
    r = history.revert  # measured over the dataset's batches: the model kept, by hand
    kept = r["agreement_before"] if r["reverted"] else r["agreement_after"]
    assert kept == _agreement(model, teacher, x)
    history = hope_keras.recover(model, x, epochs=0)
    assert history.history == {}
    assert model.compiled


class _ImageBatches(keras.utils.PyDataset):
    """Batches of 32 images, labelled or not."""

    def __init__(self, x, y=None):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // 32

    def __getitem__(self, i):
        x = self.x[32 * i:32 * (i + 1)]
        return x if self.y is None else (x, self.y[32 * i:32 * (i + 1)])


@pytest.mark.parametrize("labelled", [False, True])
def test_a_keras_pydataset_is_distilled_and_checked_on_like_a_dataset(labelled):
    """recover refused a `keras.utils.PyDataset` (compress read it already); its
    agreement check reads its first batches, as for a tf.data dataset."""
    teacher, model = _compressed()
    x = _images(128)
    y = np.arange(128) % 3 if labelled else None
    history = hope_keras.recover(model, _ImageBatches(x, y), teacher=teacher, epochs=1,
                                 verbose=0, revert_if_worse=True)
    assert len(history.history["distillation_loss"]) == 1
    assert ("label_loss" in history.history) == labelled
    r = history.revert
    kept = r["agreement_before"] if r["reverted"] else r["agreement_after"]
    assert kept == _agreement(model, teacher, x)


def test_the_results_recover_takes_other_data_and_reestimates_on_it():
    """`CompressionResult.recover` distils on compress's data= by default; given
    data= (a data-free run has none), it re-estimates the statistics on that data
    first, as `hope_keras.recover` does (it used to fail on a duplicate argument)."""
    teacher = small_resnet(seed=4)
    model = copy_model(teacher)
    result = hope_keras.compress(model, density=0.5, verbose=False)
    with pytest.raises(ValueError, match=r"no data= given to compress.*data=x"):
        result.recover(teacher=teacher)
    x = _images(64, seed=7)
    expected = copy_model(model)
    hope_keras.recover(expected, x, teacher=teacher, epochs=0, verbose=0)
    result.recover(teacher=teacher, data=x, epochs=0, verbose=0)
    for a, b in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_array_equal(a, b)  # BN statistics re-estimated on x
    # With compress's data, that data by default; data= overrides it.
    model = copy_model(teacher)
    result = hope_keras.compress(model, density=0.5, data=_images(64), verbose=False)
    expected = copy_model(model)
    hope_keras.recover(expected, x, teacher=teacher, epochs=0, verbose=0)
    result.recover(teacher=teacher, data=x, epochs=0, verbose=0)
    for a, b in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("named", [False, True], ids=["list", "dict"])
def test_a_model_of_two_inputs_recovers_on_a_list_or_dict_of_arrays(named):
    """One array per input (Keras' convention) or a dict keyed by the input names:
    the BN re-estimation and the distillation both read it; removed channels stay
    zero, and slim keeps computing the same function."""
    keras.utils.set_random_seed(3)
    image, meta = keras.Input((8, 8, 3), name="image"), keras.Input((4,), name="meta")
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3)(image)))
    m = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Dense(6)(meta)))
    z = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(h), m])
    teacher = keras.Model([image, meta], keras.layers.Dense(3)(z))
    model = copy_model(teacher)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(64, 8, 8, 3)).astype("float32"),
          rng.normal(size=(64, 4)).astype("float32")]
    data = {"image": xs[0], "meta": xs[1]} if named else xs
    result = hope_keras.compress(model, density=0.5, data=data, verbose=False)
    zeros = {v.path: v.numpy() == 0 for v in model.trainable_variables}
    history = result.recover(teacher=teacher, epochs=1, verbose=0, revert_if_worse=False)
    assert np.isfinite(history.history["loss"][-1])
    for v in model.trainable_variables:
        assert np.all(v.numpy()[zeros[v.path]] == 0), v.path
    np.testing.assert_allclose(hope_keras.slim(model)(xs, training=False),
                               model(xs, training=False), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_and_model_untouched():
    teacher, model = _compressed()
    before = [w.copy() for w in model.get_weights()]
    x = _images(32)
    with pytest.raises(ValueError, match="teacher .*or labelled data"):
        hope_keras.recover(model, x, epochs=1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        hope_keras.recover(model, x, teacher=teacher, temperature=0)
    with pytest.raises(ValueError, match="must not be the student"):
        hope_keras.recover(model, x, teacher=model)
    with pytest.raises(ValueError, match="outputs shape"):
        hope_keras.recover(model, x, teacher=mlp())
    with pytest.raises(TypeError, match="data must be"):
        hope_keras.recover(model, "images.npy", teacher=teacher)
    for lr in (float("nan"), 0.0, -1.0, "1e-3", True):
        with pytest.raises(ValueError, match=f"learning_rate=.*{lr!r}"):
            hope_keras.recover(model, x, teacher=teacher, learning_rate=lr)
    for bs in (0, 2.5):
        with pytest.raises(ValueError, match=f"batch_size={bs!r}"):
            hope_keras.recover(model, x, teacher=teacher, batch_size=bs)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_diverging_training_is_reported_and_the_weights_put_back():
    """A learning rate far too high makes the weights non-finite: `recover` says so
    (not that the data holds NaNs) and gives the model back as it was, BN
    statistics included (they are re-estimated before training)."""
    teacher, model = _compressed()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(FloatingPointError, match="diverged.*put back.*Lower the learning"):
        hope_keras.recover(model, _images(64), teacher=teacher, epochs=2, verbose=0,
                           optimizer=keras.optimizers.SGD(1e12))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _agreement(model, teacher, x):
    """How often the model's top class is the teacher's on x, by hand."""
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=-1)
                         == np.argmax(teacher.predict(x, verbose=0), axis=-1)))


def test_revert_if_worse_puts_back_a_model_that_training_made_worse():
    """A student equal to its teacher (agreement 1), trained at a learning rate far
    too high (finite weights, other top classes): by default (``revert_if_worse``)
    the weights come back bit for bit, with a warning and both agreements (the
    second checked by hand against the same training with ``revert_if_worse=False``,
    which keeps them)."""
    teacher = small_resnet(seed=4)
    x = _images(256)
    kwargs = dict(teacher=teacher, epochs=1, verbose=0, reestimate="after",
                  learning_rate=0.5, shuffle=False)
    trained = copy_model(teacher)
    history = hope_keras.recover(trained, x, revert_if_worse=False, **kwargs)
    assert not hasattr(history, "revert")
    lowered = _agreement(trained, teacher, x)
    assert lowered < 1.0
    model = copy_model(teacher)
    with pytest.warns(UserWarning, match="lowered the agreement with the teacher.*put back"):
        history = hope_keras.recover(model, x, **kwargs)
    for a, b in zip(model.get_weights(), teacher.get_weights()):
        np.testing.assert_array_equal(a, b)
    r = history.revert
    assert r["reverted"] and r["agreement_before"] == 1.0
    assert r["agreement_after"] == pytest.approx(lowered, abs=0.02)  # 5 of 256 inputs


def test_revert_if_worse_keeps_a_model_that_training_improved():
    teacher, model = _compressed()
    x = _images(256)
    untrained = copy_model(model)
    hope_keras.reestimate_batchnorm_statistics(untrained, x)  # recover's first step
    history = hope_keras.recover(model, x, teacher=teacher, epochs=3, verbose=0,
                                 learning_rate=1e-2, revert_if_worse=True)
    r = history.revert
    assert not r["reverted"] and r["agreement_after"] > r["agreement_before"]
    assert r["agreement_before"] == _agreement(untrained, teacher, x)
    assert r["agreement_after"] == _agreement(model, teacher, x)
    with pytest.raises(ValueError, match="revert_if_worse=.*'yes'"):
        hope_keras.recover(model, x, teacher=teacher, revert_if_worse="yes")


_MIRRORED = textwrap.dedent("""
    import tensorflow as tf
    import keras, numpy as np
    from conftest import copy_model, mlp, small_resnet
    import hope_keras

    teacher = small_resnet(seed=4)
    compressed = copy_model(teacher)
    hope_keras.compress(compressed, density=0.5, verbose=False)
    x = np.random.default_rng(0).normal(size=(128, 10, 10, 3)).astype("float32")
    kwargs = dict(epochs=2, verbose=0, batch_size=32, shuffle=False,
                  learning_rate=3e-3)

    single = copy_model(compressed)
    h1 = hope_keras.recover(single, x, teacher=teacher, **kwargs)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        student = copy_model(compressed)
        mirrored_teacher = copy_model(teacher)
    h2 = hope_keras.recover(student, x, teacher=mirrored_teacher, **kwargs)

    kd1, kd2 = h1.history["distillation_loss"], h2.history["distillation_loss"]
    assert np.allclose(kd1, kd2, rtol=1e-4), (kd1, kd2)
    assert kd1[-1] < kd1[0], kd1
    moved = 0
    for a, b, c, v in zip(single.get_weights(), student.get_weights(),
                          compressed.get_weights(), single.weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=v.path)
        assert np.all(b[c == 0] == 0) or "moving" in v.path, v.path
        moved += int(np.count_nonzero(a != c))
    assert moved > 100, moved
    y1, y2 = single.predict(x, verbose=0), student.predict(x, verbose=0)
    assert np.allclose(y1, y2, rtol=1e-3, atol=1e-3), np.abs(y1 - y2).max()
    print("MIRRORED_OK", kd1, kd2)
""")


@pytest.mark.slow  # a fresh process (a mirrored edit is in make test: test_interruption.py)
def test_recover_under_mirrored_strategy_matches_one_device():
    run_on_two_logical_cpus(_MIRRORED)


def test_subclassed_student_is_distilled_as_logits():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.fc = L.Dense(8)
            self.bn = L.BatchNormalization()
            self.head = L.Dense(3)

        def call(self, x, training=False):
            return self.head(keras.ops.relu(self.bn(self.fc(x), training=training)))

    teacher, student = Net(), Net()
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    teacher(x), student(x)
    history = hope_keras.recover(student, x, teacher=teacher, epochs=3, verbose=0,
                                 learning_rate=1e-2, reestimate=False)
    kd = history.history["distillation_loss"]
    assert kd[-1] < kd[0], kd


def _one_channel_map(seed=0):
    """An image-to-image model ending in a one-channel sigmoid (a mask, a
    reconstruction): a transposed convolution reads a group."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, strides=2, padding="same")(inputs)))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2DTranspose(6, 3, strides=2, padding="same")(x)))
    model = keras.Model(inputs, L.Conv2D(1, 3, padding="same", activation="sigmoid")(x))
    hope_keras.reestimate_batchnorm_statistics(model, _maps(256, seed + 1))
    return model


def _maps(n, seed=0, channels=1):
    """Inputs of the image-to-image and two-head models: n maps of 8 × 8."""
    return np.random.default_rng(seed).uniform(size=(n, 8, 8, channels)).astype("float32")


def test_a_one_unit_output_is_refused_by_kl_and_distilled_by_its_mean_squared_difference():
    teacher = _one_channel_map()
    model = copy_model(teacher)
    hope_keras.compress(model, density=0.5, verbose=False)
    x = _maps(256, seed=3)
    weights = model.get_weights()
    with pytest.raises(ValueError, match="one unit.*distillation='mse'"):
        hope_keras.recover(model, x, teacher=teacher)
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="distillation must be one of"):
        hope_keras.recover(model, x, teacher=teacher, distillation="l2")
    history = hope_keras.recover(model, x, teacher=teacher, epochs=4, verbose=0,
                                 learning_rate=3e-3, distillation="mse")
    kd = history.history["distillation_loss"]
    assert kd[-1] < 0.7 * kd[0], kd
    # The check's value is the outputs' mean squared difference, computed by hand.
    r = history.revert
    assert set(r) == {"mse_before", "mse_after", "reverted"} and not r["reverted"]
    by_hand = np.mean((np.asarray(model(x, training=False), np.float64)
                       - np.asarray(teacher(x, training=False), np.float64)) ** 2)
    assert r["mse_after"] == pytest.approx(by_hand, rel=1e-4)
    assert r["mse_after"] < r["mse_before"]
    assert isinstance(model.loss, keras.losses.MeanSquaredError)


def test_mse_distillation_and_label_terms_are_their_formulas():
    teacher = _one_channel_map(1)
    student = copy_model(teacher)
    student.get_layer(index=1).kernel.assign(student.get_layer(index=1).kernel * 0.5)
    x, y = _maps(16, seed=5), _maps(16, seed=6)
    distiller = Distiller(student, teacher, distillation="mse", label_weight=0.25)
    s = np.asarray(student(x, training=False), np.float64)
    t = np.asarray(teacher(x, training=False), np.float64)
    loss = float(distiller.compute_loss(x, y, student(x, training=False), training=False))
    expected = np.mean((s - t) ** 2) + 0.25 * np.mean((s - y) ** 2)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_revert_if_worse_under_mse_puts_back_a_model_that_training_made_worse():
    teacher = _one_channel_map(2)
    model = copy_model(teacher)
    x = _maps(128, seed=7)
    with pytest.warns(UserWarning, match="raised the mean squared difference.*put back"):
        history = hope_keras.recover(model, x, teacher=teacher, epochs=1, verbose=0,
                                     reestimate="after", optimizer=keras.optimizers.SGD(5.0),
                                     distillation="mse", shuffle=False)
    assert history.revert["reverted"] and history.revert["mse_before"] == 0.0
    for a, b in zip(model.get_weights(), teacher.get_weights()):
        np.testing.assert_array_equal(a, b)


def _two_heads(seed=0):
    """A detector's shape: class scores (softmax) and a box regression, one trunk."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(8, 3, padding="same")(inputs)))
    x = L.GlobalAveragePooling2D()(x)
    x = L.ReLU()(L.BatchNormalization()(L.Dense(12)(x)))
    model = keras.Model(inputs, [L.Dense(3, activation="softmax", name="cls")(x),
                                 L.Dense(4, name="box")(x)])
    hope_keras.reestimate_batchnorm_statistics(model, _maps(256, seed + 1, channels=3))
    return model


def test_a_model_of_two_outputs_is_distilled_per_output_and_checked_per_output():
    teacher = _two_heads()
    model = copy_model(teacher)
    hope_keras.compress(model, density=0.6, verbose=False)
    x = _maps(256, seed=3, channels=3)
    weights = model.get_weights()
    for bad, match in (({"cls": "kl"}, "one per output"), (["kl"], "one per output"),
                       ({"cls": "kl", "box": "l2"}, "Received: 'l2' for output 'box'")):
        with pytest.raises(ValueError, match=match):
            hope_keras.recover(model, x, teacher=teacher, distillation=bad)
    with pytest.raises(ValueError, match="Labels are read for a model of one output"):
        hope_keras.recover(model, (x, np.zeros(256, "int64")), teacher=teacher,
                           distillation=["kl", "mse"])
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    history = hope_keras.recover(model, x, teacher=teacher, epochs=3, verbose=0,
                                 learning_rate=3e-3, distillation={"box": "mse", "cls": "kl"})
    kd = history.history["distillation_loss"]
    assert kd[-1] < kd[0], kd
    r = history.revert
    assert set(r) == {"cls", "box", "reverted"}
    assert set(r["cls"]) == {"agreement_before", "agreement_after"}
    assert set(r["box"]) == {"mse_before", "mse_after"}
    # Training helped both heads here; the check's values by hand.
    assert not r["reverted"] and r["box"]["mse_after"] < r["box"]["mse_before"]
    (sc, sb), (tc, tb) = model(x, training=False), teacher(x, training=False)
    agree = np.mean(np.argmax(sc, -1) == np.argmax(tc, -1))
    mse = np.mean((np.asarray(sb, np.float64) - np.asarray(tb, np.float64)) ** 2)
    assert r["cls"]["agreement_after"] == pytest.approx(agree)
    assert r["box"]["mse_after"] == pytest.approx(mse, rel=1e-4)
    assert model.compiled


def test_two_outputs_loss_is_the_sum_of_their_terms():
    teacher = _two_heads(1)
    student = copy_model(teacher)
    student.get_layer("box").kernel.assign(student.get_layer("box").kernel * 0.5)
    student.get_layer("cls").kernel.assign(student.get_layer("cls").kernel * 2.0)
    x = _maps(16, seed=5, channels=3)
    distiller = Distiller(student, teacher, temperature=2.0, distillation=["kl", "mse"])
    with hope_keras.deploy.recover._Overrides(distiller.overrides()):
        (s_cls, s_box), (t_cls, t_box) = student(x), teacher(x)  # logits: softmax bypassed
        loss = float(distiller.compute_loss(x, None, [s_cls, s_box], training=False))
    s_cls, t_cls = np.asarray(s_cls, np.float64) / 2.0, np.asarray(t_cls, np.float64) / 2.0
    log_q = s_cls - np.log(np.exp(s_cls).sum(-1, keepdims=True))
    log_p = t_cls - np.log(np.exp(t_cls).sum(-1, keepdims=True))
    kl = np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)) * 4.0
    mse = np.mean((np.asarray(s_box, np.float64) - np.asarray(t_box, np.float64)) ** 2)
    assert loss == pytest.approx(kl + mse, rel=1e-4)


def test_a_dict_output_is_named_by_its_keys():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = L.ReLU()(L.BatchNormalization()(L.Dense(8)(inputs)))
    teacher = keras.Model(inputs, {"score": L.Dense(3, activation="softmax")(h),
                                   "offset": L.Dense(1)(h)})
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    hope_keras.reestimate_batchnorm_statistics(teacher, x)
    model = copy_model(teacher)
    with pytest.raises(ValueError, match="output 'offset'.*one unit.*distillation='mse'"):
        hope_keras.recover(model, x, teacher=teacher)
    history = hope_keras.recover(model, x, teacher=teacher, epochs=1, verbose=0,
                                 distillation={"score": "kl", "offset": "mse"})
    assert set(history.revert) == {"score", "offset", "reverted"}
    out = model.evaluate(x, {"score": np.zeros(64, "int64"), "offset": np.zeros((64, 1))},
                         verbose=0, return_dict=True)
    assert {"score_accuracy", "offset_loss"} <= set(out)
