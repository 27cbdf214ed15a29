"""`profile`: parameters, FLOPs per example and measured latency of a model.

**FLOPs convention** (as common tools count them): 2 × the multiply-accumulates of the
layers with kernels, per example — Dense (and Dense on sequences / feature maps),
Conv1D/2D/3D (grouped included), DepthwiseConv1D/2D, SeparableConv1D/2D and
Conv1D/2D/3DTranspose. Biases, BatchNormalization, activations, pooling, additions
and other layers are not counted (they are a few percent of a CNN's count). Layer
types are looked up in the layer registry (`hope_keras.layers`: each rule's
``flops``), the same counts `compress(flops=...)` budgets with, so a new type is one
registry entry. Shapes are those of the built model's graph (every call of a layer is
counted; nested models are entered).

**Latency**: the median over ``repeats`` runs of one batch, after ``warmup`` runs, by
each method: ``"predict"`` (``model.predict``, what a Keras user calls),
``"call"`` (``model(x, training=False)`` compiled once with ``tf.function``, the
graph without ``predict``'s per-call overhead) and ``"tflite"`` (the float32
TFLite conversion in the TFLite interpreter, or a ``.tflite`` file given as the
model). With a ``reference`` model the runs are interleaved (model, reference,
model, ...; the order alternates each round), so machine noise hits both alike.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Dict, List, Optional

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules
from hope_keras.deploy.export import export_tflite, set_tflite_inputs, tflite_interpreter

__all__ = ["Profile", "latency_ratio", "layer_flops", "model_flops", "profile"]

METHODS = ("predict", "call", "tflite")


# ------------------------------------------------------------------ FLOPs
def _dims(shape, what, layer) -> List[int]:
    dims = list(shape)
    if any(d is None for d in dims):
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) has an unknown {what} "
            f"dimension: FLOPs need a fixed input shape. Received: {what}_shape="
            f"{tuple(shape)}. Build the model on keras.Input with every dimension "
            "but the batch given.")
    return dims


def node_flops(node, fg) -> int:
    layer = node.op
    if not kg.is_layer(layer) or not node.inputs or not node.outputs:
        return 0
    rule = layer_rules.get(layer)
    in_shape, out_shape = fg.shapes[node.inputs[0]], fg.shapes[node.outputs[0]]
    if type(rule).flops is layer_rules.LayerRule.flops:
        return 0  # a layer type without FLOPs (BN, activations, pooling, ...)
    _dims(out_shape[1:], "output", layer)
    _dims(in_shape[1:], "input", layer)
    return int(rule.flops(layer, node, int(in_shape[-1]), int(out_shape[-1]),
                          in_shape, out_shape))


def layer_flops(layer) -> int:
    """FLOPs per example of one layer, summed over its calls in built models.

    Args:
        layer: A layer called on symbolic inputs (part of a built Functional or
            Sequential model), or a nested model (its own layers are counted).

    Returns:
        int: 2 × multiply-accumulates per example (see the module doc); 0 for a
        layer type whose rule counts no FLOPs.

    Example:

    >>> import keras
    >>> from hope_keras.deploy.profile import layer_flops
    >>> inputs = keras.Input((32, 32, 3))
    >>> conv = keras.layers.Conv2D(8, 3, padding="same")
    >>> model = keras.Model(inputs, conv(inputs))
    >>> layer_flops(conv) == 2 * 32 * 32 * (3 * 3 * 3 * 8)
    True
    """
    if isinstance(layer, keras.Model):
        return model_flops(layer)
    if not kg.inbound_count(layer):
        raise ValueError(f"Layer {layer.name!r} has not been called on symbolic "
                         "inputs: its shapes are unknown. Build the model first.")
    rule = layer_rules.get(layer)
    total = 0
    for in_shape, out_shape in kg.call_shapes(layer):
        _dims(out_shape[1:], "output", layer)
        _dims(in_shape[1:], "input", layer)
        total += int(rule.flops(layer, None, int(in_shape[-1]), int(out_shape[-1]),
                                in_shape, out_shape))
    return total


def model_flops(model, per_layer: bool = False):
    """FLOPs per example of a model, counted by the layer registry's rules
    (`hope_keras.layers`) over its graph, nested models entered.

    Args:
        model: A built Functional or Sequential model (a subclassed model is
            counted from its layers' own calls).
        per_layer: Also return ``{layer key: FLOPs}`` (nested layers whose names
            repeat get their path, ``"outer/inner"``).

    Returns:
        int, or ``(int, dict)`` with ``per_layer``.
    """
    table: Dict[str, int] = {}
    try:
        fg = kg.flatten(model)
    except ValueError:  # subclassed: each layer's own calls
        for layer in kg.nested_layers(model):
            if isinstance(layer, keras.Model) or not kg.inbound_count(layer):
                continue
            value = layer_flops(layer)
            if value:
                table[layer.name] = table.get(layer.name, 0) + value
    else:
        for node in fg.nodes:
            value = node_flops(node, fg)
            if value:
                table[node.key] = table.get(node.key, 0) + value
    total = int(sum(table.values()))
    return (total, table) if per_layer else total


# ---------------------------------------------------------------- latency
def _is_tflite(model) -> bool:
    return isinstance(model, (bytes, bytearray)) or (
        isinstance(model, (str, os.PathLike)) and os.fspath(model).lower().endswith(".tflite"))


def _input_specs(model):
    """``[(shape without the batch axis, dtype)]`` of the model's inputs."""
    if _is_tflite(model):
        return [(tuple(int(d) for d in i["shape_signature"][1:]), i["dtype"])
                for i in tflite_interpreter(model).get_input_details()]
    return [(tuple(t.shape[1:]), t.dtype) for t in kg.functional_of(model).inputs]


def _check_same_inputs(model, reference) -> None:
    """Both models are timed on one batch: their input shapes must agree (unknown
    dimensions agree with any)."""
    def fits(a, b):
        return len(a) == len(b) and all(
            p is None or q is None or p < 0 or q < 0 or p == q for p, q in zip(a, b))

    mine, theirs = ([shape for shape, _ in _input_specs(m)] for m in (model, reference))
    if len(mine) != len(theirs) or not all(fits(a, b) for a, b in zip(mine, theirs)):
        raise ValueError(f"model takes inputs of shape {mine} and reference {theirs}: "
                         "their latencies are timed on the same batch. Compare models "
                         "of the same inputs, or pass latency=False for parameters and "
                         "FLOPs only.")


def _inputs_for(model, x, batch_size):
    if x is not None:
        return x
    rng = np.random.default_rng(0)
    specs = _input_specs(model)
    arrays = []
    for shape, dtype in specs:
        if any(d is None or d < 0 for d in shape):
            raise ValueError(f"Model input shape {shape} has unknown dimensions: pass "
                             "x=, a batch to time.")
        arrays.append(rng.normal(size=(batch_size, *shape)).astype(dtype))
    return arrays[0] if len(arrays) == 1 else arrays


def _runners(model, x, methods, num_threads):
    """``({method: zero-argument function running one batch}, TFLite size or None)``."""
    out, size = {}, None
    if _is_tflite(model):
        methods = [m for m in methods if m == "tflite"] or ["tflite"]
    for method in methods:
        if method == "predict":
            n = len(keras.tree.flatten(x)[0])
            out[method] = (lambda m=model: m.predict(x, batch_size=n, verbose=0))
        elif method == "call":
            import tensorflow as tf

            fn = tf.function(lambda t, m=model: m(t, training=False))
            xt = keras.tree.map_structure(tf.convert_to_tensor, x)
            out[method] = (lambda: keras.tree.map_structure(np.asarray, fn(xt)))
        elif method == "tflite":
            source = model if _is_tflite(model) else export_tflite(model)
            if isinstance(source, (bytes, bytearray)):
                size = len(source)
            interpreter = tflite_interpreter(source, num_threads)
            set_tflite_inputs(interpreter, x)
            out[method] = interpreter.invoke
        else:
            raise ValueError(f"methods must be among {METHODS}. Received: {method!r}")
    return out, size


def _time(runners: List[Dict[str, Callable]], repeats: int, warmup: int):
    """Median seconds per run of every runner, interleaved across models."""
    flat = [(i, m, fn) for i, r in enumerate(runners) for m, fn in r.items()]
    for _ in range(warmup):
        for _, _, fn in flat:
            fn()
    times = {(i, m): [] for i, m, _ in flat}
    for r in range(repeats):
        order = flat if r % 2 == 0 else flat[::-1]
        for i, m, fn in order:
            t0 = time.perf_counter()
            fn()
            times[(i, m)].append(time.perf_counter() - t0)
    return [{m: float(np.median(times[(i, m)])) for m in r} for i, r in enumerate(runners)]


def latency_ratio(model, reference, x=None, batch_size: int = 1, method: str = "call",
                  repeats: int = 30, warmup: int = 3,
                  num_threads: Optional[int] = None) -> float:
    """The latency of ``model`` over ``reference``'s: the median of per-round ratios.

    Each round runs both once, back to back (the order alternating each round), and
    takes the ratio of the two times; the result is the median over ``repeats``
    rounds. On a shared machine a slow spell hits both runs of a round alike, so this
    is steadier than the ratio of two medians (`profile`'s ``ratio``), whose medians
    may come from different spells (docs/benchmarks.md, "Latency: slimmed models").

    Args:
        model: A built Keras model (or ``.tflite`` path / bytes, with ``"tflite"``).
        reference: The model to compare with, of the same inputs.
        x: The batch to time; default a normal-random batch of ``batch_size``.
        batch_size: Examples per timed batch when ``x`` is not given.
        method: ``"call"`` (default), ``"predict"`` or ``"tflite"`` (module doc).
        repeats: Timed rounds.
        warmup: Untimed runs of each model first (tracing, allocation).
        num_threads: Threads of the TFLite interpreter.

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((16,))
    >>> big = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(64)(inputs)))
    >>> small = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(8)(inputs)))
    >>> ratio = hope_keras.latency_ratio(small, big, repeats=5)
    >>> ratio > 0
    True
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}. Received: method={method!r}")
    _check_same_inputs(model, reference)
    batch = _inputs_for(reference, x, batch_size)
    run, run_reference = (_runners(m, batch, (method,), num_threads)[0][method]
                          for m in (model, reference))
    for _ in range(warmup):
        run(), run_reference()
    ratios = []
    for r in range(repeats):
        seconds = {}
        for name, fn in ((("m", run), ("r", run_reference)) if r % 2 == 0
                         else (("r", run_reference), ("m", run))):
            t0 = time.perf_counter()
            fn()
            seconds[name] = time.perf_counter() - t0
        ratios.append(seconds["m"] / seconds["r"])
    return float(np.median(ratios))


# ----------------------------------------------------------------- result
@dataclasses.dataclass
class Profile:
    """What `profile` measured for one model (and its reference, when given).

    Attributes:
        name: The model's name (or the ``.tflite`` file's).
        params: ``model.count_params()`` (None for a ``.tflite`` model).
        flops: FLOPs per example (see the module doc; None for ``.tflite``).
        layers: ``{layer name: FLOPs}`` of the layers with a count.
        latency: ``{method: median seconds per batch}`` (empty without timing).
        batch_size: Examples per timed batch.
        repeats: Timed runs per method.
        size_bytes: Size of the ``.tflite`` flatbuffer (the model's, or its float32
            conversion when ``"tflite"`` was timed); else None.
        reference: The reference model's `Profile`, when one was given.
    """

    name: str
    params: Optional[int]
    flops: Optional[int]
    layers: Dict[str, int]
    latency: Dict[str, float]
    batch_size: int
    repeats: int
    size_bytes: Optional[int] = None
    reference: Optional["Profile"] = None

    def __repr__(self) -> str:  # the per-layer counts are in `summary(layers=True)`
        size = "" if self.size_bytes is None else f", size_bytes={self.size_bytes}"
        latency = {m: float(f"{s:.3g}") for m, s in self.latency.items()}  # seconds
        ref = "" if self.reference is None else f", reference={self.reference.name!r}"
        return (f"Profile(name={self.name!r}, params={self.params}, flops={self.flops}, "
                f"layers={len(self.layers)}, latency={latency}{size}{ref})")

    def ratio(self, what: str) -> Optional[float]:
        """This model's ``params``, ``flops``, ``size_bytes`` or a latency method
        divided by the reference's (None when either is missing)."""
        if self.reference is None:
            return None
        mine = self.latency.get(what) if what in METHODS else getattr(self, what)
        ref = (self.reference.latency.get(what) if what in METHODS
               else getattr(self.reference, what))
        return None if mine is None or not ref else mine / ref

    def rows(self):
        """``(label, key, value)`` rows of the summary table."""
        rows = [("parameters", "params", self.params),
                ("FLOPs / example", "flops", self.flops)]
        if self.size_bytes is not None or (
                self.reference is not None and self.reference.size_bytes is not None):
            rows.append(("TFLite size (bytes)", "size_bytes", self.size_bytes))
        methods = list(self.latency)
        if self.reference is not None:
            methods += [m for m in self.reference.latency if m not in methods]
        for m in methods:
            rows.append((f"latency {m} (ms / batch of {self.batch_size})", m,
                         None if m not in self.latency else 1e3 * self.latency[m]))
        return rows

    def summary(self, print_fn: Optional[Callable[[str], None]] = None,
                layers: bool = False) -> None:
        """Prints the profile (a comparison table when there is a reference).

        Args:
            print_fn: Called with each line (default ``print``), as in
                ``model.summary``.
            layers: Also print the FLOPs of each counted layer.
        """
        p = print_fn or print

        def fmt(v, key):
            if v is None:
                return "—"
            if key in METHODS:
                return f"{v:.3f}"
            return f"{int(v):,}"

        if layers and self.reference is None:
            p(f"{'layer':<32} {'FLOPs / example':>18} {'share':>7}")
            for name, f in self.layers.items():
                share = f / self.flops if self.flops else 0.0
                p(f"{name:<32} {f:>18,} {share:>7.1%}")
            p("")
        elif layers:
            ref_layers = self.reference.layers
            names = list(ref_layers) + [n for n in self.layers if n not in ref_layers]
            p(f"{'layer FLOPs / example':<40} {'reference':>16} {'model':>16} {'ratio':>7}")
            for name in names:
                a, b = ref_layers.get(name), self.layers.get(name)
                r = f"{(b or 0) / a:.3f}" if a else "—"  # a removed layer: 0
                p(f"{name[:40]:<40} {fmt(a, 'flops'):>16} {fmt(b, 'flops'):>16} {r:>7}")
            p("")
        if self.reference is None:
            p(f"Profile of {self.name!r}")
            for label, key, v in self.rows():
                p(f"  {label:<38} {fmt(v, key):>16}")
            return
        ref = self.reference
        # The names in full on their own line: cut to a column they can read the same.
        p(f"reference: {ref.name!r}  model: {self.name!r}")
        p(f"{'':<40} {'reference':>16} {'model':>16} {'ratio':>7}")
        for label, key, v in self.rows():
            rv = (ref.latency.get(key) if key in METHODS else getattr(ref, key))
            rv = None if rv is None else (1e3 * rv if key in METHODS else rv)
            r = self.ratio(key)
            p(f"{label:<40} {fmt(rv, key):>16} {fmt(v, key):>16} "
              f"{'—' if r is None else f'{r:.3f}':>7}")
        if self.latency:
            p(f"(latency: median of {self.repeats} interleaved runs)")


def _static(model, name):
    if _is_tflite(model):
        size = len(model) if isinstance(model, (bytes, bytearray)) else os.path.getsize(model)
        label = name or ("tflite" if isinstance(model, (bytes, bytearray))
                         else os.path.basename(os.fspath(model)))
        return label, None, None, {}, size
    total, table = model_flops(model, per_layer=True)
    return name or model.name, int(model.count_params()), total, table, None


def profile(model, reference=None, x=None, batch_size: int = 1,
            methods=("predict", "call"), repeats: int = 20, warmup: int = 3,
            latency: bool = True, num_threads: Optional[int] = None) -> Profile:
    """Parameters, FLOPs per example and latency of a model, optionally vs another.

    Args:
        model: A built Keras model, or a ``.tflite`` file path / flatbuffer bytes
            (then only ``"tflite"`` latency and the file size are reported).
        reference: The model to compare with (e.g. the original, with ``model`` its
            `hope_keras.slim` version); the same kinds as ``model``. Ratios are
            ``model / reference``.
        x: The batch to time (array, or list for several inputs). Default: a
            normal-random batch of ``batch_size`` (seed 0) shaped like the inputs.
        batch_size: Examples per timed batch when ``x`` is not given.
        methods: Any of ``"predict"``, ``"call"``, ``"tflite"`` (see the module doc).
        repeats: Timed runs per method (the median is reported).
        warmup: Untimed runs per method first (tracing, allocation).
        latency: False: parameters and FLOPs only (fast, nothing runs).
        num_threads: Threads of the TFLite interpreter (default: its own choice).

    Returns:
        A `Profile` (``.summary()`` prints it; ``.reference`` holds the reference's).

    Raises:
        ValueError: on an unknown method, shapes that are not fixed, or a reference
            of other input shapes (timed on the same batch).

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((16,))
    >>> big = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(64)(inputs)))
    >>> inputs = keras.Input((16,))
    >>> small = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(32)(inputs)))
    >>> p = hope_keras.profile(small, reference=big, methods=("call",), repeats=3)
    >>> p.flops, p.reference.flops, p.ratio("flops")
    (1280, 2560, 0.5)
    >>> p.summary(print_fn=lambda line: None)
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods must be among {METHODS}. Received: methods={methods!r}")
    for what, m in (("model", model), ("reference", reference)):
        ok = isinstance(m, keras.Model) or _is_tflite(m)
        if not ok and not (what == "reference" and m is None):
            raise ValueError(f"{what} must be a keras.Model or a .tflite model (path or "
                             "bytes). "
                             f"Received: {what}={m!r:.80}")
    models = [model] + ([reference] if reference is not None else [])
    statics = [_static(m, None) for m in models]
    timings = [{} for _ in models]
    sizes = [s[4] for s in statics]
    if latency:
        if reference is not None:
            _check_same_inputs(model, reference)
        batch = _inputs_for(model, x, batch_size)
        built = [_runners(m, batch, methods, num_threads) for m in models]
        timings = _time([r for r, _ in built], repeats, warmup)
        batch_size = len(keras.tree.flatten(batch)[0])
        sizes = [s if s is not None else size for s, (_, size) in zip(sizes, built)]
    profiles = [Profile(name=s[0], params=s[1], flops=s[2], layers=s[3], latency=t,
                        batch_size=batch_size, repeats=repeats if latency else 0,
                        size_bytes=size)
                for s, t, size in zip(statics, timings, sizes)]
    if reference is not None:
        profiles[0].reference = profiles[1]
    return profiles[0]
