"""Tracing a subclassed `keras.Model` into an equivalent Functional model.

A subclassed model has no static graph: its `call` is Python. When that `call` is
made only of Keras layers and `keras.ops` calls, running it once on a symbolic
`keras.Input` records every layer call and every operation as a node, which is
exactly a Functional model. The Functional model made here calls **the same layer
objects**, so it shares the user's weights: `hope_keras.compress` edits the traced
graph's layers in place, and those edits land in the user's model.

What cannot be traced is refused, naming the first operation that failed: a
TensorFlow function (``tf.nn.relu(x)``, ``tf.concat``) applied to a symbolic tensor,
Python control flow on a tensor's value (``if ops.mean(x) > 0``), or a `call` whose
result depends on something besides its layers (checked by running both on the same
random batch). docs/quickstart.md ("Models from elsewhere") shows how to rebuild
such a model as a Functional one from the same layers.

Example:

>>> import keras, numpy as np
>>> from hope_keras.graph.tracing import traced
>>> class Net(keras.Model):
...     def __init__(self):
...         super().__init__()
...         self.body = keras.Sequential([keras.layers.Dense(8),
...                                       keras.layers.BatchNormalization()])
...         self.head = keras.layers.Dense(2)
...     def call(self, x):
...         return self.head(keras.ops.relu(self.body(x)))
>>> net = Net()
>>> _ = net(np.zeros((1, 4), "float32"))
>>> functional = traced(net)
>>> functional.layers[-1] is net.head
True
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
import weakref
from typing import Optional

import keras
import numpy as np
from hope_keras.graph import adapter as kg

__all__ = ["traced", "is_subclassed", "input_shape_of", "TracingError"]

# One traced graph per model: every trace adds a node to each layer it calls, so
# tracing again would make the layers look shared.
_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class TracingError(ValueError):
    """A subclassed model's `call` could not be traced into a Functional model."""


def is_subclassed(model) -> bool:
    """Whether `model` is a `keras.Model` that is neither Functional nor Sequential."""
    return kg.is_subclassed(model)


def input_shape_of(model) -> Optional[tuple]:
    """The input shape (batch axis included) `model` was built or called with, or None."""
    shapes = kg.build_shapes(model)
    if len(shapes) == 1:
        shape = next(iter(shapes.values()))
        if isinstance(shape, (tuple, list)) and all(
                d is None or isinstance(d, int) for d in shape):
            return (None,) + tuple(shape[1:])  # a first call's batch size is no constraint
    return None


_OWN_DIRS = (os.path.dirname(keras.__file__), os.path.dirname(os.path.abspath(__file__)))


def _first_user_frame(tb, call_code):
    """The innermost frame of the traceback inside the model's `call` (or, if none,
    outside Keras and this package): where the user's code did what failed."""
    frames = traceback.extract_tb(tb)
    in_call = [f for f in frames if call_code is not None
               and f.filename == call_code.co_filename and f.name == call_code.co_name]
    if in_call:
        return in_call[-1]
    outside = [f for f in frames if not f.filename.startswith(_OWN_DIRS)]
    return outside[-1] if outside else (frames[-1] if frames else None)


def _failed_operation(error, tb, call_code) -> str:
    frame = _first_user_frame(tb, call_code)
    # The function the user's line called: the frame just inside it.
    frames = traceback.extract_tb(tb)
    callee = None
    if frame is not None:
        for i, f in enumerate(frames):
            if f is frame and i + 1 < len(frames):
                callee = frames[i + 1]
    where = ""
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f"`{line}` ({os.path.basename(frame.filename)}, line {frame.lineno})"
    called = ""
    if callee is not None and not callee.filename.startswith(_OWN_DIRS[0]):
        module = callee.filename.split("site-packages" + os.sep)[-1]
        called = f", which calls {callee.name} in {module}"
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    message = message.split(". ")[0].rstrip(".")  # its first sentence
    return f"{where}{called}: {type(error).__name__}: {message[:300]}"


def traced(model, input_shape: Optional[tuple] = None):
    """An equivalent Functional model of a subclassed `model`, built from its own layers.

    Functional and Sequential models are returned unchanged.

    Args:
        model: A `keras.Model`. A subclassed one must be built (called once, or
            `build(input_shape)`), or `input_shape` given.
        input_shape: The input shape with the batch axis, e.g. ``(None, 64, 64, 3)``
            (default: the shape the model was built with).

    Returns:
        A Functional `keras.Model` whose layers are the model's own layer objects
        (weights shared), with the model's outputs (a dict or a list as `call`
        returns them). Traced once per model and then reused.

    Raises:
        TracingError: naming the first operation of `call` that cannot be traced
            (a TensorFlow function or Python control flow on a symbolic tensor), or
            when the traced graph does not reproduce the model's outputs.

    Example:

    >>> import keras
    >>> class Tiny(keras.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.dense = keras.layers.Dense(3)
    ...     def call(self, x):
    ...         return self.dense(x) * 2.0
    >>> f = traced(Tiny(), input_shape=(None, 5))
    >>> f.output_shape
    (None, 3)
    """
    if not is_subclassed(model):
        return model
    cached = _TRACED.get(model)
    if cached is not None and (input_shape is None or
                               tuple(cached.inputs[0].shape) == tuple(input_shape)):
        return cached
    shape = tuple(input_shape) if input_shape is not None else input_shape_of(model)
    name = f"{type(model).__name__} '{model.name}'"
    if shape is None:
        raise TracingError(
            f"Cannot trace the subclassed model {name}: its input shape is unknown (it "
            "is not built, or Keras could not build it symbolically). Build it with "
            "`model.build((None, ...))`, or trace it once with its input shape: "
            "`hope_keras.graph.tracing.traced(model, input_shape=(None, ...))`; later calls "
            "reuse that trace.")
    call = type(model).call
    code = getattr(call, "__code__", None)
    inputs = keras.Input(batch_shape=shape, name="input")
    kwargs = {}
    try:
        if "training" in inspect.signature(call).parameters:
            kwargs["training"] = False
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        pass
    try:
        outputs = model.call(inputs, **kwargs)
        functional = keras.Model(inputs, outputs, name=f"{model.name}_traced")
    except Exception as e:  # noqa: BLE001 - any failure of the trace is the user's call
        raise TracingError(
            f"Cannot trace the subclassed model {name} into a Functional model: its "
            f"`call` is not made only of Keras layers and keras.ops. First operation "
            f"that failed: {_failed_operation(e, e.__traceback__, code)}. Use "
            "keras.ops (e.g. keras.ops.relu, keras.ops.concatenate) instead, or "
            "rebuild the model as a Functional one from the same layers "
            "(docs/quickstart.md, \"Models from elsewhere\").") from e
    _check_same(model, functional, shape, name, kwargs)
    _TRACED[model] = functional
    return functional


def _check_same(model, functional, shape, name, kwargs) -> None:
    """Runs both on one random batch: the traced graph must give the model's outputs
    (it would not if `call` read state the trace cannot see)."""
    if any(d is None for d in shape[1:]):
        return  # no concrete batch to run; the trace itself is the check
    dims = (2,) + tuple(int(d) for d in shape[1:])
    x = np.random.default_rng(0).normal(size=dims).astype("float32")
    mine = keras.tree.flatten(functional(x, training=False))
    theirs = keras.tree.flatten(model(x, **kwargs))
    if len(mine) != len(theirs):
        raise TracingError(
            f"The traced graph of {name} has {len(mine)} outputs, the model "
            f"{len(theirs)}.")
    for a, b in zip(mine, theirs):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        scale = max(float(np.max(np.abs(b))), 1e-6) if b.size else 1.0
        if a.shape != b.shape or float(np.max(np.abs(a - b))) > 1e-4 * scale:
            raise TracingError(
                f"The traced graph of {name} does not reproduce the model's outputs "
                "on a random batch: its `call` depends on something besides its "
                "layers and keras.ops (Python state, layers made inside `call`, the "
                "training flag). Rebuild it as a Functional model from the same "
                "layers (docs/quickstart.md, \"Models from elsewhere\").")
