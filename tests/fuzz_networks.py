"""Random networks for fuzzing compress / slim / replay: the Keras side of the plans
of tests/fuzz_plan.py.

`build(plan)` makes the plan's model (Functional, Sequential or subclassed, with a
nested backbone, several inputs and outputs, mixed precision, every stage kind of
`fuzz_plan`) and gives its BatchNorms random statistics (negative γ included). Half
of the groups get a planted noisy near-duplicate neuron and 70 % of the evictable
blocks a weak branch, so that merges and evictions actually happen.
`fuzz_checks.check(seed)` compresses it and checks every claim; `observed_patterns`
reads back which patterns a built model holds.

Run from the repository root: ``python tests/fuzz_checks.py --n 500``; `make fuzz`
runs the same checks as tests (tests/test_fuzz.py).
"""

from __future__ import annotations

import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import fuzz_plan  # noqa: E402
from hope_keras.graph import adapter as kg  # noqa: E402
from hope_keras.graph import layers as layer_rules  # noqa: E402

L = keras.layers
CONV = {1: L.Conv1D, 2: L.Conv2D, 3: L.Conv3D}
# keras.applications' Inception-ResNet sum, x + scale · r.
SCALED_SUM = kg.optional_classes("applications.inception_resnet_v2",
                                 ("CustomScaleLayer",))["CustomScaleLayer"]
SEPARABLE = {1: L.SeparableConv1D, 2: L.SeparableConv2D}
DEPTHWISE = {1: L.DepthwiseConv1D, 2: L.DepthwiseConv2D}
TRANSPOSE = {1: L.Conv1DTranspose, 2: L.Conv2DTranspose, 3: L.Conv3DTranspose}
_BY_DIMS = {
    "max_pool": (L.MaxPooling1D, L.MaxPooling2D, L.MaxPooling3D),
    "avg_pool": (L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D),
    "global_avg_pool": (L.GlobalAveragePooling1D, L.GlobalAveragePooling2D,
                        L.GlobalAveragePooling3D),
    "global_max_pool": (L.GlobalMaxPooling1D, L.GlobalMaxPooling2D, L.GlobalMaxPooling3D),
    "spatial_dropout": (L.SpatialDropout1D, L.SpatialDropout2D, L.SpatialDropout3D),
    "zero_padding": (L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D),
    "cropping": (L.Cropping1D, L.Cropping2D, L.Cropping3D),
    "upsampling": (L.UpSampling1D, L.UpSampling2D, L.UpSampling3D),
}
# keras.ops function (and arguments) of each activation drawn as an operation.
_OPS = {"relu_layer": ("relu",), "relu6": ("relu6",), "leaky_relu": ("leaky_relu", 0.1),
        "swish": ("silu",), "hard_swish": ("hard_silu",), "gelu": ("gelu",),
        "tanh": ("tanh",), "sigmoid": ("sigmoid",), "selu": ("selu",),
        "softplus": ("softplus",)}
_FUSED = {"relu_layer": "relu", "relu_activation": "relu"}


def _layer_scale():
    return kg.optional_classes("applications.convnext", ("LayerScale",))["LayerScale"]


class FuzzNet(keras.Model):
    """A subclassed model whose `call` applies a chain of layers and keras.ops
    activations (a ``str`` item: the name of a `_OPS` entry)."""

    def __init__(self, items, **kwargs):
        super().__init__(**kwargs)
        self.chain = [item for item in items if not isinstance(item, str)]
        self.program = tuple(item if isinstance(item, str) else "" for item in items)

    def call(self, x):
        layers = iter(self.chain)
        for op in self.program:
            if op:
                fn, *args = _OPS[op]
                x = getattr(keras.ops, fn)(x, *args)
            else:
                x = next(layers)(x)
        return x


class _Builder:
    """Builds a plan's stages: applied to tensors (Functional), or collected as a
    chain of items (Sequential, subclassed, a nested Sequential backbone)."""

    def __init__(self, plan):
        self.plan, self.dims = plan, plan.dims
        self.mixed_rng = np.random.default_rng([plan.seed, 48])
        self.count = collections.Counter()
        self.chain = None  # a list while collecting a chain
        self.outputs = []  # extra model outputs (forks)

    # ------------------------------------------------------------- layers
    def make(self, cls, *args, base=None, **kwargs):
        """A layer with a unique name, mixed_float16 where the plan says."""
        base = base or cls.__name__.lower()
        self.count[base] += 1
        # "layers": the first layer (the stem) and half of the others.
        mixed = self.plan.mixed == "model" or (self.plan.mixed == "layers" and (
            sum(self.count.values()) == 1 or self.mixed_rng.random() < 0.5))
        # (TensorFlow has no float16 AvgPool3D / MaxPool3D kernel on the CPU.)
        if mixed and cls not in (L.AveragePooling3D, L.MaxPooling3D):
            kwargs["dtype"] = "mixed_float16"
        return cls(*args, name=f"{base}{self.count[base]}", **kwargs)

    def call(self, layer, x):
        if self.chain is not None:
            self.chain.append(layer)
            return x
        return layer(x)

    def activation(self, spec, x):
        name = spec["name"]
        if spec["form"] == "ops":
            if self.chain is not None:
                self.chain.append(name)
                return x
            fn, *args = _OPS[name]
            return getattr(keras.ops, fn)(x, *args)
        if name == "relu_layer":
            layer = self.make(L.ReLU, base="relu_layer")
        elif name == "relu6":
            layer = self.make(L.ReLU, max_value=6.0, base="relusix")
        elif name == "leaky_relu":
            layer = self.make(L.LeakyReLU, negative_slope=0.1, base="leaky")
        elif name == "elu":
            layer = self.make(L.ELU, base="elu")
        else:
            layer = self.make(L.Activation, _FUSED.get(name, name), base="act")
        return self.call(layer, x)

    def producer(self, spec, activation=None, strides=None):
        fused = None if activation is None else _FUSED.get(activation, activation)
        common = {"use_bias": spec["bias"], "activation": fused}
        if spec["type"] == "dense":
            return self.make(L.Dense, spec["width"], base="dense", **common)
        conv = {"kernel_size": spec["kernel"], "padding": spec["padding"],
                "strides": strides or spec["strides"], "dilation_rate": spec["dilation"]}
        if spec["type"] == "separable":
            return self.make(SEPARABLE[self.dims], spec["width"], base="sep",
                             depth_multiplier=spec["depth_multiplier"], **conv, **common)
        if spec["type"] == "transpose":
            return self.make(TRANSPOSE[self.dims], spec["width"], base="convT", **conv,
                             **common)
        return self.make(CONV[self.dims], spec["width"], base="conv", **conv, **common)

    def bn(self, spec):
        return self.make(L.BatchNormalization, center=spec["center"], scale=spec["scale"],
                         base="bn")

    def by_dims(self, what, *args, **kwargs):
        return self.make(_BY_DIMS[what][self.dims - 1], *args, base=what, **kwargs)

    # ------------------------------------------------------------- stages
    def group(self, spec, x):
        act, layout = spec["act"], spec["layout"]
        fused = act["name"] if act["form"] == "fused" else None
        x = self.call(self.producer(spec["producer"], activation=fused), x)
        if layout == "bn_act":
            return self.activation(act, self.call(self.bn(spec["bn"]), x))
        if layout == "act_bn":
            return self.call(self.bn(spec["bn"]), self.activation(act, x))
        if layout == "fused_bn":
            return self.call(self.bn(spec["bn"]), x)
        return x if fused else self.activation(act, x)  # no_bn

    def pass_(self, spec, x):
        for item in spec["layers"]:
            kind = item["layer"]
            if kind == "dropout":
                layer = [lambda: self.make(L.Dropout, 0.3),
                         lambda: self.make(L.GaussianNoise, 0.1),
                         lambda: self.make(L.Identity)][item["variant"]]()
            elif kind == "spatial_dropout":
                layer = self.by_dims(kind, 0.3)
            elif kind in ("max_pool", "avg_pool", "upsampling"):
                layer = self.by_dims(kind, 2)
            else:  # zero_padding, cropping
                layer = self.by_dims(kind, 1)
            x = self.call(layer, x)
        return x

    def pinned(self, spec, x):
        if spec["layer"] == "unit_norm":
            layer = self.make(L.UnitNormalization, axis=-1)
        else:
            layer = self.make(L.GroupNormalization, groups=1)
        return self.call(layer, x)

    def width(self, x):
        if self.chain is not None:
            return self._chain_width
        return int(x.shape[-1])

    def inverted(self, spec, x):
        y = self.group(spec["expand"], x) if spec["expand"] else x
        dw = spec["dw"]
        conv = {"padding": "same", "strides": dw["strides"], "dilation_rate": dw["dilation"],
                "use_bias": dw["bias"]}
        if dw["grouped"]:
            c = spec["expand"]["producer"]["width"] if spec["expand"] else self.width(x)
            layer = self.make(CONV[self.dims], c, dw["kernel"], groups=c, base="gconv", **conv)
        else:
            layer = self.make(DEPTHWISE[self.dims], dw["kernel"], base="dw", **conv)
        y = self.activation(dw["act"], self.call(self.bn(dw["bn"]), self.call(layer, y)))
        y = self.call(self.bn(spec["project_bn"]), self.call(self.producer(spec["project"]), y))
        if spec["residual"]:
            return self.make(L.Add)([x, y])
        return y

    def residual(self, spec, x):
        y = x
        for g in spec["branch"]:
            y = self.group(g, y)
        y = self.producer(spec["final"])(y)
        if spec["final_bn"]:
            y = self.bn(spec["final_bn"])(y)
        if spec["projection"]:
            shortcut = self.producer(spec["shortcut"], strides=spec["strides"])(x)
            shortcut = self.bn(spec["shortcut_bn"])(shortcut)
        elif spec["pooled"]:
            shortcut = self.by_dims("max_pool", 1, strides=1)(x)
        else:
            shortcut = x
        if spec.get("scale", 1.0) != 1.0:
            x = self.make(SCALED_SUM, spec["scale"], base="scaled_sum")([shortcut, y])
        else:
            x = self.make(L.Add)([shortcut, y])
        return self.activation(spec["post_act"], x) if spec["post_act"] else x

    def preact(self, spec, x):
        x = self.producer(spec["stem"])(x)  # the raw stream
        for b in spec["blocks"]:
            pre = self.make(L.ReLU, base="relu_layer")(self.bn(b["pre_bn"])(x))
            y = self.producer(b["final"])(self.group(b["inner"], pre))
            shortcut = self.by_dims("max_pool", 1, strides=1)(x) if b["pooled"] else x
            x = self.make(L.Add)([shortcut, y])
        return self.make(L.ReLU, base="relu_layer")(self.bn(spec["end_bn"])(x))

    def concat(self, spec, x):
        ys = []
        for br in spec["branches"]:
            y = self.group(br["group"], x)
            if br["pool"]:
                y = self.by_dims("avg_pool", 3, strides=1, padding="same")(y)
            ys.append(y)
        x = self.make(L.Concatenate)(ys)
        added = spec.get("added")
        if added:  # Inception-ResNet: x + scale · r, r a producer of the concatenation
            r = self.producer(added["producer"])(x)
            if added["bn"]:
                r = self.bn(added["bn"])(r)
            if added["scale"] == 1.0:
                return self.make(L.Add)([x, r])
            return self.make(SCALED_SUM, added["scale"], base="scaled_sum")([x, r])
        return x

    def densenet(self, spec, x):
        for k, prod in enumerate(spec["growth"]):
            pre = self.make(L.ReLU, base="relu_layer")(self.bn(spec["bn"][k])(x))
            x = self.make(L.Concatenate)([x, self.producer(prod)(pre)])
        return x

    def se(self, spec, x):
        c = self.width(x)
        if self.dims:
            conv = lambda n, act=None: self.make(CONV[self.dims], n, 1, activation=act,  # noqa: E731
                                                 base="squeeze")
            if spec["reshape"]:
                pooled = self.by_dims("global_avg_pool")(x)
                pooled = self.make(L.Reshape, (1,) * self.dims + (c,))(pooled)
            else:
                pooled = self.by_dims("global_avg_pool", keepdims=True)(x)
        else:
            conv = lambda n, act=None: self.make(L.Dense, n, activation=act, base="squeeze")  # noqa: E731
            pooled = x
        s = conv(spec["squeeze"], "relu")(pooled)
        if spec["gate"] == "sigmoid":
            gate = conv(c, "sigmoid")(s)
        elif spec["gate"] == "hard_sigmoid":
            gate = self.make(L.Activation, "hard_sigmoid", base="act")(conv(c)(s))
        else:  # MobileNetV3's hard sigmoid from keras operations
            gate = self.make(L.ReLU, max_value=6.0, base="relusix")(conv(c)(s) + 3.0) * (1.0 / 6.0)
        x = self.make(L.Multiply)([x, gate])
        return self.bn(spec["project_bn"])(self.producer(spec["project"])(x))

    def layernorm(self, spec, x):
        w = spec["width"]
        x = self.producer(spec["stem"])(x)
        for b in spec["blocks"]:
            y = x
            if b["dw"] == "grouped":
                y = self.make(CONV[self.dims], w, 3, padding="same", groups=w, base="gconv")(y)
            elif b["dw"]:
                y = self.make(DEPTHWISE[self.dims], 3, padding="same", base="dw")(y)
            y = self.make(L.LayerNormalization, epsilon=1e-6, base="ln")(y)
            y = self.activation(b["act"], self.make(L.Dense, b["expand"], base="dense")(y))
            y = self.make(L.Dense, w, base="dense")(y)
            if b["layer_scale"]:
                y = self.make(_layer_scale(), 0.5, w, base="layer_scale")(y)
            x = x + y if b["add_op"] else self.make(L.Add)([x, y])
        return self.make(L.LayerNormalization, epsilon=1e-6, base="ln")(x)

    def fork(self, spec, x):
        if self.dims:
            layer = self.make(CONV[self.dims], spec["width"], 1, base="fork")
            pool = lambda t: self.by_dims("global_avg_pool")(t)  # noqa: E731
        else:
            layer = self.make(L.Dense, spec["width"], base="fork")
            pool = lambda t: t  # noqa: E731
        self.outputs.append(pool(layer(x)))
        if spec["shared"]:  # the same layer on the next group's output (same width)
            x = self.group(spec["next"], x)
            self.outputs.append(pool(layer(x)))
        return x

    def shared_act(self, spec, x):
        kind = spec["layer"]
        shared = (self.make(L.ReLU, base="relu_layer") if kind == "relu" else
                  self.make(L.Dropout, 0.2) if kind == "dropout" else
                  self.make(L.Activation, "relu", base="act"))
        for g in spec["groups"]:
            x = self.bn(g["bn"])(self.producer(g["producer"])(x))
            if kind == "dropout":
                x = self.make(L.ReLU, base="relu_layer")(x)
            x = shared(x)
        return x

    def stage(self, spec, x):
        kind = spec["kind"]
        x = getattr(self, "pass_" if kind == "pass" else kind)(spec, x)
        if self.chain is not None:
            self._chain_width = fuzz_plan.stage_width(spec, self._chain_width)
        return x

    def collect(self, stages, width):
        """The stages as a chain of items (layers, and op names)."""
        self.chain, self._chain_width = [], width
        for spec in stages:
            self.stage(spec, None)
        items, self.chain = self.chain, None
        return items


def build(plan) -> keras.Model:
    """The plan's model, with random BatchNorm statistics and biases."""
    keras.utils.set_random_seed(plan.seed)
    b = _Builder(plan)
    if plan.container != "functional":
        model = _build_chain(plan, b)
    else:
        model = _build_functional(plan, b)
    _randomize(model, np.random.default_rng([plan.seed, 50]))
    return model


def _vector(plan, b):
    if plan.vector == "flatten":
        return b.make(L.Flatten)
    if plan.vector == "flatten_channels_first":
        return b.make(L.Flatten, data_format="channels_first")
    return b.by_dims(plan.vector)


def input_shape(plan):
    """The model's input shape: the plan's, spatial dimensions unknown if it says so."""
    if plan.unknown_spatial:
        return (None,) * plan.dims + plan.shape[-1:]
    return plan.shape


def _build_chain(plan, b):
    items = b.collect(plan.stages, plan.shape[-1])
    if plan.vector:
        items.append(_vector(plan, b))
        b.dims = 0
    items += b.collect(plan.head_stages, 0)  # groups: they read no width
    items.append(L.Dense(3, name="head"))
    name = f"fuzz_{plan.container}_{plan.seed}"
    if plan.container == "sequential":
        return keras.Sequential([keras.Input(input_shape(plan))] + items, name=name)
    model = FuzzNet(items, name=name)
    model(np.zeros((1,) + plan.shape, "float32"))
    return model


def _build_functional(plan, b):
    inputs = [keras.Input(input_shape(plan), name="x")]
    x = inputs[0]
    second = plan.second_input
    nested = plan.nested
    for k, spec in enumerate(plan.stages):
        if nested and k == nested["start"]:
            x = _nested(plan, b, x)
        if nested and nested["start"] <= k < nested["stop"]:
            continue
        x = b.stage(spec, x)
        if k == 0 and second and second["where"] == "early":
            inputs.append(keras.Input(second["shape"], name="x2"))
            y = b.group(second["group"], inputs[1])
            x = b.make(L.Concatenate if second["merge"] == "concat" else L.Add)([x, y])
    if plan.vector:
        x = _vector(plan, b)(x)
        b.dims = 0
        if second and second["where"] == "late":
            inputs.append(keras.Input(second["shape"], name="x2"))
            x = b.make(L.Concatenate)([x, b.group(second["group"], inputs[1])])
    for spec in plan.head_stages:
        x = b.stage(spec, x)
    outputs = b.outputs + [L.Dense(3, name="head")(x)]
    return keras.Model(inputs if len(inputs) > 1 else inputs[0],
                       outputs if len(outputs) > 1 else outputs[0],
                       name=f"fuzz_functional_{plan.seed}")


def _nested(plan, b, x):
    """The plan's backbone (a Functional or Sequential model) called on `x`."""
    start, stop = plan.nested["start"], plan.nested["stop"]
    inner_in = keras.Input(tuple(x.shape[1:]))
    if plan.nested["kind"] == "sequential":
        items = b.collect(plan.stages[start:stop], int(x.shape[-1]))
        backbone = keras.Sequential([inner_in] + items, name="backbone_seq")
    else:
        y = inner_in
        for spec in plan.stages[start:stop]:
            y = b.stage(spec, y)
        backbone = keras.Model(inner_in, y, name="backbone")
    return backbone(x)


def _randomize(model, rng):
    """Random BN statistics (15 % negative γ), LayerNorm and LayerScale weights, biases."""
    layer_scale = kg.optional_classes("applications.convnext", ("LayerScale",)).get(
        "LayerScale")
    for layer in kg.flatten(model).layers.values():
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            if layer.scale:
                g = rng.uniform(0.3, 1.5, n) * np.where(rng.random(n) < 0.15, -1.0, 1.0)
                layer.gamma.assign(g.astype("float32"))
            if layer.center:
                layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_mean.assign(rng.normal(0, 0.3, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.3, 2.0, n).astype("float32"))
        elif isinstance(layer, L.LayerNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.5, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
        elif layer_scale is not None and isinstance(layer, layer_scale):
            layer.gamma.assign(rng.uniform(0.3, 1.0, layer.gamma.shape).astype("float32"))
        elif getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.3, layer.bias.shape).astype("float32"))


def plant_twins(graph, rng) -> int:
    """A noisy copy of one neuron in about half of the "neurons" groups (a cheap
    merge): its filter, bias, BN entries and every reader's input weights."""
    planted = 0
    for g in graph.groups.values():
        if g.kind != "neurons" or g.size < 3 or rng.random() < 0.5:
            continue
        src, dst = (int(v) for v in rng.choice(g.size, 2, replace=False))
        noise = float(rng.uniform(0.01, 0.1))
        p, bn = graph.layer(g.producer), graph.layer(g.bn)
        k = p.kernel.numpy()
        kv = np.moveaxis(k, layer_rules.output_axis(p), -1)  # a view: filters last
        kv[..., dst] = kv[..., src] * (1 + noise * rng.normal(size=kv[..., src].shape))
        p.kernel.assign(k)
        if p.use_bias:
            bias = p.bias.numpy()
            bias[dst] = bias[src]
            p.bias.assign(bias)
        for w in bn.weights:
            a = w.numpy()
            a[dst] = a[src]
            w.assign(a)
        for c in g.readers:  # Dense / ConvND / ConvNDTranspose kernels
            layer = graph.layer(c.layer)
            u = layer.kernel.numpy()
            axis = layer_rules.get(layer).in_weights(layer)[0].axis
            uv = np.moveaxis(u, axis, 0)  # a view: input positions first
            rows_src, rows_dst = c.positions[src], c.positions[dst]
            uv[rows_dst] = uv[rows_src] * (1 + noise * rng.normal(size=uv[rows_src].shape))
            layer.kernel.assign(u)
        planted += 1
    return planted


def weaken_blocks(graph, rng) -> int:
    """Scales the internal BNs of 70 % of the evictable blocks down (cheap to evict)."""
    weak = 0
    for blk in graph.blocks:
        if not blk.evictable or rng.random() < 0.3:
            continue
        factor = float(rng.uniform(0.02, 0.3))
        # The paper's eviction cost reads the internal capacities, the default cost
        # the final BN: weaken both.
        for bn_name in [graph.groups[x].bn for x in blk.groups] + [blk.final_bn]:
            if bn_name is None:  # a coupled group or a branch without a final BN
                continue
            bn = graph.layer(bn_name)
            for attr in ("gamma", "beta"):
                v = getattr(bn, attr, None)
                if v is not None:
                    v.assign(v.numpy() * factor)
        weak += 1
    return weak
