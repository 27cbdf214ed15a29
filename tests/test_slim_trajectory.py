"""slim equals the in-place model; trajectories replay, save and load; bad files."""

import os

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L, copy_model, mlp, outputs_equal, plant_duplicate, small_resnet


def _x(model, n=5, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


@pytest.fixture(scope="module")
def compressed():
    model = small_resnet(seed=11)
    for src, dst in ((0, 5), (1, 7), (2, 8)):
        plant_duplicate(model, "fc", "head", src, dst, seed=dst)
    for name in ("b1a_bn", "b1b_bn"):  # a weaker block: evicted during the run
        bn = model.get_layer(name)
        for v in (bn.gamma, bn.beta):
            v.assign(0.3 * v.numpy())
    original = copy_model(model)
    result = hope_keras.compress(model, density=0.35, verbose=False)
    assert {s.kind for s in result.trajectory.steps} == {"prune", "merge", "evict"}
    return original, model, result


def test_slim_equals_in_place_model_and_is_smaller(compressed):
    _, model, result = compressed
    small = hope_keras.slim(model)
    assert outputs_equal(small, model, _x(model))
    assert small.count_params() < model.count_params()
    assert small.count_params() == round(result.params_ratio * model.count_params())
    evicted = {s.unit for s in result.trajectory.steps if s.kind == "evict"}
    assert evicted == {"b1_add"}
    names = [layer.name for layer in small.layers]
    assert not {"b1a", "b1a_bn", "b1b", "b1b_bn", "b1_add"} & set(names)


def test_slim_model_save_load_round_trip(compressed, tmp_path):
    _, model, _ = compressed
    small = hope_keras.slim(model)
    path = os.path.join(tmp_path, "slim.keras")
    small.save(path)
    loaded = keras.models.load_model(path)
    x = _x(model)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(small(x)))


def test_slim_removes_zero_channels_of_an_unedited_model():
    model = mlp((8, 6), seed=12)
    bn = model.get_layer("fc0_bn")
    for attr in ("gamma", "beta"):
        v = bn.weights[[w.name for w in bn.weights].index(attr)]
        v.assign(np.where(np.arange(8) % 3 == 0, 0.0, v.numpy()).astype("float32"))
    small = hope_keras.slim(model)
    assert small.get_layer("fc0").units == 5
    assert small.get_layer("fc1").kernel.shape == (5, 6)
    assert outputs_equal(small, model, _x(model))
    # Nothing dead: same architecture and parameter count.
    assert hope_keras.slim(mlp((8, 6), seed=13)).count_params() == model.count_params()


def test_slim_sequential_with_flatten():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(5, 3), L.BatchNormalization(),
                              L.ReLU(), L.Flatten(), L.Dense(4)])
    from conftest import randomize_bn

    randomize_bn(model)
    hope_keras.compress(model, steps=2, verbose=False)
    small = hope_keras.slim(model)
    assert small.layers[1].filters == 3
    assert outputs_equal(small, model, _x(model))


def test_replay_equals_direct_run_and_save_load_round_trips(compressed, tmp_path):
    original, model, result = compressed
    path = os.path.join(tmp_path, "t.npz")
    result.trajectory.save(path)
    loaded = hope_keras.Trajectory.load(path)
    assert len(loaded) == len(result.trajectory)
    for field in ("kind", "unit", "i", "j", "J", "P_init", "DR", "c_before", "c_after",
                  "active_after", "params_after", "coef"):
        np.testing.assert_array_equal(loaded.field(field), result.trajectory.field(field))
    assert loaded.meta["fingerprint"] == result.trajectory.meta["fingerprint"]
    replayed = loaded.replay(copy_model(original), step=len(loaded))
    for a, b in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Replaying to an intermediate density stops at the first step that reaches it.
    k = loaded.step_for_density(0.7)
    assert loaded.densities()[k - 1] <= 0.7 < loaded.densities()[k - 2]
    partial = loaded.replay(copy_model(original), density=0.7)
    direct = copy_model(original)
    hope_keras.compress(direct, steps=k, verbose=False)
    for a, b in zip(partial.get_weights(), direct.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_fingerprint_is_the_hash_of_the_weights_as_copied(compressed, monkeypatch):
    """The run's fingerprint (hashed on a thread from views of the weights while the
    tables fill) is the model's before the run, byte for byte the hash of copies of
    its weights: trajectories saved before views were used still replay."""
    from hope_keras.graph import adapter as _keras_graph
    from hope_keras.graph.fingerprint import fingerprint

    original, _, result = compressed
    graph = hope_keras.analyze(original).graph
    from_views = fingerprint(original, graph)
    monkeypatch.setattr(_keras_graph, "weight_view", lambda w: np.array(w.numpy()))
    assert fingerprint(original, graph) == from_views == result.trajectory.meta["fingerprint"]


@pytest.mark.parametrize("statistic", ["moving_mean", "moving_variance"])
def test_bn_statistics_alone_make_another_model(compressed, statistic):
    """HOPE reads the BN moving statistics (the folding, the moments): a model that
    differs from the recorded one in them alone is another model, for a replay and
    for an analysis (non-trainable weights count in the fingerprint)."""
    original, _, result = compressed
    other = copy_model(original)
    analysis = hope_keras.analyze(other, verbose=False)
    var = getattr(other.get_layer("fc_bn"), statistic)
    var.assign(var.numpy() * 1.25 + 0.01)
    before = [w.copy() for w in other.get_weights()]
    with pytest.raises(ValueError, match="fingerprint"):
        result.trajectory.replay(other, step=3)
    with pytest.raises(ValueError, match="changed since this analysis"):
        hope_keras.Encoder(other, analysis=analysis, verbose=False)
    for a, b in zip(before, other.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_replay_refuses_another_model_and_leaves_it_untouched(compressed):
    _, model, result = compressed
    other = small_resnet(seed=99)
    before = [w.copy() for w in other.get_weights()]
    with pytest.raises(ValueError, match="fingerprint"):
        result.trajectory.replay(other, step=3)
    with pytest.raises(ValueError, match="fingerprint"):
        result.trajectory.replay(model, step=3)  # already compressed
    for a, b in zip(before, other.get_weights()):
        np.testing.assert_array_equal(a, b)
    mlp_model = mlp()  # other layers altogether: said so, not as other weights
    with pytest.raises(ValueError, match=r"with other layers than model .*channel groups "
                                         r"differ: \['"):
        result.trajectory.replay(mlp_model, step=3)


def test_corrupt_trajectory_files_raise_clear_errors(compressed, tmp_path):
    _, _, result = compressed
    bad = os.path.join(tmp_path, "bad.npz")
    with open(bad, "wb") as f:
        f.write(b"not a zip file")
    with pytest.raises(ValueError, match="bad.npz"):
        hope_keras.Trajectory.load(bad)
    good = os.path.join(tmp_path, "good.npz")
    result.trajectory.save(good)
    with np.load(good) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["J"] = arrays["J"][:-1]
    truncated = os.path.join(tmp_path, "truncated.npz")
    np.savez(truncated, **arrays)
    with pytest.raises(ValueError, match="corrupt"):
        hope_keras.Trajectory.load(truncated)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        hope_keras.Trajectory.load(os.path.join(tmp_path, "missing.npz"))


def test_prune_costs_for_deft(compressed):
    _, _, result = compressed
    costs = result.trajectory.prune_costs()
    prunes = [s for s in result.trajectory.steps if s.kind == "prune"]
    assert len(costs) == len(prunes)
    s = prunes[0]
    assert costs[(s.unit, s.i)] == (s.J, s.c_after)


@pytest.mark.parametrize("conv, shape", [(L.Conv1D, (12, 3)), (L.Conv3D, (5, 5, 5, 2))])
def test_conv1d_and_conv3d_groups_compress_and_slim(conv, shape):
    keras.utils.set_random_seed(5)
    inputs = keras.Input(shape)
    x = L.ReLU()(L.BatchNormalization()(conv(6, 3, padding="same", name="a")(inputs)))
    x = L.ReLU()(L.BatchNormalization()(conv(5, 3, name="b")(x)))
    x = L.Flatten()(x)
    model = keras.Model(inputs, L.Dense(3)(x))
    from conftest import randomize_bn

    randomize_bn(model, 5)
    assert set(hope_keras.walk(model).groups) == {"a", "b"}
    hope_keras.compress(model, density=0.5, verbose=False)
    small = hope_keras.slim(model)
    assert small.get_layer("a").filters + small.get_layer("b").filters <= 5
    assert outputs_equal(small, model, _x(model))
