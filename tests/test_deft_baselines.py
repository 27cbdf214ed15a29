"""DEFT baselines and retention: per-example Fisher, method elasticities, EWC penalty,
source-head graft with restored BN statistics."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import mlp, small_resnet
from hope_keras import deft
from hope_keras.deft.retention import example_slice


def _data(model, n=12, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    return x, (np.arange(n) % classes).astype("int64")


def _per_example_fisher(model, x, y, variables):
    """The Fisher diagonal by an explicit loop over the examples (one or several
    input arrays)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {v.path: np.zeros(v.shape) for v in variables}
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            li = loss(y[i:i + 1], model(example_slice(x, i, i + 1), training=False))
        for v, g in zip(variables, tape.gradient(li, variables)):
            out[v.path] += np.square(np.asarray(g, np.float64)) / len(y)
    return out


@pytest.mark.parametrize("method", ["layerwise", "vmap"])
def test_fisher_is_the_mean_of_per_example_squared_gradients(method):
    model = mlp((5, 4), d_in=6, d_out=3)
    x, y = _data(model)
    F = deft.diagonal_fisher(model, x, y, batch_size=5, method=method)  # uneven batch
    head = "head"
    variables = [v for l in model.layers if l.name != head for v in l.trainable_weights]
    assert set(F) == {v.path for v in variables}
    expected = _per_example_fisher(model, x, y, variables)
    for p, f in F.items():
        np.testing.assert_allclose(f, expected[p], rtol=1e-4, atol=1e-7, err_msg=p)
    # ... and not the square of the batch-mean gradient.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        lb = loss(y, model(x, training=False))
    g = dict(zip([v.path for v in variables], tape.gradient(lb, variables)))
    assert not np.allclose(F["fc0/kernel"], np.square(g["fc0/kernel"].numpy()))


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_a_two_input_model_is_scored_and_trained_one_array_per_input(method):
    """Keras takes a multi-input model's data as a list of arrays: the Fisher is the
    per-example mean over the examples (not over the arrays), accuracy counts
    examples, and `Trainer.fit` takes ``([x1, x2], y)``."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    a, b = keras.Input((4,)), keras.Input((3,))
    h = L.ReLU()(L.BatchNormalization(name="bn")(L.Dense(6, name="fc")(
        L.Concatenate()([a, b]))))
    model = keras.Model([a, b], L.Dense(3, name="head")(h))
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(10, 4)).astype("float32"), rng.normal(size=(10, 3)).astype("float32")]
    y = (np.arange(10) % 3).astype("int64")
    F = deft.diagonal_fisher(model, x, y, batch_size=4, method=method)
    variables = [v for l in model.layers if l.name != "head" for v in l.trainable_weights]
    expected = _per_example_fisher(model, x, y, variables)
    for p, f in F.items():
        np.testing.assert_allclose(f, expected[p], rtol=1e-4, atol=1e-7, err_msg=p)
    pred = np.argmax(model.predict(x, verbose=0), axis=-1)
    assert deft.accuracy(model, x, y, batch_size=4) == pytest.approx(np.mean(pred == y))
    history = deft.Trainer(model, keras.optimizers.SGD(0.1)).fit(
        (x, y), epochs=1, batch_size=4, target_val=(x, y))
    assert 0.0 <= history.best["target_acc"] <= 1.0
    with pytest.raises(ValueError, match="holds 10, 9 examples"):
        deft.Trainer(model, keras.optimizers.SGD(0.1)).fit(([x[0], x[1][:9]], y), epochs=1)


def test_fisher_of_a_grouped_convolution_and_of_mixed_precision_layers():
    """TensorFlow's vectorisation mis-shapes a grouped 3-D convolution at run time:
    the Fisher then goes one example after another, with the same values. Under a
    mixed-precision policy the closed form computes in float32."""
    L = keras.layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 4, 4))
    h = L.ReLU()(L.BatchNormalization(name="bn")(
        L.Conv3D(4, 3, groups=4, padding="same", name="g")(inputs)))
    model = keras.Model(inputs, L.Dense(3, name="head")(L.GlobalAveragePooling3D()(h)))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 4, 4, 4, 4)).astype("float32"), np.arange(6) % 3
    variables = [v for l in model.layers if l.name != "head" for v in l.trainable_weights]
    F = deft.diagonal_fisher(model, x, y, batch_size=4, method="vmap")
    want = _per_example_fisher(model, x, y, variables)
    for p in want:
        np.testing.assert_allclose(F[p], want[p], rtol=1e-4, atol=1e-8, err_msg=p)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(1)
        inputs = keras.Input((5,))
        h = L.ReLU()(L.BatchNormalization(name="bn")(L.Dense(6, name="fc")(inputs)))
        model = keras.Model(inputs, L.Dense(3, name="head", dtype="float32")(h))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = rng.normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    a = deft.diagonal_fisher(model, x, y, batch_size=4, method="layerwise")
    b = deft.diagonal_fisher(model, x, y, batch_size=4, method="vmap")
    for p in b:
        np.testing.assert_allclose(a[p], b[p], rtol=2e-2, atol=1e-6 * float(b[p].max()),
                                   err_msg=p)


def test_layerwise_fisher_matches_vmap_on_a_convolutional_resnet():
    model = small_resnet(seed=3)
    x, y = _data(model, n=10, classes=4)
    a = deft.diagonal_fisher(model, x, y, batch_size=4, method="layerwise")
    b = deft.diagonal_fisher(model, x, y, batch_size=4, method="vmap")
    assert set(a) == set(b) and {"stem/kernel", "b1b_bn/gamma", "fc/kernel"} <= set(a)
    for p in a:
        np.testing.assert_allclose(a[p], b[p], rtol=2e-3, atol=1e-7 * float(b[p].max()),
                                   err_msg=p)


def test_method_elasticities_and_ewc_penalty():
    model = small_resnet()
    target = deft.replace_head(model, 5, seed=0)
    assert target.get_layer("head_target").kernel.shape == (9, 5)
    assert deft.method_elasticity("full", target) == {}
    head_only = deft.method_elasticity("head", target)
    assert not any(k.startswith("head_target") for k in head_only)
    assert set(head_only.values()) == {0.0}
    assert {"stem/kernel", "c2_bn/gamma", "fc/kernel", "fc/bias"} <= set(head_only)
    peft = deft.method_elasticity("peft", target)
    assert "fc/kernel" in peft and "fc/bias" not in peft and "c2_bn/gamma" not in peft
    assert "head_target/kernel" not in peft
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(), elasticity=peft)
    by = {v.path: v for v in target.trainable_variables}
    assert opt.elasticity_of(by["fc/kernel"]) == 0.0 and opt.elasticity_of(by["fc/bias"]) == 1
    with pytest.raises(ValueError, match="method='deft' needs plan"):
        deft.method_elasticity("deft", target)
    with pytest.raises(ValueError, match="Received: method='lora'"):
        deft.method_elasticity("lora", target)
    fisher = {"fc/kernel": np.full((by["fc/kernel"].shape), 2.0, "float32")}
    pen = deft.EWCPenalty(target, fisher, lam=3.0)
    assert float(pen(target)) == 0.0
    by["fc/kernel"].assign(by["fc/kernel"].numpy() + 0.5)
    n = int(np.prod(by["fc/kernel"].shape))
    assert float(pen(target)) == pytest.approx(0.5 * 3.0 * 2.0 * 0.25 * n, rel=1e-5)
    with pytest.raises(ValueError, match="no trainable variables"):
        deft.EWCPenalty(target, {"nope/kernel": np.zeros(1)}, 1.0)


@keras.saving.register_keras_serializable(package="test_deft_baselines")
class _Scale(keras.layers.Layer):
    """A per-channel scale whose weight has no name (Keras numbers it)."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.s


def test_baselines_on_a_nested_backbone_and_weights_keras_named_by_a_counter():
    """A nested backbone's layers are not the outer model's `layers`: the head-only
    and PEFT maps name its variables. A weight created without a name is called
    ``variable_<counter>``, so the copy `replace_head` makes names it differently:
    the Fisher of the source still anchors the copy's variable."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    inner_in = keras.Input((5,))
    h = _Scale(name="scale")(L.ReLU()(L.BatchNormalization(name="bn")(
        L.Dense(6, name="fc")(inner_in))))
    backbone = keras.Model(inner_in, h, name="backbone")
    inputs = keras.Input((5,))
    source = keras.Model(inputs, L.Dense(3, name="head")(backbone(inputs)))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)).astype("float32"), np.arange(8) % 3
    fisher = deft.diagonal_fisher(source, x, y)
    target = deft.replace_head(source, 4, seed=0)
    scale_path = [v.path for v in target.trainable_variables if v.path.startswith("scale/")]
    assert scale_path and scale_path[0] not in fisher  # renamed by the counter
    pen = deft.EWCPenalty(target, fisher, lam=2.0)
    var = {v.path: v for v in target.trainable_variables}[scale_path[0]]
    var.assign(var.numpy() + 1.0)
    want = 0.5 * 2.0 * float(np.sum(fisher[[k for k in fisher if k.startswith("scale/")][0]]))
    assert float(pen(target)) == pytest.approx(want, rel=1e-5)
    for method in ("head", "peft"):
        emap = deft.method_elasticity(method, target)
        opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1), elasticity=emap)
        start = {v.path: v.numpy().copy() for v in target.trainable_variables}
        deft.Trainer(target, opt).fit((x, y), epochs=1, batch_size=4, restore_best=False)
        for v in target.trainable_variables:
            moved = not np.array_equal(v.numpy(), start[v.path])
            free = v.path.startswith("head_target") or (method == "peft" and len(v.shape) < 2)
            assert moved == free, (method, v.path)


def test_deft_elasticity_of_a_replaced_head_trains_the_target_model():
    # The sequence of benchmarks/deft_transfer.py: plan, apply, replace_head, then the
    # map for the target model, passed as elasticity= (keys checked against variables).
    model = small_resnet(seed=1)
    p = deft.plan(model, percentile=50, cost="paper")
    p.apply(model)
    target = deft.replace_head(model, 5, seed=0)
    emap = deft.method_elasticity("deft", target, plan=p)
    plan_map = p.elasticity_map()
    assert p.head == "head" and "head" in plan_map
    assert "head" not in emap and emap["head_target"] == 1.0
    assert {k: v for k, v in emap.items() if k != "head_target"} == {
        k: v for k, v in plan_map.items() if k != "head"}
    assert any(v == 0.0 or (isinstance(v, list) and 0.0 in v) for v in emap.values())
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), elasticity=emap)
    target.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    x, y = _data(target, n=32, classes=5)
    target.fit(x, y, batch_size=16, epochs=2, verbose=0)  # built: every key matched
    by = {v.path: v for v in target.trainable_variables}
    assert np.all(by["head_target/kernel"].numpy() != start["head_target/kernel"])
    frozen = 0
    for path, v in by.items():
        s = np.broadcast_to(np.asarray(opt.elasticity_of(v), dtype=np.float64), v.shape)
        np.testing.assert_array_equal(v.numpy()[s == 0], start[path][s == 0],
                                      err_msg=path)
        frozen += int(np.count_nonzero(s == 0))
    assert frozen > 0
    # On the source model itself the plan's map is returned as it is.
    assert deft.method_elasticity("deft", model, plan=p) == plan_map
    # A plan of another model is refused, naming the layers it lacks.
    other = mlp((5, 4), d_in=6, d_out=3)
    with pytest.raises(ValueError, match="does not have"):
        deft.method_elasticity("deft", other, plan=p)


def test_retention_grafts_the_masked_source_head_and_restores_statistics():
    model = small_resnet(seed=5)
    p = deft.plan(model, percentile=60)
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    drift = p.head_input_drift > 0
    assert retention.num_masked == int(drift.sum()) > 0
    assert np.all(retention.kernel[drift] == 0)
    x, _ = _data(model, n=16)
    logits = retention.logits(model, x)
    target = deft.replace_head(model, 5)
    # Change the target's BN statistics: the graft must not see them, and must put
    # them back afterwards.
    bn = target.get_layer("c2_bn")
    bn.moving_mean.assign(bn.moving_mean.numpy() + 3.0)
    changed = bn.moving_mean.numpy().copy()
    np.testing.assert_allclose(retention.logits(target, x), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), changed)
    y = logits.argmax(-1)
    assert retention.evaluate(target, x, y) == 1.0
    assert deft.h_score(1.0, 0.0) == 0.0 and deft.h_score(0.5, 0.5) == 0.5
