"""The one adapter to Keras's private internals: a model as a flat list of calls.

Keras 3 keeps a Functional model's graph in private attributes (``_nodes_by_depth``,
``Node.arguments``, ``KerasTensor._keras_history``, ``Layer._inbound_nodes``), and
some classes hope_keras needs live only in private modules (``keras.src...``). This
is the only module of hope_keras that reads them (and the few private attributes of
models and optimizers that the training wrappers need); everything else works on the
`FlatGraph` and the small functions here. The supported Keras range is stated in
``pyproject.toml``; ``make test-keras-range`` runs the walker, registry, slim and
engine tests on its oldest and newest versions (see docs/architecture.md).

A `FlatGraph` is the model with every nested Functional/Sequential sub-model
expanded inline: one `FlatNode` per call of a layer (or of a Keras operation such
as ``x + 3.0``), in a topological order, connected by *tensor keys*. A layer keeps
its own name as its key unless another layer of the flattened model has the same
name (nested models may repeat names); then the key is qualified with the path of
sub-model names, ``"backbone/conv1"``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import keras
import numpy as np

__all__ = ["FlatGraph", "FlatNode", "flatten", "rebuild", "functional_of", "flat_name",
           "producer_layer_of", "input_layers_of", "is_layer", "is_input_layer",
           "inbound_count", "call_shapes", "nested_layers", "accepts_training",
           "run_through_graph", "optional_classes", "loss_tracker", "optimizer_variables",
           "optimizer_trainable_variables"]


@dataclasses.dataclass
class FlatNode:
    """One call of a layer (or Keras operation) in the flattened graph.

    Attributes:
        index: Position in `FlatGraph.nodes` (a topological order).
        key: The layer's key (its name, or a path-qualified name; see module doc).
        op: The `keras.layers.Layer` or `keras.Operation` that was called.
        inputs: Keys of the tensors it reads, in the order of its call arguments.
        outputs: Keys of the tensors it produces.
        path: Names of the sub-models it sits in, outermost first.
    """

    index: int
    key: str
    op: object
    inputs: List[str]
    outputs: List[str]
    path: Tuple[str, ...]
    _node: object = dataclasses.field(repr=False, default=None)
    _local: Dict[int, str] = dataclasses.field(repr=False, default_factory=dict)

    def call_args(self, tensors: Dict[str, object]):
        """The call's ``(args, kwargs)`` with tensor keys replaced from `tensors`."""
        table = {tid: tensors[key] for tid, key in self._local.items() if key in tensors}
        return self._node.arguments.fill_in(table)

    @property
    def args(self) -> tuple:
        """The call's positional arguments as recorded (symbolic tensors, constants)."""
        return tuple(self._node.arguments.args)


@dataclasses.dataclass
class FlatGraph:
    """A model's calls, flattened through nested sub-models (see module doc).

    Attributes:
        model: The model it was read from.
        nodes: Every call, in topological order (model inputs excluded).
        layers: Layer key → layer object.
        calls: Layer key → number of calls.
        producer: Tensor key → (node index, output position); model inputs absent.
        consumers: Tensor key → indices of the nodes that read it.
        shapes: Tensor key → its symbolic shape (batch axis first).
        inputs: Tensor keys of the model inputs, with their `InputLayer`s.
        outputs: Tensor keys of the model outputs, flattened.
    """

    model: object
    nodes: List[FlatNode]
    layers: Dict[str, object]
    calls: Dict[str, int]
    producer: Dict[str, Tuple[int, int]]
    consumers: Dict[str, List[int]]
    shapes: Dict[str, Tuple]
    inputs: List[Tuple[str, object]]
    outputs: List[str]

    def nodes_of(self, key: str) -> List[FlatNode]:
        """Every call of the layer `key`."""
        return [n for n in self.nodes if n.key == key]

    def node_of(self, key: str) -> FlatNode:
        """The single call of layer `key` (raises for a shared layer)."""
        found = self._first.get(key)
        if found is None:
            raise KeyError(f"No layer '{key}' in model '{self.model.name}'.")
        return self.nodes[found]

    def __post_init__(self):
        self._first = {}
        for n in self.nodes:
            self._first.setdefault(n.key, n.index)
        self._outs = set(self.outputs)

    def producer_node(self, tensor: str) -> Optional[FlatNode]:
        """The node that produces `tensor` (None for a model input)."""
        p = self.producer.get(tensor)
        return None if p is None else self.nodes[p[0]]

    def children(self, node: FlatNode) -> List[FlatNode]:
        """The nodes that read any output of `node`."""
        out, seen = [], set()
        for t in node.outputs:
            for k in self.consumers.get(t, ()):
                if k not in seen:
                    seen.add(k)
                    out.append(self.nodes[k])
        return out

    def parents(self, node: FlatNode) -> List[Optional[FlatNode]]:
        """The nodes producing each input of `node` (None for model inputs)."""
        return [self.producer_node(t) for t in node.inputs]

    def is_output(self, tensor: str) -> bool:
        """Whether `tensor` is a model output."""
        return tensor in self._outs


def functional_of(model):
    """The Functional graph behind a Functional or Sequential model.

    A subclassed model is traced into an equivalent Functional model of its own
    layers (`hope_keras.graph.tracing.traced`).

    Raises:
        ValueError: for unbuilt models, and (`hope_keras.graph.tracing.TracingError`) for
            subclassed models whose `call` cannot be traced.
    """
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise ValueError(
                f"Sequential model '{model.name}' is not built. Build it first, e.g. "
                "by giving it a `keras.Input(shape)` as first layer or calling "
                "`model.build(input_shape)`."
            )
        return functional
    if not isinstance(model, keras.Model):
        hint = (" Load a saved model first: keras.models.load_model(path)."
                if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__") else "")
        raise ValueError(
            f"hope_keras needs a keras.Model (Functional or Sequential). Received: "
            f"{type(model).__name__} {model!r:.80}.{hint}")
    if not hasattr(model, "_nodes_by_depth"):
        # A subclassed model: its `call` traced once into a Functional model of the
        # same layers (hope_keras.graph.tracing), or a TracingError naming what failed.
        from hope_keras.graph import tracing

        return tracing.traced(model)
    return model


def is_subclassed(model) -> bool:
    """Whether `model` is a `keras.Model` that is neither Functional nor Sequential."""
    return (isinstance(model, keras.Model) and not isinstance(model, keras.Sequential)
            and not hasattr(model, "_nodes_by_depth"))


def is_layer(op) -> bool:
    """Whether a graph node's `op` is a `keras.layers.Layer` (with weights, a config
    and a name to rebuild it by), not a stateless Keras operation (``x + 3.0``)."""
    return isinstance(op, keras.layers.Layer)


def is_input_layer(layer) -> bool:
    """Whether `layer` is a model's `keras.layers.InputLayer` (``model.layers`` of a
    Functional model lists them)."""
    return isinstance(layer, keras.layers.InputLayer)


def build_shapes(model) -> dict:
    """The input shapes a layer or model was built with (``{argument: shape}``)."""
    return dict(getattr(model, "_build_shapes_dict", None) or {})


def weight_view(variable) -> np.ndarray:
    """A weight's values as numpy, without a copy where the backend allows it (on
    TensorFlow a read-only view of the variable's buffer)."""
    value = getattr(variable, "value", None)
    try:
        return np.asarray(value.value() if hasattr(value, "value") else variable.numpy())
    except (AttributeError, TypeError, ValueError):
        return np.asarray(keras.ops.convert_to_numpy(variable))


def trusted_deserialization():
    """A context in which ``from_config`` may rebuild layers that Keras' safe mode
    refuses (a `Lambda` of a Python function): `slim` and `calibrate` copy layers of a
    model already in memory, not of an untrusted file."""
    try:
        from keras.src.saving.serialization_lib import SafeModeScope
    except ImportError:  # pragma: no cover - a Keras without it has no safe mode here
        import contextlib

        return contextlib.nullcontext()
    return SafeModeScope(False)


def _is_submodel(op) -> bool:
    return isinstance(op, keras.Model) and not isinstance(op, keras.layers.InputLayer)


def _ordered_nodes(functional):
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        yield from functional._nodes_by_depth[depth]


def flatten(model) -> FlatGraph:
    """Reads `model` (Functional or Sequential, nested or not) into a `FlatGraph`.

    Example:

    >>> import keras
    >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    >>> x = keras.Input((4,))
    >>> outer = keras.Model(x, keras.layers.Dense(2, name="head")(inner(x)))
    >>> [n.key for n in flatten(outer).nodes]
    ['d', 'head']
    """
    top = functional_of(model)
    raw: List[dict] = []
    counter = [0]

    def new_key():
        counter[0] += 1
        return f"t{counter[0]}"

    inputs: List[Tuple[str, object]] = []

    def walk(functional, path, mapping: Dict[int, str]):
        for node in _ordered_nodes(functional):
            op = node.operation
            if isinstance(op, keras.layers.InputLayer):
                out = node.outputs[0]
                if id(out) not in mapping:  # a top-level model input
                    key = new_key()
                    mapping[id(out)] = key
                    inputs.append((key, op))
                continue
            in_keys, local = [], {}
            for t in node.input_tensors:
                key = mapping.get(id(t))
                if key is None:  # a tensor made outside this graph (a constant input)
                    key = mapping[id(t)] = new_key()
                in_keys.append(key)
                local[id(t)] = key
            if _is_submodel(op):
                inner = functional_of(op)
                inner_map: Dict[int, str] = {}
                inner_inputs = keras.tree.flatten(inner.inputs)
                if len(inner_inputs) != len(in_keys):
                    raise ValueError(
                        f"Cannot read the nested model '{op.name}': it is called with "
                        f"{len(in_keys)} tensors but has {len(inner_inputs)} inputs.")
                for t, key in zip(inner_inputs, in_keys):
                    inner_map[id(t)] = key
                walk(inner, path + (op.name,), inner_map)
                for t_out, t_in in zip(node.outputs, keras.tree.flatten(inner.outputs)):
                    mapping[id(t_out)] = inner_map[id(t_in)]
                continue
            out_keys = []
            for t in node.outputs:
                key = mapping[id(t)] = new_key()
                out_keys.append(key)
            raw.append(dict(op=op, inputs=in_keys, outputs=out_keys, path=path,
                            node=node, local=local,
                            shapes=[tuple(t.shape) for t in node.outputs]))

    top_map: Dict[int, str] = {}
    # The model's inputs first, in its own order (the walk meets them by depth, which
    # is not that order, and a rebuild must take its inputs as the model did).
    input_ops = {id(node.outputs[0]): node.operation for node in _ordered_nodes(top)
                 if isinstance(node.operation, keras.layers.InputLayer)}
    for t in keras.tree.flatten(top.inputs):
        if id(t) in input_ops and id(t) not in top_map:
            top_map[id(t)] = new_key()
            inputs.append((top_map[id(t)], input_ops[id(t)]))
    walk(top, (), top_map)
    # Layer keys: plain names unless two distinct layers share a name.
    by_name: Dict[str, set] = {}
    for r in raw:
        by_name.setdefault(r["op"].name, set()).add(id(r["op"]))
    keys: Dict[int, str] = {}
    used = set()
    for r in raw:
        op = r["op"]
        if id(op) in keys:
            continue
        key = op.name if len(by_name[op.name]) == 1 else "/".join(r["path"] + (op.name,))
        base, k = key, 1
        while key in used:
            key, k = f"{base}_{k}", k + 1
        used.add(key)
        keys[id(op)] = key
    nodes, layers, calls, producer, consumers, shapes = [], {}, {}, {}, {}, {}
    for key, layer in inputs:
        shapes[key] = tuple(layer.batch_shape)
    for idx, r in enumerate(raw):
        key = keys[id(r["op"])]
        nodes.append(FlatNode(idx, key, r["op"], r["inputs"], r["outputs"], r["path"],
                              r["node"], r["local"]))
        layers[key] = r["op"]
        calls[key] = calls.get(key, 0) + 1
        for pos, (t, shape) in enumerate(zip(r["outputs"], r["shapes"])):
            producer[t] = (idx, pos)
            shapes[t] = shape
        for t in r["inputs"]:
            consumers.setdefault(t, []).append(idx)
    outputs = [top_map[id(t)] for t in keras.tree.flatten(top.outputs)]
    return FlatGraph(model, nodes, layers, calls, producer, consumers, shapes, inputs,
                     outputs)


def rebuild(model, call_node: Callable, name: str, graph: Optional[FlatGraph] = None):
    """Rebuilds a model call by call, as one flat Functional model.

    Args:
        model: The model to rebuild (not changed). Nested sub-models are inlined.
        call_node: ``call_node(node, tensors)`` returns the new output(s) of the
            `FlatNode` ``node`` (usually a new layer called on
            ``node.call_args(tensors)``), or None to drop it; ``tensors`` maps
            tensor keys to the new tensors (the caller may add entries).
        name: Name of the new model.
        graph: ``flatten(model)``, if already computed.

    Returns:
        A new Functional `keras.Model` with fresh inputs of the same shapes.
    """
    g = graph or flatten(model)
    tensors: Dict[str, object] = {}
    new_inputs = []
    for key, layer in g.inputs:
        t = keras.Input(batch_shape=layer.batch_shape, dtype=layer.dtype, name=layer.name)
        tensors[key] = t
        new_inputs.append(t)
    for node in g.nodes:
        outputs = call_node(node, tensors)
        if outputs is None:
            continue
        for key, t in zip(node.outputs, keras.tree.flatten(outputs)):
            tensors[key] = t
    outputs = [tensors[k] for k in g.outputs]
    # Several outputs keep the model's structure (a dict stays a dict, by its keys).
    struct = getattr(functional_of(model), "_outputs_struct", None)
    if len(outputs) > 1 and struct is not None and len(keras.tree.flatten(struct)) == len(
            outputs):
        outputs = keras.tree.pack_sequence_as(struct, outputs)
    elif len(outputs) == 1:
        outputs = outputs[0]
    return keras.Model(inputs=new_inputs if len(new_inputs) > 1 else new_inputs[0],
                       outputs=outputs, name=name)


def flat_name(key: str) -> str:
    """The layer name a key gets in a flattened (rebuilt) model: Keras names cannot
    hold ``/``."""
    return key.replace("/", "_")


def producer_layer_of(tensor):
    """The layer that produced a symbolic `KerasTensor` (e.g. ``model.outputs[0]``)."""
    return tensor._keras_history.operation


def input_layers_of(layer) -> List[object]:
    """The layers feeding the first call of `layer` (for a layer called once)."""
    node = layer._inbound_nodes[0]
    return [t._keras_history.operation for t in node.input_tensors]


def inbound_count(layer) -> int:
    """How many times `layer` was called in a graph."""
    return len(layer._inbound_nodes)


def call_shapes(layer) -> List[Tuple[tuple, tuple]]:
    """``(input shape, output shape)`` of every symbolic call of `layer` (first
    input and output of each call)."""
    out = []
    for node in layer._inbound_nodes:
        ins, outs = list(node.input_tensors), list(node.outputs)
        if ins and outs:
            out.append((tuple(ins[0].shape), tuple(outs[0].shape)))
    return out


def nested_layers(layer) -> List[object]:
    """Every layer inside a nested model/layer (empty for a plain layer)."""
    fn = getattr(layer, "_flatten_layers", None)
    return list(fn(include_self=False)) if fn is not None else []


def optional_classes(module: str, names) -> Dict[str, type]:
    """Classes that exist only in a private Keras module (``keras.src.<module>``):
    ``{name: class}`` for those this Keras version has (empty if the module is absent).
    """
    import importlib

    try:
        mod = importlib.import_module(f"keras.src.{module}")
    except ImportError:
        return {}
    return {n: getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)}


def loss_tracker(model):
    """The `keras.metrics.Mean` that a compiled model's ``fit`` reports as ``loss``
    (a custom ``train_step`` updates it)."""
    return model._loss_tracker


def optimizer_variables(optimizer) -> list:
    """The variables an optimizer created itself (``iterations``, learning rate,
    slots), without those of the optimizers it wraps."""
    return list(optimizer._variables)


def optimizer_trainable_variables(optimizer) -> list:
    """The model variables an optimizer was built for, in its slot order."""
    return list(optimizer._trainable_variables)


def accepts_training(op) -> bool:
    """Whether calling `op` takes a ``training`` argument."""
    return "training" in getattr(op, "_call_context_args", ()) or bool(
        getattr(op, "_call_has_training_arg", False))


def input_names(model) -> list:
    """The names a dict of the model's inputs is keyed by, in the order of
    ``model.inputs``: a Functional model built on a dict of inputs, its keys; else
    its input tensors' names (Keras' `Functional._standardize_inputs` reads both)."""
    functional = functional_of(model)
    struct = getattr(functional, "_inputs_struct", None)
    if isinstance(struct, dict):
        return sorted(struct)  # keras.tree.flatten orders a dict by its keys
    return [t.name for t in functional.inputs]


def run_through_graph(functional, x, operation_fn):
    """Runs a Functional model on `x`, each operation replaced by
    ``operation_fn(op)`` (inputs cast to the model's input dtypes)."""
    from keras import ops

    inputs = functional._standardize_inputs(x)
    inputs = [ops.cast(t, ref.dtype) for t, ref in zip(inputs, functional.inputs)]
    return functional._run_through_graph(inputs, operation_fn=operation_fn)


def graph_function(fn, jit_compile: bool = False):
    """``fn`` compiled with ``tf.function``, without autograph.

    The library's compiled steps walk the graph in Python and call each layer.
    Autograph would convert the walk, which needs no conversion, at most of the
    tracing time (half a small model's `compress`), and it leaves the layers' calls
    as they are: Keras layer code is not converted either way, so a layer that
    branches in Python on a tensor fails in both. ``jit_compile=True`` has XLA
    compile the whole function (slower to compile, faster to run; a graph with an
    operation XLA has no kernel for raises ``tf.errors.InvalidArgumentError`` on
    the first call, before anything runs).
    """
    import tensorflow as tf

    return tf.function(fn, reduce_retracing=True, autograph=False,
                       jit_compile=bool(jit_compile))
