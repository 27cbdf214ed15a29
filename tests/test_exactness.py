"""Edits against independent expectations.

Merges of non-duplicate pairs and evictions of live branches are checked against what
the parent formula / a hand-built model predicts, computed here from the original
weights with Keras forward passes and plain numpy (not with the library's own
extraction code). Written so that `ModelEditor.merge` ignoring neuron j, or `evict`
doing nothing, fails them.
"""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L, copy_model, plant_duplicate, randomize_bn
from hope_keras.edit.editor import ModelEditor, ParentCoefficients


def _x(model, n=8, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _bn(center, scale, name):
    return L.BatchNormalization(center=center, scale=scale, name=name)


def _randomize_biases(model, seed):
    rng = np.random.default_rng(seed + 100)
    for layer in model.layers:
        if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.3, layer.bias.shape).astype("float32"))


# One group "p" (producer → BN "p_bn" → ReLU "p_relu" → ... → consumer "c"): the only
# group of the model, so every merge the engine picks is in it.
def _single_group_model(consumer, center, scale, seed):
    keras.utils.set_random_seed(seed)
    bias = seed % 2 == 0
    if consumer == "conv":
        inputs = keras.Input((6, 6, 3))
        x = L.Conv2D(5, 3, padding="same", use_bias=bias, name="p")(inputs)
        x = L.ReLU(name="p_relu")(_bn(center, scale, "p_bn")(x))
        x = L.Conv2D(4, 3, name="c")(x)
        outputs = L.Dense(2, name="head")(L.GlobalAveragePooling2D()(x))
    elif consumer == "conv_transpose":  # reads the channel on its kernel's last axis
        inputs = keras.Input((6, 6, 3))
        x = L.Conv2D(5, 3, padding="same", use_bias=bias, name="p")(inputs)
        x = L.ReLU(name="p_relu")(_bn(center, scale, "p_bn")(x))
        x = L.Conv2DTranspose(4, 3, strides=2, name="c")(x)
        outputs = L.Dense(2, name="head")(L.GlobalAveragePooling2D()(x))
    elif consumer == "conv_after_transpose":  # a producer whose filters are on axis -2
        inputs = keras.Input((3, 3, 3))
        x = L.Conv2DTranspose(5, 3, strides=2, padding="same", use_bias=bias, name="p")(inputs)
        x = L.ReLU(name="p_relu")(_bn(center, scale, "p_bn")(x))
        x = L.Conv2D(4, 3, name="c")(x)
        outputs = L.Dense(2, name="head")(L.GlobalAveragePooling2D()(x))
    elif consumer == "flatten_dense":
        inputs = keras.Input((6, 6, 2))
        x = L.Conv2D(4, 3, use_bias=bias, name="p")(inputs)
        x = L.ReLU(name="p_relu")(_bn(center, scale, "p_bn")(x))
        x = L.Flatten(name="flat")(L.MaxPooling2D(name="pool")(x))
        outputs = L.Dense(3, name="c")(x)
    else:
        inputs = keras.Input((7,))
        x = L.Dense(6, use_bias=bias, name="p")(inputs)
        x = L.ReLU(name="p_relu")(_bn(center, scale, "p_bn")(x))
        outputs = L.Dense(3, name="c")(L.Dropout(0.3, name="drop")(x))
    model = keras.Model(inputs, outputs, name=f"single_{consumer}")
    randomize_bn(model, seed, gamma=(0.4, 1.6))
    _randomize_biases(model, seed)
    # A negative γ: the fold must carry its sign.
    bn = model.get_layer("p_bn")
    if scale:
        g = bn.gamma.numpy()
        g[1] = -abs(g[1])
        bn.gamma.assign(g)
    return model


def _channel_rows(model, activation, consumer, channel):
    """Indices of the consumer kernel's input axis that read `channel`: found by pushing
    a one-hot channel through the layers between the activation and the consumer."""
    act = model.get_layer(activation)
    shape = tuple(act.output.shape[1:])
    onehot = np.zeros((1,) + shape, dtype="float32")
    onehot[..., channel] = 1.0
    x = onehot
    layer = model.get_layer(consumer)
    path = []
    for lyr in model.layers[model.layers.index(act) + 1:]:
        if lyr is layer:
            break
        path.append(lyr)
    for lyr in path:
        x = lyr(x, training=False)
    x = np.asarray(x)[0]
    return np.flatnonzero(x.reshape(-1, x.shape[-1]).any(axis=0)) if isinstance(
        layer, (L.Conv2D, L.Conv2DTranspose)) else np.flatnonzero(x.reshape(-1))


def _layout(layer):
    """Which kernel axis a consumer reads its input channels on."""
    return ("transpose" if isinstance(layer, L.Conv2DTranspose)
            else "conv" if isinstance(layer, L.Conv2D) else "dense")


def _consumer_slice(kernel, layout, rows):
    return {"conv": lambda: kernel[..., rows, :], "transpose": lambda: kernel[..., rows],
            "dense": lambda: kernel[rows]}[layout]()


def _check_merge(before, after, i, j, coef, x, tol=2e-5):
    """`after` is `before` with neurons i, j of group p merged with coefficients `coef`."""
    a1, a2, m1, m2, gamma_k, beta_k = coef
    y0 = np.asarray(keras.Model(before.inputs[0], before.get_layer("p_bn").output)(x),
                    dtype=np.float64)
    y1 = np.asarray(keras.Model(after.inputs[0], after.get_layer("p_bn").output)(x),
                    dtype=np.float64)
    scale = np.abs(y0).max()
    expected = a1 * y0[..., i] + a2 * y0[..., j]
    assert np.abs(y1[..., i] - expected).max() <= tol * max(scale, np.abs(expected).max())
    assert np.all(y1[..., j] == 0.0)
    others = [k for k in range(y0.shape[-1]) if k not in (i, j)]
    np.testing.assert_array_equal(y1[..., others], y0[..., others])
    # The parent's BN parameters are its pre-activation's std and mean (spec section 5).
    bn = after.get_layer("p_bn")
    if bn.scale:
        assert float(bn.gamma.numpy()[i]) == pytest.approx(abs(gamma_k), rel=1e-6)
    if bn.center:
        assert float(bn.beta.numpy()[i]) == pytest.approx(beta_k, rel=1e-6, abs=1e-7)
    # Consumer: rows of i are m1·u_i + m2·u_j, rows of j are zero, the rest untouched.
    k0 = before.get_layer("c").kernel.numpy().astype(np.float64)
    k1 = after.get_layer("c").kernel.numpy().astype(np.float64)
    layout = _layout(before.get_layer("c"))
    n = y0.shape[-1]
    rows = [_channel_rows(before, "p_relu", "c", c) for c in range(n)]
    ui, uj = _consumer_slice(k0, layout, rows[i]), _consumer_slice(k0, layout, rows[j])
    np.testing.assert_allclose(_consumer_slice(k1, layout, rows[i]), m1 * ui + m2 * uj,
                               rtol=1e-6, atol=1e-7 * np.abs(k0).max())
    assert np.all(_consumer_slice(k1, layout, rows[j]) == 0.0)
    for c in others:
        np.testing.assert_array_equal(_consumer_slice(k1, layout, rows[c]),
                                      _consumer_slice(k0, layout, rows[c]))


CONSUMERS = ["conv", "flatten_dense", "dense", "conv_transpose", "conv_after_transpose"]
BN_FLAGS = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("center,scale", BN_FLAGS)
def test_editor_merge_of_a_non_duplicate_pair_follows_the_parent_formula(consumer, center,
                                                                         scale):
    seed = 3 + CONSUMERS.index(consumer) + 4 * BN_FLAGS.index((center, scale))
    original = _single_group_model(consumer, center, scale, seed)
    model = copy_model(original)
    rng = np.random.default_rng(seed)
    a1, a2, m1, m2 = rng.uniform(0.3, 1.5, 4) * rng.choice([-1.0, 1.0], 4)
    coef = ParentCoefficients(a1, a2, m1, m2, gamma=rng.uniform(0.5, 2.0),
                              beta=rng.normal())
    i, j = 1, 3  # neuron 1 has a negative γ when the BN scales
    editor = ModelEditor(model, hope_keras.walk(model))
    with editor.step():
        editor.merge("p", i, j, coef)
    editor.commit()
    _check_merge(original, model, i, j, (a1, a2, m1, m2, coef.gamma, coef.beta), _x(model))


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("merge_scale", ["sum", "paper"])
@pytest.mark.parametrize("center,scale", [(True, True), (False, False)])
def test_engine_merge_changes_the_model_as_its_recorded_parent_predicts(consumer, merge_scale,
                                                                        center, scale):
    """compress picks a merge; the in-place edit and a replay of the recorded
    coefficients by a fresh editor both follow the formula."""
    seed = 20 + CONSUMERS.index(consumer)
    original = _single_group_model(consumer, center, scale, seed)
    model = copy_model(original)
    result = hope_keras.Encoder(model, cost=hope_keras.costs.HopeCost(merge_scale=merge_scale), actions=("merge",), verbose=False).compress(steps=1)
    (step,) = result.trajectory.steps
    assert step.kind == "merge" and step.unit == "p"
    assert np.isfinite(step.coef).all() and step.coef[4] ** 2 > 1e-3
    _check_merge(original, model, step.i, step.j, step.coef, _x(model))
    replayed = copy_model(original)
    editor = ModelEditor(replayed, hope_keras.walk(replayed))
    with editor.step():
        editor.merge("p", step.i, step.j, ParentCoefficients(*step.coef))
    editor.commit()
    for a, b in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------ merges inside a run
def _chain(seed):
    """Sequential conv → pool → conv → Flatten → Dense → Dropout → head, three groups,
    with planted near-duplicates (5 % noise) so the engine merges."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8, 8, 2)),
        L.Conv2D(6, 3, padding="same", name="a"), L.BatchNormalization(name="a_bn"),
        L.ReLU(name="a_relu"), L.MaxPooling2D(name="pool"),
        L.Conv2D(5, 3, name="b"), L.BatchNormalization(name="b_bn"), L.ReLU(name="b_relu"),
        L.Flatten(name="flat"),
        L.Dense(8, name="fc"), L.BatchNormalization(name="fc_bn"), L.ReLU(name="fc_relu"),
        L.Dropout(0.2, name="drop"),
        L.Dense(3, name="head"),
    ], name="chain")
    randomize_bn(model, seed, gamma=(0.4, 1.6))
    _randomize_biases(model, seed)
    for src, dst in ((0, 5), (2, 6)):
        plant_duplicate(model, "fc", "head", src, dst, seed=dst + seed)
    return model


def _predict_after_merge(model, group, i, j, coef, x):
    """Output of `model` after merging (i, j) in `group`, predicted from its layers:
    BN output through the formula, consumer kernel rebuilt by hand, later layers as is."""
    a1, a2, m1, m2, gamma_k, _ = coef
    layers = model.layers
    bn = model.get_layer(f"{group}_bn")
    k = layers.index(bn)
    h = x
    for lyr in layers[:k + 1]:
        h = lyr(h, training=False)
    h = np.asarray(h, dtype=np.float64)
    h2 = h.copy()
    if gamma_k ** 2 < bn.epsilon:  # inactive parent: both slots go
        h2[..., i] = 0.0
    else:
        h2[..., i] = a1 * h[..., i] + a2 * h[..., j]
    h2[..., j] = 0.0
    t = np.maximum(h2, 0.0).astype("float32")
    k += 2  # past the ReLU
    while not hasattr(layers[k], "kernel"):
        t = layers[k](t, training=False)
        k += 1
    consumer = layers[k]
    kernel = consumer.kernel.numpy().astype(np.float64)
    is_conv = isinstance(consumer, L.Conv2D)
    ri = _channel_rows(model, f"{group}_relu", consumer.name, i)
    rj = _channel_rows(model, f"{group}_relu", consumer.name, j)
    new = kernel.copy()
    if is_conv:
        new[..., ri, :] = m1 * kernel[..., ri, :] + m2 * kernel[..., rj, :]
        new[..., rj, :] = 0.0
    else:
        new[ri] = m1 * kernel[ri] + m2 * kernel[rj]
        new[rj] = 0.0
    clone = consumer.__class__.from_config(consumer.get_config())
    clone.build(tuple(t.shape))
    clone.set_weights([new.astype("float32"), consumer.bias.numpy()])
    t = clone(t)
    for lyr in layers[k + 1:]:
        t = lyr(t, training=False)
    return np.asarray(t, dtype=np.float64)


@pytest.mark.parametrize("merge_scale", ["sum", "paper"])
def test_every_merge_of_a_run_moves_the_output_as_the_parent_predicts(merge_scale):
    original = _chain(seed=31)
    x = _x(original, 6)
    run = hope_keras.Encoder(copy_model(original), cost=hope_keras.costs.HopeCost(merge_scale=merge_scale), verbose=False).compress(steps=14)
    merges = [k for k, s in enumerate(run.trajectory.steps) if s.kind == "merge"]
    assert len(merges) >= 2, [s.kind for s in run.trajectory.steps]
    for k in merges:
        s = run.trajectory.steps[k]
        before = copy_model(original)
        if k:
            hope_keras.Encoder(before, cost=hope_keras.costs.HopeCost(merge_scale=merge_scale), verbose=False).compress(steps=k)
        after = copy_model(original)
        hope_keras.Encoder(after, cost=hope_keras.costs.HopeCost(merge_scale=merge_scale), verbose=False).compress(steps=k + 1)
        expected = _predict_after_merge(before, s.unit, s.i, s.j, s.coef, x)
        got = np.asarray(after(x), dtype=np.float64)
        moved = np.abs(np.asarray(before(x)) - expected).max()
        assert np.abs(got - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max()), k
        assert moved > 1e-4  # a non-duplicate merge does change the function


# ------------------------------------------------------------------- evictions
def _resnet(seed, center=True, scale=True):
    """Conv stem; an identity block whose branch is live; a head. The block's final BN
    may drop its center / scale."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3), name="image")
    x = L.Conv2D(6, 3, padding="same", name="stem")(inputs)
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(x))
    y = L.Conv2D(4, 3, padding="same", name="b1a")(x)
    y = L.ReLU(name="b1a_relu")(L.BatchNormalization(name="b1a_bn")(y))
    y = L.Conv2D(6, 1, name="b1b")(y)
    y = L.BatchNormalization(center=center, scale=scale, name="b1b_bn")(y)
    x = L.ReLU(name="b1_out")(L.Add(name="b1_add")([x, y]))
    x = L.Conv2D(5, 3, name="c2")(x)
    x = L.ReLU(name="c2_relu")(L.BatchNormalization(name="c2_bn")(x))
    x = L.GlobalAveragePooling2D(name="gap")(x)
    outputs = L.Dense(3, name="head")(x)
    model = keras.Model(inputs, outputs, name="resnet")
    randomize_bn(model, seed)
    _randomize_biases(model, seed)
    return model


def _shortcut_only(model):
    """The same network built by hand without the branch; weights copied by name."""
    inputs = keras.Input((8, 8, 3), name="image")
    names = ["stem", "stem_bn", "stem_relu", "b1_out", "c2", "c2_bn", "c2_relu", "gap", "head"]
    x = inputs
    for name in names:
        old = model.get_layer(name)
        new = old.__class__.from_config(old.get_config())
        x = new(x)
        new.set_weights(old.get_weights())
    return keras.Model(inputs, x)


@pytest.mark.parametrize("center,scale", BN_FLAGS)
def test_evicting_a_live_branch_equals_the_shortcut_only_model(center, scale):
    model = _resnet(seed=41 + BN_FLAGS.index((center, scale)), center=center, scale=scale)
    x = _x(model)
    expected = np.asarray(_shortcut_only(model)(x))
    assert np.abs(np.asarray(model(x)) - expected).max() > 1e-3  # the branch is live
    editor = ModelEditor(model, hope_keras.walk(model))
    with editor.step():
        editor.evict("b1_add")
    editor.commit()
    np.testing.assert_allclose(np.asarray(model(x)), expected, rtol=1e-5, atol=1e-6)
    small = hope_keras.slim(model)
    assert "b1a" not in [layer.name for layer in small.layers]
    np.testing.assert_allclose(np.asarray(small(x)), expected, rtol=1e-5, atol=1e-6)


def test_engine_eviction_equals_the_shortcut_only_model():
    model = _resnet(seed=45)
    x = _x(model)
    expected = np.asarray(_shortcut_only(model)(x))
    # The edit alone (the stream readers' statistics correction would move c2_bn).
    result = hope_keras.Encoder(model, actions=("evict",), correction=False, verbose=False).compress(steps=1)
    assert [(s.kind, s.unit) for s in result.trajectory.steps] == [("evict", "b1_add")]
    np.testing.assert_allclose(np.asarray(model(x)), expected, rtol=1e-5, atol=1e-6)


def test_editor_column_cache_equals_the_mirror_through_every_kind_of_write():
    """`ModelEditor.columns` (the cached producer-kernel columns the engine reads for
    sketched groups) returns the mirror's current columns after prunes and merges in
    the group (columns written), in its neighbours (Conv2D kernels' input rows, a
    Dense kernel's rows), an interrupted step (undone) and a commit, with so few
    slots that columns are evicted and read again."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 3))
    x = inputs
    for k in range(2):
        x = L.Conv2D(10, 3, padding="same", name=f"conv{k}")(x)
        x = L.ReLU()(L.BatchNormalization(name=f"conv{k}_bn")(x))
    x = L.Flatten()(x)
    x = L.Dense(8, name="fc")(x)
    x = L.ReLU()(L.BatchNormalization(name="fc_bn")(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    randomize_bn(model, seed=0)
    graph = hope_keras.walk(model)
    editor = ModelEditor(model, graph)
    kernels = ["conv0", "conv1", "fc", "head"]
    for name in kernels:
        editor.cache_columns(name, "kernel", slots=3)
    rng = np.random.default_rng(0)
    live = {g: list(range(graph.groups[g].size)) for g in ("conv0", "conv1", "fc")}

    def check():
        for name in kernels:
            arr = editor.array(name, "kernel")
            cols = rng.integers(0, arr.shape[-1], size=rng.integers(1, 5))
            if rng.random() < 0.5:  # sorted distinct columns: returned without reorder
                cols = np.unique(cols)
            ref = arr.reshape(-1, arr.shape[-1])[:, cols].T
            np.testing.assert_array_equal(editor.columns(name, "kernel", cols), ref)

    check()
    for step in range(18):
        g = rng.choice([g for g in live if len(live[g]) > 2])
        i, j = rng.choice(live[g], size=2, replace=False)
        with editor.step():
            if step % 3 == 0:
                editor.prune(g, int(j))
            else:
                editor.merge(g, int(i), int(j), ParentCoefficients(
                    *rng.uniform(0.5, 1.5, size=4), gamma=1.2, beta=0.1))
        live[g].remove(int(j))
        check()
        if step == 10:  # an interrupted step: its writes are undone (undo records
            # of cached columns come from the cache)
            before = {name: editor.array(name, "kernel").copy() for name in kernels}
            editor.columns("conv1", "kernel", live["conv1"][:2])
            with pytest.raises(RuntimeError):
                with editor.step():
                    editor.merge("conv1", live["conv1"][0], live["conv1"][1],
                                 ParentCoefficients(0.7, 1.3, 0.9, 1.1, gamma=1.2, beta=0.1))
                    editor.prune("fc", live["fc"][0])
                    raise RuntimeError("interrupted")
            for name in kernels:
                np.testing.assert_array_equal(editor.array(name, "kernel"), before[name])
            check()
    editor.commit()
    check()
    for name in kernels:  # the variables now hold the edits
        kernel = model.get_layer(name).kernel.numpy()
        np.testing.assert_array_equal(editor.columns(name, "kernel", [2, 0]),
                                      kernel.reshape(-1, kernel.shape[-1])[:, [2, 0]].T)
    assert sum(editor._columns[k].hits for k in editor._columns) > 0
