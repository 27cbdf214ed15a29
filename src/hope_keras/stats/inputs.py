"""The one reader of a user's data: batches of a model's inputs.

`compress(data=...)`, `recover`, `reestimate_batchnorm_statistics` and `calibrate`
take the same kinds of data, read by Keras' conventions:

* an array (or tensor) of inputs, cut into batches;
* for a model of several inputs, a list of arrays (one per input, in the order of
  ``model.inputs``); for any model, a dict of arrays keyed by its input names (the
  keys of the dict it was built on, else its `keras.Input` names; other keys are
  ignored), cut alike;
* a tuple ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``: ``x`` is read, labels
  are ignored;
* a `tf.data.Dataset`, or any other iterable, of batches: each element is ``x`` (an
  array, or a list or dict for several inputs) or a tuple whose first item is ``x``.
  A list that is not one array per input of the model is an iterable of batches.

Inputs given as a dict come out as the list of them in the order of ``model.inputs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Iterator

import keras
import numpy as np

from hope_keras.graph import adapter as kg

__all__ = ["batches", "check_shapes", "count", "concatenate", "take", "input_shapes"]


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or (keras.ops.is_tensor(x) and not isinstance(x, Mapping))


def _num_inputs(model) -> int:
    return len(keras.tree.flatten(kg.functional_of(model).inputs))


def input_shapes(model) -> list:
    """The shapes of the model's inputs (batch axis included), in the order of
    ``model.inputs`` (the order of the lists `batches` yields)."""
    return [tuple(t.shape) for t in keras.tree.flatten(kg.functional_of(model).inputs)]


def check_shapes(model, x, shape_error: str) -> None:
    """The arrays of a batch `x` against the model's input shapes (their known
    dimensions), named before anything runs; `shape_error` starts the message of a
    wrong shape (e.g. ``"data= holds inputs of shape"``)."""
    want = input_shapes(model)
    parts = keras.tree.flatten(x)
    if len(parts) != len(want):
        raise ValueError(f"The data holds {len(parts)} array(s) per batch, but model "
                         f"'{model.name}' takes {len(want)} input(s) of shapes {want}: give "
                         "a list (or dict) of one array per input. Nothing was changed.")
    for k, (part, shape) in enumerate(zip(parts, want)):
        got = tuple(np.shape(part))
        if len(got) == len(shape) and all(w is None or w == g
                                          for w, g in zip(shape[1:], got[1:])):
            continue
        # One axis short where the rest fits: single inputs read as batches.
        short = len(got) == len(shape) - 1 and all(
            w is None or w == g for w, g in zip(shape[2:], got[1:]))
        hint = (" An array's first axis, and each item of a list or generator, is "
                "read as a batch of inputs: stack single inputs first "
                "(np.stack(items)).") if short else ""
        which = f" (input {k})" if len(want) > 1 else ""
        raise ValueError(f"{shape_error} {got}{which}, but model '{model.name}' takes "
                         f"inputs of shape {shape}.{hint} Nothing was changed.")


def _from_dict(model, data: Mapping):
    """A dict of the model's inputs (other keys are ignored, as Keras does) as the
    list of them in the order of ``model.inputs`` (one input: its array); refused,
    naming the keys, when one is missing."""
    names = kg.input_names(model)
    if not set(names) <= set(map(str, data)):
        raise TypeError(
            f"A dict of data is read as the model's inputs by name; model '{model.name}' "
            f"takes {len(names)} input(s) named {names}. Received a dict with keys "
            f"{sorted(map(str, data))}. Nothing was changed.")
    return [data[name] for name in names] if len(names) > 1 else data[names[0]]


def _input_arrays(model, data):
    """`data` as the model's inputs held in arrays (an array; a list of arrays, one
    per input of a model of several), or None when it is not."""
    if _is_array(data):
        return data
    if isinstance(data, Mapping):
        data = _from_dict(model, data)
        if not all(_is_array(v) for v in keras.tree.flatten(data)):
            raise TypeError("A dict of data holds the model's inputs as arrays (one per "
                            "input). For batches pass a tf.data.Dataset or an iterable.")
        return data
    n = _num_inputs(model)
    if isinstance(data, list) and n > 1 and len(data) == n and all(
            _is_array(v) and np.ndim(v) >= 1 for v in data):
        return list(data)
    return None


def count(x) -> int:
    """The number of examples in `x` (an array, or a list or dict of arrays)."""
    return int(len(keras.tree.flatten(x)[0]))


def take(x, start: int, stop: int):
    """Examples ``start:stop`` of every array of `x`, as NumPy arrays."""
    return keras.tree.map_structure(lambda a: np.asarray(a[start:stop]), x)


def concatenate(parts: list):
    """Batches (arrays, or lists or dicts of arrays alike) joined along the batch axis."""
    return keras.tree.map_structure(lambda *a: np.concatenate([np.asarray(v) for v in a]),
                                    *parts)


def batches(model, data, batch_size: int) -> Iterator:
    """Yields the inputs ``x`` of each batch of `data` (see the module docstring);
    arrays are cut into batches of `batch_size`.

    Example:

    >>> import keras, numpy as np
    >>> a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    >>> model = keras.Model([a, b], keras.layers.Concatenate()([a, b]))
    >>> data = ([np.zeros((5, 3)), np.ones((5, 2))], np.zeros(5))  # (x, y)
    >>> [[part.shape for part in x] for x in batches(model, data, batch_size=4)]
    [[(4, 3), (4, 2)], [(1, 3), (1, 2)]]
    """
    if isinstance(data, tuple):  # (x,), (x, y) or (x, y, sample_weight)
        if not 1 <= len(data) <= 3:
            raise ValueError(f"A tuple of data must be (x,), (x, y) or (x, y, "
                             f"sample_weight); received a tuple of {len(data)}.")
        data = data[0]
    arrays = _input_arrays(model, data)
    if arrays is not None:
        n = count(arrays)
        for start in range(0, n, batch_size):
            yield take(arrays, start, start + batch_size)
        return
    if not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
        raise TypeError(
            "data must be a numpy array, a list or dict of arrays (a model of several "
            "inputs), a tf.data.Dataset or an iterable of batches. Received: data of "
            f"type {type(data).__name__}.")
    for element in data:
        x = element[0] if isinstance(element, tuple) else element
        yield _from_dict(model, x) if isinstance(x, Mapping) else x
