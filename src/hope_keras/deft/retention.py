"""Source retention as the paper measures it (appendix G.5) and the H-score."""

from __future__ import annotations

import contextlib
from typing import Optional

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules
from hope_keras.deft.plan import COMPENSATIONS, feature_layer_of, find_head
from hope_keras.scoring import moments

__all__ = ["SourceRetention", "h_score", "accuracy"]


def h_score(acc_target: float, acc_source: float) -> float:
    """Harmonic mean ``2·a_t·a_s / (a_t + a_s)`` (0 when both are 0).

    Example:

    >>> round(h_score(0.9, 0.5), 4)
    0.6429
    """
    s = float(acc_target) + float(acc_source)
    return 0.0 if s <= 0 else 2.0 * float(acc_target) * float(acc_source) / s


def num_examples(x) -> int:
    """Examples in model inputs `x`: one array, or a list, tuple or dict of arrays
    (one per input of a multi-input model, as Keras takes them)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return len(x[0]) if len(x) else 0
    return len(x)


def example_slice(x, start: int, stop: int):
    """Examples ``start:stop`` of model inputs `x` (see `num_examples`)."""
    if isinstance(x, dict):
        return {k: v[start:stop] for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [v[start:stop] for v in x]
    return x[start:stop]


def accuracy(model, x, y, batch_size: int = 512) -> float:
    """Top-1 accuracy of `model` in inference mode (argmax of its outputs); `x` one
    array, or one per model input."""
    correct, n = 0, num_examples(x)
    y = np.asarray(y).reshape(-1)
    for start in range(0, n, batch_size):
        out = np.asarray(model(example_slice(x, start, start + batch_size), training=False))
        correct += int(np.sum(np.argmax(out, axis=-1) == y[start:start + batch_size]))
    return correct / max(n, 1)


def _input_means(model, head, rows):
    """Data-free means (BN surrogate) of the head's input features `rows`."""
    fg = kg.flatten(model)
    mean, _ = moments.propagate(fg)[fg.node_of(head).inputs[0]]
    if mean.shape != rows.shape:
        return np.zeros(int(rows.sum()))
    return mean[rows]


class SourceRetention:
    """Evaluates the source task on a fine-tuned backbone (appendix G.5).

    Snapshots, from the source model (after `DeftPlan.apply` for DEFT), the source
    head and the moving statistics of every BatchNormalization. `evaluate` then
    grafts the source head back onto any model with the same backbone layer names,
    with its inputs from slack features zeroed (the plan's head-input drift), swaps
    the BN moving statistics to the source values, evaluates, and swaps them back.
    Accuracy is the argmax of the source head's logits (its activation is monotonic).

    Args:
        source_model: The source model (its head and BN statistics are copied now).
        plan: The `DeftPlan`, for the slack mask of the grafted head (None: no mask,
            as for the baselines).
        compensate: With ``"mean"`` or ``"mean_var"``, the head's bias gains the
            data-free mean of its zeroed slack inputs (weights × the surrogate's
            ``E[x]`` of the source model); default: the plan's ``compensate``.
        head: The source head's name (default: the plan's, or found automatically).
        x, y: Default source evaluation data.

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.deft import SourceRetention
    >>> inputs = keras.Input((4,))
    >>> h = keras.layers.Dense(5, name="feat")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    >>> retention = SourceRetention(model)
    >>> x = np.random.rand(10, 4).astype("float32")
    >>> y = model.predict(x, verbose=0).argmax(-1)
    >>> retention.evaluate(model, x, y)
    1.0
    """

    def __init__(self, source_model, plan=None, head: Optional[str] = None,
                 x=None, y=None, compensate: Optional[str] = None):
        head = head or (plan.head if plan is not None else find_head(source_model))
        layer = source_model.get_layer(head)
        self.head = head
        self.feature_layer = feature_layer_of(source_model, head)
        self.kernel = np.array(layer.kernel.numpy())
        self.bias = (np.array(layer.bias.numpy()) if getattr(layer, "bias", None) is not None
                     else np.zeros(self.kernel.shape[-1], self.kernel.dtype))
        if plan is not None:
            drift = np.asarray(plan.head_input_drift) > 0
            if drift.shape != (self.kernel.shape[0],):
                raise ValueError(
                    f"The plan's head input ({drift.size} features) does not match head "
                    f"'{head}' ({self.kernel.shape[0]} inputs).")
            if compensate is None:
                compensate = plan.options.get("compensate", "none")
            if compensate not in COMPENSATIONS:
                raise ValueError(f"compensate must be one of {COMPENSATIONS}. "
                                 f"Received: compensate={compensate!r}")
            if compensate != "none" and drift.any():
                self.bias = self.bias + _input_means(source_model, head, drift) @ \
                    self.kernel[drift].astype(np.float64)
                self.bias = self.bias.astype(self.kernel.dtype)
            self.kernel[drift, :] = 0.0
            self.num_masked = int(drift.sum())
        else:
            drift = np.zeros(self.kernel.shape[0], dtype=bool)
            self.num_masked = 0
        # The features the grafted head reads: a slack feature is never multiplied
        # in, not even by zero (a diverged fine-tuning's NaN would pass through 0 · x).
        self._read = np.flatnonzero(~drift)
        # Every BN, those of a nested backbone too (a keras.applications model used
        # as a layer): fine-tuning moves their statistics as much as the others'.
        self.bn_stats = {
            l.name: (np.array(l.moving_mean.numpy()), np.array(l.moving_variance.numpy()))
            for l in kg.nested_layers(source_model)
            if layer_rules.get(l).normalization == "batch"
        }
        self.data = (x, y)
        self._feature_models = {}

    @contextlib.contextmanager
    def source_statistics(self, model):
        """Context in which `model`'s BN moving statistics are the source ones."""
        saved = {}
        layers = {}
        for layer in kg.nested_layers(model):
            layers.setdefault(layer.name, layer)
        try:
            for name, (mean, var) in self.bn_stats.items():
                bn = layers.get(name)
                if bn is None:
                    continue
                saved[name] = (bn, bn.moving_mean.numpy(), bn.moving_variance.numpy())
                bn.moving_mean.assign(mean)
                bn.moving_variance.assign(var)
            yield model
        finally:
            for bn, mean, var in saved.values():
                bn.moving_mean.assign(mean)
                bn.moving_variance.assign(var)

    def feature_model(self, model):
        """`model` up to the features its head reads: the source head's input, or
        on a target model (whose head `replace_head` renamed) its own head's."""
        key = id(model)
        if key not in self._feature_models:
            names = {layer.name for layer in model.layers}
            head = self.head if self.head in names else find_head(model)
            out = model.get_layer(head).input
            if out.shape[-1] != self.kernel.shape[0]:
                raise ValueError(
                    f"Model '{model.name}': its head '{head}' reads {out.shape[-1]} "
                    f"features, the source head '{self.head}' {self.kernel.shape[0]}: "
                    "pass the target model made from the source model "
                    "(deft.replace_head).")
            inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
            self._feature_models[key] = keras.Model(inputs, out)
        return self._feature_models[key]

    def logits(self, model, x, batch_size: int = 512) -> np.ndarray:
        """Source-head logits of `model`'s backbone (BN statistics restored)."""
        feats = self.feature_model(model)
        outs = []
        with self.source_statistics(model):
            for start in range(0, num_examples(x), batch_size):
                f = np.asarray(feats(example_slice(x, start, start + batch_size),
                                     training=False))
                f = f.reshape(len(f), -1)[:, self._read]
                outs.append(f @ self.kernel[self._read] + self.bias)
        return np.concatenate(outs) if outs else np.zeros((0, self.kernel.shape[-1]))

    def evaluate(self, model, x=None, y=None, batch_size: int = 512) -> float:
        """Source accuracy of `model` with the source head grafted back."""
        if x is None:
            x, y = self.data
        if x is None:
            raise ValueError("No source data: pass x, y here or to SourceRetention().")
        pred = np.argmax(self.logits(model, x, batch_size), axis=-1)
        return float(np.mean(pred == np.asarray(y).reshape(-1)))
