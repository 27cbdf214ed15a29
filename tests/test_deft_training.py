"""DEFT training: frozen/masked weights stay bit-identical, dynamic decoupling,
optimizer serialisation, model.fit == custom loop, MirroredStrategy on 2 CPUs."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from conftest import run_on_two_logical_cpus, small_resnet
from hope_keras import deft


def _setup(seed=0, percentile=50, cost="paper"):
    model = small_resnet(seed=seed)
    p = deft.plan(model, percentile=percentile, cost=cost)
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    target = deft.replace_head(model, 5, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(48, 10, 10, 3)).astype("float32")
    y = (np.arange(48) % 5).astype("int64")
    return model, p, retention, target, x, y


def _scale(opt, v):
    return np.broadcast_to(np.asarray(opt.elasticity_of(v), dtype=np.float64), v.shape)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_frozen_and_masked_weights_stay_bit_identical(inner):
    _, p, _, target, x, y = _setup()
    base = (keras.optimizers.SGD(0.1, momentum=0.9) if inner == "sgd"
            else keras.optimizers.Adam(0.01))
    opt = deft.ElasticOptimizer(base, p)
    target.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    target.fit(x, y, batch_size=16, epochs=3, verbose=0)
    moved_elastic = 0
    for v in target.trainable_variables:
        now, before, s = v.numpy(), start[v.path], _scale(opt, v)
        np.testing.assert_array_equal(now[s == 0], before[s == 0], err_msg=v.path)
        moved_elastic += int(np.count_nonzero(now[s > 0] != before[s > 0]))
    assert moved_elastic > 100
    # Masked weights (zeroed by eq. 28) are still exactly zero.
    for name, drift in p.input_drift.items():
        if name == p.head:
            continue
        k = target.get_layer(name).kernel.numpy()
        e_out = np.broadcast_to(np.asarray(p.layer_elasticity[name]), (k.shape[-1],))
        assert np.all(k[..., drift > 0, :][..., e_out == 0] == 0)
    # The inner optimizer's state of frozen parameters is exactly zero.
    slots = [s for s in base.variables if "momentum" in s.path or "momentum" in s.name
             or "velocity" in s.path]
    assert slots
    by_name = {v.path.replace("/", "_"): v for v in target.trainable_variables}
    for slot in slots:
        owner = slot.path.split("/")[-1].rsplit("_", 1)[0]  # "<layer>_<var>_momentum"
        mask = _scale(opt, by_name[owner]) == 0
        assert np.all(slot.numpy()[mask] == 0), slot.path


@pytest.mark.parametrize("cost", ["paper", "hope"])
def test_dynamic_decoupling_core_activations_do_not_move(cost):
    """With ``cost="hope"`` the plan also covers the residual stream ("stem": stem,
    b1b and the Add), a coupled group without a BN of its own: its channels are
    probed at every BN that writes them (stem_bn, and b1b_bn, the branch's share)."""
    from hope_keras.graph.walker import walk

    model, p, retention, target, x, y = _setup(seed=2, percentile=60, cost=cost)
    assert ("stem" in p.groups) == (cost == "hope")
    groups = walk(model).groups
    # The activations of every group (BN output; ReLU is applied channel-wise).
    probed = [(g, name) for g in p.groups
              for name in ([p.options["bn_of"][g]] if p.options["bn_of"].get(g) else
                           [c.layer for c in groups[g].couplings if c.role == "channel"])]
    assert {g for g, _ in probed} == set(p.groups)
    probe = keras.Model(target.input, [target.get_layer(name).output for _, name in probed])
    with retention.source_statistics(target):
        before = [np.asarray(a) for a in probe(x, training=False)]
    src_before = retention.evaluate(target, x, y)
    trainer = deft.Trainer(target, deft.ElasticOptimizer(
        keras.optimizers.SGD(0.2, momentum=0.9), p), retention=retention)
    trainer.fit((x, y), epochs=3, batch_size=8, restore_best=False)
    with retention.source_statistics(target):
        after = [np.asarray(a) for a in probe(x, training=False)]
    slack_moved = False
    for (g, _), b, a in zip(probed, before, after):
        core = p.elasticity[g] == 0
        np.testing.assert_allclose(a[..., core], b[..., core], rtol=0, atol=1e-6,
                                   err_msg=g)
        slack_moved |= bool(np.any(a[..., ~core] != b[..., ~core]))
    assert slack_moved
    assert retention.evaluate(target, x, y) == src_before


def test_optimizer_config_roundtrip_and_model_save(tmp_path):
    _, p, _, target, x, y = _setup()
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), p,
                                elasticity={"c2/bias": 0.0}, default=1.0, name="elastic")
    config = opt.get_config()
    again = deft.ElasticOptimizer.from_config(config)
    assert again.get_config() == config
    assert again.elasticity["c2/bias"] == 0.0 and again.elasticity["fc"] == \
        p.elasticity_map()["fc"]
    ser = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(ser, deft.ElasticOptimizer) and ser.get_config() == config
    assert float(ser.learning_rate) == pytest.approx(0.05)
    target.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    target.fit(x, y, batch_size=16, epochs=1, verbose=0)
    target.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, deft.ElasticOptimizer)
    assert loaded.optimizer.get_config() == config
    assert int(loaded.optimizer.iterations) == int(opt.iterations) == 3


@pytest.mark.slow  # a fresh Python process imports TensorFlow
def test_a_saved_elastic_model_loads_in_a_fresh_process_after_importing_deft(tmp_path):
    """As docs/deft.md says: `import hope_keras` alone (which imports nothing
    heavy) does not register `ElasticOptimizer` with Keras; `import hope_keras.deft`
    before `load_model` does."""
    _, p, _, target, x, y = _setup()
    target.compile(deft.ElasticOptimizer(keras.optimizers.SGD(0.05), p),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    target.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    target.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want.npy", target.predict(x, verbose=0))
    script = textwrap.dedent(f'''
        import sys
        import numpy as np, keras
        import {{module}}
        try:
            m = keras.saving.load_model({str(path)!r})
        except TypeError as e:
            print("refused:", e); sys.exit(3)
        got = m.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
        assert type(m.optimizer).__name__ == "ElasticOptimizer"
        assert np.array_equal(got, np.load({str(tmp_path / "want.npy")!r}))
        ''')
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for module, rc in (("hope_keras.deft", 0), ("hope_keras", 3)):
        proc = subprocess.run([sys.executable, "-c", script.format(module=module)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == rc, (module, proc.stdout, proc.stderr[-2000:])
    assert "ElasticOptimizer" in proc.stdout


def test_optimizer_refuses_weight_decay_and_bad_maps():
    with pytest.raises(ValueError, match="weight_decay=0.1"):
        deft.ElasticOptimizer(keras.optimizers.AdamW(weight_decay=0.1))
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(), elasticity={"fc": [1.0, 0.0]})
    v = keras.Variable(np.zeros((3, 4)), name="kernel")
    v_path = type("V", (), {"path": "fc/kernel", "shape": (3, 4)})()
    with pytest.raises(ValueError, match="'fc/kernel' has shape"):
        opt.elasticity_of(v_path)
    del v
    # (channels, 1) broadcasts over a transposed kernel's inputs; (1, …) never stands
    # for the channels.
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(), elasticity={
        "t/kernel": [[1.0], [0.0]], "u/kernel": [[1.0, 0.0, 1.0]]})
    t_path = type("V", (), {"path": "t/kernel", "shape": (3, 3, 2, 5)})()
    assert np.asarray(opt.elasticity_of(t_path)).shape == (2, 1)
    u_path = type("V", (), {"path": "u/kernel", "shape": (3, 3, 2, 3)})()
    with pytest.raises(ValueError, match="'u/kernel' has shape"):
        opt.elasticity_of(u_path)


def test_a_plan_of_another_model_and_mismatched_labels_are_refused_before_training():
    _, p, _, target, x, y = _setup()
    L = keras.layers
    other = keras.Sequential([keras.Input((10, 10, 3)), L.Conv2D(4, 3), L.BatchNormalization(),
                              L.ReLU(), L.GlobalAveragePooling2D(), L.Dense(5)])
    before = target.get_weights()
    with pytest.raises(ValueError, match="None of the plan's .* the plan was made for "
                                         "another model"):
        other.compile(deft.ElasticOptimizer(keras.optimizers.SGD(0.1), p),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        other.fit(x, y, epochs=1, verbose=0)
    trainer = deft.Trainer(target, deft.ElasticOptimizer(keras.optimizers.SGD(0.1), p))
    with pytest.raises(ValueError, match=f"{len(x)} examples .per input array. and 5 labels"):
        trainer.fit((x, y[:5]), epochs=1)
    for a, b in zip(before, target.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_model_fit_and_custom_loop_give_the_same_update():
    _, p, _, target, x, y = _setup()
    twin = keras.models.clone_model(target)
    twin.set_weights(target.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    target.compile(deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), p), loss)
    target.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    trainer = deft.Trainer(twin, deft.ElasticOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), p))
    trainer.fit((x, y), epochs=2, batch_size=16, shuffle=False, restore_best=False)
    for a, b, w in zip(target.get_weights(), twin.get_weights(), target.weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=w.path)


_MIRRORED = textwrap.dedent("""
    import tensorflow as tf
    import keras, numpy as np
    from conftest import small_resnet
    from hope_keras import deft

    model = small_resnet(seed=4)
    p = deft.plan(model, percentile=60)
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        target = deft.replace_head(model, 5, seed=0)
        opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), p)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 10, 10, 3)).astype("float32")
    y = (np.arange(64) % 5).astype("int64")
    ys = np.argmax(retention.logits(model, x), -1)  # the masked source head's labels
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    trainer = deft.Trainer(target, opt, strategy=strategy, retention=retention)
    hist = trainer.fit((x, y), epochs=2, batch_size=16, target_val=(x, y),
                       source_val=(x, ys), restore_best=False)
    moved = 0
    for v in target.trainable_variables:
        s = np.broadcast_to(np.asarray(opt.elasticity_of(v), float), v.shape)
        now = v.numpy()
        assert np.array_equal(now[s == 0], start[v.path][s == 0]), v.path
        moved += int(np.count_nonzero(now[s > 0] != start[v.path][s > 0]))
    assert moved > 100, moved
    assert int(opt.iterations.numpy()) == 8, opt.iterations.numpy()
    assert all(np.isfinite(e["loss"]) for e in hist.epochs)
    assert hist.epochs[-1]["source_acc"] == 1.0, hist.epochs
    print("MIRRORED_OK", hist.best_epoch, hist.best["h_score"])
""")


@pytest.mark.slow  # a fresh process (a mirrored edit is in make test: test_interruption.py)
def test_trainer_under_mirrored_strategy_on_two_logical_cpus():
    run_on_two_logical_cpus(_MIRRORED)


def test_core_is_bit_identical_after_fine_tuning_with_shock_reduction():
    model = small_resnet(seed=5)
    before = {w.path: w.numpy().copy() for w in model.weights}
    p = deft.plan(model, percentile=60, compensate="mean_var")
    p.apply(model)
    applied = {w.path: w.numpy().copy() for w in model.weights}
    # The compensation changed core biases and BN statistics (not a no-op).
    moved = [k for k in applied if not np.array_equal(applied[k], before[k])
             and ("bias" in k or "moving" in k)]
    assert any("moving_variance" in k for k in moved) and any("bias" in k for k in moved)
    retention = deft.SourceRetention(model, plan=p)
    target = deft.replace_head(model, 5, seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 10, 10, 3)).astype("float32")
    y = (np.arange(48) % 5).astype("int64")
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), p)
    deft.Trainer(target, opt, retention=retention).fit((x, y), epochs=2, batch_size=16,
                                                       restore_best=False)
    frozen = 0
    for v in target.trainable_variables:
        if v.path not in applied:  # the new head
            continue
        s = _scale(opt, v)
        np.testing.assert_array_equal(v.numpy()[s == 0], applied[v.path][s == 0],
                                      err_msg=v.path)
        frozen += int(np.count_nonzero(s == 0))
    assert frozen > 100
    # Retention evaluates with the compensated source statistics.
    with retention.source_statistics(target):
        for layer in target.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                np.testing.assert_array_equal(layer.moving_variance.numpy(),
                                              applied[layer.moving_variance.path])


def _mobile_block_model(seed=0):
    """Depthwise and separable convolutions between ReLU6 groups (every group
    coupled, so only the width-free cost prices them), with a residual sum."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((10, 10, 3))
    x = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(12, 3, padding="same", name="stem")(inputs)))
    y = L.DepthwiseConv2D(3, padding="same", name="dw")(x)
    y = L.ReLU(6.0)(L.BatchNormalization(name="dw_bn")(y))
    y = L.BatchNormalization(name="pw_bn")(L.Conv2D(12, 1, name="pw")(y))
    x = L.Add()([x, y])
    x = L.SeparableConv2D(16, 3, padding="same", name="sep")(x)
    x = L.ReLU(6.0)(L.BatchNormalization(name="sep_bn")(x))
    x = L.GlobalAveragePooling2D()(x)
    return _trained_looking_statistics(keras.Model(inputs, L.Dense(4, name="head")(x)), seed)


def _applied_and_retargeted(model, plan):
    """`plan` applied to `model`; its retention, a 3-class target and 48 inputs."""
    plan.apply(model)
    retention = deft.SourceRetention(model, plan=plan)
    target = deft.replace_head(model, 3, seed=0)
    shape = tuple(model.inputs[0].shape[1:])
    x = np.random.default_rng(0).normal(size=(48,) + shape).astype("float32")
    return retention, target, x, (np.arange(48) % 3).astype("int64")


def _trained_looking_statistics(model, seed, gamma=True):
    """BN moving statistics (and γ) drawn as a trained model's, in place."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n).astype("float32"))
            if gamma:
                layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
    return model


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_depthwise_and_separable_layers_keep_their_core_through_fine_tuning(inner):
    """A depthwise kernel's channels lie on its axis -2 and a separable convolution's
    depthwise kernel feeds every output: the plan scales the first per channel and
    freezes the second while an output is core, and masks the pointwise rows of
    drifting channels into core outputs. The source model's logits then stay what
    they were after `apply` (theorem H.2), while the slack moves."""
    model = _mobile_block_model()
    p = deft.plan(model, percentile=40, cost="hope", verbose=False)
    emap = p.elasticity_map()
    dw = np.asarray(emap["dw/kernel"])
    assert dw.shape == (12, 1) and 0 < dw.sum() < 12  # core and slack channels
    assert emap["sep/depthwise_kernel"] == 0.0  # some output of 'sep' is core
    retention, target, x, y = _applied_and_retargeted(model, p)
    pointwise = model.get_layer("sep").pointwise_kernel.numpy()
    drift = p.input_drift["sep"] > 0  # depth multiplier 1: a row per channel
    core_out = np.asarray(emap["sep"]) == 0
    assert drift.any() and core_out.any()
    assert np.all(pointwise[:, :, drift][..., core_out] == 0)  # the cut rows
    before = retention.logits(target, x)
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    base = (keras.optimizers.SGD(0.2, momentum=0.9) if inner == "sgd"
            else keras.optimizers.Adam(0.02))
    opt = deft.ElasticOptimizer(base, p)
    deft.Trainer(target, opt, retention=retention).fit((x, y), epochs=3, batch_size=8,
                                                       restore_best=False)
    np.testing.assert_allclose(retention.logits(target, x), before, rtol=0, atol=1e-5)
    kernel = target.get_layer("dw").kernel.numpy()
    moved = np.any(kernel != start["dw/kernel"], axis=(0, 1, 3))
    np.testing.assert_array_equal(moved, dw[:, 0] > 0)  # exactly the slack channels
    np.testing.assert_array_equal(target.get_layer("sep").depthwise_kernel.numpy(),
                                  start["sep/depthwise_kernel"])
    for v in target.trainable_variables:
        s = _scale(opt, v)
        np.testing.assert_array_equal(v.numpy()[s == 0], start[v.path][s == 0],
                                      err_msg=v.path)


def _transposed_block_model(seed=0):
    """A decoder step: a strided convolution, a transposed one back up (BN-ReLU
    neuron layers both), a convolution, a Dense head."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(12, 3, padding="same", name="c1")(inputs)))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, strides=2, padding="same",
                                                 name="c2")(x)))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2DTranspose(12, 3, strides=2, padding="same",
                                                          name="up")(x)))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(10, 3, padding="same", name="c3")(x)))
    x = L.GlobalAveragePooling2D()(x)
    return _trained_looking_statistics(keras.Model(inputs, L.Dense(4, name="head")(x)), seed)


def test_a_transposed_convolution_keeps_its_core_and_drifts_only_its_slack():
    """A transposed convolution's outputs lie on its kernel's axis -2: the plan scales
    them per channel (``(C, 1)``) and cuts its drifting inputs from its core outputs,
    so only its slack outputs drift on (not every channel, which would cut every
    input of the core that reads them). Theorem H.2 holds through fine-tuning."""
    model = _transposed_block_model()
    p = deft.plan(model, percentile=40, verbose=False)
    emap = p.elasticity_map()
    e_up = np.asarray(emap["up"])
    assert np.asarray(emap["up/kernel"]).shape == (12, 1)
    assert 0 < e_up.sum() < 12
    np.testing.assert_array_equal(p.input_drift["c3"] > 0, e_up > 0)
    retention, target, x, y = _applied_and_retargeted(model, p)
    kernel = model.get_layer("up").kernel.numpy()  # (3, 3, outputs, inputs)
    drift_in, core_out = p.input_drift["up"] > 0, e_up == 0
    assert drift_in.any() and core_out.any()
    assert np.all(kernel[:, :, core_out][..., drift_in] == 0)  # the cuts
    assert np.any(kernel[:, :, core_out][..., ~drift_in] != 0)
    before = retention.logits(target, x)
    start = {v.path: v.numpy().copy() for v in target.trainable_variables}
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.2, momentum=0.9), p)
    deft.Trainer(target, opt, retention=retention).fit((x, y), epochs=3, batch_size=8,
                                                       restore_best=False)
    np.testing.assert_allclose(retention.logits(target, x), before, rtol=0, atol=1e-5)
    moved = np.any(target.get_layer("up").kernel.numpy() != start["up/kernel"],
                   axis=(0, 1, 3))
    np.testing.assert_array_equal(moved, e_up > 0)  # exactly the slack outputs


def test_a_saved_plan_keeps_its_per_variable_elasticities(tmp_path):
    model = _mobile_block_model(seed=1)
    p = deft.plan(model, percentile=40, cost="hope", verbose=False)
    path = str(tmp_path / "plan.npz")
    p.save(path)
    q = deft.DeftPlan.load(path)
    assert set(q.variable_elasticity) == set(p.variable_elasticity) != set()
    assert q.elasticity_map() == p.elasticity_map()


def _layer_norm_block_model(seed=0, proj=True):
    """A ConvNeXt-style block: depthwise convolution, LayerNormalization, a GELU MLP
    (1 × 1 convolutions), a residual sum."""
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = L.BatchNormalization(name="stem_bn")(L.Conv2D(8, 2, strides=2, name="stem")(inputs))
    y = L.DepthwiseConv2D(3, padding="same", name="dw")(x)
    y = L.LayerNormalization(epsilon=1e-6, name="ln")(y)
    y = L.Conv2D(32, 1, activation="gelu", name="pw1")(y)
    y = L.Conv2D(8, 1, name="pw2")(y)
    x = L.Add()([x, y])
    if proj:
        x = L.BatchNormalization(name="proj_bn")(L.Conv2D(16, 1, name="proj")(x))
        x = L.Activation("gelu")(x)
    model = keras.Model(inputs, L.Dense(4, name="head")(L.GlobalAveragePooling2D()(x)))
    return _trained_looking_statistics(model, seed, gamma=False)


def test_a_group_a_layer_normalization_reads_stays_core_and_the_core_keeps_its_outputs():
    """A LayerNormalization mixes every channel's statistics: the plan keeps the
    groups it reads core (the stream), and the source logits survive fine-tuning
    (theorem H.2). The MLP's hidden slack feeds only the core stream, so the mask
    cuts it off (docs/deft.md, "Limits"); the group after the stream learns."""
    from hope_keras.graph.walker import normalised_together
    from hope_keras.graph.walker import walk

    model = _layer_norm_block_model()
    p = deft.plan(model, percentile=40, verbose=False)  # no ReLU neuron layer: "hope"
    graph = walk(model)
    read_by_norm = {g for g in p.groups if normalised_together(graph.groups[g], graph.layer)}
    assert read_by_norm and read_by_norm != set(p.groups)
    for g in p.groups:
        assert (p.elasticity[g].any()) == (g not in read_by_norm), g
    retention, target, x, y = _applied_and_retargeted(model, p)
    before = retention.logits(target, x)
    proj = target.get_layer("proj").kernel.numpy().copy()
    slack = p.elasticity["proj"] > 0
    assert slack.any() and np.all(target.get_layer("pw2").kernel.numpy()[
        0, 0, p.elasticity["pw1"] > 0] == 0)  # hidden slack → core stream: cut
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), p)
    deft.Trainer(target, opt, retention=retention).fit((x, y), epochs=3, batch_size=8,
                                                       restore_best=False)
    np.testing.assert_allclose(retention.logits(target, x), before, rtol=0, atol=1e-5)
    moved = np.any(target.get_layer("proj").kernel.numpy() != proj, axis=(0, 1, 2))
    np.testing.assert_array_equal(moved, slack)  # the slack learned, the core did not


def test_drift_into_a_layer_normalization_reaches_every_channel_after_it():
    """Given slack in a group a LayerNormalization reads (an elasticity map by
    hand), every channel after the normalization drifts, so the mask cuts them all
    from core outputs."""
    from hope_keras.deft.application import elasticities_and_drift
    from hope_keras.graph.walker import walk

    model = _layer_norm_block_model(seed=1)
    graph = walk(model)
    stream = next(g for g, grp in graph.groups.items() if grp.stream)
    e = np.zeros(graph.groups[stream].size)
    e[0] = 1.0
    _, drift = elasticities_and_drift(model, graph, {stream: e}, "head", 0.0)
    assert np.all(drift["pw1"] > 0)


def test_a_plan_whose_slack_cannot_reach_the_head_says_so():
    """Without the group after the stream, the only slack (the MLP's hidden group)
    feeds the core stream: fine-tuning would move the head alone, so the plan keeps
    every neuron core and its masks cut nothing."""
    import warnings

    model = _layer_norm_block_model(proj=False)
    before = model.get_weights()
    with pytest.warns(UserWarning, match="No slack channel of this plan reaches the head"):
        p = deft.plan(model, percentile=40, verbose=False)
    # Every neuron core: applying the plan changes nothing (no merge, mask or shift).
    assert not any(e.any() for e in p.elasticity.values()) and not p.merges
    p.apply(model)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="No slack channel")
        deft.plan(_layer_norm_block_model(), percentile=40, verbose=False)


def test_a_nested_backbone_under_a_new_head_keeps_its_source_through_fine_tuning():
    """The transfer-learning layout: a backbone model used as a layer, then a Dense
    head. The grafted source head reads the head's input (the backbone's features),
    and the source statistics of the backbone's own BNs are restored for it: after
    fine-tuning (which moves those statistics) the source logits are unchanged."""
    from hope_keras.graph.adapter import nested_layers

    backbone = _mobile_block_model(seed=3)
    backbone = keras.Model(backbone.input, backbone.layers[-2].output, name="backbone")
    model = keras.Sequential([keras.Input((10, 10, 3)), backbone,
                              keras.layers.Dense(4, name="head")])
    p = deft.plan(model, percentile=40, verbose=False)
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    assert "dw_bn" in retention.bn_stats  # a BN of the nested backbone
    target = deft.replace_head(model, 3, seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 10, 10, 3)).astype("float32")
    y = (np.arange(32) % 3).astype("int64")
    before = retention.logits(target, x)
    bn = next(layer for layer in nested_layers(target) if layer.name == "dw_bn")
    mean = bn.moving_mean.numpy().copy()
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), p)
    deft.Trainer(target, opt, retention=retention).fit((x, y), epochs=2, batch_size=8,
                                                       restore_best=False)
    assert np.any(bn.moving_mean.numpy() != mean)  # fine-tuning moved the statistics
    np.testing.assert_allclose(retention.logits(target, x), before, rtol=0, atol=1e-5)


def test_the_grafted_head_never_reads_a_slack_feature_not_even_a_nan():
    model = small_resnet(seed=4)
    p = deft.plan(model, percentile=60, verbose=False, pinned_elasticity=1.0)
    p.apply(model)
    retention = deft.SourceRetention(model, plan=p)
    slack = np.flatnonzero(p.head_input_drift > 0)
    assert 0 < slack.size < p.head_input_drift.size
    x = np.random.default_rng(0).normal(size=(8, 10, 10, 3)).astype("float32")
    before = retention.logits(model, x)
    feats = retention.feature_model(model)
    poisoned = keras.Model(feats.input, keras.layers.Lambda(
        lambda f: f + np.where(np.isin(np.arange(f.shape[-1]), slack), np.nan, 0.0)
        .astype("float32"))(feats.output))
    retention._feature_models[id(model)] = poisoned
    np.testing.assert_array_equal(retention.logits(model, x), before)
