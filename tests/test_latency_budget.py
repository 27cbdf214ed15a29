"""compress(latency=r): a FLOPs budget steered by a measured latency ratio. The control
loop is tested with deterministic timers (latency as a function of FLOPs); one smoke
test times for real and checks only the structure (timings are the machine's)."""

import warnings

import numpy as np
import pytest

import hope_keras
from hope_keras import LatencyBudget
from hope_keras.search.latency import MIN_STEP
from conftest import conv_net, copy_model, run_cli


def flops_ratio(small, reference):
    return hope_keras.profile(small, reference=reference, latency=False).ratio("flops")


class FakeTimer:
    """Latency ratio = FLOPs ratio + a fixed overhead (what does not shrink), and a
    record of every call."""

    def __init__(self, overhead=0.1):
        self.overhead, self.calls = overhead, []

    def __call__(self, small, reference):
        value = flops_ratio(small, reference) + self.overhead
        self.calls.append(value)
        return value


def weights_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.get_weights(), b.get_weights()))


def test_the_loop_lowers_flops_until_the_measured_ratio_is_met():
    model, timer = conv_net(), FakeTimer(0.1)
    result = hope_keras.compress(model, latency=LatencyBudget(0.6, timer=timer),
                                 verbose=False)
    rounds = result.trajectory.meta["latency"]["rounds"]
    assert result.stopped == "budget"
    assert result.latency_ratio == timer.calls[-1] <= 0.6
    # The first round ran to FLOPs 0.6 and measured 0.1 above it: not enough.
    assert rounds[0]["flops_target"] == 0.6 and rounds[0]["measured"] > 0.6
    assert len(rounds) >= 2 and [t for r in rounds for t in r["times"]] == timer.calls
    # A pass is measured twice; the rounds before it, once.
    assert [len(r["times"]) for r in rounds] == [1] * (len(rounds) - 1) + [2]
    for before, after in zip(rounds, rounds[1:]):  # f ← f·r/m, at least MIN_STEP lower
        expected = min(before["flops_target"] * 0.6 / before["measured"],
                       before["flops_target"] * (1 - MIN_STEP),
                       before["flops_ratio"] * (1 - MIN_STEP))
        assert after["flops_target"] == pytest.approx(expected)
        assert after["step"] > before["step"]
    # The measured ratio is the slimmed model's, and FLOPs end at most 0.5.
    assert result.flops_ratio <= 0.5 + 1e-9
    assert result.latency_ratio == pytest.approx(
        flops_ratio(hope_keras.slim(model), model) + 0.1)
    meta = result.trajectory.meta["latency"]
    assert meta["ratio"] == 0.6 and meta["step"] == len(result.trajectory)
    assert meta["measured"] == result.latency_ratio and meta["method"] == "timer"
    assert "latency_ratio=" in repr(result)


def test_the_run_continues_one_trajectory_and_replays_exactly(tmp_path):
    original = conv_net(1)
    model = copy_model(original)
    result = hope_keras.compress(model, latency=LatencyBudget(0.55, timer=FakeTimer()),
                                 verbose=False)
    first = result.trajectory.meta["latency"]["rounds"][0]
    # The first round is a plain run to its FLOPs target: the same steps.
    direct = hope_keras.compress(copy_model(original), flops=first["flops_target"],
                                 verbose=False)
    assert len(direct.trajectory) == first["step"]
    assert [(s.kind, s.unit, s.i, s.j) for s in direct.trajectory] == \
        [(s.kind, s.unit, s.i, s.j) for s in result.trajectory.steps[:first["step"]]]
    # Replaying the saved trajectory to its last step gives the model bit for bit.
    path = str(tmp_path / "t.npz")
    result.trajectory.save(path)
    loaded = hope_keras.Trajectory.load(path)
    assert loaded.meta["latency"] == result.trajectory.meta["latency"]
    replayed = loaded.replay(copy_model(original), step=loaded.meta["latency"]["step"])
    assert weights_equal(replayed, model)
    # A FLOPs replay to the reached ratio stops at the same step.
    assert loaded.step_for(flops=result.flops_ratio) == len(result.trajectory)


def test_a_budget_met_at_the_first_measurement_is_one_round():
    model = conv_net(2)
    result = hope_keras.compress(model, latency=LatencyBudget(0.7, timer=FakeTimer(0.0)),
                                 verbose=False)
    assert len(result.trajectory.meta["latency"]["rounds"]) == 1
    assert result.latency_ratio <= 0.7 and result.stopped == "budget"


def test_steps_stop_the_loop_and_the_ratio_reached_is_reported():
    model, timer = conv_net(3), FakeTimer(0.5)  # overhead 0.5: 0.6 is out of reach
    with pytest.warns(UserWarning, match=r"stopped before latency=0.6: steps= was reached\. "
                                         r"The last measured latency ratio is 0\.\d{3}"):
        result = hope_keras.compress(model, latency=LatencyBudget(0.6, timer=timer),
                                     steps=30, verbose=False)
    assert result.stopped == "steps" and len(result.trajectory) == 30
    assert result.latency_ratio == timer.calls[-1] > 0.6


def test_an_unreachable_ratio_stops_when_no_action_is_left():
    model = conv_net(4)
    with pytest.warns(UserWarning, match="latency=0.3: no admissible action is left"):
        result = hope_keras.compress(model, actions=("prune",), verbose=False, latency=(
            LatencyBudget(0.3, min_flops=0.0, timer=FakeTimer(0.5))))
    assert result.stopped == "no_action" and result.latency_ratio > 0.3


def test_the_flops_target_stops_at_min_flops():
    model = conv_net(4)
    with pytest.warns(UserWarning, match="FLOPs floor min_flops=0.15 was reached"):
        result = hope_keras.compress(model, verbose=False,
                                     latency=LatencyBudget(0.6, timer=FakeTimer(0.5)))
    rounds = result.trajectory.meta["latency"]["rounds"]
    assert result.stopped == "min_flops" and result.latency_ratio > 0.6
    assert result.trajectory.meta["latency"]["min_flops"] == 0.15
    assert min(r["flops_target"] for r in rounds) >= 0.15
    assert rounds[-2]["flops_ratio"] > 0.15 >= result.flops_ratio


def test_one_lucky_measurement_does_not_end_the_run():
    timer = FakeTimer(0.2)  # the first round's real measurement is over 0.6

    def lucky_once(small, reference):
        value = timer(small, reference)
        return 0.2 if len(timer.calls) == 2 else value  # the second call: a lucky median

    result = hope_keras.compress(conv_net(7), verbose=False,
                                 latency=LatencyBudget(0.6, timer=lucky_once))
    rounds = result.trajectory.meta["latency"]["rounds"]
    assert rounds[1]["times"][0] == 0.2 and rounds[1]["measured"] == timer.calls[2] > 0.6
    assert result.stopped == "budget" and len(rounds) > 2
    assert result.latency_ratio == timer.calls[-1] <= 0.6


@pytest.mark.parametrize("bad", [0, 0.0, -0.2, 1.5, "0.5", True, [0.5], float("nan")])
def test_bad_ratios_are_refused_before_any_edit(bad):
    model = conv_net()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="latency must be"):
        hope_keras.compress(model, latency=bad, verbose=False)
    with pytest.raises(ValueError, match="latency must be"):
        hope_keras.Encoder(model, verbose=False).compress(latency=bad)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_bad_options_and_budget_mixes_are_refused():
    model = conv_net()
    before = [w.copy() for w in model.get_weights()]
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"repeats": 1.5}, "repeats"),
                          ({"timer": 3}, "timer"), ({"min_flops": 0.7}, "min_flops"),
                          ({"fold_batchnorm": "yes"}, "fold_batchnorm")):
        with pytest.raises(ValueError, match=match):
            LatencyBudget(0.5, **kwargs)
    with pytest.raises(ValueError, match="latency= alone"):
        hope_keras.compress(model, latency=0.5, density=0.5, verbose=False)
    with pytest.raises(ValueError, match="positive ratio"):
        hope_keras.compress(model, latency=LatencyBudget(0.5, timer=lambda s, r: "fast"),
                            verbose=False)
    fresh = conv_net()
    with pytest.raises(ValueError, match="latency= alone"):
        hope_keras.compress(fresh, latency=0.5, flops=0.5, verbose=False)
    assert all(np.array_equal(a, b) for a, b in zip(before, fresh.get_weights()))


def test_a_real_measurement_is_reported_and_the_model_slims():
    model = conv_net(5)
    params0 = model.count_params()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hope_keras.compress(model, latency=LatencyBudget(0.5, repeats=3, warmup=1),
                                     steps=40, verbose=False)
    unmet = [w for w in caught if "stopped before latency=0.5" in str(w.message)]
    assert len(unmet) == (result.latency_ratio > 0.5)  # warned exactly when unmet
    meta = result.trajectory.meta["latency"]
    assert result.stopped in ("budget", "steps")
    assert isinstance(result.latency_ratio, float) and result.latency_ratio > 0
    assert meta["method"] == "call" and meta["batch_size"] == 1 and meta["repeats"] == 3
    assert meta["rounds"][-1]["measured"] == result.latency_ratio
    assert hope_keras.slim(model).count_params() < params0


def test_the_command_line_budget(tmp_path, capsys):
    path, out = str(tmp_path / "net.keras"), str(tmp_path / "slim.keras")
    conv_net(6).save(path)

    def main(*args):
        return run_cli(capsys, *args)

    for bad in (("--latency-budget", "0"), ("--latency-budget", "1.5"),
                ("--latency-budget", "0.5", "--flops", "0.5")):
        status, _ = main("compress", path, *bad, "--out", out, "--quiet")
        assert status == 2
    # 1.0: met as soon as the slimmed copy times no slower than the original.
    status, printed = main("compress", path, "--latency-budget", "1.0", "--out", out,
                           "--trajectory", str(tmp_path / "t.npz"))
    assert status == 0, printed.err
    assert "measured latency ratio" in printed.out
    meta = hope_keras.Trajectory.load(str(tmp_path / "t.npz")).meta["latency"]
    assert meta["ratio"] == 1.0 and meta["measured"] <= 1.0


def test_fold_batchnorm_times_the_slimmed_copy_folded_against_the_model_as_is():
    """The timer sees fold_batchnorm(slim(model)): no BN left, the same outputs as the
    slimmed copy; the reference keeps its BNs."""
    import keras

    model, seen = conv_net(), []

    def timer(small, reference):
        seen.append((small, reference))
        return flops_ratio(small, reference) + 0.1

    budget = LatencyBudget(0.6, timer=timer, fold_batchnorm=True)
    assert "fold_batchnorm=True" in repr(budget)
    result = hope_keras.compress(model, latency=budget, verbose=False)
    assert result.stopped == "budget"
    assert result.trajectory.meta["latency"]["fold_batchnorm"] is True
    bn = keras.layers.BatchNormalization
    small, reference = seen[-1]
    assert not any(isinstance(layer, bn) for layer in small.layers)
    assert any(isinstance(layer, bn) for layer in reference.layers)
    x = np.random.default_rng(0).normal(size=(4,) + tuple(model.inputs[0].shape[1:]))
    y_small = np.asarray(small(x.astype("float32")))
    y_slim = np.asarray(hope_keras.slim(model)(x.astype("float32")))
    np.testing.assert_allclose(y_small, y_slim, rtol=1e-4, atol=1e-5 * np.abs(y_slim).max())
