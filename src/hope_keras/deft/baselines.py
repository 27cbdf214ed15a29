"""Transfer baselines in the DEFT harness: full FT, head-only, PEFT, EWC.

Every method is a map of gradient multipliers for `ElasticOptimizer` (plus, for EWC,
a penalty for `Trainer`), so all methods share one training loop:

* ``"full"``: everything trains;
* ``"head"``: only the new head trains;
* ``"peft"``: all 1-D tensors (biases, BN γ/β) and the new head train, kernels are
  frozen (appendix G.5);
* ``"ewc"``: everything trains, with ``λ/2 Σ F_k (θ_k − θ*_k)²`` over the backbone, ``F``
  the per-example diagonal Fisher over the source training set (eqs. 99–100);
* ``"deft"``: the plan's elasticities.

BatchNormalization runs in training mode for every method (as in DEFT), and source
retention restores the source BN statistics (appendix G.5).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import keras
import numpy as np

from hope_keras.deft.plan import find_head
from hope_keras.deft.retention import example_slice, num_examples
from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules

__all__ = ["METHODS", "replace_head", "method_elasticity", "diagonal_fisher",
           "EWCPenalty", "L2Penalty"]

METHODS = ("deft", "full", "head", "peft", "ewc")


def replace_head(model, units: int, head: Optional[str] = None, name: Optional[str] = None,
                 activation=None, seed: Optional[int] = None):
    """A new model: a copy of `model`'s backbone with a fresh Dense head.

    The backbone layers keep their names and weights (copied, not shared); the new
    head reads the old head's input. Call it inside ``strategy.scope()`` to create a
    distributed model.

    Args:
        model: The source model.
        units: Number of target classes.
        head: The source head (found automatically for one-output models).
        name: The new head's name (default ``"<head>_target"``).
        activation: The new head's activation (default: the source head's).
        seed: Seed of the new head's Glorot-uniform initialisation.

    Returns:
        The target `keras.Model`.

    Example:

    >>> import keras
    >>> from hope_keras.deft import replace_head
    >>> inputs = keras.Input((4,))
    >>> x = keras.layers.Dense(8, name="feat")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    >>> target = replace_head(model, 5)
    >>> target.output_shape, target.layers[-1].name
    ((None, 5), 'head_target')
    """
    head = head or find_head(model)
    try:
        clone = keras.models.clone_model(model)
    except NotImplementedError:  # a subclassed model without get_config
        raise ValueError(
            f"replace_head copies the backbone with keras.models.clone_model, which "
            f"cannot copy model '{model.name}' (a {type(model).__name__}, subclassed "
            f"without get_config). Build the target model yourself: the same backbone "
            f"layers (their names are the plan's keys) and a new Dense head, trained "
            f"with ElasticOptimizer(optimizer, plan).") from None
    clone.set_weights(model.get_weights())
    old = clone.get_layer(head)
    if activation is None:
        activation = keras.activations.serialize(old.activation)
    new = keras.layers.Dense(
        int(units), activation=activation, name=name or f"{head}_target",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed))
    outputs = new(old.input)
    inputs = clone.inputs[0] if len(clone.inputs) == 1 else clone.inputs
    return keras.Model(inputs, outputs, name=f"{model.name}_target")


def method_elasticity(method: str, model, plan=None, head: Optional[str] = None
                      ) -> Dict[str, object]:
    """The `ElasticOptimizer` elasticity map of a method, for the target `model`.

    The map names only layers of `model`. For ``"deft"`` it is the plan's map with the
    plan's source head (``plan.head``) replaced by `model`'s head, which is fully
    elastic (1.0): `replace_head` gives the new head another name, and the source
    head is not a layer of the target model.

    Args:
        method: One of ``METHODS``.
        model: The target model (its new head, found or given, stays elastic).
        plan: The `DeftPlan` (``"deft"`` only), made from the source model whose
            backbone `model` carries.
        head: The target head's name (found automatically by default).

    Returns:
        ``{layer name or 'layer/variable': elasticity}`` for `ElasticOptimizer`'s
        ``elasticity=`` (``"head"`` and ``"peft"``: each frozen variable by its path,
        a nested backbone's included).

    Raises:
        ValueError: An unknown method, ``"deft"`` without a plan, or a plan that
            names backbone layers `model` does not have (a plan of another model).

    Example:

    >>> import keras
    >>> from hope_keras import deft
    >>> inputs = keras.Input((4,))
    >>> h = keras.layers.Dense(8, use_bias=False, name="fc")(inputs)
    >>> h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="fc_bn")(h))
    >>> source = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    >>> target = deft.replace_head(source, 5)
    >>> emap = deft.method_elasticity("deft", target, plan=deft.plan(source))
    >>> "head" in emap, emap["head_target"]
    (False, 1.0)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}. Received: method={method!r}")
    head = head or find_head(model)
    if method == "deft":
        if plan is None:
            raise ValueError("method='deft' needs plan=<DeftPlan>.")
        return _plan_map_for(model, plan, head)
    if method in ("full", "ewc"):
        return {}
    # Keyed by variable path: the layers of a nested backbone are not `model.layers`.
    in_head = {id(v) for v in model.get_layer(head).trainable_weights}
    out = {}
    for v in model.trainable_variables:
        if id(v) in in_head:
            continue
        if method == "head" or len(v.shape) >= 2:  # peft: freeze tensors of rank ≥ 2
            out[v.path] = 0.0
    return out


def _plan_map_for(model, plan, head: str) -> Dict[str, object]:
    """The plan's elasticity map restricted to `model`, whose head `head` is elastic."""
    emap = plan.elasticity_map()
    names = {layer.name for layer in model.layers}
    replaced = head != plan.head
    if replaced:
        emap.pop(plan.head, None)  # the source head, replaced by `head`
    missing = sorted(k for k in emap if k.split("/")[0] not in names)
    if missing:
        raise ValueError(
            f"The plan names layers {missing[:8]} that model '{model.name}' does not "
            f"have: pass the target model made from the planned source model (plan "
            f"head {plan.head!r}; model head {head!r}).")
    if replaced:
        emap[head] = 1.0
    return emap


def diagonal_fisher(model, x, y, batch_size: int = 128, variables=None,
                    from_logits: Optional[bool] = None, method: str = "auto",
                    verbose: bool = False) -> Dict[str, np.ndarray]:
    """Per-example empirical diagonal Fisher (eq. 99): ``E_x[(∂L_CE/∂θ)²]``.

    Per-example gradients are squared and averaged over all of `x` (BN in inference
    mode, so examples are independent); this is not the square of batch-averaged
    gradients. Two vectorised implementations:

    * ``"layerwise"``: one batched backward pass gives each layer's input and output
      gradient for every example; per-example parameter gradients are then formed in
      closed form (Dense: outer products; Conv2D: image patches × output gradients;
      BN: sums of ``δ·x̂`` and ``δ``). Dense, Conv2D (linear activation, groups=1,
      channels-last) and BatchNormalization variables only.
    * ``"vmap"``: ``tf.vectorized_map`` over per-example gradient tapes (any layer;
      TF runs ``Conv2DBackpropFilter`` in a while_loop inside it, slower). Where
      TensorFlow's vectorisation fails at run time (a grouped 3-D convolution), the
      examples go one after another (`tf.map_fn`), with the same values.

    ``"auto"`` uses ``"layerwise"`` when every scored variable allows it.

    Args:
        model: The source model (with its source head).
        x, y: Source training inputs (one array, or a list of arrays for a model of
            several inputs) and integer labels.
        batch_size: Examples per vectorised batch.
        variables: Variables to score (default: trainable variables of every layer
            but the head).
        from_logits: Whether the model outputs logits (default: True unless its head
            has a softmax activation).
        method: ``"auto"``, ``"layerwise"`` or ``"vmap"``.

    Returns:
        ``{variable path: Fisher diagonal}``.

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.deft import diagonal_fisher
    >>> inputs = keras.Input((3,))
    >>> h = keras.layers.Dense(4, name="feat")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    >>> F = diagonal_fisher(model, np.ones((6, 3), "float32"), np.zeros(6, "int64"))
    >>> sorted(F), F["feat/kernel"].shape
    (['feat/bias', 'feat/kernel'], (3, 4))
    """
    import tensorflow as tf

    if method not in ("auto", "layerwise", "vmap"):
        raise ValueError(f"method must be 'auto', 'layerwise' or 'vmap'. Received: "
                         f"method={method!r}")
    head = find_head(model)
    if variables is None:
        variables = [v for l in model.layers if l.name != head for v in l.trainable_weights]
    variables = list(variables)
    if from_logits is None:
        act = getattr(model.get_layer(head), "activation", None)
        from_logits = getattr(act, "__name__", "") != "softmax"
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits,
                                                         reduction=None)
    batch_sum = None
    if method in ("auto", "layerwise"):
        batch_sum = _layerwise_fisher_fn(model, variables, loss_fn)
        if batch_sum is None and method == "layerwise":
            raise ValueError(
                "method='layerwise' supports Dense, Conv2D (linear activation, "
                "groups=1, channels_last) and BatchNormalization variables of a "
                "single-output model; use method='vmap' for this model.")
    if batch_sum is None:
        batch_sum = _vmap_fisher_fn(model, variables, loss_fn)

    total = [np.zeros(v.shape, np.float64) for v in variables]
    n = num_examples(x)
    y = np.asarray(y).astype(np.int64).reshape(-1)
    for start in range(0, n, batch_size):
        parts = batch_sum(tf.nest.map_structure(tf.convert_to_tensor,
                                                example_slice(x, start, start + batch_size)),
                          tf.convert_to_tensor(y[start:start + batch_size]))
        for t, p in zip(total, parts):
            t += p.numpy()
        if verbose:
            print(f"fisher: {min(start + batch_size, n)}/{n}", end="\r")
    return {v.path: (t / max(n, 1)).astype(np.float32) for v, t in zip(variables, total)}


def _vmap_fisher_fn(model, variables, loss_fn):
    """Per-example squared gradients, vectorised (`tf.vectorized_map`); where the
    vectorisation fails at run time (TensorFlow's converter mis-shapes grouped
    convolutions), one example after another (`tf.map_fn`) from then on."""
    import tensorflow as tf

    def one(args):
        xi, yi = args
        with tf.GradientTape() as tape:
            out = model(tf.nest.map_structure(lambda t: t[None], xi), training=False)
            loss = loss_fn(yi[None], out)[0]
        grads = tape.gradient(loss, variables)
        return [tf.zeros(v.shape, v.dtype) if g is None else tf.square(g)
                for g, v in zip(grads, variables)]

    @tf.function(reduce_retracing=True)
    def vectorised(xb, yb):
        return [tf.reduce_sum(s, axis=0) for s in tf.vectorized_map(one, (xb, yb))]

    @tf.function(reduce_retracing=True)
    def looped(xb, yb):
        spec = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        sq = tf.map_fn(one, (xb, yb), fn_output_signature=spec)
        return [tf.reduce_sum(s, axis=0) for s in sq]

    state = {"fn": vectorised}

    def batch_sum(xb, yb):
        if state["fn"] is vectorised:
            try:
                return vectorised(xb, yb)
            except tf.errors.InvalidArgumentError:
                state["fn"] = looped
        return looped(xb, yb)

    return batch_sum


def _layerwise_fisher_fn(model, variables, loss_fn):
    """The closed-form per-example Fisher of Dense/Conv2D/BN variables, or None."""
    import tensorflow as tf

    try:
        fg = kg.flatten(model)
    except ValueError:
        return None
    if len(fg.outputs) != 1 or len(fg.inputs) != 1 or any(c > 1 for c in fg.calls.values()):
        return None
    if any(not kg.is_layer(n.op) for n in fg.nodes):
        return None
    owner = {}
    for layer in fg.layers.values():
        for w in layer.trainable_weights:
            owner[id(w)] = layer
    kinds = {}
    for v in variables:
        layer = owner.get(id(v))
        if layer is None:
            return None
        rule = layer_rules.get(layer)
        linear = rule.activation(layer) is None
        if rule.kind == "dense" and linear:
            kinds[layer.name] = "dense"
        elif (rule.kind == "conv" and linear and len(layer.kernel.shape) == 4
              and layer.groups == 1 and layer.data_format == "channels_last"):
            kinds[layer.name] = "conv2d"  # the patches below: a 2-D convolution
        elif rule.normalization == "batch" and layer.axis in (
                -1, len(layer.input.shape) - 1):
            kinds[layer.name] = "bn"
        else:
            return None
    out_key = fg.outputs[0]

    @tf.function(reduce_retracing=True)
    def batch_sum(xb, yb):
        inputs, zeros = {}, {}
        with tf.GradientTape() as tape:
            values = {fg.inputs[0][0]: xb}
            for node in fg.nodes:
                layer, name = node.op, node.op.name
                args = [values[t] for t in node.inputs]
                arg = args[0] if len(args) == 1 else args
                out = layer(arg, training=False)
                if name in kinds:
                    z = tf.zeros_like(out)
                    tape.watch(z)
                    out = out + z
                    inputs[name], zeros[name] = arg, z
                values[node.outputs[0]] = out
            total = tf.reduce_sum(loss_fn(yb, values[out_key]))
        names = list(zeros)
        deltas = dict(zip(names, tape.gradient(total, [zeros[n] for n in names])))
        result = []
        for v in variables:
            layer = owner[id(v)]
            # float32 (a mixed-precision layer computes in float16)
            a, d = (tf.cast(t, tf.float32) for t in (inputs[layer.name], deltas[layer.name]))
            kind = kinds[layer.name]
            b = tf.shape(d)[0]
            if kind == "bn":
                xhat = (a - layer.moving_mean) * tf.math.rsqrt(
                    layer.moving_variance + layer.epsilon)
                term = d * xhat if v is layer.gamma else d
                per = tf.reduce_sum(tf.reshape(term, [b, -1, term.shape[-1]]), axis=1)
                result.append(tf.reduce_sum(tf.square(per), axis=0))
                continue
            if v is getattr(layer, "bias", None):
                per = tf.reduce_sum(tf.reshape(d, [b, -1, d.shape[-1]]), axis=1)
                result.append(tf.reduce_sum(tf.square(per), axis=0))
                continue
            if kind == "dense":
                a3 = tf.reshape(a, [b, -1, a.shape[-1]])
                d3 = tf.reshape(d, [b, -1, d.shape[-1]])
                g = tf.einsum("bpi,bpo->bio", a3, d3)
            else:
                kh, kw = layer.kernel_size
                sh, sw = layer.strides
                rh, rw = layer.dilation_rate
                patches = tf.image.extract_patches(
                    a, [1, kh, kw, 1], [1, sh, sw, 1], [1, rh, rw, 1],
                    layer.padding.upper())
                g = tf.einsum("bhwk,bhwo->bko", patches, d)
            result.append(tf.reshape(tf.reduce_sum(tf.square(g), axis=0), v.shape))
        return result

    return batch_sum


class EWCPenalty:
    """``λ/2 Σ_k F_k (θ_k − θ*_k)²`` over the variables in `fisher` (eq. 100).

    Args:
        model: The target model; its current values of the Fisher's variables are the
            anchor ``θ*`` (create the penalty before fine-tuning).
        fisher: ``{variable path: Fisher diagonal}`` (`diagonal_fisher`, usually of
            the source model; a weight Keras named by its counter, ``"variable_2"``,
            is matched to the model's within its layer, in creation order).
        lam: ``λ``.
    """

    def __init__(self, model, fisher: Dict[str, np.ndarray], lam: float):
        import tensorflow as tf

        by_path = {v.path: v for v in model.trainable_variables}
        match = _match_paths(model, fisher)
        self.lam = float(lam)
        keys = sorted(fisher)
        self.paths = [match[k] for k in keys]
        self.fisher = [tf.constant(fisher[k]) for k in keys]
        self.anchor = [tf.constant(by_path[p].numpy()) for p in self.paths]

    def __call__(self, model):
        import tensorflow as tf

        by_path = {v.path: v for v in model.trainable_variables}
        total = 0.0
        for p, f, a in zip(self.paths, self.fisher, self.anchor):
            total += tf.reduce_sum(f * tf.square(by_path[p] - a))
        return 0.5 * self.lam * total


_UNNAMED = re.compile(r"variable(_\d+)?$")


def _match_paths(model, fisher) -> Dict[str, str]:
    """``{Fisher key: path of the same variable in model}``. Keras names a weight
    created without a name after a process-wide counter (``"layer/variable_2"``), so
    a copy of the source (`replace_head`) names it differently: those are matched
    within their layer, in creation order, by shape."""
    by_path = {v.path: v for v in model.trainable_variables}
    out = {k: k for k in fisher if k in by_path}
    missing = [k for k in fisher if k not in by_path]

    def unnamed(path):
        return _UNNAMED.match(path.rsplit("/", 1)[-1]) is not None

    def order(path):
        tail = path.rsplit("_", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    free = {}
    for path in by_path:
        if path not in out.values() and unnamed(path):
            free.setdefault(path.rsplit("/", 1)[0], []).append(path)
    wanted = {}
    for k in missing:
        if unnamed(k):
            wanted.setdefault(k.rsplit("/", 1)[0], []).append(k)
    for layer, keys in wanted.items():
        keys, paths = sorted(keys, key=order), sorted(free.get(layer, []), key=order)
        if len(keys) == len(paths) and all(
                tuple(by_path[p].shape) == tuple(np.shape(fisher[k]))
                for k, p in zip(keys, paths)):
            out.update(zip(keys, paths))
    unmatched = [k for k in fisher if k not in out]
    if unmatched:
        raise ValueError(
            f"EWC: model '{model.name}' has no trainable variables {unmatched[:5]} "
            "(Fisher keys are variable paths of the source model).")
    return out


class L2Penalty:
    """``l2 · Σ ‖W‖²`` over trainable tensors of rank > 1 (appendix G.3 fine-tuning)."""

    def __init__(self, l2: float):
        self.l2 = float(l2)

    def __call__(self, model):
        import tensorflow as tf

        return self.l2 * tf.add_n([tf.reduce_sum(tf.square(v))
                                   for v in model.trainable_variables if len(v.shape) > 1])
