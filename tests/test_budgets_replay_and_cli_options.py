"""Parameter and FLOPs budgets through `Trajectory.step_for` / `Trajectory.replay` and
the command line, and the CLI's ``--cost``, ``--latency``, ``--no-slim`` and
``--quantize``.

The budgets are checked against the slimmed model itself: its ``count_params()`` and
`hope_keras.profile`'s FLOPs after the steps replayed must be within the budget,
and one step fewer must not be (so the step chosen is the first that meets it). The
CLI's runs are compared with the Python API's on the same model.
"""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp, run_cli, small_resnet


@pytest.fixture(scope="module")
def run():
    """A small ResNet (a residual stream, a Flatten → Dense) compressed to density
    0.3, its original kept."""
    original = small_resnet(seed=13)
    model = copy_model(original)
    result = hope_keras.compress(model, density=0.3, verbose=False)
    return original, result.trajectory


def _sizes(model, reference):
    p = hope_keras.profile(hope_keras.slim(model), reference=reference, latency=False)
    return p.ratio("params"), p.ratio("flops")


@pytest.mark.parametrize("what,index", [("params", 0), ("flops", 1)])
def test_step_for_and_replay_meet_a_params_or_flops_budget_first_at_that_step(run, what,
                                                                              index):
    original, trajectory = run
    end = _sizes(trajectory.replay(copy_model(original), step=len(trajectory)), original)
    budget = round(0.5 * (1.0 + end[index]), 3)  # halfway: some steps, not all
    k = trajectory.step_for(**{what: budget})
    assert 0 < k < len(trajectory)
    at_k = _sizes(trajectory.replay(copy_model(original), step=k), original)
    before = _sizes(trajectory.replay(copy_model(original), step=k - 1), original)
    assert at_k[index] <= budget < before[index], (k, at_k, before)
    # The step's recorded ratio is the slimmed model's.
    recorded = trajectory[k - 1].params_after if what == "params" else trajectory[k - 1].flops_after
    assert recorded == pytest.approx(at_k[index], rel=1e-12)
    replayed = trajectory.replay(copy_model(original), **{what: budget})
    by_step = trajectory.replay(copy_model(original), step=k)
    for a, b in zip(replayed.get_weights(), by_step.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert trajectory.step_for(**{what: 1.0}) == 0


def _cli_out(capsys, *args):
    status, printed = run_cli(capsys, *args)
    return status, printed.out


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_budgets") / "net.keras"
    small_resnet(seed=13).save(path)
    return path


@pytest.mark.parametrize("option,value,cost", [("--params", 0.7, "hope"),
                                                ("--flops", 0.6, "hope"),
                                                ("--params", 0.8, "paper")])
def test_cli_compress_budget_and_cost_equal_the_api(model_file, tmp_path, capsys, option,
                                                    value, cost):
    out, traj = tmp_path / "slim.keras", tmp_path / "t.npz"
    status, _ = _cli_out(capsys, "compress", model_file, option, value, "--cost", cost,
                     "--out", out, "--trajectory", traj, "--quiet")
    assert status == 0
    original = keras.models.load_model(model_file)
    small = keras.models.load_model(out)
    p = hope_keras.profile(small, reference=original, latency=False)
    what = option[2:]
    assert p.ratio(what) <= value
    saved = hope_keras.Trajectory.load(str(traj))
    assert saved.meta["options"]["cost"]["name"] == cost
    model = keras.models.load_model(model_file)
    expected = hope_keras.compress(model, cost=cost, verbose=False, **{what: value})
    assert [(s.kind, s.unit, s.i, s.j) for s in saved] == [
        (s.kind, s.unit, s.i, s.j) for s in expected.trajectory]
    x = np.random.default_rng(0).normal(size=(4, 10, 10, 3)).astype("float32")
    np.testing.assert_allclose(small(x), hope_keras.slim(model)(x), rtol=1e-5, atol=1e-5)


def test_cli_compress_latency_prints_the_timings(model_file, tmp_path, capsys):
    rows = ("latency predict (ms / batch of 1)", "latency call (ms / batch of 1)")
    status, stdout = _cli_out(capsys, "compress", model_file, "--density", "0.6", "--out",
                          tmp_path / "s.keras")
    assert status == 0 and "FLOPs / example" in stdout
    assert not any(row in stdout for row in rows)
    status, stdout = _cli_out(capsys, "compress", model_file, "--density", "0.6", "-o",
                          tmp_path / "s.keras", "--latency")  # -o: --out's short form
    assert status == 0
    for row in rows:  # reference, model, ratio: positive timings
        line = next(l for l in stdout.splitlines() if l.startswith(row))
        ref, mine, ratio = (float(v.replace(",", "")) for v in line[len(row):].split())
        assert ref > 0 and mine > 0
        # Each number is printed to 3 decimals: the ratio of the printed timings is
        # within their rounding (±0.0005 each) of the printed ratio (±0.0005).
        slack = 5e-4 + (mine / ref) * (5e-4 / mine + 5e-4 / ref) * 1.01
        assert abs(ratio - mine / ref) <= slack, (ref, mine, ratio)


def test_cli_replay_budgets_and_no_slim(model_file, tmp_path, capsys):
    traj = tmp_path / "t.npz"
    status, _ = _cli_out(capsys, "compress", model_file, "--density", "0.3", "--out",
                     tmp_path / "s.keras", "--trajectory", traj, "--quiet")
    assert status == 0
    trajectory = hope_keras.Trajectory.load(str(traj))
    x = np.random.default_rng(1).normal(size=(4, 10, 10, 3)).astype("float32")
    for option, value in (("--params", 0.75), ("--flops", 0.7)):
        slim_out, full_out = tmp_path / "slim.keras", tmp_path / "full.keras"
        assert _cli_out(capsys, "replay", model_file, traj, option, value, "--out", slim_out,
                    "--quiet")[0] == 0
        assert _cli_out(capsys, "replay", model_file, traj, option, value, "--out", full_out,
                    "--no-slim", "--quiet")[0] == 0
        expected = trajectory.replay(keras.models.load_model(model_file),
                                     **{option[2:]: value})
        full, small = keras.models.load_model(full_out), keras.models.load_model(slim_out)
        # --no-slim: the original's shapes, the replayed weights; else the slimmed model.
        assert full.count_params() == expected.count_params()
        for a, b in zip(full.get_weights(), expected.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert small.count_params() < full.count_params()
        np.testing.assert_allclose(small(x), full(x), rtol=1e-5, atol=1e-5)


def test_cli_export_quantize_dynamic(tmp_path, capsys):
    model = mlp((64, 48), d_in=32, seed=2)  # kernels of ≥ 1024 values are quantized
    path = tmp_path / "m.keras"
    model.save(path)
    plain, quantized = tmp_path / "f.tflite", tmp_path / "q.tflite"
    assert _cli_out(capsys, "export", path, "--out", plain, "--quiet")[0] == 0
    assert _cli_out(capsys, "export", path, "--out", quantized, "--quantize", "dynamic",
                "--quiet")[0] == 0
    assert quantized.stat().st_size < plain.stat().st_size
    x = np.random.default_rng(2).normal(size=(8, 32)).astype("float32")
    y = np.asarray(model(x))
    np.testing.assert_allclose(hope_keras.deploy.export.tflite_predict(str(plain), x), y,
                               rtol=1e-5, atol=1e-5)
    q = hope_keras.deploy.export.tflite_predict(str(quantized), x)
    assert np.abs(q - y).max() < 0.05 * np.abs(y).max()
