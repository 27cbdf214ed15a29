"""`ElasticOptimizer`: gradient scaling by neuron elasticity (docs/theory.md §9, eq. 29)."""

from __future__ import annotations

from typing import Dict, Optional

import keras
import numpy as np
from keras import ops

from hope_keras.graph import adapter as kg

__all__ = ["ElasticOptimizer"]


def _normalise_map(elasticity) -> Dict[str, object]:
    out = {}
    for key, value in dict(elasticity or {}).items():
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"Elasticity of '{key}' must be a number or a (nested) list of numbers. "
                f"Received: {value!r}") from None
        if not np.all(np.isfinite(arr)) or np.any(arr < 0) or np.any(arr > 1):
            raise ValueError(f"Elasticity of '{key}' must be in [0, 1] (a gradient "
                             f"multiplier). Received: {value!r}")
        out[str(key)] = float(arr) if arr.ndim == 0 else arr.tolist()
    return out


@keras.saving.register_keras_serializable(package="hope_keras")
class ElasticOptimizer(keras.optimizers.Optimizer):
    """Wraps an optimizer and scales each gradient by its neuron's elasticity (eq. 29).

    Every gradient of a parameter that belongs to output channel ``b`` of a layer (the
    last axis of a kernel, bias, BN γ/β) is multiplied by ``e_b`` before the inner
    optimizer sees it. With ``e_b = 0`` the parameter never moves and its optimizer
    state (SGD momentum, Adam moments) stays exactly zero, so masked and frozen
    weights stay bit-identical. Works in ``model.fit`` and in custom loops, under
    ``tf.distribute`` strategies, like `keras.optimizers.LossScaleOptimizer`.

    A variable's elasticity is looked up by its path (``"layer/kernel"``), then by its
    layer name; variables of layers not in the map (for instance a new target head)
    get ``default``.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap. Decoupled weight
            decay and EMA are refused (they would move frozen parameters); use a
            kernel regularizer or an explicit L2 term instead (its gradient is scaled).
        plan: A `hope_keras.deft.DeftPlan` (its ``elasticity_map()`` is used).
        elasticity: Or a map ``{layer or "layer/variable": number or list over the
            output channels}`` (a nested list over a variable's last axes where its
            channels are not last, 1 where it broadcasts: ``(C, 1)`` for a depthwise
            or a transposed convolution's kernel); entries here override the plan's.
        default: Elasticity of variables found in neither.
        name: Optimizer name.

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.deft import ElasticOptimizer
    >>> inputs = keras.Input((4,))
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="fc")(inputs))
    >>> opt = ElasticOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
    ...                        elasticity={"fc": [1.0, 0.0]})
    >>> model.compile(opt, "mse")
    >>> before = model.get_layer("fc").kernel.numpy()
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=2, verbose=0)
    >>> after = model.get_layer("fc").kernel.numpy()
    >>> bool((after[:, 1] == before[:, 1]).all()), bool((after[:, 0] != before[:, 0]).all())
    (True, True)
    """

    def __init__(self, inner_optimizer, plan=None, *, elasticity=None,
                 default: float = 1.0, name: Optional[str] = None, **kwargs):
        if kwargs:
            raise ValueError(
                "ElasticOptimizer does not support arguments "
                f"{sorted(kwargs)}; set them on the inner optimizer.")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "inner_optimizer must be a keras.optimizers.Optimizer. Received: "
                f"{type(inner_optimizer).__name__}")
        wd = getattr(inner_optimizer, "weight_decay", None)
        if wd:
            raise ValueError(
                f"The inner optimizer {type(inner_optimizer).__name__} has decoupled "
                f"weight_decay={wd}, which would move frozen parameters. Set "
                "weight_decay=None and use an L2 term in the loss (its gradient is "
                "scaled by the elasticity).")
        if getattr(inner_optimizer, "use_ema", False):
            raise ValueError(
                "The inner optimizer has use_ema=True; EMA overwrites would move frozen "
                "parameters. Received: use_ema=True.")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        merged = {}
        if plan is not None:
            if isinstance(plan, dict):
                merged.update(plan)
            elif hasattr(plan, "elasticity_map"):
                merged.update(plan.elasticity_map())
            else:
                raise ValueError(
                    "plan must be a DeftPlan or an elasticity dict. Received: "
                    f"{type(plan).__name__}")
        # A plan's keys are checked together at `build`: none matching means the plan
        # was made for another model (its layer names differ).
        self._plan_keys = set(_normalise_map(merged))
        merged.update(elasticity or {})
        self.elasticity = _normalise_map(merged)
        # Keys given by hand are checked against the variables at `build` (a typo
        # would freeze nothing); a plan's map also names layers a new head replaces.
        self._given_keys = set(_normalise_map(elasticity))
        self.default = float(default)
        self._scale_cache: Dict[str, object] = {}

    # ------------------------------------------------------------------ scaling
    def elasticity_of(self, variable):
        """The elasticity (float or numpy vector) that applies to `variable`."""
        path = getattr(variable, "path", None) or getattr(variable, "name", "")
        parts = path.split("/")
        candidates = [path]
        if len(parts) >= 2:
            candidates += ["/".join(parts[-2:]), parts[-2]]
        for key in candidates:
            if key in self.elasticity:
                value = self.elasticity[key]
                if isinstance(value, list):
                    value = np.asarray(value, dtype=np.float64)
                    shape = tuple(int(d) for d in variable.shape)
                    last = shape[len(shape) - value.ndim:]
                    if value.ndim > len(shape) or any(
                            v != s and (v != 1 or k == 0)
                            for k, (v, s) in enumerate(zip(value.shape, last))):
                        raise ValueError(
                            f"Elasticity of '{key}' has shape {value.shape} but variable "
                            f"'{path}' has shape {shape}: a list must match its last "
                            "(output-channel) axis, or its last axes, the channels first "
                            "and 1 where it broadcasts (a depthwise or transposed "
                            "convolution's kernel: (channels, 1)).")
                    if np.all(value == value.ravel()[0]):
                        return float(value.ravel()[0])
                return value
        return self.default

    def scale_gradients(self, grads, trainable_variables):
        """Returns the gradients multiplied by each variable's elasticity."""
        out = []
        for g, v in zip(grads, trainable_variables):
            if g is None:
                out.append(g)
                continue
            e = self.elasticity_of(v)
            if isinstance(e, float):
                if e == 1.0:
                    out.append(g)
                elif e == 0.0:
                    out.append(ops.zeros_like(g))
                else:
                    out.append(ops.multiply(g, ops.cast(e, g.dtype)))
            else:
                out.append(ops.multiply(g, ops.convert_to_tensor(e, dtype=g.dtype)))
        return out

    # -------------------------------------------------------------- optimizer API
    def build(self, var_list):
        # A key that names no variable would silently freeze nothing (a typo).
        names = set()
        for v in var_list:
            parts = (getattr(v, "path", None) or getattr(v, "name", "")).split("/")
            names |= {"/".join(parts)} | ({"/".join(parts[-2:]), parts[-2]}
                                          if len(parts) >= 2 else set())
        unknown = sorted(k for k in self._given_keys if k not in names)
        if unknown:
            raise ValueError(
                f"Elasticity keys {unknown[:8]} match no variable being trained (keys are "
                "layer names or 'layer/variable' paths, e.g. "
                f"{sorted(names)[:3]}).")
        if self._plan_keys and not self._plan_keys & names:
            raise ValueError(
                f"None of the plan's {len(self._plan_keys)} layer names (e.g. "
                f"{sorted(self._plan_keys)[:3]}) names a variable being trained (e.g. "
                f"{sorted(names)[:3]}): the plan was made for another model. Make the "
                "plan from this model's source (deft.plan, then plan.apply).")
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return kg.optimizer_variables(self) + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        tvs = trainable_variables if trainable_variables is not None else \
            kg.optimizer_trainable_variables(self)
        scaled = self.scale_gradients(list(grads), list(tvs))
        return self.inner_optimizer.apply(scaled, trainable_variables=trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        scaled = self.scale_gradients(list(grads), kg.optimizer_trainable_variables(self))
        n_own = len(kg.optimizer_variables(self))
        own = list(optimizer_variables[:n_own])
        new_vars, new_inner = self.inner_optimizer.stateless_apply(
            optimizer_variables[n_own:], scaled, trainable_variables)
        return new_vars, own + list(new_inner)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if hasattr(self, "inner_optimizer"):
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def __repr__(self) -> str:
        return (f"ElasticOptimizer(inner={type(self.inner_optimizer).__name__}, "
                f"elasticity={len(self.elasticity)} keys, default={self.default:g})")

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "elasticity": self.elasticity,
            "default": self.default,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects)
        optimizer = cls(inner, **config)
        optimizer._given_keys = set()  # a saved map (a plan's included) was checked
        optimizer._plan_keys = set()
        return optimizer
