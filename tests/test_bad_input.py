"""Bad input to the public API (models, analyses, data, budgets, files, CLI arguments).

The standard: a clear error that names what was received and what to do, and the
user's models untouched.
"""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp
from hope_keras.search import baselines
from hope_keras.search.encoder import Encoder


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _assert_untouched(model, before):
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_an_analysis_of_another_model_is_refused_and_neither_model_is_edited():
    first, second = mlp(seed=0), mlp(seed=1)
    analysis = hope_keras.analyze(first, verbose=False)
    w1, w2 = _weights(first), _weights(second)
    with pytest.raises(ValueError, match="another model object.*Nothing was changed"):
        hope_keras.Encoder(second, analysis=analysis, verbose=False).compress(density=0.5)
    with pytest.raises(ValueError, match="another model object"):
        baselines.prune(second, 0.5, analysis=analysis)
    _assert_untouched(first, w1)
    _assert_untouched(second, w2)


def test_a_stale_analysis_is_refused():
    model = mlp(seed=2)
    analysis = hope_keras.analyze(model, verbose=False)
    hope_keras.Encoder(model, analysis=analysis, verbose=False).compress(density=0.7)  # fresh: fine
    before = _weights(model)
    with pytest.raises(ValueError, match="changed since this analysis.*stale"):
        hope_keras.Encoder(model, analysis=analysis, verbose=False).compress(density=0.5)
    _assert_untouched(model, before)
    # A copy with the same weights is another object: analyze it.
    with pytest.raises(ValueError, match="another model object"):
        hope_keras.Encoder(copy_model(model), analysis=analysis, verbose=False).compress(density=0.5)


@pytest.mark.parametrize("where", ["fc0/kernel", "fc1_bn/gamma", "head/kernel"])
def test_compress_refuses_nan_weights_anywhere_before_editing(where):
    model = mlp(seed=3)
    var = next(v for v in model.weights if v.path == where)
    value = var.numpy()
    value.flat[1] = np.nan
    var.assign(value)
    before = _weights(model)
    with pytest.raises(ValueError, match=f"NaN/Inf weights: {where} \\(1 NaN/Inf\\).*"
                                         "Nothing was changed"):
        hope_keras.compress(model, density=0.5, verbose=False)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)  # NaN compares equal here


def _nan_data(n=64, d=6, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, d)).astype("float32")
    x[3, 2] = np.nan
    return x


def test_nan_data_is_refused_before_the_bn_statistics_are_written():
    model = mlp(seed=4)
    before = _weights(model)
    with pytest.raises(ValueError, match="not finite.*NaN/Inf.*Nothing was changed"):
        hope_keras.reestimate_batchnorm_statistics(model, _nan_data())
    _assert_untouched(model, before)


def test_recover_refuses_nan_inputs_and_labels_out_of_range_before_any_change():
    model, teacher = mlp(seed=5), mlp(seed=5)
    before = _weights(model)
    with pytest.raises(ValueError, match="1 NaN/Inf value.*Nothing was changed"):
        hope_keras.recover(model, _nan_data(), teacher=teacher, verbose=0)
    x = np.nan_to_num(_nan_data())
    with pytest.raises(ValueError, match=r"integer classes in \[0, 3\).*from 7 to 7"):
        hope_keras.recover(model, (x, np.full(64, 7)), teacher=teacher, verbose=0)
    _assert_untouched(model, before)


def test_calibrate_refuses_nan_data_and_a_zero_batch_size():
    import keras

    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="fc")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    with pytest.raises(ValueError, match="fc are not finite.*NaN/Inf"):
        hope_keras.calibrate(model, _nan_data())
    with pytest.raises(ValueError, match="batch_size must be a positive integer.*0"):
        hope_keras.calibrate(model, np.nan_to_num(_nan_data()), batch_size=0)


@pytest.mark.parametrize("build", [lambda: mlp((20, 16), seed=1),
                                   lambda: __import__("conftest").small_resnet(seed=2)])
def test_compressing_a_compressed_model_counts_from_its_live_channels(build):
    """The channels (and evicted blocks) an earlier run removed start removed: a budget
    the model already meets is refused, and the reported ratios are `slim`'s."""
    model = build()
    dense = model.count_params()
    first = hope_keras.compress(model, density=0.5, verbose=False)
    before = _weights(model)
    with pytest.raises(ValueError, match=r"already met.*density 0\.5000\)\. Nothing"):
        hope_keras.compress(model, density=0.7, verbose=False)
    with pytest.raises(ValueError, match="already met"):
        hope_keras.compress(model, params=first.params_ratio + 0.05, verbose=False)
    _assert_untouched(model, before)
    second = hope_keras.compress(model, density=0.3, verbose=False)
    assert second.density <= 0.3
    assert second.params_ratio == pytest.approx(hope_keras.slim(model).count_params() / dense)
    assert len(second.trajectory) < len(first.trajectory)  # no step re-removes a channel


def test_cli_refuses_outputs_that_would_overwrite_the_input_or_each_other(tmp_path, capsys):
    from hope_keras import cli

    model = str(tmp_path / "m.keras")
    mlp((5, 4)).save(model)
    before = open(model, "rb").read()
    out = str(tmp_path / "s.keras")
    for argv, message in (
            (["compress", model, "--density", "0.5", "--out", model], "is the input model"),
            (["compress", model, "--density", "0.5", "--out", out, "--trajectory", out],
             "--trajectory must end with .npz"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert open(model, "rb").read() == before


def test_a_path_or_none_instead_of_a_model_says_so():
    with pytest.raises(ValueError, match="needs a keras.Model.*Received: str.*load_model"):
        hope_keras.analyze("/tmp/model.keras")
    with pytest.raises(ValueError, match="needs a keras.Model.*NoneType"):
        hope_keras.slim(None)
    with pytest.raises(ValueError, match="model must be a keras.Model.*model=None"):
        hope_keras.profile(None)


def test_corrupt_trajectory_metadata_and_fields_name_the_file(tmp_path):
    import json

    model = mlp(seed=6)
    result = hope_keras.compress(model, density=0.5, verbose=False)
    good = str(tmp_path / "good.npz")
    result.trajectory.save(good)
    with np.load(good) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    merge = int(np.flatnonzero(arrays["kind"] == "merge")[0])

    def variant(name, **changes):
        path = str(tmp_path / f"{name}.npz")
        np.savez(path, **{**arrays, **changes})
        return path

    coef = arrays["coef"].copy()
    coef[merge] = 1e300
    active = arrays["active_after"].astype(np.float64)
    active[1] = np.nan
    frac = arrays["i"].astype(np.float64)
    frac[0] += 0.5
    cases = {
        variant("nanactive", active_after=active): "'active_after' holds values that are "
                                                   "not whole numbers \\(step 1: nan\\)",
        variant("fraci", i=frac): "'i' holds values that are not whole numbers \\(step 0",
        variant("metalist", meta=np.array(json.dumps([1, 2]))): "metadata is a list",
        variant("nofp", meta=np.array(json.dumps({k: v for k, v in meta.items()
                                                  if k != "fingerprint"}))):
            "fingerprint / options metadata",
        variant("kind2d", kind=arrays["kind"][:, None]): "field shapes",
        variant("jstr", J=np.array(["x"] * len(arrays["J"]))): "field 'J' holds",
        variant("coefbig", coef=coef): "overflowing parent coefficients",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            hope_keras.Trajectory.load(path)
        assert path in str(e.value)
    # Metadata without the model's name loads; a mismatch then still says what to do.
    unnamed = hope_keras.Trajectory.load(variant("noname", meta=np.array(json.dumps(
        {k: v for k, v in meta.items() if k != "model_name"}))))
    with pytest.raises(ValueError, match="recorded on model '\\?' with other weights"):
        unnamed.replay(mlp(seed=99), step=1)


@pytest.mark.parametrize("value", ["0.5", True, 1.5, float("nan")])
def test_replay_checks_its_budget_as_compress_does(value):
    model = mlp(seed=7)
    original = copy_model(model)
    trajectory = hope_keras.compress(model, density=0.5, verbose=False).trajectory
    before = _weights(original)
    with pytest.raises(ValueError, match="density must be"):
        trajectory.replay(original, density=value)
    _assert_untouched(original, before)


def test_recover_auto_verbosity_stays_quiet_when_output_is_not_a_terminal(capsys):
    model, teacher = mlp(seed=8), mlp(seed=8)
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    hope_keras.recover(model, x, teacher=teacher, epochs=1, batch_size=16)
    assert capsys.readouterr().out == ""
    hope_keras.recover(model, x, teacher=teacher, epochs=1, batch_size=16, verbose=1)
    assert "2/2" in capsys.readouterr().out  # a bar when asked for


def test_slim_copies_a_lambda_layer_of_the_model_in_memory():
    import keras

    L = keras.layers
    inputs = keras.Input((8,))
    x = L.ReLU()(L.BatchNormalization()(L.Dense(6, name="fc0")(inputs)))
    x = L.ReLU()(L.BatchNormalization()(L.Dense(6, name="fc1")(x)))  # pinned: → Lambda
    x = L.Lambda(lambda t: t * 2.0)(x)
    model = keras.Model(inputs, L.Dense(2)(x))
    hope_keras.compress(model, density=0.5, verbose=False)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_allclose(np.asarray(hope_keras.slim(model)(x)), np.asarray(model(x)),
                               atol=1e-5)


def test_a_channels_first_convolution_is_listed_as_pinned():
    import keras

    L = keras.layers
    inputs = keras.Input((3, 16, 16))
    x = L.Conv2D(8, 3, data_format="channels_first", name="c1")(inputs)
    x = L.ReLU()(L.BatchNormalization(axis=1)(x))
    model = keras.Model(inputs, L.Dense(2, name="head")(L.Flatten()(x)))
    pinned = {p.layer: p.reason for p in hope_keras.analyze(model, verbose=False).pinned}
    assert "channels_first" in pinned["c1"]


def test_cli_report_with_a_model_it_does_not_fit_writes_nothing(tmp_path, capsys):
    from hope_keras import cli  # the report needs matplotlib: a test dependency

    model = mlp(seed=9)
    trajectory = str(tmp_path / "run.npz")
    hope_keras.compress(copy_model(model), density=0.5, verbose=False).trajectory.save(
        trajectory)
    other = str(tmp_path / "other.keras")
    mlp(seed=10).save(other)
    out = tmp_path / "report.png"
    assert cli.main(["report", trajectory, "--out", str(out), "--model", other]) == 1
    assert "fingerprint" in capsys.readouterr().err and not out.exists()


def test_compress_refuses_a_negative_moving_variance_before_editing():
    model = mlp(seed=11)
    var = model.get_layer("fc0_bn").moving_variance
    value = var.numpy()
    value[0] = -1.0
    var.assign(value)
    before = _weights(model)
    with pytest.raises(ValueError, match="'fc0_bn' has a negative moving variance.*"
                                         "reestimate_batchnorm_statistics.*Nothing"):
        hope_keras.compress(model, density=0.5, verbose=False)
    _assert_untouched(model, before)


def test_recover_explains_a_list_of_examples():
    model, teacher = mlp(seed=12), mlp(seed=12)
    images = [np.zeros(6, "float32") for _ in range(5)]
    with pytest.raises(ValueError, match="list of 5 arrays.*has 1.*np.stack"):
        hope_keras.recover(model, images, teacher=teacher, verbose=0)


def test_deft_and_export_arguments_found_by_the_probe(tmp_path):
    import keras

    from hope_keras import deft
    from hope_keras.derivative_matching import sup_error

    model = mlp(seed=13)
    with pytest.raises(ValueError, match="'fc0' is not a head"):
        deft.plan(model, head="fc0")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        deft.ElasticOptimizer(keras.optimizers.SGD(0.1), elasticity={"fc0": -1.0})
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(0.1), elasticity={"fc0_typo": 0.0})
    with pytest.raises(ValueError, match=r"\['fc0_typo'\] match no variable"):
        opt.build(model.trainable_variables)
    with pytest.raises(ValueError, match="path must end with .tflite"):
        hope_keras.export_tflite(model, str(tmp_path / "small.keras"))
    path = tmp_path / "SMALL.TFLITE"
    hope_keras.export_tflite(model, str(path))
    assert hope_keras.profile(str(path), latency=False).size_bytes == path.stat().st_size
    tanh = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="radius must be a positive number"):
        sup_error(tanh, tanh, radius=-1.0)


def test_deft_trainer_refuses_source_data_it_cannot_score_before_training():
    """`source_val` without a retention scored NaN silently (a probe found it)."""
    import keras

    from hope_keras import deft

    model = mlp(seed=14)
    trainer = deft.Trainer(model, keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(8,) + model.input_shape[1:]).astype("float32")
    y = np.zeros(8, dtype="int64")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="retention=None"):
        trainer.fit((x, y), epochs=1, source_val=(x, y))
    with pytest.raises(ValueError, match="retention=None"):
        trainer.evaluate(source_val=(x, y))
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_analyze_pins_a_sketched_group_with_nan_weights_naming_layer_and_count(monkeypatch):
    from hope_keras.scoring import cache as cache_lib

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 8)  # every group of the mlp sketched
    model = mlp(seed=6)
    var = model.get_layer("fc0").kernel
    value = var.numpy()
    value.flat[[1, 5]] = (np.nan, np.inf)
    var.assign(value)
    analysis = hope_keras.analyze(model)
    reasons = {p.layer: p.reason for p in analysis.pinned}
    assert "fc0" in reasons and "fc0" not in {g.name for g in analysis.groups}
    assert "Layer 'fc0' has 2 NaN/Inf value(s) in its kernel" in reasons["fc0"]
    assert any(isinstance(c, cache_lib.SketchCache) for c in analysis.caches.values())


def test_a_flops_budget_on_unknown_spatial_dimensions_is_refused_untouched():
    """FLOPs of a convolution need its output's height and width: with an input of
    unknown size, a FLOPs budget would count every convolution as 1 × 1 and rank
    (and stop) by that. Refused before any edit, as `profile` refuses; density and
    parameter budgets do not need it."""
    inputs = keras.Input((None, None, 3))
    x = keras.layers.Conv2D(8, 3, name="conv")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    before = _weights(model)
    with pytest.raises(ValueError, match="'conv' .*unknown output dimension.*fixed input"):
        hope_keras.compress(model, flops=0.5, verbose=False)
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="unknown output dimension"):
        Encoder(model).run(flops=0.5)
    hope_keras.compress(model, density=0.5, verbose=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(density=2), "density must be in \\(0, 1\\]. Received: density=2"),
    (dict(density="0.5"), "density must be a number .* Received: density='0.5'"),
    (dict(params=float("nan")), "params must be in \\(0, 1\\]"),
    (dict(flops=0), "flops must be in \\(0, 1\\]"),
    (dict(steps=-1), "steps must be an integer ≥ 0. Received: steps=-1"),
    (dict(steps=2.5), "steps=2.5"),
])
def test_encoder_run_checks_its_budgets_as_compress_does(kwargs, message):
    model = mlp(seed=9)
    before = _weights(model)
    enc = Encoder(model)
    with pytest.raises(ValueError, match=message):
        enc.run(verbose=False, **kwargs)
    _assert_untouched(model, before)
    assert len(enc.trajectory) == 0


def test_batchnorm_reestimation_refuses_bad_data_untouched():
    """Wrong input shape (named, not a traced function's traceback), a batch size of
    0, and a single sample (every Dense BN's variance would become 0)."""
    model = mlp(seed=10)
    before = _weights(model)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    with pytest.raises(ValueError, match="batches have shape \\(64, 7\\).*\\(None, 6\\)"):
        hope_keras.reestimate_batchnorm_statistics(model, np.zeros((64, 7), "float32"))
    with pytest.raises(ValueError, match="batch_size=0"):
        hope_keras.reestimate_batchnorm_statistics(model, x, batch_size=0)
    with pytest.raises(ValueError, match="one value per channel \\(1 sample"):
        hope_keras.reestimate_batchnorm_statistics(model, x[:1])
    _assert_untouched(model, before)
    hope_keras.reestimate_batchnorm_statistics(model, x)  # the good data goes through


def test_wrong_types_are_named():
    model = mlp(seed=11)
    before = _weights(model)
    with pytest.raises(TypeError, match="analysis must be a hope_keras.Analysis.*'x' of "
                                        "type str"):
        hope_keras.Encoder(model, analysis="x", verbose=False).compress(density=0.5)
    with pytest.raises(TypeError, match="correct_statistics needs .*None of type NoneType"):
        hope_keras.correct_statistics(model, None)
    with pytest.raises(TypeError, match="file path .*Received: None"):
        hope_keras.Trajectory.load(None)
    _assert_untouched(model, before)
