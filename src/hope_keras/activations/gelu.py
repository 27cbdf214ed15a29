"""GELU as the backend computes it: its constants and the tanh approximation.

HOPE's Gaussian moments (`hope_keras.activations.registry`) and derivative
matching's Taylor expansions (`hope_keras.derivative_matching`) both evaluate GELU;
they match the backend's own float32 constants to agree with the Keras forward pass
to 1e-15 in float64.
"""

from __future__ import annotations

import math

import keras
import numpy as np


def _gelu_erf_scale() -> float:
    """``s`` in ``gelu(x) = x Φ(s x)`` as the backend computes it.

    TensorFlow's ``tf.nn.gelu(approximate=False)`` (used by Keras'
    ``"gelu"``) multiplies by ``1/√2`` cast from a *float32* constant, even for
    float64 tensors, so it evaluates ``x Φ(s x)`` with ``s = √2 · fl32(1/√2)``
    (``s − 1 ≈ 1.7e-8``). Matching that makes float64 models match to 1e-15.
    """
    if keras.backend.backend() == "tensorflow":
        return math.sqrt(2.0) * float(np.float32(0.7071067811865476))
    return 1.0


GELU_S = _gelu_erf_scale()


GELU_C = math.sqrt(2.0 / math.pi)
# tf.nn.gelu(approximate=True) casts 0.044715 from a float32 constant (also for float64).
GELU_A = float(np.float32(0.044715)) if keras.backend.backend() == "tensorflow" else 0.044715


@keras.saving.register_keras_serializable(package="hope_keras")
def gelu_approximate(x):
    """The tanh approximation of GELU, as a named Keras activation.

    ``keras.activations.gelu`` (what ``activation="gelu"`` gives) is the exact
    erf form. Use this function as ``activation=gelu_approximate`` for the tanh
    form; derivative matching recognises it and expands it exactly.

    Args:
        x: Input tensor.

    Returns:
        ``0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))``.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import gelu_approximate
    layer = keras.layers.Dense(8, activation=gelu_approximate)
    ```
    """
    return keras.activations.gelu(x, approximate=True)

