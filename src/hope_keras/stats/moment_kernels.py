"""Per-channel mean and variance of an activation in one read, compiled with numba.

The statistics corrections measure every BatchNormalization's input on a sample.
The backend's float32 reductions (the mean, then the centred squares) pass over each
tensor four times and write temporaries as large as it. These kernels read the
tensor once, in place, and accumulate in float64 around a per-channel shift (the
first row's value), so the variance ``Σ(x − s)²/n − (Σ(x − s)/n)²`` loses no digits
that matter.

Compiled functions are cached on disk where numba can (`hope_keras._jit`).
"""

from __future__ import annotations

import numba
import numpy as np

from hope_keras._jit import jit_options

__all__ = ["channel_moments"]

_JIT = jit_options(__file__)


@numba.njit(**_JIT)
def _moments_last(x):
    """(rows, channels), channels last: the inner loop runs over the channels."""
    rows, channels = x.shape
    shift = np.empty(channels)
    for c in range(channels):
        shift[c] = x[0, c]
    s1 = np.zeros(channels)
    s2 = np.zeros(channels)
    for r in range(rows):
        for c in range(channels):
            d = np.float64(x[r, c]) - shift[c]
            s1[c] += d
            s2[c] += d * d
    mean = s1 / rows
    var = np.maximum(s2 / rows - mean * mean, 0.0)
    return shift + mean, var


@numba.njit(**_JIT)
def _moments_inner(x):
    """(outer, channels, inner): channels first (the inner loop runs over positions)."""
    outer, channels, inner = x.shape
    shift = np.empty(channels)
    for c in range(channels):
        shift[c] = x[0, c, 0]
    s1 = np.zeros(channels)
    s2 = np.zeros(channels)
    for o in range(outer):
        for c in range(channels):
            sc = shift[c]
            a = 0.0
            b = 0.0
            for k in range(inner):
                d = np.float64(x[o, c, k]) - sc
                a += d
                b += d * d
            s1[c] += a
            s2[c] += b
    n = outer * inner
    mean = s1 / n
    var = np.maximum(s2 / n - mean * mean, 0.0)
    return shift + mean, var


def channel_moments(x: np.ndarray, axis: int = -1):
    """Mean and (biased) variance of every slice of `x` along `axis`, as float64.

    Args:
        x: An array; read as float32.
        axis: The channel axis.

    Returns:
        ``(mean, variance)``, each of shape ``(x.shape[axis],)``. A channel holding
        a NaN or an infinity gets NaN.

    Example:
        >>> import numpy as np
        >>> from hope_keras.stats.moment_kernels import channel_moments
        >>> x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
        >>> mean, var = channel_moments(x, axis=-1)
        >>> mean.tolist(), np.round(var, 6).tolist()
        ([5.0, 6.0], [11.666667, 11.666667])
    """
    # One type compiled: float32 (what the backends' reductions used too), read-only
    # (a tensor's shared buffer is).
    x = np.ascontiguousarray(x, dtype=np.float32).view()
    x.flags.writeable = False
    axis = axis % x.ndim
    shape = x.shape
    if x.size == 0:
        raise ValueError(f"channel_moments needs at least one value per channel. "
                         f"Received an array of shape {shape}.")
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    if inner == 1:
        return _moments_last(x.reshape(outer, shape[axis]))
    return _moments_inner(x.reshape(outer, shape[axis], inner))
