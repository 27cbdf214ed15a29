"""Walk the graph: what a Keras model is made of, as HOPE sees it.

* `adapter`: the one place that touches Keras internals (nodes, weights as NumPy
  views, nested models).
* `layers`: the layer registry: what each layer type does to channels (producer,
  normalisation, activation, channelwise, residual merge, reshaping) and its
  parameter and FLOPs formulas. Every pattern question is asked of it.
* `operation_rules`: the same for Keras operation nodes (``x + 3.0``,
  ``keras.ops.relu``, ``keras.ops.mean`` over spatial axes).
* `walker`: `walk` finds every channel group (producer, BatchNorm, consumers,
  couplings) and every residual block.
* `tracing`: subclassed models traced into equivalent Functional ones.
"""

from hope_keras.graph import operation_rules  # noqa: E402,F401 - registers its rules
