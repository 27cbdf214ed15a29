"""The command line (usage errors, outputs checked before any work, --help and
--version), trajectory files (replay bounds, out-of-range and unreadable files named
with the file and step), budgets of the wrong type, and the progress bar."""

import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp


# ---------------------------------------------------------------- trajectories
@pytest.fixture(scope="module")
def run():
    model = mlp((8, 6), seed=3)
    original = copy_model(model)
    result = hope_keras.compress(model, steps=5, verbose=False)
    return original, model, result.trajectory


def test_replay_to_density_one_applies_no_step(run):
    original, _, trajectory = run
    model = copy_model(original)
    trajectory.replay(model, density=1.0)  # applied one step before
    for a, b in zip(model.get_weights(), original.get_weights()):
        np.testing.assert_array_equal(a, b)


def _save_with(trajectory, path, **changes):
    trajectory.save(path)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    for key, (index, value) in changes.items():
        arrays[key][index] = value
    np.savez(path, **arrays)
    return path


def test_an_out_of_range_slot_is_a_clear_error_naming_file_and_step(run, tmp_path):
    original, _, trajectory = run
    bad = _save_with(trajectory, str(tmp_path / "slot.npz"), i=(2, 99))
    with pytest.raises(ValueError, match=r"slot\.npz.*step 2 .*i=99 outside \[0, \d+\)"):
        hope_keras.Trajectory.load(bad)  # raised a raw IndexError at replay
    # A trajectory built in memory is checked against the model before any edit.
    steps = list(trajectory.steps)
    steps[3] = steps[3].__class__(**{**steps[3].__dict__, "i": -1})
    broken = hope_keras.Trajectory(trajectory.meta, steps)
    model = copy_model(original)
    with pytest.raises(ValueError, match=r"step 3 .*i=-1 outside"):
        broken.replay(model, step=5)
    for a, b in zip(model.get_weights(), original.get_weights()):
        np.testing.assert_array_equal(a, b)
    unknown = _save_with(trajectory, str(tmp_path / "unit.npz"), unit=(1, "nope"))
    with pytest.raises(ValueError, match=r"step 1 .*names no neuron group"):
        hope_keras.Trajectory.load(unknown)


def test_unreadable_trajectory_files_do_not_mention_pickles(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(np.random.default_rng(0).bytes(500))
    with pytest.raises(ValueError, match="junk.npz.*not an .npz archive") as e:
        hope_keras.Trajectory.load(str(junk))
    assert "pickle" not in str(e.value)
    objects = str(tmp_path / "objects.npz")
    np.savez(objects, meta=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="objects.npz.*Python objects") as e:
        hope_keras.Trajectory.load(objects)
    assert "allow_pickle" not in str(e.value)


# ------------------------------------------------------------------- budgets
@pytest.mark.parametrize("kwargs, match", [
    ({"density": "0.5"}, r"density must be a number in \(0, 1\]. Received: density='0.5'"),
    ({"params": [0.5]}, r"params must be a number.*Received: params=\[0.5\]"),
    ({"density": float("nan")}, r"density must be in \(0, 1\]. Received: density=nan"),
    ({"steps": 2.5}, r"steps must be an integer ≥ 0. Received: steps=2.5"),
])
def test_budgets_of_the_wrong_type_are_clear_errors(kwargs, match):
    model = mlp((5, 4), seed=7)
    with pytest.raises(ValueError, match=match):  # density="0.5" raised a bare TypeError
        hope_keras.compress(model, verbose=False, **kwargs)
    assert hope_keras.compress(model, density=np.float32(0.5), verbose=False).density <= 0.5


# ----------------------------------------------------------------------- CLI
def _cli(*args):
    from hope_keras import cli

    return cli.main(list(args))


def test_cli_replay_density_above_one_is_a_usage_error(run, tmp_path, capsys):
    original, _, trajectory = run
    model_path, traj = str(tmp_path / "m.keras"), str(tmp_path / "t.npz")
    original.save(model_path)
    trajectory.save(traj)
    out = tmp_path / "r.keras"
    with pytest.raises(SystemExit) as e:  # exited 0 and wrote a file
        _cli("replay", model_path, traj, "--density", "1.5", "--out", str(out))
    assert e.value.code == 2 and not out.exists()
    assert "--density: must be a number in (0, 1], got '1.5'" in capsys.readouterr().err
    bad = _save_with(trajectory, str(tmp_path / "bad.npz"), j=(0, 1000))
    assert _cli("replay", model_path, bad, "--step", "3", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "bad.npz" in err and "step 0" in err and "Traceback" not in err


def test_cli_corrupt_model_file_is_not_reported_as_missing(tmp_path, capsys):
    bad = tmp_path / "corrupt.keras"
    bad.write_bytes(np.random.default_rng(1).bytes(2000))
    assert _cli("analyze", str(bad)) == 1
    err = capsys.readouterr().err
    assert "corrupt.keras" in err and "not a Keras model file" in err
    assert "not found" not in err.lower()


def test_cli_checks_output_paths_before_any_work(tmp_path, monkeypatch, capsys):
    import hope_keras.search.encoder

    def no_run(*args, **kwargs):
        raise AssertionError("compress ran before the output paths were checked")

    monkeypatch.setattr(hope_keras.search.encoder, "compress", no_run)
    model = str(tmp_path / "m.keras")
    mlp((5, 4)).save(model)
    for out, message in ((str(tmp_path / "no" / "such" / "dir" / "s.keras"), "does not exist"),
                         (str(tmp_path / "slim.h5"), "must end with .keras"),
                         (str(tmp_path), "must end with .keras")):
        with pytest.raises(SystemExit) as e:
            _cli("compress", model, "--density", "0.5", "--out", out)
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("compress", model, "--density", "0.5", "--out", str(tmp_path / "s.keras"),
             "--trajectory", str(tmp_path / "missing" / "t.npz"))
    with pytest.raises(SystemExit):
        _cli("compress", model, "--density", "0.5", "--out", str(tmp_path / "s.keras"),
             "--actions", "prune,shrink")


def test_cli_help_version_and_every_option_documented(capsys):
    from hope_keras import __version__, cli

    with pytest.raises(SystemExit) as e:
        _cli("--version")
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hope-keras {__version__}"
    parser = cli._parser()
    for name, sub in parser.commands.items():
        for action in sub._actions:
            assert action.help, (name, action.dest)


def test_cli_help_imports_no_tensorflow():
    """`--help` took 4 s importing TensorFlow. (That a run's stderr has no TensorFlow
    start-up lines is checked by test_cli_plots.py's subprocess run.)"""
    import subprocess
    import sys

    code = ("import sys\nfrom hope_keras import cli\ntry:\n    cli.main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('tensorflow' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("False"), r.stderr


# ------------------------------------------------------------------ progress
def test_progress_bar_counts_the_planned_work_shows_current_values_and_ends_its_line(capsys):
    model = mlp((12, 10), seed=4)
    result = hope_keras.compress(model, density=0.5, verbose=True)
    out = capsys.readouterr().out
    assert out.endswith("\n")
    last = out.replace("\r", "\n").strip().splitlines()[-1]
    assert "11/11" in last  # 22 neurons → 11 to remove; it showed steps/neurons
    assert f"density: {result.density:.4f}" in last  # not Progbar's running average
    assert f"params: {result.params_ratio:.4f}" in last
    hope_keras.compress(mlp((12, 10), seed=4), steps=3, verbose=True)
    assert "3/3" in capsys.readouterr().out.replace("\r", "\n").strip().splitlines()[-1]


def test_progress_is_silent_when_stdout_is_not_a_terminal(capsys):
    hope_keras.compress(mlp((12, 10), seed=4), density=0.5)  # verbose="auto"
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="verbose must be True, False or 'auto'"):
        hope_keras.compress(mlp((12, 10), seed=4), density=0.5, verbose="loud")
