"""round_to: every group a run touches ends at a multiple of it (or whole); budgets
met from below; trajectories replay bit for bit and slice between rounds only."""

import keras
import numpy as np
import pytest

import hope_keras
from hope_keras.search.encoder import Encoder
from hope_keras.search.rounding import WidthRounding
from conftest import L, bn_relu, copy_model, mlp, outputs_equal, randomize_bn, widths_by_step
from conftest import conv_net as shared_conv_net

KERNEL_LAYERS = (L.Dense, L.Conv2D, L.SeparableConv2D, L.DepthwiseConv2D)


def conv_net(seed=0):
    """Widths 36 and 19 are no multiples of 8 or 4."""
    return shared_conv_net(seed, widths=(24, 36, 20, 19))


def residual_net(seed=0):
    """A 16-wide residual stream (one coupled group over two Adds), a projection to
    a 24-wide stream, and branches of 20 and 12 channels."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10, 10, 3))
    x = bn_relu(L.Conv2D(16, 3, padding="same", name="stem")(inputs), "stem")
    for k, width in enumerate((20, 12)):
        y = bn_relu(L.Conv2D(width, 3, padding="same", name=f"b{k}a")(x), f"b{k}a")
        y = L.BatchNormalization(name=f"b{k}b_bn")(L.Conv2D(16, 1, name=f"b{k}b")(y))
        x = L.ReLU()(L.Add(name=f"b{k}_add")([x, y]))
    shortcut = L.BatchNormalization(name="proj_bn")(L.Conv2D(24, 1, strides=2,
                                                              name="proj")(x))
    y = bn_relu(L.Conv2D(28, 3, strides=2, padding="same", name="b2a")(x), "b2a")
    y = L.BatchNormalization(name="b2b_bn")(L.Conv2D(24, 1, name="b2b")(y))
    x = L.ReLU()(L.Add(name="b2_add")([shortcut, y]))
    x = L.GlobalAveragePooling2D()(x)
    return randomize_bn(keras.Model(inputs, L.Dense(3, name="head")(x), name="res"), seed)


def separable_net(seed=0):
    """SeparableConv2D and DepthwiseConv2D + pointwise, mini-Xception style."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12, 12, 3))
    x = bn_relu(L.Conv2D(20, 3, padding="same", name="stem")(inputs), "stem")
    x = bn_relu(L.SeparableConv2D(36, 3, padding="same", name="sep1")(x), "sep1")
    x = bn_relu(L.DepthwiseConv2D(3, padding="same", name="dw")(x), "dw")
    x = bn_relu(L.Conv2D(28, 1, name="pw")(x), "pw")
    x = bn_relu(L.SeparableConv2D(44, 3, strides=2, name="sep2")(x), "sep2")
    x = L.GlobalAveragePooling2D()(x)
    return randomize_bn(keras.Model(inputs, L.Dense(3, name="head")(x), name="sep"), seed)


def dense_net(seed=0):
    return mlp((40, 27, 16), d_in=8, seed=seed)


MODELS = {"conv": conv_net, "residual": residual_net, "separable": separable_net,
          "dense": dense_net}


def _x(model, n=4):
    shape = (n,) + tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(0).normal(size=shape).astype("float32")


def _widths(model):
    """{layer name: output channels} of the layers with kernels, head excepted."""
    return {layer.name: int(layer.output.shape[-1]) for layer in model.layers
            if isinstance(layer, KERNEL_LAYERS) and layer.name != "head"}


def _compress(make, budget, round_to, correction=False):
    model = make()
    original = copy_model(model)
    result = Encoder(model, search={"round_to": round_to}, correction=correction,
                     verbose=False).compress(**budget)
    return original, model, result


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("budget", [{"flops": 0.6}, {"params": 0.5}, {"density": 0.6}])
def test_widths_are_multiples_and_budget_is_met(name, budget):
    r = 4
    original, model, result = _compress(MODELS[name], budget, r)
    small = hope_keras.slim(model)
    before, after = _widths(original), _widths(small)
    assert before.keys() == after.keys()
    changed = {k: (before[k], w) for k, w in after.items() if w != before[k]}
    assert changed, "the run left every layer whole"
    assert all(w % r == 0 for _, w in changed.values()), changed
    assert outputs_equal(small, model, _x(model))
    (what, target), = budget.items()
    p = hope_keras.profile(small, reference=original, latency=False)
    measured = {"flops": p.ratio("flops"), "params": p.ratio("params"),
                "density": result.density}[what]
    assert measured <= target + 1e-9
    assert result.stopped == "budget"
    # The steps inside a round are listed; the last step closes every round.
    inside = result.trajectory.meta.get("unrounded_steps", [])
    assert inside and len(result.trajectory) not in inside


def test_round_to_one_is_the_default_run():
    _, a, ra = _compress(conv_net, {"flops": 0.5}, 1)
    model = conv_net()
    rc = Encoder(model, correction=False, verbose=False).compress(flops=0.5)
    assert [s.unit for s in ra.trajectory] == [s.unit for s in rc.trajectory]
    assert all(np.array_equal(x, y) for x, y in zip(a.get_weights(), model.get_weights()))
    assert "unrounded_steps" not in rc.trajectory.meta
    assert "round_to" not in rc.trajectory.meta["options"]


def test_rounding_changes_the_widths_a_plain_run_leaves():
    _, plain, _ = _compress(conv_net, {"flops": 0.6}, 1)
    _, rounded, _ = _compress(conv_net, {"flops": 0.6}, 8)
    plain_w = _widths(hope_keras.slim(plain))
    rounded_w = _widths(hope_keras.slim(rounded))
    assert any(w % 8 for w in plain_w.values())  # the test could fail without round_to
    original = _widths(conv_net())
    assert all(w % 8 == 0 or w == original[k] for k, w in rounded_w.items()), rounded_w


@pytest.mark.parametrize("name", ["residual", "separable"])
def test_replay_is_bit_identical_and_slices_between_rounds(name, tmp_path):
    """A run to flops=0.45 replayed to flops=0.7 gives the direct flops=0.7 run's
    weights bit for bit (statistics corrected as `compress` corrects them)."""
    r = 4
    original, model, long_run = _compress(MODELS[name], {"flops": 0.45}, r,
                                          correction="auto")
    path = str(tmp_path / "run.npz")
    long_run.trajectory.save(path)
    trajectory = hope_keras.Trajectory.load(path)
    assert trajectory.meta["options"]["round_to"] == r
    replayed = trajectory.replay(copy_model(original), flops=0.45)
    assert all(np.array_equal(x, y) for x, y in zip(replayed.get_weights(),
                                                    model.get_weights()))
    _, direct, short_run = _compress(MODELS[name], {"flops": 0.7}, r, correction="auto")
    k = trajectory.step_for(flops=0.7)
    assert k == len(short_run.trajectory)
    sliced = trajectory.replay(copy_model(original), flops=0.7)
    assert all(np.array_equal(x, y) for x, y in zip(sliced.get_weights(),
                                                    direct.get_weights()))
    # The first step at or below 0.7 may be inside a round: the slice goes on to its end.
    first = int(np.flatnonzero(trajectory.field("flops_after") <= 0.7)[0]) + 1
    assert k >= first
    widths = _widths(hope_keras.slim(sliced))
    whole = _widths(original)
    assert all(w % r == 0 or w == whole[k] for k, w in widths.items()), widths


def test_groups_at_or_below_round_to_stay_whole():
    model = mlp((6, 16), d_in=5, seed=2)
    enc = Encoder(model, search={"round_to": 8}, correction=False, verbose=False)
    assert enc.run() == "no_action"
    assert _widths(hope_keras.slim(model)) == {"fc0": 6, "fc1": 8}


def test_out_of_reach_with_round_to_is_refused_before_any_edit():
    model = mlp((6, 16), d_in=5, seed=2)
    weights = model.get_weights()
    with pytest.raises(ValueError, match="out of reach"):
        Encoder(model, search={"round_to": 8}, verbose=False).compress(density=0.5)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


@pytest.mark.parametrize("bad", [0, -8, 2.5, "8", True])
def test_bad_round_to_is_refused(bad):
    with pytest.raises(ValueError, match="round_to"):
        Encoder(mlp(), search={"round_to": bad}, verbose=False)


def test_width_rounding_rounds():
    r = WidthRounding(8)
    r.start("g", 30)
    assert r.open == ("g", 24)
    r.after("g", 25)
    assert r.open == ("g", 24)
    r.after("g", 23)  # a merge of two dead neurons passed the target
    assert r.open == ("g", 16)
    r.after("g", 16)
    assert r.open is None
    r.start("g", 8)  # no multiple of 8 at or above 8 below 8: no round
    assert r.open is None


def test_cli_round_to(tmp_path, capsys):
    from hope_keras import cli

    path, out, traj = (str(tmp_path / n) for n in ("m.keras", "s.keras", "t.npz"))
    conv_net().save(path)
    assert cli.main(["compress", path, "--flops", "0.6", "--round-to", "8", "--out", out,
                     "--trajectory", traj, "--quiet"]) in (0, None)
    widths = _widths(keras.models.load_model(out))
    whole = _widths(conv_net())
    assert widths != whole
    assert all(w % 8 == 0 or w == whole[k] for k, w in widths.items()), widths
    assert hope_keras.Trajectory.load(traj).meta["options"]["round_to"] == 8
    with pytest.raises(SystemExit):
        cli.main(["compress", path, "--flops", "0.6", "--round-to", "0", "--out", out])


def test_out_of_reach_flops_names_round_to():
    model = mlp((6, 16), d_in=5, seed=2)
    with pytest.raises(ValueError, match="round_to=8"):
        Encoder(model, search={"round_to": 8}, verbose=False).compress(flops=0.5)


@pytest.mark.parametrize("name", ["conv", "residual"])
def test_every_step_outside_a_round_leaves_every_group_rounded(name):
    """Widths followed step by step from the trajectory alone: between rounds every
    group is a multiple of round_to or whole; inside a round exactly one is not."""
    r = 4
    _, _, result = _compress(MODELS[name], {"flops": 0.3}, r)
    t = result.trajectory
    whole = dict(t.meta["groups"])
    inside = set(t.meta["unrounded_steps"])
    for k, _, width in widths_by_step(t):
        off = [g for g, n in width.items() if n % r and n != whole[g]]
        assert len(off) == (1 if k in inside else 0), (k, off)
