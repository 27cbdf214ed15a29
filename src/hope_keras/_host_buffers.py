"""The one adapter to TensorFlow's host buffers: NumPy views of variables, no copies.

TensorFlow reads a resource variable that lives in host memory without copying it:
the tensor of a read shares the variable's buffer, and ``EagerTensor._numpy()``
(private) wraps that buffer as a NumPy array that keeps it alive. The editor writes
through such views (`hope_keras.edit.editor.VIEW_MIN_BYTES`), and analysis reads through
read-only ones where it copies or reduces what it reads at once: an 8192 × 8192
float32 kernel is 256 MB that `variable.numpy()` would copy first.

Whether a view aliases the variable is checked (two reads share one buffer); where
it does not (a variable in GPU memory, a distributed variable, another backend)
the callers fall back to ``variable.numpy()``. An assignment to the variable gives
it a new buffer (TensorFlow copies on write while a view holds the old one): a view
is a snapshot from then on, which `still_aliased` detects.
"""

from __future__ import annotations

from typing import Optional, Tuple

import keras
import numpy as np


def buffer_view(var, min_bytes: int = 0) -> Optional[Tuple[np.ndarray, object]]:
    """``(view, held)``: a writable NumPy view of Keras variable `var`'s own host
    buffer and the tensor read it came from, when `var` is a plain TensorFlow
    resource variable of at least `min_bytes` in host memory; else None.

    Example:

    >>> import keras, numpy as np
    >>> layer = keras.layers.Dense(3)
    >>> layer.build((None, 2))
    >>> found = buffer_view(layer.kernel)
    >>> found is None or bool(np.array_equal(found[0], layer.kernel.numpy()))
    True
    """
    found = _host_read(var, min_bytes)
    if found is None:
        return None
    view, held, target = found
    try:
        again = target.value()._numpy()
    except Exception:  # noqa: BLE001 - any failure: the copying path
        return None
    if not (view.flags.writeable and np.shares_memory(view, again)):
        return None
    return view, held


def _host_read(var, min_bytes: int = 0):
    """``(array, tensor, variable)`` of one read of a plain TensorFlow resource
    variable of at least `min_bytes` (the array wraps the read's host buffer), else
    None."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    target = getattr(var, "value", None)
    # A plain resource variable: a distributed one's read is one replica's buffer.
    if not isinstance(target, tf.Variable) or type(target).__name__ != "ResourceVariable":
        return None
    if target.shape.num_elements() * target.dtype.size < min_bytes:
        return None
    try:
        held = target.value()
        view = held._numpy()  # no copy: TensorFlow's own host buffer
    except Exception:  # noqa: BLE001 - any failure: the copying path
        return None
    if not (isinstance(view, np.ndarray) and view.shape == tuple(target.shape)):
        return None
    return view, held, target


def still_aliased(var, view: np.ndarray) -> bool:
    """Whether `view` (from `buffer_view`) is still variable `var`'s buffer."""
    try:
        return bool(np.shares_memory(view, var.value.value()._numpy()))
    except Exception:  # noqa: BLE001
        return False


def read_values(var) -> np.ndarray:
    """The values of variable `var` as a NumPy array: a read-only view of a read's
    host buffer (a plain TensorFlow variable), else ``var.numpy()`` (a copy). For reads
    that copy or reduce the values at once: the view changes with the variable
    (the editor writes in place), so it must not be kept.

    Example:

    >>> import keras, numpy as np
    >>> layer = keras.layers.Dense(3)
    >>> layer.build((None, 2))
    >>> values = read_values(layer.kernel)
    >>> bool(np.array_equal(values, layer.kernel.numpy())), values.flags.writeable
    (True, False)
    """
    found = _host_read(var)  # one read: values only, whether or not it aliases
    if found is None:
        arr = np.asarray(var.numpy() if hasattr(var, "numpy") else var)
    else:
        arr = found[0]
    arr = arr.view()  # read-only without touching the caller's array (an ndarray given)
    arr.flags.writeable = False
    return arr
