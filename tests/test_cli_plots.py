"""`hope-keras` driven as a subprocess, and the plot files."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp, run_cli, small_resnet
from hope_keras import plots

# No TF_* settings: the CLI itself keeps TensorFlow's start-up lines off stderr.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}


def run(*args):
    return subprocess.run([sys.executable, "-m", "hope_keras.cli", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "net.keras")
    small_resnet(seed=21).save(path)
    return path


def _in_process(capsys, *args):
    """Runs the CLI in this process (no TensorFlow start); returns (status, stdout)."""
    status, printed = run_cli(capsys, *args)
    return status, printed.out


def test_cli_compress_replay_report(model_file, tmp_path, capsys):
    out, traj, png = (str(tmp_path / n) for n in ("slim.keras", "t.npz", "r.png"))
    # One real subprocess: the command as a user runs it, stderr free of start-up noise.
    r = run("compress", model_file, "--density", "0.5", "--out", out, "--trajectory", traj)
    assert r.returncode == 0, r.stderr
    assert "density 0.5" in r.stdout
    assert "FLOPs / example" in r.stdout and "latency" not in r.stdout
    assert r.stderr == ""  # no absl / oneDNN / CUDA / cpu_feature_guard lines
    original = keras.models.load_model(model_file)
    small = keras.models.load_model(out)
    assert small.count_params() < original.count_params()

    replayed = str(tmp_path / "replayed.keras")
    status, stdout = _in_process(capsys, "replay", model_file, traj, "--density", "0.5",
                                 "--out", replayed, "--quiet")
    assert status == 0 and stdout == ""
    x = np.random.default_rng(0).normal(size=(3, 10, 10, 3)).astype("float32")
    np.testing.assert_allclose(keras.models.load_model(replayed)(x), small(x), rtol=1e-6,
                               atol=1e-6)

    status, _ = _in_process(capsys, "report", traj, "--out", png)
    assert status == 0 and os.path.getsize(png) > 10_000
    status, stdout = _in_process(capsys, "report", traj, "--out", png, "--model", model_file)
    assert status == 0
    assert f"{small.count_params():,}" in stdout and "FLOPs / example" in stdout

    tfl = str(tmp_path / "slim.tflite")
    status, _ = _in_process(capsys, "export", out, "--out", tfl)
    assert status == 0
    np.testing.assert_allclose(hope_keras.deploy.export.tflite_predict(tfl, x), small(x),
                               rtol=1e-5, atol=1e-5)

    status, stdout = _in_process(capsys, "analyze", model_file)
    assert status == 0 and "b1_add" in stdout and "Pinned" in stdout

    # --data: the statistics re-estimated on the inputs, as compress(data=) does.
    images = np.random.default_rng(5).normal(size=(80, 10, 10, 3)).astype("float32")
    np.save(tmp_path / "x.npy", images)
    with_data = str(tmp_path / "data.npz")
    status, _ = _in_process(capsys, "compress", model_file, "--density", "0.5", "--out",
                            str(tmp_path / "data.keras"), "--trajectory", with_data,
                            "--data", str(tmp_path / "x.npy"), "--quiet")
    assert status == 0
    options = hope_keras.Trajectory.load(with_data).meta["options"]
    assert options["correct_statistics"] == "data"
    expected = keras.models.load_model(model_file)
    hope_keras.compress(expected, density=0.5, data=images, verbose=False)
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "data.keras")(x),
                               expected(x), rtol=1e-5, atol=1e-5)


def test_cli_errors_have_shell_exit_codes(model_file, tmp_path, capsys):
    from hope_keras import cli

    def status(*args):  # in-process: the same exit statuses, without a TensorFlow start
        try:
            return cli.main(list(args))
        except SystemExit as e:
            return e.code

    assert status("compress", str(tmp_path / "missing.keras"), "--density", "0.5",
                  "--out", str(tmp_path / "x.keras")) == 1
    assert "missing.keras" in capsys.readouterr().err
    assert status("compress", model_file, "--density", "1.0", "--out",
                  str(tmp_path / "x.keras")) == 1
    assert "already met" in capsys.readouterr().err
    assert status("compress", model_file, "--out", str(tmp_path / "x.keras")) == 2  # no budget
    assert "one of the arguments" in capsys.readouterr().err
    assert status("compress", model_file, "--density", "0.5", "--out",
                  str(tmp_path / "x.keras"), "--data", str(tmp_path / "none.npy")) == 2
    assert "none.npy" in capsys.readouterr().err
    np.save(tmp_path / "wrong.npy", np.zeros((4, 3)))
    assert status("compress", model_file, "--density", "0.5", "--out",
                  str(tmp_path / "x.keras"), "--data", str(tmp_path / "wrong.npy")) == 1
    err = capsys.readouterr().err
    assert "wrong.npy" in err and "(4, 3)" in err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"junk")
    assert status("replay", model_file, str(bad), "--step", "1", "--out",
                  str(tmp_path / "y.keras")) == 1
    assert "bad.npz" in capsys.readouterr().err
    # A model whose weights are not those recorded: the advice names the CLI's option,
    # which then replays.
    traj = str(tmp_path / "t.npz")
    hope_keras.compress(keras.models.load_model(model_file), density=0.6,
                        verbose=False).trajectory.save(traj)
    other = str(tmp_path / "other.keras")
    small_resnet(seed=22).save(other)
    capsys.readouterr()
    assert status("replay", other, traj, "--step", "2", "--out",
                  str(tmp_path / "z.keras")) == 1
    err = capsys.readouterr().err
    assert "fingerprint mismatch" in err and "--no-check" in err and "check=False" not in err
    assert status("replay", other, traj, "--step", "2", "--out", str(tmp_path / "z.keras"),
                  "--no-check", "--quiet") == 0


def test_plot_functions_write_non_empty_files(tmp_path):
    model = mlp((8, 6), seed=22)
    analysis = hope_keras.analyze(model)
    result = hope_keras.compress(copy_model(model), density=0.5, verbose=False)
    w = plots.widths(result.trajectory)
    assert [w["fc0"][0], w["fc1"][0]] == [8, 6]
    assert w["fc0"][1] + w["fc1"][1] == result.trajectory.steps[-1].active_after
    for name, draw in (("widths", lambda: plots.plot_widths(result.trajectory)),
                       ("dr", lambda: plots.plot_dr(result.trajectory)),
                       ("hist", lambda: plots.plot_capacity_histogram(analysis)),
                       ("acc", lambda: plots.plot_accuracy_vs_density(
                           {"HOPE": ([1.0, 0.5], [0.9, 0.8])}))):
        ax = draw()
        path = tmp_path / f"{name}.png"
        ax.figure.savefig(path)
        assert path.stat().st_size > 5_000
    assert os.path.getsize(plots.report(result.trajectory, str(tmp_path / "r.png"))) > 10_000


def test_cli_data_for_a_model_of_two_inputs_is_a_npz_named_by_its_inputs(tmp_path, capsys):
    """--data of a model of several inputs: a .npz of one array per input, under the
    inputs' names (the same correction as compress(data=dict)); one array, or an
    .npz missing an input, is refused naming the inputs."""
    keras.utils.set_random_seed(4)
    image, meta = keras.Input((8, 8, 3), name="image"), keras.Input((4,), name="meta")
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3)(image)))
    m = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Dense(6)(meta)))
    z = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(h), m])
    model_file = str(tmp_path / "two.keras")
    keras.Model([image, meta], keras.layers.Dense(3)(z)).save(model_file)
    rng = np.random.default_rng(0)
    named = {"image": rng.normal(size=(40, 8, 8, 3)).astype("float32"),
             "meta": rng.normal(size=(40, 4)).astype("float32")}
    np.savez(tmp_path / "x.npz", **named)
    out = str(tmp_path / "small.keras")
    status, _ = _in_process(capsys, "compress", model_file, "--density", "0.5", "--out", out,
                            "--data", str(tmp_path / "x.npz"), "--quiet")
    assert status == 0
    expected = keras.models.load_model(model_file)
    hope_keras.compress(expected, density=0.5, data=named, verbose=False)
    xs = [named["image"], named["meta"]]
    np.testing.assert_allclose(keras.models.load_model(out)(xs), expected(xs),
                               rtol=1e-5, atol=1e-5)
    np.save(tmp_path / "one.npy", named["image"])
    np.savez(tmp_path / "half.npz", image=named["image"])
    for bad, says in (("one.npy", "holds one array"), ("half.npz", "missing ['meta']")):
        status, printed = run_cli(capsys, "compress", model_file, "--density", "0.5",
                                  "--out", out, "--data", str(tmp_path / bad), "--quiet")
        assert status == 1 and says in printed.err and "['image', 'meta']" in printed.err
