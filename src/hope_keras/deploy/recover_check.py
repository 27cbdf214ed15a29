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


def output_names(model, count: int = 1) -> list:
    """The names a user gives `model`'s outputs, in ``model.outputs`` order: a dict
    output's keys (sorted, as Keras flattens them), else the output layers' names."""
    struct = getattr(model, "output", None) if getattr(model, "outputs", None) else None
    if isinstance(struct, dict):
        return sorted(struct)
    names = getattr(model, "output_names", None) if struct is not None else None
    return list(names) if names else [f"output_{k}" for k in range(count)]


class AgreementCheck:
    """How often the model's top class (last axis) is the teacher's (no teacher:
    the label) on `check_sample`'s inputs, both models in inference mode; with
    ``distillation="mse"``, the mean squared difference of the outputs; one measure
    per output (`modes`: each output's distillation). Each
    call measures the model as it is then; for arrays the teacher's outputs are
    computed once, a dataset is read in one pass per call (a reshuffling dataset
    stays paired)."""

    def __init__(self, model, teacher, fit_data, batch_size: int, modes=("kl",)):
        self.measures = ["agreement" if m == "kl" else "mse" for m in modes]
        self.names = output_names(model, len(modes))
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

    def report(self, before, after):
        """``(History.revert, why)``: the measures before and after training (one
        output: ``{"agreement_before", "agreement_after", "reverted"}`` or the
        ``mse_`` pair; several: one such pair per output name), and what got worse,
        as ``(what, details)`` (None when nothing did: training is undone if any
        output's measure did)."""
        worse = [(m, f"output {n!r}: {b:.4g} → {a:.4g}")
                 for m, n, b, a in zip(self.measures, self.names, before, after)
                 if (a < b if m == "agreement" else a > b)]
        pairs = [{f"{m}_before": b, f"{m}_after": a}
                 for m, b, a in zip(self.measures, before, after)]
        out = dict(pairs[0]) if len(pairs) == 1 else dict(zip(self.names, pairs))
        out["reverted"] = bool(worse)
        if not worse:
            return out, None
        what = " and ".join(sorted({"lowered the agreement" if m == "agreement" else
                                    "raised the mean squared difference" for m, _ in worse}))
        return out, (what, "; ".join(d for _, d in worse))

    def _seen(self, outs) -> list:
        outs = [np.asarray(ops.convert_to_numpy(o), dtype=np.float64)
                for o in keras.tree.flatten(outs)]
        return [np.argmax(o, axis=-1) if m == "agreement" else o
                for o, m in zip(outs, self.measures)]

    def _wanted(self, batch, seen) -> list:
        if self.teacher_fn is not None:
            return self._seen(self.teacher_fn(batch[0]))
        return [np.reshape(np.asarray(batch[1], dtype=seen[0].dtype), seen[0].shape)]

    def __call__(self) -> list:
        """Each output's measure, in ``model.outputs`` order."""
        wants = []
        score, total = np.zeros(len(self.measures)), np.zeros(len(self.measures))
        for k, batch in enumerate(self._batches()):
            seen = self._seen(self.model_fn(batch[0]))
            want = self._wanted(batch, seen) if self.want is None else self.want[k]
            wants.append(want)
            for j, (s, w, m) in enumerate(zip(seen, want, self.measures)):
                score[j] += float(np.sum(s == w) if m == "agreement" else np.sum((s - w) ** 2))
                total[j] += s.size
        if not is_dataset(self.sample["x"]):
            self.want = wants
        return [float(v) for v in score / np.maximum(total, 1)]


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
