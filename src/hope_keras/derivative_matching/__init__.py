"""Derivative matching: data-free, width-independent compression of analytic MLPs.

The second compressor of ``hope_keras`` (see ``docs/derivative_matching.md``):
for Dense stacks with real-analytic hidden activations (sigmoid, tanh, GELU,
softplus, SiLU) and a low input dimension, keep at most ``D_k = C(d_in + k, d_in)``
neurons per hidden layer so that all input derivatives of the network at a center
up to order ``k`` are unchanged.

Example:

```python
import keras
from hope_keras import derivative_matching as dm
keras.utils.set_random_seed(0)
teacher = keras.Sequential([keras.Input((2,)),
                            keras.layers.Dense(512, activation="sigmoid"),
                            keras.layers.Dense(512, activation="sigmoid"),
                            keras.layers.Dense(1)])
student, report = dm.compress_mlp(teacher, order=6, radius=1.0)
print(report)
print(dm.sup_error(teacher, student, radius=1.0))
```
"""

from hope_keras.derivative_matching.activations import (
    AnalyticActivation,
    gelu_approximate,
    get_analytic_activation,
    polynomial_activation,
    register_activation,
    taylor_coefficients,
)
from hope_keras.derivative_matching.compress import (
    CompressionReport,
    LayerReport,
    compress_mlp,
    derivative_features,
    sample_ball,
    sup_error,
)
from hope_keras.derivative_matching.jets import (
    estimate_memory,
    hidden_jets,
    multi_indices,
    num_features,
)
from hope_keras.derivative_matching.maxvol import ColumnSelection, maxvol_columns

__all__ = [
    "AnalyticActivation",
    "ColumnSelection",
    "CompressionReport",
    "LayerReport",
    "compress_mlp",
    "derivative_features",
    "estimate_memory",
    "gelu_approximate",
    "get_analytic_activation",
    "hidden_jets",
    "maxvol_columns",
    "multi_indices",
    "num_features",
    "polynomial_activation",
    "register_activation",
    "sample_ball",
    "sup_error",
    "taylor_coefficients",
]
