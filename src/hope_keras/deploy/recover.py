"""`recover`: win back the accuracy a compression lost, with a little unlabeled data.

A data-free compression (`hope_keras.compress`, a baseline, or a hand edit) changes
what each layer sees, so the BatchNorm moving statistics are stale and the outputs
drift from the original's. `recover` fixes both with the tools users already know:

1. re-estimates every BN layer's moving statistics on the data
   (`hope_keras.reestimate_batchnorm_statistics`);
2. trains the compressed model (the student) to reproduce the original's (the
   teacher's) outputs by knowledge distillation (Hinton et al., 2015): the KL
   divergence between the temperature-softened class distributions, times ``T²``;
   with labelled data, plus a cross-entropy on the labels. The loop is Keras's own
   ``fit`` on a `Distiller` (a `keras.Model` whose ``compute_loss`` and
   ``train_step`` are overridden), so callbacks, the progress bar, ``tf.data`` input
   and any ``tf.distribute`` strategy work as usual;
3. re-estimates the BN statistics again for the trained weights, and compiles the
   model for inference.

Every trainable weight entry that is exactly zero when training starts stays exactly
zero (its gradient is masked; the zeros are re-imposed when ``fit`` ends, for an
optimizer that would move a weight without a gradient). That is what
keeps a pruned neuron pruned in an in-place compressed model (its filter, bias, BN
γ and β and consumer slices are zero), so `hope_keras.slim` removes the same
channels after `recover` as before; it also preserves unstructured sparsity.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import keras
import numpy as np
from keras import ops

from hope_keras.graph import adapter as kg
from hope_keras.stats.bn_stats import reestimate_batchnorm_statistics
from hope_keras.progress import interactive
from hope_keras.graph import layers as layer_rules
from hope_keras.activations.lookup import activation_name, layer_activation
from hope_keras.deploy.recover_check import (  # noqa: F401 - CHECK_*: documented here
    CHECK_BATCHES, CHECK_INPUTS, AgreementCheck, Batches, is_dataset, output_names)

__all__ = ["Distiller", "recover"]

_BN_MODES = ("train", "frozen")
#: ``"kl"``: class scores on the output's last axis; ``"mse"``: outputs matched as they
#: are (regression, reconstruction, one-channel sigmoid maps).
DISTILLATIONS = ("kl", "mse")


# ----------------------------------------------------------------- output kinds
def _output_layer(model, k: int = 0):
    """The layer that produces the model's output `k`, inside nested models (None
    for a subclassed model, which has no graph to read)."""
    if not getattr(model, "outputs", None):
        return None
    op = kg.producer_layer_of(model.outputs[k])
    while isinstance(op, keras.Model) and getattr(op, "outputs", None):
        op = kg.producer_layer_of(op.outputs[0])
    return op


def _softmax_head(model, k: int = 0):
    """``(layer, kind)``: how the model's output `k` relates to its logits.

    ``kind`` is ``"activation"`` when ``layer.activation`` is a softmax (a Dense or
    Conv head with ``activation="softmax"``, or an ``Activation("softmax")`` layer):
    the logits are the output with that activation bypassed. ``"layer"`` for a
    ``keras.layers.Softmax`` output (its log is used). ``None``: the output is taken
    as logits (or log-probabilities, the same up to a constant per example).
    """
    layer = _output_layer(model, k)
    if layer is None or activation_name(layer_activation(layer)) != "softmax":
        return layer, None
    if getattr(layer, "activation", None) is not None:
        return layer, "activation"
    return layer, "layer"


def _noise_layers(model):
    """``(layer, attribute)`` of the layers of ``model`` (nested models included) that
    add noise in training only, with the attribute that sets its strength (Dropout's
    ``rate``, GaussianNoise's ``stddev``; `hope_keras.layers.LayerRule.noise`)."""
    found = ((layer, layer_rules.get(layer).noise) for layer in kg.nested_layers(model))
    return [(layer, attr) for layer, attr in found if attr is not None]


class _Overrides:
    """Sets layer attributes for the duration of ``fit``, then restores them.

    Used to bypass softmax heads (``activation`` → identity: exact logits) and to
    switch noise layers off (``rate`` or ``stddev`` → 0). Layers read these
    attributes when the step is traced, which happens inside ``fit``. Active for
    the whole of ``fit``: under a MirroredStrategy the replicas trace concurrently,
    so a per-call swap would race.
    """

    def __init__(self, changes):
        self.changes = list(changes)  # (layer, attribute, value)
        self.saved = []

    def __enter__(self):
        for layer, attr, value in self.changes:
            self.saved.append((layer, attr, getattr(layer, attr)))
            setattr(layer, attr, value)
        return self

    def __exit__(self, *exc):
        for layer, attr, value in reversed(self.saved):
            setattr(layer, attr, value)
        self.saved.clear()
        return False


def _distillations(distillation, model) -> tuple:
    """One of `DISTILLATIONS` per output of `model` (in ``model.outputs`` order):
    `distillation` for all, or a list of one per output, or a dict keyed by the
    output names; ``"kl"`` needs classes to compare."""
    outputs = list(getattr(model, "outputs", None) or [None])  # subclassed: one
    names = output_names(model, len(outputs))
    if isinstance(distillation, str):
        modes = [distillation] * len(outputs)
    elif isinstance(distillation, dict) and sorted(distillation) == sorted(names):
        modes = [distillation[n] for n in names]
    elif isinstance(distillation, (list, tuple)) and len(distillation) == len(outputs):
        modes = list(distillation)
    else:
        raise ValueError(
            f"distillation must be one of {DISTILLATIONS}, or one per output of model "
            f"{model.name!r} (a list of {len(outputs)}, or a dict keyed by {names}). "
            f"Received: distillation={distillation!r}")
    for mode, out, name in zip(modes, outputs, names):
        if mode not in DISTILLATIONS:
            raise ValueError(f"distillation must be one of {DISTILLATIONS} (each output's). "
                             f"Received: {mode!r} for output {name!r}")
        if mode == "kl" and out is not None and out.shape[-1] == 1:
            raise ValueError(
                f"distillation='kl' compares class distributions on an output's last "
                f"axis; output {name!r} of model {model.name!r} has shape "
                f"{tuple(out.shape)}, one unit there, whose softmax is constant (the "
                "loss would be zero). For a regression, a reconstruction or a "
                "one-channel sigmoid map pass distillation='mse'. Nothing was changed.")
    return tuple(modes)


def _logits(y, kind):
    """Logits (up to a per-example constant) from a model output of the given kind."""
    y = ops.cast(y, "float32")
    if kind == "layer":
        return ops.log(ops.clip(y, 1e-30, 1.0))
    return y


class _Untracked:
    """Holds a model without Keras tracking it (the teacher's weights are not ours)."""

    def __init__(self, value):
        self.value = value


# ------------------------------------------------------------------- Distiller
class Distiller(keras.Model):
    """Trains ``student`` to match ``teacher`` (and labels, when given) with ``fit``.

    The loss per batch (per output, summed) is
    ``distillation_weight · T² · KL(softmax(t/T) ‖ softmax(s/T))``
    with ``t``, ``s`` the teacher's and the student's logits, plus, for batches with
    labels ``y``, ``label_weight ·`` sparse categorical cross-entropy of the student
    (integer labels), plus the student's own losses (regularizers). Without a teacher
    only the label term remains. ``fit`` reports ``loss``, ``distillation_loss``
    (``T²·KL``, unweighted; with a teacher) and ``label_loss`` (with labels). With
    ``distillation="mse"`` both terms are mean squared differences of the outputs as
    they are (no softmax, no temperature): from the teacher's, and from the labels.

    Trainable weight entries that are exactly zero when the Distiller is created
    stay zero: their gradients are masked (with zero gradients, SGD, Adam, AdamW,
    RMSprop or Lion leave them at zero) and ``fit`` sets them back to zero when it
    ends, in case an optimizer moved them anyway.

    Logits: a model whose output layer has ``activation="softmax"`` (or is an
    ``Activation("softmax")``) is read before its softmax: the activation is bypassed
    while the training step is traced (the `recover` function and ``fit`` on a
    Distiller do this; the models are restored afterwards). A ``keras.layers.Softmax``
    output is converted with ``log``; any other output is taken as logits.

    Args:
        student: The model to train (its variables must live in the strategy that
            trains: create or load it inside ``strategy.scope()``).
        teacher: The reference model, not trained, called in inference mode; or
            ``None`` (labels only).
        temperature: ``T``, the softening temperature (> 0).
        distillation_weight: Weight of the distillation term.
        label_weight: Weight of the label cross-entropy (used when batches have
            labels).
        batchnorm: ``"train"``: the student's BN layers normalise with batch
            statistics (synchronised across replicas, so that the result does not
            depend on the number of replicas); ``"frozen"``: the student runs in
            inference mode (BN moving statistics), its weights, γ and β included,
            still train.
        dropout: Keep the student's Dropout (and GaussianDropout, AlphaDropout,
            GaussianNoise) layers active in ``"train"`` mode. Default False: their
            rate is set to 0 while ``fit`` runs, so that the student is compared
            with the teacher on the same deterministic function.
        freeze_zeros: Keep exactly-zero trainable entries at zero (default True).
        distillation: ``"kl"`` (default): the output's last axis holds class scores;
            ``"mse"``: the outputs are matched as they are (regression,
            reconstruction, a one-channel sigmoid map), for an output whose last
            axis has one unit too, where the softmax is constant. Several outputs:
            one per output (a list, or a dict keyed by the output names).

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.deploy.recover import Distiller
    >>> inputs = keras.Input((4,))
    >>> teacher = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    >>> student = keras.models.clone_model(teacher)
    >>> distiller = Distiller(student, teacher, temperature=2.0)
    >>> distiller.compile(keras.optimizers.SGD(0.1))
    >>> x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    >>> history = distiller.fit(x, epochs=2, batch_size=8, verbose=0)
    >>> sorted(history.history)
    ['distillation_loss', 'loss']
    """

    def __init__(self, student, teacher=None, temperature: float = 4.0,
                 distillation_weight: float = 1.0, label_weight: float = 1.0,
                 batchnorm: str = "train", dropout: bool = False,
                 freeze_zeros: bool = True, distillation: str = "kl", **kwargs):
        super().__init__(**kwargs)
        modes = _distillations(distillation, student)
        if not (isinstance(temperature, numbers.Real) and temperature > 0):
            raise ValueError(f"temperature must be > 0. Received: temperature={temperature!r}")
        if batchnorm not in _BN_MODES:
            raise ValueError(f"batchnorm must be one of {_BN_MODES}. Received: "
                             f"batchnorm={batchnorm!r}")
        for name, w in (("distillation_weight", distillation_weight),
                        ("label_weight", label_weight)):
            if not (isinstance(w, numbers.Real) and w >= 0):
                raise ValueError(f"{name} must be ≥ 0. Received: {name}={w!r}")
        if teacher is student:
            raise ValueError("The teacher must not be the student itself: pass the "
                             "uncompressed model (load it again, or copy it before "
                             "compressing).")
        self.student = student
        self._teacher = _Untracked(teacher)
        self.temperature = float(temperature)
        self.distillation_weight = float(distillation_weight)
        self.label_weight = float(label_weight)
        self.batchnorm = batchnorm
        self.dropout = bool(dropout)
        self.distillations = modes  # one per output
        # Only class scores are read before a softmax.
        self._student_kinds = [_softmax_head(student, k)[1] if m == "kl" else None
                               for k, m in enumerate(modes)]
        self._teacher_kinds = [_softmax_head(teacher, k)[1] if m == "kl" and teacher
                               is not None else None for k, m in enumerate(modes)]
        if teacher is not None and getattr(teacher, "outputs", None) and getattr(
                student, "outputs", None):
            ts = [tuple(t.shape[1:]) for t in teacher.outputs]
            ss = [tuple(t.shape[1:]) for t in student.outputs]
            if ts != ss:
                raise ValueError(
                    f"The teacher {teacher.name!r} outputs shape {ts}, the student "
                    f"{student.name!r} {ss}: they must match. Received: "
                    f"teacher.output_shape={teacher.output_shape}, "
                    f"student.output_shape={student.output_shape}")
        masks = {}
        if freeze_zeros:
            for v in student.trainable_variables:
                keep = np.asarray(v.numpy()) != 0
                if not keep.all():
                    masks[id(v)] = (v, keep)
        self._masks = _Untracked(masks)  # id(variable) -> (variable, keep mask)
        self.distillation_tracker = keras.metrics.Mean(name="distillation_loss")
        self.label_tracker = keras.metrics.Mean(name="label_loss")

    @property
    def teacher(self):
        return self._teacher.value

    @property
    def frozen_entries(self) -> int:
        """How many trainable entries are held at exactly zero."""
        return int(sum(keep.size - int(np.count_nonzero(keep))
                       for _, keep in self._masks.value.values()))

    def reimpose_zeros(self):
        """Sets the frozen entries back to zero (cross-replica context, eager)."""
        for v, keep in self._masks.value.values():
            v.assign(np.where(keep, np.asarray(v.numpy()), 0).astype(v.dtype))

    def overrides(self):
        """``(layer, attribute, value)`` set while ``fit`` runs (see the class doc)."""
        changes = []
        for k, (sk, tk) in enumerate(zip(self._student_kinds, self._teacher_kinds)):
            if sk == "activation":
                changes.append((_softmax_head(self.student, k)[0], "activation",
                                keras.activations.linear))
            if tk == "activation":
                changes.append((_softmax_head(self.teacher, k)[0], "activation",
                                keras.activations.linear))
        if not self.dropout:
            for layer, attr in _noise_layers(self.student):
                changes.append((layer, attr, 0.0))
        return changes

    def call(self, x, training=False):
        train = bool(training) and self.batchnorm == "train"
        return self.student(x, training=train)

    def _replicas(self) -> int:
        return self.distribute_strategy.num_replicas_in_sync

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        outs = [_logits(p, kind) for p, kind in zip(keras.tree.flatten(y_pred),
                                                     self._student_kinds)]
        s = outs[0]
        total = ops.zeros((), "float32")
        weights = None if sample_weight is None else ops.cast(sample_weight, "float32")

        def mean(per_example):
            if weights is None:
                return ops.mean(per_example)
            return ops.sum(per_example * weights) / ops.maximum(ops.sum(weights), 1e-12)

        if self.teacher is not None:  # every output's term, summed
            kd = ops.zeros((), "float32")
            targets = keras.tree.flatten(self.teacher(x, training=False))
            for s_k, t_k, mode, kind in zip(outs, targets, self.distillations,
                                            self._teacher_kinds):
                t_k = ops.stop_gradient(_logits(t_k, kind))
                if mode == "mse":
                    d = ops.reshape(ops.square(s_k - t_k), (ops.shape(s_k)[0], -1))
                    kd = kd + mean(ops.mean(d, axis=1))
                    continue
                tau = self.temperature
                log_p = ops.log_softmax(t_k / tau, axis=-1)
                log_q = ops.log_softmax(s_k / tau, axis=-1)
                kl = ops.sum(ops.exp(log_p) * (log_p - log_q), axis=-1)
                kd = kd + mean(ops.reshape(kl, (-1,))) * (tau * tau)
            self.distillation_tracker.update_state(kd)
            total = total + self.distillation_weight * kd
        if y is not None and len(outs) > 1:
            raise ValueError("Labels are read for a model of one output; this one has "
                             f"{len(outs)}: distil from the teacher (unlabeled data).")
        if y is not None and self.distillations[0] == "mse":
            d = ops.square(s - ops.reshape(ops.cast(y, "float32"), ops.shape(s)))
            ce = mean(ops.mean(ops.reshape(d, (ops.shape(s)[0], -1)), axis=1))
            self.label_tracker.update_state(ce)
            total = total + self.label_weight * ce
        elif y is not None:
            ce = keras.losses.sparse_categorical_crossentropy(
                ops.reshape(y, (-1,)), ops.reshape(s, (-1, s.shape[-1])), from_logits=True)
            ce = mean(ce)
            self.label_tracker.update_state(ce)
            total = total + self.label_weight * ce
        elif self.teacher is None:
            raise ValueError("The Distiller has no teacher and the batch has no labels: "
                             "nothing to learn from. Pass a teacher or (x, y) data.")
        for extra in self.student.losses:
            total = total + ops.cast(ops.sum(extra), "float32")
        # Each replica averages its own share of the global batch; gradients are
        # summed across replicas, so scale by 1 / replicas (as Keras losses do).
        return total / self._replicas()

    def train_step(self, data):
        import tensorflow as tf

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
            kg.loss_tracker(self).update_state(
                loss * self._replicas(),
                sample_weight=tf.shape(keras.tree.flatten(x)[0])[0])
            scaled = self.optimizer.scale_loss(loss)
        variables = self.trainable_variables
        grads = tape.gradient(scaled, variables)
        masks = self._masks.value
        grads = [g if g is None or id(v) not in masks
                 else g * ops.cast(masks[id(v)][1], g.dtype)
                 for g, v in zip(grads, variables)]
        self.optimizer.apply_gradients(zip(grads, variables))
        return self._logs(x, y, y_pred, sample_weight)

    def _logs(self, x, y, y_pred, sample_weight):
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # Terms that do not exist for this data are left out (not logged as 0).
        if y is None:
            logs.pop("label_loss", None)
        if self.teacher is None:
            logs.pop("distillation_loss", None)
        return logs

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=False)
        kg.loss_tracker(self).update_state(
            loss * self._replicas(),
            sample_weight=ops.shape(keras.tree.flatten(x)[0])[0])
        return self._logs(x, y, y_pred, sample_weight)

    def _run(self, method, *args, **kwargs):
        """Runs ``fit``/``evaluate`` with the overrides on and BN synchronised."""
        bns = []
        if self.batchnorm == "train" and self._replicas() > 1:
            bns = [layer for layer in kg.nested_layers(self.student)
                   if layer_rules.get(layer).normalization == "batch"
                   and not layer.synchronized]
        for bn in bns:
            bn.synchronized = True
        try:
            with _Overrides(self.overrides()):
                # A function traced outside the overrides would keep the softmax.
                self.train_function = self.test_function = None
                return method(*args, **kwargs)
        finally:
            for bn in bns:
                bn.synchronized = False
            self.train_function = self.test_function = None

    def fit(self, *args, **kwargs):
        """``keras.Model.fit`` with the heads' softmax bypassed (and noise off)."""
        try:
            return self._run(super().fit, *args, **kwargs)
        finally:
            # Masked gradients keep zeros at zero for SGD, Adam(W), RMSprop, Lion...;
            # an optimizer that moves weights without a gradient is undone here.
            self.reimpose_zeros()

    def evaluate(self, *args, **kwargs):
        """``keras.Model.evaluate`` of the distillation (and label) loss."""
        return self._run(super().evaluate, *args, **kwargs)


# --------------------------------------------------------------------- recover
def _split(data):
    """``(fit positional/keyword args, BN re-estimation data, labelled?)``."""
    if isinstance(data, tuple):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                f"A tuple of arrays must be (x,), (x, y) or (x, y, sample_weight); "
                f"received a tuple of {len(data)}.")
        names = ("x", "y", "sample_weight")
        return dict(zip(names, data)), data[0], len(data) >= 2
    if isinstance(data, (np.ndarray, list, dict)) or ops.is_tensor(data):
        return {"x": data}, data, False
    if isinstance(data, keras.utils.PyDataset):  # labelled if its batches are (x, y)
        first = data[0]
        return {"x": data}, data, isinstance(first, tuple) and len(first) >= 2
    try:
        import tensorflow as tf

        if isinstance(data, tf.data.Dataset):
            spec = data.element_spec
            labelled = isinstance(spec, tuple) and len(spec) >= 2
            return {"x": data}, data, labelled
    except ImportError:  # pragma: no cover - the TF backend is required anyway
        pass
    raise TypeError(
        "data must be a numpy array or tensor of inputs, a tuple (x, y[, "
        "sample_weight]) of arrays, or a batched tf.data.Dataset or keras.utils.PyDataset "
        f"yielding x or (x, y). Received: data of type {type(data).__name__}")


def _check_arrays(model, fit_data, classes: bool = True) -> None:
    """Array data is checked before anything is written: finite inputs, and (with
    `classes`) integer labels that index the model's output (a dataset is checked as
    it streams: the BN re-estimation refuses non-finite statistics)."""
    x = fit_data["x"]
    if is_dataset(x):
        return
    if isinstance(x, (list, tuple)) and len(x) != len(model.inputs):
        raise ValueError(
            f"A list of {len(x)} arrays is read as the inputs of a model with "
            f"{len(x)} inputs (Keras' convention); model '{model.name}' has "
            f"{len(model.inputs)}. For a batch of examples pass one array, e.g. "
            "np.stack(images). Nothing was changed.")
    for k, part in enumerate(keras.tree.flatten(x)):
        arr = np.asarray(part)
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(
                np.sum(arr, dtype=np.float64)):
            bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            raise ValueError(f"The inputs hold {bad} NaN/Inf value(s) (input {k}, shape "
                             f"{arr.shape}). Clean the data first. Nothing was changed.")
    y = fit_data.get("y")
    if y is None or isinstance(y, (dict, list)) or not classes:
        return
    y = np.asarray(y)
    classes = model.outputs[0].shape[-1]
    if y.size and classes is not None and (y.ndim <= 1 or y.shape[-1] == 1):
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)) or y.min() < 0 \
                or y.max() >= classes:
            raise ValueError(
                f"The labels must be integer classes in [0, {classes}) (the model's "
                f"output has {classes} units). Received labels from {y.min()} to "
                f"{y.max()}. Nothing was changed.")


def recover(model, data, teacher=None, epochs: int = 1, verbose="auto",
            temperature: float = 4.0, label_weight: Optional[float] = None,
            optimizer=None, learning_rate: float = 1e-3, batch_size: int = 64,
            batchnorm: str = "train", dropout: bool = False, reestimate: bool = True,
            freeze_zeros: bool = True, revert_if_worse: bool = True,
            steps_per_epoch: Optional[int] = None, distillation: str = "kl", **fit_kwargs):
    """Recovers a compressed model's accuracy: BN re-estimation, then distillation.

    Works on the in-place compressed model (pruned neurons stay exactly zero, so
    `hope_keras.slim` removes the same channels afterwards) and on the slimmed one.
    The model is trained in place; the user's teacher is only read.

    Steps: (1) re-estimates BN moving statistics on ``data``
    (`hope_keras.reestimate_batchnorm_statistics`); (2) ``epochs`` of ``fit`` on a
    `Distiller`: ``T²·KL`` between the teacher's and the model's softened outputs,
    plus, for labelled data, ``label_weight ·`` cross-entropy on the labels
    (integer class labels); (3) re-estimates the BN statistics again (the weights
    moved); (4) compiles the model for inference: ``loss`` sparse categorical
    cross-entropy (``from_logits`` unless the head ends in a softmax),
    ``metrics=["accuracy"]`` and the optimizer used, so ``model.evaluate(x, y)``
    works.

    The model's output is a class score vector on the last axis: logits,
    log-probabilities, or probabilities. A head with ``activation="softmax"`` (or an
    ``Activation("softmax")`` output layer) is read before the softmax, so the KL is
    computed on exact logits; a ``keras.layers.Softmax`` output through ``log``. Any
    other output (a regression, a reconstruction, a sigmoid map) takes
    ``distillation="mse"``: the outputs are matched as they are, labels are targets
    of the same shape, the check of ``revert_if_worse`` is the mean squared
    difference, and the model is compiled with a mean squared error.

    Under a ``tf.distribute`` strategy: create or load the model (and the teacher)
    inside ``strategy.scope()``; `recover` runs ``fit`` in the model's strategy.
    With ``batchnorm="train"`` the BN batch statistics are synchronised across
    replicas during `recover`, so the result matches a single-device run.

    Args:
        model: The compressed `keras.Model`, edited in place: class scores on its
            output's last axis, or any output with ``distillation="mse"``; several
            outputs with one ``distillation`` each.
        data: Unlabelled inputs ``x`` (numpy array or tensor; a list or dict of
            arrays for a model of several inputs), a tuple ``(x, y)`` / ``(x, y,
            sample_weight)`` of arrays, or a batched ``tf.data.Dataset`` yielding
            ``x`` or ``(x, y)``, or a ``keras.utils.PyDataset`` of such batches
            (`hope_keras.stats.inputs`). Finite, or give
            ``steps_per_epoch`` (also the number of batches of each re-estimation).
        teacher: The uncompressed model (load it again, or copy it before
            compressing). ``None``: labels only (data must be labelled).
        epochs: Epochs of distillation; 0 re-estimates the BN statistics only.
        verbose: ``fit``'s verbosity (0, 1 or 2); ``"auto"`` (default): a progress
            bar only when standard output is a terminal or a notebook, as
            `compress`'s (Keras' ``"auto"`` would draw it into logs and pipes).
        temperature: The softening temperature ``T``.
        label_weight: Weight of the label term against the distillation term
            (weight 1). Default: 1 without a teacher, else 0.5 (labelled data).
        optimizer: A Keras optimizer (default ``Adam(learning_rate)``).
        learning_rate: Learning rate of the default optimizer.
        batch_size: Batch size for array data (ignored for datasets).
        batchnorm: ``"train"`` (batch statistics during training, default) or
            ``"frozen"`` (the model in inference mode; see `Distiller`).
        dropout: Keep Dropout-like layers active while training (default False).
        reestimate: Re-estimate the BN statistics before and after training
            (True, default; needs a Functional or Sequential model: pass False for
            a subclassed one, whose output is then taken as logits), or
            ``"after"``: only after training (the statistics are already the
            data's, e.g. after ``compress(data=...)``).
        freeze_zeros: Keep exactly-zero trainable entries at zero (default True;
            needed for the in-place model).
        revert_if_worse: Measure, in inference mode, how often the model's top
            class agrees with the teacher's (no teacher: with the labels) on the
            first `CHECK_INPUTS` inputs of ``data`` (a dataset: its first
            `CHECK_BATCHES` batches), before training and after the final
            re-estimation, and put back the weights from before training, with a
            warning, when training lowered it (default True; False keeps the
            trained model whatever it scores). The top class, not the
            distillation loss: the loss also weighs the softened outputs, which
            training can match better while the top class moves (docs/deploy.md,
            "Training that makes the model worse is undone"). The
            two values are in the returned History's ``revert`` attribute. It
            costs three inference passes over those inputs (the model before and
            after training, the teacher once).
        steps_per_epoch: Passed to ``fit``; needed for an infinite dataset.
        distillation: ``"kl"`` (default, class scores) or ``"mse"`` (outputs matched
            as they are; see above); for a model of several outputs, one per output
            (a list in ``model.outputs`` order, or a dict keyed by the output names:
            a dict output's keys, else the output layers' names), their terms
            summed; its data are unlabeled.
        **fit_kwargs: More ``fit`` arguments: ``callbacks``, ``validation_data``
            (labelled), ``shuffle``, ...

    Returns:
        The ``keras.callbacks.History`` of ``fit`` (``loss``, and per epoch
        ``distillation_loss`` with a teacher, ``label_loss`` with labels); an empty
        one when ``epochs=0``. With ``revert_if_worse`` and ``epochs > 0`` its
        ``revert`` attribute is ``{"agreement_before", "agreement_after",
        "reverted"}`` (``"mse"``: ``{"mse_before", "mse_after", "reverted"}``;
        several outputs: one such pair per output name, and ``"reverted"``, True when
        training made any output's measure worse).

    Raises:
        ValueError: on a bad argument, no teacher and no labels, or output shapes
            that differ (the model is then unchanged).
        FloatingPointError: when training makes weights NaN/Inf (a learning rate
            too high). Any error once the work has begun puts the model's weights
            back as they were (an interrupt with Ctrl-C leaves them as they are).

    Example:

    >>> import keras, numpy as np, hope_keras
    >>> inputs = keras.Input((8,))
    >>> h = keras.layers.Dense(16)(inputs)
    >>> h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    >>> teacher = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    >>> model = keras.models.clone_model(teacher)
    >>> model.set_weights(teacher.get_weights())
    >>> _ = hope_keras.compress(model, density=0.5, verbose=False)
    >>> x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    >>> history = hope_keras.recover(model, x, teacher=teacher, epochs=2, verbose=0)
    >>> len(history.history["distillation_loss"])
    2
    >>> sorted(history.revert)  # kept, or put back if training lowered the agreement
    ['agreement_after', 'agreement_before', 'reverted']
    >>> hope_keras.slim(model).count_params() < teacher.count_params()
    True
    """
    if not isinstance(epochs, numbers.Integral) or epochs < 0:
        raise ValueError(f"epochs must be an integer ≥ 0. Received: epochs={epochs!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be an integer ≥ 1. Received: "
                         f"batch_size={batch_size!r}")
    if optimizer is None and (isinstance(learning_rate, bool)
                              or not isinstance(learning_rate, numbers.Real)
                              or not 0.0 < float(learning_rate) < math.inf):
        raise ValueError(f"learning_rate must be a finite number > 0. Received: "
                         f"learning_rate={learning_rate!r}")
    if batchnorm not in _BN_MODES:
        raise ValueError(f"batchnorm must be one of {_BN_MODES}. Received: "
                         f"batchnorm={batchnorm!r}")
    fit_data, bn_data, labelled = _split(data)
    modes = _distillations(distillation, model)
    if labelled and len(modes) > 1:
        raise ValueError(f"Labels are read for a model of one output; model {model.name!r} "
                         f"has {len(modes)}: distil from the teacher on unlabeled data. "
                         "Nothing was changed.")
    _check_arrays(model, fit_data, classes=modes == ("kl",))
    if teacher is None and not labelled and epochs > 0:
        raise ValueError(
            "recover needs a teacher (the uncompressed model) or labelled data (x, y) "
            "to train; pass epochs=0 to re-estimate the BN statistics only.")
    if label_weight is None:
        label_weight = 1.0 if teacher is None else 0.5
    strategy = model.distribute_strategy
    with strategy.scope():
        # Built before anything changes, so that argument errors leave the model as is.
        distiller = Distiller(model, teacher, temperature=temperature,
                              distillation_weight=1.0, label_weight=label_weight,
                              batchnorm=batchnorm, dropout=dropout,
                              freeze_zeros=freeze_zeros, distillation=distillation)
        if optimizer is None:
            optimizer = keras.optimizers.Adam(learning_rate)

    if reestimate not in (True, False, "after"):
        raise ValueError(f"reestimate must be True, False or 'after'. Received: "
                         f"reestimate={reestimate!r}")
    if not isinstance(revert_if_worse, bool):
        raise ValueError(f"revert_if_worse must be True or False. Received: "
                         f"revert_if_worse={revert_if_worse!r}")

    def reestimate_bn():
        if reestimate:
            reestimate_batchnorm_statistics(model, bn_data, batches=steps_per_epoch,
                                            batch_size=batch_size)

    before = model.get_weights()  # put back if anything below fails
    try:
        if reestimate is True:
            reestimate_bn()
        check = (AgreementCheck(model, teacher, fit_data, batch_size, modes)
                 if revert_if_worse and epochs > 0 else None)
        if check is not None:
            # What training would be undone to: `before` unless re-estimated since.
            untrained = model.get_weights() if reestimate is True else before
            start = check()
        history = _train(model, distiller, strategy, optimizer, fit_data, epochs,
                         verbose, batch_size, steps_per_epoch, fit_kwargs, reestimate_bn)
        if check is not None:
            end = check()
            history.revert, worse = check.report(start, end)
            if worse:
                model.set_weights(untrained)
                warnings.warn(
                    f"recover: training {worse[0]} with the "
                    f"{'teacher' if teacher is not None else 'labels'} on the check "
                    f"inputs ({worse[1]}); the weights from before training were put "
                    "back (revert_if_worse=True).", stacklevel=2)
    except Exception:
        model.set_weights(before)
        raise
    with strategy.scope():
        losses = [keras.losses.MeanSquaredError() if m == "mse" else
                  keras.losses.SparseCategoricalCrossentropy(
                      from_logits=_softmax_head(model, k)[1] is None)
                  for k, m in enumerate(modes)]
        metrics = [["accuracy"] if m == "kl" else [] for m in modes]
        if len(modes) > 1 and isinstance(getattr(model, "output", None), dict):
            keys = output_names(model)  # the order of model.outputs
            losses, metrics = dict(zip(keys, losses)), dict(zip(keys, metrics))
        elif len(modes) == 1:
            losses, metrics = losses[0], metrics[0]
        model.compile(optimizer=optimizer, loss=losses, metrics=metrics)
    return history


def _train(model, distiller, strategy, optimizer, fit_data, epochs, verbose, batch_size,
           steps_per_epoch, fit_kwargs, reestimate_bn):
    """`recover`'s distillation and second re-estimation; raises if training made
    the weights non-finite."""
    history = keras.callbacks.History()
    history.set_model(model)
    if epochs > 0:
        with strategy.scope():
            distiller.compile(optimizer=optimizer)
            # Its slots made now, not inside the first traced step: one trace, not two.
            if not distiller.optimizer.built:
                distiller.optimizer.build(distiller.trainable_variables)
        if is_dataset(fit_data["x"]):
            fit_kwargs.setdefault("shuffle", False)  # a dataset shuffles itself
        else:
            fit_kwargs.setdefault("batch_size", batch_size)
        if verbose == "auto":  # the library's meaning: a bar only when interactive
            verbose = 1 if interactive() else 0
        history = distiller.fit(**fit_data, epochs=epochs, verbose=verbose,
                                steps_per_epoch=steps_per_epoch, **fit_kwargs)
        bad = [v.path for v in model.trainable_weights
               if not np.isfinite(keras.ops.convert_to_numpy(v)).all()]
        if bad:
            try:
                lr = f"{float(keras.ops.convert_to_numpy(optimizer.learning_rate)):g}"
            except Exception:  # a schedule or an optimizer without one
                lr = "?"
            raise FloatingPointError(
                f"Training diverged: {len(bad)} weight(s) became NaN/Inf (first: "
                f"{bad[0]!r}) with {type(optimizer).__name__} at learning rate {lr}. "
                f"The model's weights were put back as they were before recover. "
                f"Lower the learning rate (learning_rate=, or your optimizer's).")
        reestimate_bn()
    return history
