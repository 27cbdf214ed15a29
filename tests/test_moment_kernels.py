"""The compiled per-channel moments (`hope_keras.stats.moment_kernels`) against a
float64 NumPy reference, and `batch_moments` (what the statistics corrections
measure) on CPU tensors, arrays and the backend's fallback alike."""

import keras
import numpy as np
import pytest

from hope_keras.stats import synthetic
from hope_keras.stats.moment_kernels import channel_moments


def _reference(x, axis):
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1).reshape(-1, x.shape[axis])
    return x.mean(axis=0), x.var(axis=0)


@pytest.mark.parametrize("shape, axis", [((5, 7, 7, 16), -1), ((3, 16, 6, 5), 1),
                                         ((40, 3), -1), ((2, 3, 4), 0), ((1, 1, 9), -1)])
def test_channel_moments_match_float64(shape, axis):
    rng = np.random.default_rng(0)
    # A large offset against a small spread: a one-pass formula without the shift
    # would lose the variance's digits.
    x = (1000.0 + rng.normal(size=shape) * rng.uniform(0.01, 3.0, size=shape)).astype(np.float32)
    mean, var = channel_moments(x, axis=axis)
    ref_mean, ref_var = _reference(x, axis)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(var, ref_var, rtol=1e-7, atol=1e-9)
    assert mean.dtype == var.dtype == np.float64


def test_channel_moments_of_a_constant_channel_and_of_non_finite_values():
    x = np.ones((6, 3), np.float32)
    x[:, 1] = np.arange(6)
    x[2, 2] = np.nan
    mean, var = channel_moments(x)
    assert var[0] == 0.0 and mean[0] == 1.0
    np.testing.assert_allclose([mean[1], var[1]], [2.5, np.var(np.arange(6))])
    assert np.isnan(mean[2]) and np.isnan(var[2])
    y = np.ones((4, 2), np.float32)
    y[1, 0] = np.inf
    assert np.isnan(channel_moments(y)[1][0])


def test_channel_moments_reads_other_dtypes_and_refuses_an_empty_array():
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    np.testing.assert_allclose(channel_moments(x)[0], x.mean(axis=0))
    np.testing.assert_allclose(channel_moments(x.astype(np.int32))[1], x.var(axis=0))
    with pytest.raises(ValueError, match=r"shape \(0, 3\)"):
        channel_moments(np.zeros((0, 3), np.float32))


def test_batch_moments_reads_cpu_tensors_in_place_and_equals_the_backend_reduction():
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 0.5, size=(4, 5, 5, 8)).astype(np.float32)
    bn = keras.layers.BatchNormalization()
    tensor = keras.ops.convert_to_tensor(x)
    assert np.shares_memory(synthetic._host_view(tensor), synthetic._host_view(tensor))
    for value in (tensor, x):
        mean, var = synthetic.batch_moments(value, bn)
        ref_mean, ref_var = _reference(x, -1)
        np.testing.assert_allclose(mean, ref_mean, rtol=1e-7)
        np.testing.assert_allclose(var, ref_var, rtol=1e-6)
    # Channels first (axis 1), and a BN over two axes (the backend's reduction).
    bn1 = keras.layers.BatchNormalization(axis=1)
    np.testing.assert_allclose(synthetic.batch_moments(tensor, bn1)[1], _reference(x, 1)[1],
                               rtol=1e-6)
    # A tensor not in host memory (an accelerator's): the backend's reduction.
    fallback = pytest.MonkeyPatch()
    with fallback.context() as m:
        m.setattr(synthetic, "_host_view", lambda value: None)
        mean2, var2 = synthetic.batch_moments(tensor, bn1)
    np.testing.assert_allclose(mean2, _reference(x, 1)[0], rtol=1e-6)
    np.testing.assert_allclose(var2, _reference(x, 1)[1], rtol=1e-5)
