"""Bad input found by probing the public API (stop 32): each test failed before its fix.

The standard: a clear error that names what was received and what to do, and the
user's models untouched.
"""

import numpy as np
import pytest

import hope_keras
from conftest import copy_model, mlp
from hope_keras import baselines


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
        hope_keras.compress(second, density=0.5, analysis=analysis, verbose=False)
    with pytest.raises(ValueError, match="another model object"):
        baselines.prune(second, 0.5, analysis=analysis)
    _assert_untouched(first, w1)
    _assert_untouched(second, w2)


def test_a_stale_analysis_is_refused():
    model = mlp(seed=2)
    analysis = hope_keras.analyze(model, verbose=False)
    hope_keras.compress(model, density=0.7, analysis=analysis, verbose=False)  # fresh: fine
    before = _weights(model)
    with pytest.raises(ValueError, match="changed since this analysis.*stale"):
        hope_keras.compress(model, density=0.5, analysis=analysis, verbose=False)
    _assert_untouched(model, before)
    # A copy with the same weights is another object: analyze it.
    with pytest.raises(ValueError, match="another model object"):
        hope_keras.compress(copy_model(model), density=0.5, analysis=analysis,
                            verbose=False)


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
