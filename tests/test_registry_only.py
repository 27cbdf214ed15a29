"""Layer pattern questions go through the layer registry.

"Is this a batch normalisation, a residual Add, a Dense producer, an activation?" is
asked of `hope_keras.layers.get(layer)` (the rule of the layer's type), so that a
layer type a user registers answers it too. Only the registry module itself and the
Keras adapter may test a layer's Keras class (``isinstance``, ``issubclass``,
``type(layer) is …``, or its class name compared with a string). Read from the source
with `ast`.
"""

import ast
import pathlib

import keras
import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "hope_keras"

#: The modules allowed to test a layer's Keras class (paths under src/hope_keras):
#: the layer registry and the Keras adapter.
ALLOWED = {"graph/layers.py", "graph/adapter.py"}

#: Names that `keras.layers` exports as classes ("Dense", "Layer", …): a string
#: compared with a class name is a layer class test in disguise when it is one of these.
KERAS_LAYER_NAMES = {n for n in dir(keras.layers) if isinstance(getattr(keras.layers, n), type)}

_LAYER_MODULES = ("keras.layers", "tf.keras.layers", "tensorflow.keras.layers",
                  "keras.src.layers")


def _dotted(node):
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _LayerClassFinder:
    """Which expressions of one module name a Keras layer class."""

    def __init__(self, tree):
        self.module_aliases = set(_LAYER_MODULES)  # names bound to keras.layers
        self.class_names = set()  # names bound to layer classes (or tuples of them)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in _LAYER_MODULES:
                        self.module_aliases.add(alias.asname or alias.name)
                    elif node.module in _LAYER_MODULES or node.module.startswith(
                            "keras.src.layers"):
                        self.class_names.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in _LAYER_MODULES and alias.asname:
                        self.module_aliases.add(alias.asname)
        # Assignments (``L = keras.layers``, ``_NOISE = (keras.layers.Dropout, …)``),
        # until nothing new is learnt.
        assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
        changed = True
        while changed:
            changed = False
            for node in assigns:
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if _dotted(node.value) in self.module_aliases:
                    new = set(names) - self.module_aliases
                    self.module_aliases |= new
                elif self.names_layer_class(node.value):
                    new = set(names) - self.class_names
                    self.class_names |= new
                else:
                    continue
                changed = changed or bool(new)

    def names_layer_class(self, node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(self.names_layer_class(e) for e in node.elts)
        if isinstance(node, ast.BinOp):  # (A, B) + (C,)
            return self.names_layer_class(node.left) or self.names_layer_class(node.right)
        dotted = _dotted(node)
        if dotted is None:
            return False
        if dotted in self.class_names:
            return True
        head, _, _ = dotted.rpartition(".")
        return any(head == m or head.startswith(m + ".") for m in self.module_aliases)


def _is_class_name(node) -> bool:
    """``type(x).__name__``, ``x.__class__.__name__`` or ``x.__class__.__qualname__``."""
    if not (isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__")):
        return False
    inner = node.value
    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) \
            and inner.func.id == "type":
        return True
    return isinstance(inner, ast.Attribute) and inner.attr == "__class__"


def _is_type_of(node) -> bool:
    """``type(x)`` or ``x.__class__``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "type" and len(node.args) == 1:
        return True
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _layer_name_strings(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & KERAS_LAYER_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_layer_name_strings(e) for e in node.elts)) if node.elts \
            else set()
    return set()


def layer_class_tests(source: str):
    """``[(line, code)]`` of the layer class tests in a module's source."""
    tree = ast.parse(source)
    finder = _LayerClassFinder(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2 \
                and finder.names_layer_class(node.args[1]):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            by_name = any(_is_class_name(s) for s in sides) and any(
                _layer_name_strings(s) for s in sides)
            by_class = any(_is_type_of(s) for s in sides) and any(
                finder.names_layer_class(s) for s in sides)
            if by_name or by_class:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _modules():
    return {str(p.relative_to(PACKAGE)): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_only_the_registry_and_the_adapter_test_layer_classes():
    found = []
    for rel, path in _modules().items():
        if rel in ALLOWED:
            continue
        for line, code in layer_class_tests(path.read_text()):
            found.append(f"{rel}:{line}: {code}")
    assert not found, ("layer class tests outside the registry (ask hope_keras.layers."
                       "get(layer) instead):\n" + "\n".join(found))


def test_the_allowed_modules_exist():
    # A renamed registry or adapter must be renamed in ALLOWED too.
    assert any((PACKAGE / rel).exists() for rel in ("layers.py", "graph/layers.py"))
    assert any((PACKAGE / rel).exists() for rel in ("_keras_graph.py", "graph/adapter.py"))


@pytest.mark.parametrize("source", [
    "import keras\nisinstance(x, keras.layers.Dense)",
    "import keras\nissubclass(c, (int, keras.layers.Add))",
    "from keras.layers import Dense as D\nisinstance(x, D)",
    "from keras import layers\nisinstance(x, layers.Conv2D)",
    "import keras\nL = keras.layers\nisinstance(x, L.ReLU)",
    "import keras\n_P = (keras.layers.Dense,)\n_Q = _P + (keras.layers.Conv2D,)\n"
    "isinstance(x, _Q)",
    "type(layer).__name__ == 'BatchNormalization'",
    "layer.__class__.__name__ in ('Add', 'Concatenate')",
    "import keras\ntype(layer) is keras.layers.Conv2D",
    "import keras\nlayer.__class__ in (keras.layers.ReLU, keras.layers.ELU)",
])
def test_the_checker_finds_layer_class_tests(source):
    assert len(layer_class_tests(source)) == 1, source


@pytest.mark.parametrize("source", [
    "import keras\nisinstance(m, keras.Model)",
    "isinstance(x, (int, float))",
    "type(v).__name__ != 'ResourceVariable'",
    "getattr(act, '__name__', '') == 'relu'",
    "import keras\nkeras.layers.Dense(3)",
    "import keras\ntype(model) is keras.Sequential",
])
def test_the_checker_passes_other_code(source):
    assert layer_class_tests(source) == [], source


# ------------------------------------------- a registered layer answers the questions

class _Swish(keras.layers.Layer):
    """A user's activation layer: x·sigmoid(x)."""

    def call(self, x):
        return x * keras.ops.sigmoid(x)


class _PlainRelu(keras.layers.Layer):
    def call(self, x):
        return keras.ops.maximum(x, 0.0)


def _register_user_layers():
    from hope_keras.graph import layers as hl

    hl.register(_Swish, hl.ChannelwiseRule(activation=lambda layer: keras.activations.silu,
                                           data_format=False))
    hl.register(_PlainRelu, hl.ChannelwiseRule(
        activation=lambda layer: keras.activations.relu, data_format=False))


def test_a_registered_activation_layer_is_read_by_hope_and_derivative_matching():
    import numpy as np

    from hope_keras import activations
    from hope_keras import derivative_matching as dm

    _register_user_layers()
    layer = _Swish()
    assert activations.from_layer(layer) is activations.get("silu")
    assert dm.get_analytic_activation(layer) is dm.get_analytic_activation("silu")
    x = np.linspace(-6, 6, 61).astype("float32")  # the layer computes in float32
    np.testing.assert_allclose(activations.from_layer(layer)(x),
                               keras.ops.convert_to_numpy(layer(x)), rtol=1e-6, atol=1e-7)


def test_a_registered_relu_layer_makes_neuron_layers():
    """The walker asks the registry, not the class: a user's ReLU layer ends a
    mergeable neuron layer (Dense → BN → ReLU → Dense) like keras.layers.ReLU."""
    from hope_keras.graph.walker import walk

    _register_user_layers()
    kinds = {}
    for act in (_PlainRelu, _Swish):
        inputs = keras.Input((4,))
        x = act()(keras.layers.BatchNormalization()(keras.layers.Dense(6, name="fc")(inputs)))
        graph = walk(keras.Model(inputs, keras.layers.Dense(2)(x)))
        kinds[act.__name__] = graph.groups["fc"].kind
    assert kinds == {"_PlainRelu": "neurons", "_Swish": "coupled"}


def test_builtin_rules_answer_the_pattern_questions():
    from hope_keras.graph import layers as hl

    L = keras.layers
    assert hl.get(L.BatchNormalization()).normalization == "batch"
    assert hl.get(L.LayerNormalization()).normalization == "layer"
    assert hl.get(L.GroupNormalization()).normalization is None  # unsupported
    assert [hl.get(c).kind for c in (L.Dense(2), L.Conv1D(2, 3), L.SeparableConv2D(2, 3),
                                     L.DepthwiseConv2D(3))] == [
        "dense", "conv", "separable", None]
    assert [hl.get(c).op for c in (L.Add(), L.Multiply(), L.Concatenate())] == [
        "add", "multiply", None]
    assert [hl.get(c).noise for c in (L.Dropout(0.1), L.SpatialDropout2D(0.1),
                                      L.GaussianNoise(0.1), L.Identity())] == [
        "rate", "rate", "stddev", None]
    assert hl.get(L.Softmax()).activation(L.Softmax()) == "softmax"
