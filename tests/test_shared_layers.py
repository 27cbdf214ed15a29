"""A layer object called more than once (shared layers): `slim` rebuilds it as one
layer with all its calls, a group that reaches a later call is pinned, and the CLI
compresses such a model."""

import os

import keras
import numpy as np

import hope_keras
from conftest import L, bn_relu, outputs_equal, randomize_bn


def _x(model, n=5, seed=0):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _shared_model(seed=0):
    """Groups a and b around one Dense layer object called twice."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = bn_relu(L.Dense(8, name="a")(inputs), "a")
    x = L.Dense(5, name="mid")(x)
    shared = L.Dense(5, name="shared")
    x = shared(shared(x))
    x = bn_relu(L.Dense(6, name="b")(x), "b")
    return randomize_bn(keras.Model(inputs, L.Dense(2, name="head")(x), name="shared_net"),
                        seed)


def test_slim_rebuilds_a_model_that_reuses_a_layer():
    model = _shared_model()
    small = hope_keras.slim(model)  # unedited: one layer object, two calls
    assert small.count_params() == model.count_params()  # still one shared layer
    assert len(small.get_layer("shared")._inbound_nodes) == 2
    assert outputs_equal(small, model, _x(model))
    result = hope_keras.compress(model, density=0.5, verbose=False)
    small = hope_keras.slim(model)
    assert small.count_params() == round(result.params_ratio * model.count_params())
    assert outputs_equal(small, model, _x(model))


def test_a_group_feeding_a_later_call_of_a_shared_layer_is_pinned():
    """The walker reads every call of a shared layer: a group whose output reaches a
    later call is pinned (a merge would change what that call reads), and the reason
    names the shared layer."""
    inputs = keras.Input((6,))
    shared = L.Dense(5, name="sh")
    h = L.ReLU(name="g_relu")(L.BatchNormalization(name="g_bn")(L.Dense(5, name="g")(inputs)))
    first = L.Dense(3, name="post")(L.Dense(3, name="post0")(shared(inputs[:, :5])))
    model = keras.Model(inputs, [first, shared(h), L.Dense(2, name="c")(h)])
    graph = hope_keras.walk(model)
    assert "g" not in graph.groups
    reason = {p.layer: p.reason for p in graph.pinned}["g"]
    assert "'sh'" in reason and "shared" in reason


def test_cli_compress_of_a_model_with_a_shared_layer_writes_both_files(tmp_path, capsys):
    from hope_keras import cli

    path = str(tmp_path / "shared.keras")
    _shared_model(seed=1).save(path)
    out, traj = str(tmp_path / "slim.keras"), str(tmp_path / "t.npz")
    assert cli.main(["compress", path, "--density", "0.5", "--out", out, "--trajectory",
                     traj, "--quiet"]) == 0
    assert os.path.exists(out) and len(hope_keras.Trajectory.load(traj)) > 0
