"""Walker expectations: groups, consumers, residual blocks and pinned reasons."""

import keras
import numpy as np
import pytest

from conftest import L, bn_relu, mlp, small_resnet
from hope_keras.graph.walker import walk
from conftest import outputs_equal, randomize_bn


@pytest.fixture(scope="module")
def resnet50_graph():
    return walk(keras.applications.ResNet50(weights=None))


def test_resnet50_stem_group_has_two_consumers(resnet50_graph):
    stem = resnet50_graph.groups["conv1_conv"]
    assert stem.size == 64
    assert {c.layer for c in stem.consumers} == {"conv2_block1_0_conv", "conv2_block1_1_conv"}
    assert stem.passthrough == ("pool1_pad", "pool1_pool")


def test_resnet50_bottleneck_groups_streams_and_blocks(resnet50_graph):
    g = resnet50_graph
    neurons = [n for n, grp in g.groups.items() if grp.kind == "neurons"]
    assert len(neurons) == 33  # the stem and two per bottleneck
    assert all(n.endswith(("_1_conv", "_2_conv")) for n in neurons if n != "conv1_conv")
    # Each stage's residual stream is one coupled group: the projection shortcut and
    # every branch end write it, the next blocks read it.
    streams = {grp.writers[0][:5]: grp for grp in g.groups.values() if grp.kind == "coupled"}
    assert sorted(streams) == ["conv2", "conv3", "conv4", "conv5"]
    stage3 = streams["conv3"]
    assert stage3.size == 512
    assert set(stage3.writers) == {"conv3_block1_0_conv"} | {
        f"conv3_block{k}_3_conv" for k in range(1, 5)}
    readers = {c.layer for c in stage3.readers}
    assert readers == {f"conv3_block{k}_1_conv" for k in range(2, 5)} | {
        "conv4_block1_0_conv", "conv4_block1_1_conv"}
    assert g.coverage() == 1.0  # every hidden channel can be removed
    blocks = g.blocks
    assert len(blocks) == 16
    assert sum(b.evictable for b in blocks) == 12
    projection = {b.name for b in blocks if not b.evictable}
    assert projection == {f"conv{s}_block1_add" for s in (2, 3, 4, 5)}
    b = next(b for b in blocks if b.name == "conv3_block2_add")
    assert b.groups == ("conv3_block2_1_conv", "conv3_block2_2_conv")
    assert b.final_bn == "conv3_block2_3_bn"
    # Input of block 2 is the output of block 1 (a projection block): its last BN.
    assert b.input_bn == "conv3_block1_3_bn"
    assert b.block_input == "conv3_block1_out"


def test_resnet50_pinned_reasons(resnet50_graph):
    reasons = {p.layer: p.reason for p in resnet50_graph.pinned}
    assert list(reasons) == ["predictions"]
    assert "model output" in reasons["predictions"]


def test_vgg_style_stack_every_hidden_layer():
    inputs = keras.Input((16, 16, 3))
    x = inputs
    names = []
    for k, f in enumerate((8, 8, 16, 16)):
        x = bn_relu(L.Conv2D(f, 3, padding="same", name=f"conv{k}")(x))
        names.append(f"conv{k}")
        if k % 2:
            x = L.MaxPooling2D()(x)
    x = L.GlobalAveragePooling2D()(x)
    x = bn_relu(L.Dense(12, name="fc")(x))
    x = L.Dropout(0.5)(x)
    model = keras.Model(inputs, L.Dense(5, name="head")(x))
    g = walk(model)
    assert list(g.groups) == names + ["fc"]
    assert all(grp.kind == "neurons" for grp in g.groups.values())
    assert [c.layer for c in g.groups["conv3"].consumers] == ["fc"]
    assert [p.layer for p in g.pinned] == ["head"]


def test_bn_mlp_every_hidden_layer_and_sequential():
    model = keras.Sequential([keras.Input((5,)), L.Dense(7), L.BatchNormalization(),
                              L.ReLU(), L.Dense(6), L.BatchNormalization(),
                              L.Activation("relu"), L.Dense(2)])
    g = walk(model)
    assert [grp.size for grp in g.groups.values()] == [7, 6]
    assert walk(mlp((4, 5, 6))).groups.keys() == {"fc0", "fc1", "fc2"}


def test_flatten_consumer_and_multiple_consumers():
    inputs = keras.Input((6, 6, 2))
    x = bn_relu(L.Conv2D(4, 3, name="c")(inputs))
    a = L.Conv2D(3, 1, name="a")(x)
    b = L.Dense(3, name="b")(L.Flatten()(L.MaxPooling2D()(x)))
    model = keras.Model(inputs, [a, b])
    grp = walk(model).groups["c"]
    assert {(c.layer, c.kind) for c in grp.consumers} == {("a", "conv"), ("b", "dense")}


def test_small_resnet_block_and_coupled_stream():
    g = walk(small_resnet())
    assert list(g.groups) == ["stem", "b1a", "c2", "fc"]
    assert g.groups["stem"].kind == "coupled"
    assert set(g.groups["stem"].writers) == {"stem", "b1b"}
    (block,) = g.blocks
    assert block.evictable and block.groups == ("b1a",)
    assert block.input_bn == "stem_bn"
    assert [p.layer for p in g.pinned] == ["head"]


@pytest.mark.parametrize(
    "build, layer, kind",
    [
        # BN after the activation, BN without activation, LeakyReLU: coupled groups.
        (lambda x: L.BatchNormalization()(L.Dense(3, activation="relu", name="p")(x)), "p",
         "coupled"),
        (lambda x: L.BatchNormalization()(L.Dense(3, name="p")(x)), "p", "coupled"),
        (lambda x: L.LeakyReLU()(L.BatchNormalization()(L.Dense(3, name="p")(x))), "p",
         "coupled"),
        (lambda x: L.ReLU()(L.BatchNormalization()(L.Dense(3, name="p")(x))), "p",
         "neurons"),
    ],
)
def test_group_kinds(build, layer, kind):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, L.Dense(2)(build(inputs)))
    assert walk(model).groups[layer].kind == kind


@pytest.mark.parametrize(
    "build, layer, words",
    [
        (lambda x: L.Dense(3, activation="relu", name="p")(x), "p", "calibrate"),
        (lambda x: L.Dense(3, name="p")(x), "p", "calibrate"),
        (lambda x: L.ReLU()(L.BatchNormalization()(L.Dense(3, name="p")(x))), "p",
         "model output"),
        (lambda x: L.GroupNormalization(groups=3)(L.Dense(3, name="p")(x)), "p",
         "normalises across channels"),
        (lambda x: L.LayerNormalization(scale=False)(L.Dense(3, name="p")(x)), "p",
         "without scale"),
    ],
)
def test_pinned_reasons(build, layer, words):
    inputs = keras.Input((4,))
    out = build(inputs)
    if words != "model output":
        out = L.Dense(2)(out)
    model = keras.Model(inputs, out)
    import hope_keras

    reasons = {p.layer: p.reason for p in hope_keras.analyze(model).pinned}
    assert words.lower() in reasons[layer].lower()


def test_concatenate_couples_and_grouped_shared_and_non_channel_last_pin():
    inputs = keras.Input((8, 8, 4))
    a = bn_relu(L.Conv2D(4, 3, padding="same", name="a")(inputs))
    b = bn_relu(L.Conv2D(4, 3, padding="same", name="b")(inputs))
    x = L.Concatenate()([a, b])
    c = bn_relu(L.Conv2D(4, 3, padding="same", name="c")(x))
    d = L.Conv2D(4, 3, padding="same", groups=2, name="grouped")(c)
    e = L.ReLU()(L.BatchNormalization(axis=1)(L.Conv2D(4, 1, name="e")(d)))
    shared = L.Dense(3, name="shared")
    out = L.Add()([shared(L.GlobalAveragePooling2D()(e)), shared(L.GlobalMaxPooling2D()(e))])
    g = walk(keras.Model(inputs, out))
    # a and b reach c through the Concatenate: c reads a's channels at 0–3, b's at 4–7.
    (read_a,) = g.groups["a"].readers
    (read_b,) = g.groups["b"].readers
    assert read_a.layer == read_b.layer == "c"
    assert read_a.positions.ravel().tolist() == [0, 1, 2, 3]
    assert read_b.positions.ravel().tolist() == [4, 5, 6, 7]
    reasons = {p.layer: p.reason for p in g.pinned}
    assert "grouped" in reasons["c"] and "grouped" in reasons["grouped"]
    assert "channel-last" in reasons["e"]
    assert "shared" in reasons["shared"]


def test_nested_model_is_walked_through():
    inner = keras.Sequential([keras.Input((4,)), L.Dense(3, name="d"),
                              L.BatchNormalization(name="d_bn"), L.ReLU(name="d_relu")],
                             name="inner_net")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, L.Dense(2, name="head")(inner(inputs)))
    g = walk(model)
    assert g.groups["d"].kind == "neurons"
    assert [c.layer for c in g.groups["d"].consumers] == ["head"]


def test_unbuilt_subclassed_model_is_rejected():
    class Net(keras.Model):
        def call(self, x):
            return x

    # A built one is traced (tests/test_tracing.py); an unbuilt one has no input shape.
    with pytest.raises(ValueError, match="input shape is unknown"):
        walk(Net())


def _bn_relu_mlp(relu):
    """Dense → BN → relu → Dense → BN → relu → Dense, with the relu given."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    x = relu(L.BatchNormalization(name="bn1")(L.Dense(16, name="fc1")(inputs)))
    x = relu(L.BatchNormalization(name="bn2")(L.Dense(12, name="fc2")(x)))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    randomize_bn(model, seed=4)
    return model


@pytest.mark.parametrize("relu", [
    lambda x: keras.ops.relu(x),
    lambda x: L.Activation("relu")(x),
], ids=["ops_relu", "activation_layer"])
def test_plain_relu_is_read_from_the_activation_whatever_applies_it(relu):
    """Merges need plain ReLU: the walker asks the activation registry what the layer
    rule's activation is, so `keras.ops.relu` and ``Activation(relu)`` are the neuron
    layers a ReLU layer makes: the same groups, and `compress` takes the same steps to
    the same weights; the slim model computes the compressed one."""
    import hope_keras

    reference, model = _bn_relu_mlp(lambda x: L.ReLU()(x)), _bn_relu_mlp(relu)
    assert [g.kind for g in walk(model).groups.values()] == ["neurons", "neurons"]
    runs = [hope_keras.compress(m, density=0.5, verbose=False) for m in (reference, model)]
    steps = [[(s.kind, s.unit, s.i, s.j) for s in r.trajectory.steps] for r in runs]
    assert steps[0] == steps[1] and any(kind == "merge" for kind, *_ in steps[0])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    assert outputs_equal(hope_keras.slim(model), model, x)


def test_relu_variants_are_not_plain_relu():
    for relu in (lambda: L.ReLU(max_value=6.0), lambda: L.ReLU(threshold=0.5),
                 lambda: L.LeakyReLU(0.1), lambda: L.Activation("relu6")):
        model = _bn_relu_mlp(lambda x: relu()(x))
        groups = walk(model).groups.values()
        assert {g.kind for g in groups} == {"coupled"}
        assert all("not plain ReLU" in g.note for g in groups)


def test_an_add_of_concatenations_splits_their_writers_where_their_channels_meet():
    """Add(concat(a, b), concat(d, e)) with a, b, d, e writing 3, 2, 2, 3 channels:
    position by position a[0:2] meets d, a[2] meets e[0], b meets e[1:3]. The walk
    splits a and e there into three groups, each writer coupled at its own
    positions (a misaligned Add pinned all four before); a prune of one group, slim,
    and the outputs agree."""
    import hope_keras
    from hope_keras.edit.editor import ModelEditor

    inputs = keras.Input((4,))
    a, b, d, e = (L.Dense(n, name=k)(inputs) for k, n in (("a", 3), ("b", 2), ("d", 2), ("e", 3)))
    s = L.Add(name="sum")([L.Concatenate()([a, b]), L.Concatenate()([d, e])])
    model = keras.Model(inputs, L.Dense(2, name="head")(L.ReLU()(s)))
    g = walk(model)
    assert not g.pinned or {p.layer for p in g.pinned} == {"head"}
    outs = {name: {c.layer: c.positions[:, 0].tolist() for c in grp.couplings
                   if c.role == "out"} for name, grp in g.groups.items()}
    # Named after the group's first writer in the walk's order, with its slice.
    assert outs == {"d": {"a": [0, 1], "d": [0, 1]}, "e[0:1]": {"a": [2], "e": [0]},
                    "e[1:3]": {"b": [0, 1], "e": [1, 2]}}
    assert {grp.kind for grp in g.groups.values()} == {"coupled"}
    assert g.coverage() == 1.0
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    editor = ModelEditor(model, g)
    with editor.step():
        editor.prune("e[1:3]", 1)  # b's channel 1 and e's channel 2
    editor.commit()
    assert not model.get_layer("b").kernel.numpy()[:, 1].any()
    assert not model.get_layer("e").kernel.numpy()[:, 2].any()
    assert model.get_layer("e").kernel.numpy()[:, :2].all()
    small = hope_keras.slim(model)
    assert [small.get_layer(k).units for k in "abde"] == [3, 1, 2, 2]
    assert outputs_equal(model, small, x)


def test_a_writer_tied_twice_to_one_channel_is_pinned_with_the_reason():
    """``concat([a, a]) + b``: b's channels c and 3 + c are both a's channel c, so b
    has no single filter per channel of the group: pinned, and said why."""
    inputs = keras.Input((4,))
    a, b = L.Dense(3, name="a")(inputs), L.Dense(6, name="b")(inputs)
    s = L.Add()([L.Concatenate()([a, a]), b])
    g = walk(keras.Model(inputs, L.Dense(2, name="head")(L.ReLU()(s))))
    assert not g.groups
    reasons = {p.layer: p.reason for p in g.pinned}
    assert reasons["a"] == reasons["b"] == "an Add ties two output channels of 'b' to one channel"


@pytest.mark.parametrize("seed", range(8))
def test_random_sums_of_concatenations_split_walk_prune_and_slim_exactly(seed):
    """Random Dense writers concatenated in random widths and orders, summed (twice in
    a row, so a split reaches a later sum), then ReLU and a head: every channel is in
    a group, each writer's out couplings cover its channels exactly once, and pruning
    half of every group then `slim` keeps the outputs."""
    import hope_keras
    from hope_keras.edit.editor import ModelEditor

    rng = np.random.default_rng(seed)
    width = int(rng.integers(4, 9))
    inputs = keras.Input((5,))

    def concatenation():
        cuts = np.sort(rng.choice(np.arange(1, width), size=int(rng.integers(0, 3)),
                                  replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [width]]))
        parts = [L.Dense(int(n))(inputs) for n in sizes]
        return parts[0] if len(parts) == 1 else L.Concatenate()(parts)

    s = L.Add()([concatenation(), concatenation()])
    s = L.Add()([L.ReLU()(s), concatenation()])
    model = keras.Model(inputs, L.Dense(2, name="head")(L.ReLU()(s)))
    g = walk(model)
    assert g.coverage() == 1.0
    covered = {}
    for grp in g.groups.values():
        for c in grp.couplings:
            if c.role == "out":
                covered.setdefault(c.layer, []).extend(c.positions[:, 0].tolist())
    for layer, positions in covered.items():
        assert sorted(positions) == list(range(model.get_layer(layer).units)), layer
    editor = ModelEditor(model, g)
    pruned = 0
    for name, grp in g.groups.items():
        for i in rng.permutation(grp.size)[: grp.size // 2]:
            with editor.step():
                editor.prune(name, int(i))
            pruned += 1
    editor.commit()
    small = hope_keras.slim(model)
    x = rng.normal(size=(6, 5)).astype("float32")
    assert outputs_equal(model, small, x)
    assert small.count_params() < model.count_params() or not pruned
