"""`export_tflite`: a Keras model as a TensorFlow Lite flatbuffer.

Converts with ``tf.lite.TFLiteConverter.from_keras_model`` (float32), or with
dynamic-range quantisation (``quantize="dynamic"``: weights stored as int8, activations
in float, no calibration data needed). `tflite_interpreter` opens the result for
inference; `hope_keras.profile` times it.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import Optional, Union

import numpy as np

__all__ = ["export_tflite", "tflite_interpreter", "tflite_predict"]

QUANTIZE = (None, "dynamic")


def _convert(model, quantize):
    import tensorflow as tf

    # The converter exports a SavedModel first and prints its signature: keep quiet.
    with contextlib.redirect_stdout(io.StringIO()):
        converter = tf.lite.TFLiteConverter.from_keras_model(model)
        if quantize == "dynamic":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        return converter.convert()


def export_tflite(model, path: Optional[Union[str, os.PathLike]] = None,
                  quantize: Optional[str] = None) -> bytes:
    """Converts a Keras model (e.g. `hope_keras.slim`'s result) to TensorFlow Lite.

    Args:
        model: A built Keras model (Functional, Sequential or subclassed).
        path: Where to write the ``.tflite`` file (its name must end with ``.tflite``,
            its folder must exist); ``None``: nothing is written.
        quantize: ``None``: float32 weights and arithmetic; ``"dynamic"``:
            dynamic-range quantisation (weights int8, about 4× smaller; activations
            quantised on the fly where the kernel supports it).

    Returns:
        bytes: The flatbuffer (also written to ``path`` when given).

    Raises:
        ValueError: on an unknown ``quantize``, or when the converter fails (the
            message names the model and quotes the converter).

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> inputs = keras.Input((8,))
    >>> model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    >>> flatbuffer = hope_keras.export_tflite(model)
    >>> x = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")
    >>> y = hope_keras.deploy.export.tflite_predict(flatbuffer, x)
    >>> bool(np.allclose(y, model(x), atol=1e-5))
    True
    """
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}. Received: quantize={quantize!r}")
    if path is not None and not os.fspath(path).lower().endswith(".tflite"):
        raise ValueError(f"path must end with .tflite (a TFLite flatbuffer; save a Keras "
                         f"model with model.save). Received: path={os.fspath(path)!r}")
    try:
        flatbuffer = _convert(model, quantize)
    except Exception as e:  # the converter raises many types; keep its message
        raise ValueError(
            f"TFLite conversion of model {getattr(model, 'name', model)!r} failed: "
            f"{type(e).__name__}: {e}") from e
    if path is not None:
        with open(path, "wb") as f:
            f.write(flatbuffer)
    return flatbuffer


def tflite_interpreter(source, num_threads: Optional[int] = None):
    """An allocated TFLite interpreter for a ``.tflite`` path or flatbuffer bytes.

    Uses ``ai_edge_litert`` when installed, else ``tf.lite.Interpreter`` (whose
    deprecation warning is silenced).
    """
    kwargs = {"num_threads": num_threads}
    if isinstance(source, (bytes, bytearray)):
        kwargs["model_content"] = bytes(source)
    else:
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"No TFLite file at '{path}'.")
        kwargs["model_path"] = path
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interpreter = Interpreter(**kwargs)
    interpreter.allocate_tensors()
    return interpreter


def set_tflite_inputs(interpreter, x):
    """Resizes the interpreter's inputs to ``x``'s shapes (when needed) and sets them."""
    details = interpreter.get_input_details()
    xs = x if isinstance(x, (list, tuple)) else [x]
    if len(xs) != len(details):
        raise ValueError(f"The TFLite model has {len(details)} inputs. Received: "
                         f"{len(xs)} arrays")
    resized = False
    for d, a in zip(details, xs):
        if tuple(d["shape"]) != tuple(np.shape(a)):
            interpreter.resize_tensor_input(d["index"], np.shape(a))
            resized = True
    if resized:
        interpreter.allocate_tensors()
    for d, a in zip(details, xs):
        interpreter.set_tensor(d["index"], np.asarray(a, dtype=d["dtype"]))


def tflite_predict(source, x, num_threads: Optional[int] = None):
    """Runs a TFLite model (path, bytes or interpreter) on ``x``; returns its output(s)."""
    interpreter = source if hasattr(source, "invoke") else tflite_interpreter(
        source, num_threads)
    set_tflite_inputs(interpreter, x)
    interpreter.invoke()
    outs = [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()]
    return outs[0] if len(outs) == 1 else outs
