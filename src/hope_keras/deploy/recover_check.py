"""`recover`'s ``revert_if_worse``: how close the model is to its teacher (or to the
labels) on a sample of the data, before and after training.

The measure is the top class's agreement for class scores, the mean squared
difference for outputs matched as they are (``distillation="mse"``); training that
made it worse is undone by `hope_keras.recover`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

#: ``revert_if_worse``: the agreement is measured on at most this many of the inputs
#: (array data) or this many batches (a dataset).
CHECK_INPUTS = 1024
CHECK_BATCHES = 16


def check_sample(fit_data) -> dict:
    """`revert_if_worse`'s inputs: ``fit``'s data cut to its first `CHECK_INPUTS`
    examples (a dataset: its first `CHECK_BATCHES` batches)."""
    x = fit_data["x"]
    if isinstance(x, keras.utils.PyDataset):  # its first batches, read once
        count = CHECK_BATCHES if x.num_batches is None else min(CHECK_BATCHES, x.num_batches)
        return {"x": Batches(x[i] for i in range(count))}
    if is_dataset(x):
        return {"x": x.take(CHECK_BATCHES)}
    return {k: keras.tree.map_structure(lambda a: a[:CHECK_INPUTS], v)
            for k, v in fit_data.items() if v is not None}


def inference_fn(model):
    """``model(x, training=False)`` traced once: an eager call of a small model costs
    tens of milliseconds of Python (the demo CNN: 16 batches of 64 through it and its
    teacher took 1.4 s eager, through it alone traced 0.18 s)."""
    import tensorflow as tf

    return tf.function(lambda x: model(x, training=False), reduce_retracing=True)


class AgreementCheck:
    """How often the model's top class (last axis) is the teacher's (no teacher:
    the label) on `check_sample`'s inputs, both models in inference mode; with
    ``distillation="mse"``, the mean squared difference of the outputs. Each
    call measures the model as it is then; for arrays the teacher's outputs are
    computed once, a dataset is read in one pass per call (a reshuffling dataset
    stays paired)."""

    def __init__(self, model, teacher, fit_data, batch_size: int, distillation="kl"):
        self.measure = "agreement" if distillation == "kl" else "mse"
        self.sample = check_sample(fit_data)
        self.model_fn = inference_fn(model)
        self.teacher_fn = None if teacher is None else inference_fn(teacher)
        self.batch_size = batch_size
        self.want = None  # arrays: the teacher's (or the labels') classes, per batch

    def _batches(self):
        x = self.sample["x"]
        if is_dataset(x):
            return (e if isinstance(e, tuple) else (e,) for e in x)
        n, y, b = len(keras.tree.flatten(x)[0]), self.sample.get("y"), self.batch_size
        return ((keras.tree.map_structure(lambda a: a[k:k + b], x),
                 None if y is None else y[k:k + b]) for k in range(0, n, b))

    def worse(self, before: float, after: float) -> bool:
        return after < before if self.measure == "agreement" else after > before

    def _seen(self, out) -> np.ndarray:
        out = np.asarray(ops.convert_to_numpy(out), dtype=np.float64)
        return np.argmax(out, axis=-1) if self.measure == "agreement" else out

    def _wanted(self, batch, seen) -> np.ndarray:
        if self.teacher_fn is not None:
            return self._seen(self.teacher_fn(batch[0]))
        return np.reshape(np.asarray(batch[1], dtype=seen.dtype), seen.shape)

    def __call__(self) -> float:
        wants, score, total = [], 0.0, 0
        for k, batch in enumerate(self._batches()):
            seen = self._seen(self.model_fn(batch[0]))
            want = self._wanted(batch, seen) if self.want is None else self.want[k]
            wants.append(want)
            score += float(np.sum(seen == want) if self.measure == "agreement"
                           else np.sum((seen - want) ** 2))
            total += seen.size
        if not is_dataset(self.sample["x"]):
            self.want = wants
        return score / max(total, 1)


class Batches(list):
    """Batches read from a `keras.utils.PyDataset`, iterated as a dataset is."""


def is_dataset(x) -> bool:
    """A `tf.data.Dataset`, a `keras.utils.PyDataset` (or batches read from one):
    batched data that `fit` takes without ``batch_size``."""
    if isinstance(x, (keras.utils.PyDataset, Batches)):
        return True
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, tf.data.Dataset)
