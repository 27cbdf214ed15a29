"""The Keras adapter (hope_keras.graph.adapter), function by function.

Every private Keras attribute hope_keras reads goes through this module, so these
checks are what ``make test-keras-range`` proves on the oldest and newest supported
Keras: each compares the adapter's answer with one computed from public Keras APIs.
"""

import ast
import pathlib

import keras
import numpy as np

from conftest import L
from hope_keras.graph import adapter as kg

SRC = pathlib.Path(kg.__file__).parents[1]  # src/hope_keras


def _nested():
    keras.utils.set_random_seed(0)
    inner_in = keras.Input((6,), name="inner_x")
    inner = keras.Model(inner_in, L.Dense(5, name="dense")(L.Dense(4, name="in1")(inner_in)),
                        name="backbone")
    x = keras.Input((6,), name="x")
    h = inner(x)
    h = L.Dropout(0.5, name="drop")(h)
    out = L.Dense(3, name="dense")(h + 1.0)  # same name as a layer of the backbone
    return keras.Model(x, out, name="outer"), inner


def test_flatten_walks_nested_models_and_qualifies_repeated_names():
    model, inner = _nested()
    g = kg.flatten(model)
    keys = [n.key for n in g.nodes]
    assert keys[:2] == ["in1", "backbone/dense"] and keys[-1] == "dense"
    assert g.nodes[1].path == ("backbone",) and g.nodes[-1].path == ()
    assert g.layers["backbone/dense"] is inner.get_layer("dense")
    assert g.shapes[g.nodes[-1].outputs[0]] == (None, 3)
    assert g.outputs == g.nodes[-1].outputs
    # The Keras operation ``h + 1.0`` is a node with the constant among its arguments.
    op_node = g.nodes[-2]
    assert not isinstance(op_node.op, keras.layers.Layer)
    assert any(isinstance(a, float) and a == 1.0 for a in op_node.args)
    assert g.parents(g.nodes[-1]) == [op_node]


def test_rebuild_gives_the_same_function_with_the_same_layers():
    model, _ = _nested()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    copies = {}

    def call_node(node, tensors):
        args, kwargs = node.call_args(tensors)
        if not isinstance(node.op, keras.layers.Layer):  # a Keras operation
            return node.op(*args, **kwargs)
        config = dict(node.op.get_config(), name=kg.flat_name(node.key))
        layer = copies[node.key] = type(node.op).from_config(config)
        return layer(*args, **kwargs)

    flat = kg.rebuild(model, call_node, "flat")
    for key, layer in copies.items():
        layer.set_weights(kg.flatten(model).layers[key].get_weights())
    assert [layer.name for layer in flat.layers[1:]] == ["in1", "backbone_dense", "drop",
                                                         "dense"]
    assert not any(isinstance(layer, keras.Model) for layer in flat.layers)
    np.testing.assert_allclose(flat.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


def test_graph_queries_agree_with_public_apis():
    model, inner = _nested()
    dense_out = model.get_layer("dense")
    assert kg.producer_layer_of(model.outputs[0]) is dense_out
    assert kg.producer_layer_of(inner.outputs[0]) is inner.get_layer("dense")
    assert kg.input_layers_of(inner.get_layer("dense")) == [inner.get_layer("in1")]
    assert kg.inbound_count(inner.get_layer("in1")) == 1
    assert kg.inbound_count(L.Dense(2)) == 0
    assert {inner, inner.get_layer("in1"), model.get_layer("drop")} <= set(
        kg.nested_layers(model))
    assert kg.nested_layers(L.Dense(2)) == []
    assert kg.accepts_training(model.get_layer("drop"))
    assert kg.accepts_training(L.BatchNormalization())
    op_node = kg.flatten(model).nodes[-2]  # ``h + 1.0``: no training argument
    assert not isinstance(op_node.op, keras.layers.Layer)
    assert not kg.accepts_training(op_node.op)
    x = np.ones((2, 5), "float32")
    for layer in (dense_out, L.ReLU(), L.Dense(2)):  # may say yes; then it must work
        if kg.accepts_training(layer):
            assert tuple(layer(x, training=False).shape)[0] == 2


def test_call_shapes_and_counts_of_shared_layers():
    shared = L.Dense(2, name="shared")
    a, b = keras.Input((3,)), keras.Input((3,))
    keras.Model([a, b], [shared(a), shared(b)])
    assert kg.inbound_count(shared) == 2
    assert kg.call_shapes(shared) == [((None, 3), (None, 2))] * 2
    assert kg.call_shapes(L.Dense(2)) == []
    model, inner = _nested()
    assert kg.call_shapes(inner) == [((None, 6), (None, 5))]  # called inside `outer`


def test_run_through_graph_can_replace_operations():
    model, _ = _nested()
    fn = kg.functional_of(model)
    x = np.random.default_rng(1).normal(size=(2, 6)).astype("float32")
    same = kg.run_through_graph(fn, x, lambda op: op)
    np.testing.assert_allclose(np.asarray(same), model.predict(x, verbose=0), rtol=1e-6,
                               atol=1e-6)
    seen = []
    kg.run_through_graph(fn, x, lambda op: seen.append(op.name) or op)
    assert "drop" in seen and "backbone" in seen


def test_optional_classes_and_training_internals():
    found = kg.optional_classes("ops.numpy", ["Add", "NoSuchOp"])
    assert list(found) == ["Add"] and isinstance(found["Add"], type)
    assert kg.optional_classes("no_such_module", ["X"]) == {}
    model, _ = _nested()
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(kg.loss_tracker(model), keras.metrics.Mean)
    opt = keras.optimizers.SGD(momentum=0.9)
    opt.build(model.trainable_variables)
    assert [id(v) for v in kg.optimizer_trainable_variables(opt)] == [
        id(v) for v in model.trainable_variables]
    assert [id(v) for v in kg.optimizer_variables(opt)] == [id(v) for v in opt.variables]


def test_no_other_module_reads_keras_private_attributes():
    """Private Keras names are read in the adapter only (docs/architecture.md): the
    other modules stay on public Keras API across Keras releases."""
    private = {"_nodes_by_depth", "_keras_history", "_inbound_nodes", "_outbound_nodes",
               "_run_through_graph", "_standardize_inputs", "_flatten_layers",
               "_call_context_args", "_call_has_training_arg", "_functional",
               "_operations", "_loss_tracker", "_trainable_variables", "_variables",
               "_tracker", "arguments"}
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix().endswith("graph/adapter.py"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "keras.src"):
                name = node.module
            elif isinstance(node, ast.Import):
                name = next((a.name for a in node.names if a.name.startswith("keras.src")),
                            None)
            if name in private or (name or "").startswith("keras.src"):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {name}")
    assert offenders == []


def test_a_rebuild_takes_the_inputs_in_the_models_order():
    """A multi-input model's inputs keep their order through `slim` (the graph walk
    meets them by depth; a positional call must give the same outputs)."""
    import hope_keras

    ins = [keras.Input((8,), name=n) for n in "pqr"]
    hs = [L.ReLU()(L.BatchNormalization()(L.Dense(6)(i))) for i in ins]
    model = keras.Model(ins, L.Dense(3)(L.Concatenate()(hs)))
    xs = [np.random.default_rng(k).normal(size=(4, 8)).astype("float32") for k in range(3)]
    hope_keras.compress(model, density=0.6, verbose=False)
    small = hope_keras.slim(model)
    assert [t.name for t in small.inputs] == ["p", "q", "r"]
    np.testing.assert_allclose(np.asarray(small(xs)), np.asarray(model(xs)), atol=1e-5)
