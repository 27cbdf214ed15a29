"""Random network plans for the fuzzer (tests/fuzz_networks.py), drawn from the seed
alone, as plain data: no Keras, a few microseconds a plan.

`draw(seed)` returns a `Plan`: the model form (Functional, Sequential, subclassed,
with a nested backbone), the input (Dense, Conv1D/2D/3D), the stages (groups with
every layout and activation, residual and pre-activation blocks, inverted residuals
with depthwise convolutions, Concatenate, squeeze-excitation gates, LayerNorm
streams, forks to more outputs, shared layers, pinned layers), the BN-free variant
that goes through `calibrate`, and the compression run (cost, actions, budgets,
statistics correction, search options). `Plan.patterns` names what the plan draws,
from `PATTERNS`, so the coverage of any range of seeds is known without building a
network; the fuzzer checks that each network it builds holds the patterns its plan
names (`fuzz_networks.observed_patterns`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import numpy as np

# Every pattern the fuzzer draws: README.md's and docs/hope.md's claims (model forms,
# layers, activations, block layouts, budgets, costs, options), one line each.
PATTERNS = {
    # model forms
    "functional": "a Functional model",
    "sequential": "a keras.Sequential model",
    "subclassed": "a subclassed keras.Model (traced)",
    "nested_functional": "a Functional backbone used as a layer",
    "nested_sequential": "a Sequential backbone used as a layer",
    "several_inputs": "two model inputs",
    "several_outputs": "two or more model outputs",
    "mixed_precision": "mixed_float16 layers",
    "bn_free_calibrate": "a network without BatchNorm, through calibrate",
    "unknown_spatial_dims": "Input((None, ..., C)): flops= and profile refused",
    # producers
    "dense": "Dense producers",
    "conv1d": "Conv1D producers",
    "conv2d": "Conv2D producers",
    "conv3d": "Conv3D producers",
    "dense_on_spatial": "Dense on a feature map (last axis)",
    "depthwise": "DepthwiseConv1D/2D",
    "grouped_depthwise": "ConvND with groups = channels",
    "separable": "SeparableConv1D/2D",
    "conv_transpose": "Conv1D/2D/3DTranspose producers (strided or not)",
    "separable_multiplier": "SeparableConv with depth_multiplier 2",
    "strides": "strided convolutions",
    "dilation": "dilated convolutions",
    "no_bias": "producers without bias",
    # activations
    "relu_layer": "keras.layers.ReLU()",
    "relu_activation": "Activation('relu')",
    "relu6": "ReLU6",
    "leaky_relu": "leaky ReLU",
    "elu": "ELU",
    "swish": "swish",
    "hard_swish": "hard swish",
    "gelu": "GELU",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "selu": "SELU",
    "softplus": "softplus",
    "mish": "mish",
    "fused_activation": "an activation fused into its producer",
    "ops_activation": "an activation as a keras.ops call",
    # BatchNorm
    "bn_after_activation": "BN after the activation",
    "bn_no_center": "BN with center=False",
    "bn_no_scale": "BN with scale=False",
    # blocks
    "identity_block": "identity residual block",
    "projection_block": "projection residual block",
    "pooled_identity": "identity shortcut through pooling",
    "preact_block": "pre-activation residual block",
    "inverted_residual": "MobileNetV2 inverted residual (depthwise)",
    "concatenate": "Concatenate of branches",
    "densenet_concat": "DenseNet concatenation",
    "concat_stream_add": "a concatenation added to one producer's output (Inception-ResNet)",
    "scaled_sum": "Inception-ResNet's scaled sum x + scale · r (CustomScaleLayer)",
    "se_gate": "squeeze-excitation gate (Multiply)",
    "hard_sigmoid_ops": "hard-sigmoid gate from keras ops (x + 3) / 6",
    "layernorm_stream": "a residual stream read through LayerNormalization",
    "layer_scale": "ConvNeXt LayerScale",
    "shared_producer": "a producer called twice",
    "shared_inside_group": "a channelwise layer shared by two groups",
    "pinned_layer": "a layer the registry pins (unit or group normalization)",
    # pass-through layers
    "max_pool": "max pooling",
    "avg_pool": "average pooling",
    "global_avg_pool": "global average pooling",
    "global_max_pool": "global max pooling",
    "flatten": "Flatten",
    "flatten_channels_first": "Flatten(data_format='channels_first')",
    "dropout": "Dropout / GaussianNoise / Identity",
    "spatial_dropout": "SpatialDropout",
    "zero_padding": "ZeroPadding",
    "cropping": "Cropping",
    "upsampling": "UpSampling",
    # the run
    "api_compress": "hope_keras.compress",
    "api_encoder": "Encoder(search=...).compress",
    "cost_hope": "cost='hope'",
    "cost_paper": "cost='paper'",
    "cost_no_streams": "HopeCost(groups='no_streams')",
    "cost_config": "a cost's config dict",
    "merge_scale_paper": "merge_scale='paper'",
    "kernel_exact": "kernel='exact'",
    "mean_compensation": "mean_compensation=True",
    "budget_density": "density=",
    "budget_params": "params=",
    "budget_flops": "flops=",
    "budget_steps": "steps=",
    "budget_none": "no budget (until no action)",
    "two_budgets": "two budgets, the first met stops",
    "actions_all": "actions: prune, merge, evict",
    "actions_prune": "actions: prune",
    "actions_merge": "actions: merge",
    "actions_evict": "actions: evict",
    "actions_prune_merge": "actions: prune, merge",
    "actions_prune_evict": "actions: prune, evict",
    "actions_merge_evict": "actions: merge, evict",
    "correction_auto": "data-free correction 'auto' (synthetic inputs)",
    "correction_surrogate": "correction='surrogate'",
    "correction_off": "correction=False",
    "data_array": "data= an array",
    "data_dataset": "data= a tf.data.Dataset",
    "refresh_neighbors": "search refresh='neighbors'",
    "merge_candidates_k": "search merge_candidates=k",
    "merge_candidates_none": "search merge_candidates=None (exhaustive)",
    "merge_search_top_k": "search merge_search='top_k'",
    "round_to": "search round_to=2, 4 or 8 (narrowed widths end at multiples)",
    "budget_latency": "then latency= from the original (a timer: FLOPs ratio + 0.05)",
    "compress_again": "compress the compressed model again (starts from what is left)",
}

# Activations: relu is drawn most (merges need it); every other one the registry has.
ACTIVATIONS = ("relu_layer", "relu_activation", "relu6", "leaky_relu", "elu", "swish",
               "hard_swish", "gelu", "tanh", "sigmoid", "selu", "softplus", "mish")
_ACT_WEIGHTS = (30, 10) + (5,) * 11
# Those with a keras.ops function the registry knows as an operation.
OPS_ACTIVATIONS = ("relu_layer", "relu6", "leaky_relu", "swish", "hard_swish", "gelu",
                   "tanh", "sigmoid", "selu", "softplus")
ACTION_SETS = {"actions_all": ("prune", "merge", "evict"), "actions_prune": ("prune",),
               "actions_merge": ("merge",), "actions_evict": ("evict",),
               "actions_prune_merge": ("prune", "merge"),
               "actions_prune_evict": ("prune", "evict"),
               "actions_merge_evict": ("merge", "evict")}
BUDGET_KINDS = ("density", "params", "flops", "steps")


@dataclasses.dataclass
class Plan:
    """One network and its compression run, as data (see the module docstring).

    Attributes:
        seed: The seed it was drawn from.
        container: ``"functional"``, ``"sequential"`` or ``"subclassed"``.
        dims: 0 (Dense on vectors) or the spatial rank of the convolutions (1–3).
        shape: The input shape (batch axis excluded).
        mixed: ``"none"``, ``"model"`` (every layer mixed_float16) or ``"layers"``.
        bn_free: No BatchNorm: the model goes through `calibrate` first.
        unknown_spatial: The model's input has unknown spatial dimensions (``None``;
            `shape` gives the size the checks feed it).
        stages: The body, in order; each a dict with a ``"kind"``.
        vector: How a feature map becomes a vector (conv plans), or None.
        head_stages: Dense stages after the vector.
        second_input: The second input's spec, or None.
        nested: ``{"kind": "functional" | "sequential", "start", "stop"}``: the body
            stages wrapped into a backbone model, or None.
        run: The compression run's options (`_draw_run`).
        patterns: The `PATTERNS` this plan draws.
    """

    seed: int
    container: str
    dims: int
    shape: tuple
    mixed: str
    bn_free: bool
    unknown_spatial: bool
    stages: List[dict]
    vector: Optional[str]
    head_stages: List[dict]
    second_input: Optional[dict]
    nested: Optional[dict]
    run: dict
    patterns: frozenset = frozenset()


class _Drawer:
    """Draws stages, tracking the width and the spatial size the layers produce."""

    def __init__(self, rng, dims, spatial, *, bn_free, chain, ops):
        self.rng, self.dims, self.spatial = rng, dims, spatial
        self.bn_free, self.chain, self.ops = bn_free, chain, ops
        self.tags = set()

    def p(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def pick(self, options, weights=None):
        w = np.asarray(weights if weights is not None else [1] * len(options), float)
        return options[int(self.rng.choice(len(options), p=w / w.sum()))]

    def width(self, lo=2, hi=7) -> int:
        return int(self.rng.integers(lo, hi + 1))

    # -------------------------------------------------------------- pieces
    def activation(self, form=None, relu=False) -> dict:
        name = "relu_layer" if relu else self.pick(ACTIVATIONS, _ACT_WEIGHTS)
        if form is None:
            form = "layer"
            if self.ops and name in OPS_ACTIVATIONS and self.p(0.25):
                form = "ops"
        if form == "layer" or not name.startswith("relu_"):  # a fused / ops ReLU: no layer
            self.tags.add(name)
        if form == "ops":
            self.tags.add("ops_activation")
        elif form == "fused":
            self.tags.add("fused_activation")
        return {"name": name, "form": form}

    def bn(self) -> dict:
        spec = {"center": not self.p(0.15), "scale": not self.p(0.15)}
        self.tags.update(t for t, on in (("bn_no_center", not spec["center"]),
                                         ("bn_no_scale", not spec["scale"])) if on)
        return spec

    def producer(self, width, *, kind=None, kernel=None, strides=None, same=False) -> dict:
        """A Dense / ConvND / SeparableConvND spec; the spatial size follows it."""
        dims = self.dims
        if kind is None:
            kind = "dense" if dims == 0 else self.pick(
                ["conv", "separable", "dense", "transpose"], [80, 14 if dims < 3 else 0, 6, 6])
        spec = {"type": kind, "width": int(width), "bias": not self.p(0.3)}
        if not spec["bias"]:
            self.tags.add("no_bias")
        if kind == "dense":
            self.tags.add("dense" if dims == 0 else "dense_on_spatial")
            return spec
        self.tags.add(f"conv{dims}d" if kind == "conv" else {"separable": "separable",
                                                             "transpose": "conv_transpose"}[kind])
        k = kernel or int(self.pick([1, 2, 3], [35, 15, 50]))
        if kind == "transpose":  # "same" padding: the spatial size grows by the stride
            s = 2 if self.spatial <= 6 and not same and strides is None and self.p(0.3) else 1
            spec.update(kernel=k, strides=s, dilation=1, padding="same")
            if s > 1:
                self.tags.add("strides")
                self.spatial *= s
            return spec
        s = strides if strides is not None else (
            2 if self.spatial >= 4 and not same and self.p(0.2) else 1)
        d = 2 if s == 1 and k > 1 and self.p(0.15) else 1
        padding = "same"
        if not same and s == 1 and self.spatial - (k - 1) * d >= 2 and self.p(0.15):
            padding = "valid"
        elif dims == 1 and kind == "conv" and not same and s == 1 and self.p(0.15):
            padding = "causal"
        spec.update(kernel=k, strides=s, dilation=d, padding=padding)
        if kind == "separable":
            spec["depth_multiplier"] = 2 if self.p(0.5) else 1
            if spec["depth_multiplier"] == 2:
                self.tags.add("separable_multiplier")
        if s > 1:
            self.tags.add("strides")
            self.spatial = math.ceil(self.spatial / s)
        if d > 1:
            self.tags.add("dilation")
        if padding == "valid":
            self.spatial -= (k - 1) * d
        return spec

    def group(self, width=None, *, layout=None, relu=False, same=False, kernel=None,
              strides=None, kind=None) -> dict:
        """producer → BN → activation, or another layout of the three."""
        width = width or self.width()
        if layout is None:
            layout = "no_bn" if self.bn_free else self.pick(
                ["bn_act", "act_bn", "fused_bn"], [80, 10, 10])
        prod = self.producer(width, kind=kind, kernel=kernel, strides=strides, same=same)
        if layout == "no_bn":
            act = self.activation(form="fused" if self.p(0.5) else "layer",
                                  relu=relu or self.p(0.6))
            return {"kind": "group", "producer": prod, "layout": layout, "act": act}
        if layout == "fused_bn":
            act = self.activation(form="fused", relu=relu)
        else:
            act = self.activation(relu=relu)
        if layout != "bn_act":
            self.tags.add("bn_after_activation")
        return {"kind": "group", "producer": prod, "layout": layout, "act": act,
                "bn": self.bn()}

    def passthrough(self) -> dict:
        layers = [self._passthrough_layer() for _ in range(int(self.rng.integers(1, 3)))]
        return {"kind": "pass", "layers": layers}

    def _passthrough_layer(self) -> dict:
        options = ["dropout"]
        if self.dims:
            options += ["spatial_dropout", "zero_padding"]
            if self.spatial >= 4:
                options += ["max_pool", "avg_pool", "cropping"]
            if self.spatial * 2 <= (16 if self.dims == 1 else 12 if self.dims == 2 else 6):
                options.append("upsampling")
        weights = {"dropout": 1, "avg_pool": 1, "zero_padding": 1.5}
        layer = self.pick(options, [weights.get(o, 2) for o in options])
        self.tags.add(layer)
        self.spatial = {"max_pool": self.spatial // 2, "avg_pool": self.spatial // 2,
                        "zero_padding": self.spatial + 2, "cropping": self.spatial - 2,
                        "upsampling": self.spatial * 2}.get(layer, self.spatial)
        return {"layer": layer, "variant": int(self.rng.integers(3))}  # which dropout

    # -------------------------------------------------------------- stages
    def residual(self, width) -> dict:
        projection = self.p(0.45)
        self.tags.add("projection_block" if projection else "identity_block")
        new_width = self.width(3, 7) if projection else width
        strides = 2 if projection and self.dims and self.spatial >= 4 and self.p(0.4) else 1
        branch = [self.group(same=True, strides=strides if k == 0 else 1,
                             kind="conv" if self.dims and k == 0 and strides > 1 else None)
                  for k in range(int(self.rng.integers(1, 3)))]
        pooled = not projection and self.dims > 0 and self.p(0.5)
        if pooled:
            self.tags.add("pooled_identity")
        final = self.producer(new_width, same=True, kind="conv" if self.dims else None)
        shortcut = (self.producer(new_width, kind="conv" if self.dims else None, kernel=1,
                                  strides=1, same=True) if projection else None)
        scale = float(self.pick([0.2, 0.5], [1, 1])) if self.p(0.2) else 1.0
        if scale != 1.0:
            self.tags.add("scaled_sum")
        return {"kind": "residual", "projection": projection, "strides": strides,
                "scale": scale,
                "shortcut": shortcut, "shortcut_bn": self.bn() if projection else None,
                "branch": branch, "final": final,
                "final_bn": self.bn() if not self.p(0.1) else None, "pooled": pooled,
                "post_act": self.activation(relu=self.p(0.6)) if self.p(0.7) else None}

    def preact(self) -> dict:
        self.tags.add("preact_block")
        width = self.width(3, 7)
        stem = self.producer(width, same=True)
        blocks = []
        for _ in range(int(self.rng.integers(1, 3))):
            pooled = self.dims > 0 and self.p(0.5)
            if pooled:
                self.tags.add("pooled_identity")
            blocks.append({"pre_bn": self.bn(), "inner": self.group(same=True, relu=True),
                           "final": self.producer(width, same=True), "pooled": pooled})
        return {"kind": "preact", "stem": stem, "blocks": blocks, "end_bn": self.bn()}

    def inverted(self, width) -> dict:
        grouped = self.dims == 3 or self.p(0.25)
        self.tags.add("grouped_depthwise" if grouped else "depthwise")
        expand = self.group(self.width(3, 8), kernel=1, same=True) if self.p(0.85) else None
        s = 2 if self.spatial >= 4 and self.p(0.25) else 1
        d = 2 if s == 1 and self.p(0.2) else 1
        self.tags.update(t for t, on in (("strides", s > 1), ("dilation", d > 1)) if on)
        self.spatial = math.ceil(self.spatial / s)
        dw = {"kernel": 3, "strides": s, "dilation": d, "bias": not self.p(0.4),
              "grouped": grouped, "bn": self.bn(), "act": self.activation()}
        # A block needs a group inside its branch: the expansion (MobileNetV2's).
        residual = not self.chain and s == 1 and expand is not None and self.p(0.85)
        out = width if residual else self.width(3, 7)
        if residual:
            self.tags.add("inverted_residual")
        return {"kind": "inverted", "expand": expand, "dw": dw,
                "project": self.producer(out, kind="conv", kernel=1, same=True),
                "project_bn": self.bn(), "residual": residual}

    def concat(self, width) -> dict:
        if self.p(0.5):
            self.tags.add("densenet_concat")
            count = int(self.rng.integers(1, 3))
            return {"kind": "densenet", "bn": [self.bn() for _ in range(count)],
                    "growth": [self.producer(self.width(2, 4), same=True)
                               for _ in range(count)]}
        self.tags.add("concatenate")
        branches = []
        for _ in range(int(self.rng.integers(2, 4))):
            g = self.group(same=True, strides=1)
            pool = self.dims > 0 and self.p(0.3)
            if pool:
                self.tags.add("avg_pool")
            branches.append({"group": g, "pool": pool})
        added = None
        if self.p(0.6):  # the producer's channels split where the branches meet
            self.tags.add("concat_stream_add")
            width = sum(b["group"]["producer"]["width"] for b in branches)
            scale = float(self.pick([1.0, 0.2, 0.5], [50, 25, 25]))
            if scale != 1.0:
                self.tags.add("scaled_sum")
            added = {"producer": self.producer(width, kind="conv" if self.dims else None,
                                               kernel=1, same=True),
                     "bn": self.bn() if self.p(0.6) else None, "scale": scale}
        return {"kind": "concat", "branches": branches, "added": added}

    def se(self, width) -> dict:
        self.tags.add("se_gate")
        gate = self.pick(["sigmoid", "hard_sigmoid_ops", "hard_sigmoid"], [35, 50, 15])
        if gate == "hard_sigmoid_ops":
            self.tags.add("hard_sigmoid_ops")
        return {"kind": "se", "squeeze": self.width(2, 4), "gate": gate,
                "reshape": self.p(0.4), "project": self.producer(
                    self.width(3, 7), kind="conv" if self.dims else None, kernel=1,
                    same=True), "project_bn": self.bn()}

    def layernorm(self) -> dict:
        self.tags.add("layernorm_stream")
        width = self.width(3, 6)
        stem = self.producer(width, kind="conv" if self.dims else None, same=True)
        blocks = []
        for _ in range(int(self.rng.integers(1, 3))):
            scale = self.p(0.55)
            if scale:
                self.tags.add("layer_scale")
            dw = None
            if self.dims:
                dw = "grouped" if self.dims == 3 or self.p(0.4) else "depthwise"
                self.tags.add("grouped_depthwise" if dw == "grouped" else "depthwise")
            if self.dims:
                self.tags.add("dense_on_spatial")
            else:
                self.tags.add("dense")
            if self.p(0.6):
                act = {"name": "gelu", "form": "layer"}
                self.tags.add("gelu")
            else:
                act = self.activation()
            blocks.append({"dw": dw, "expand": self.width(4, 8), "act": act,
                           "layer_scale": scale, "add_op": self.p(0.4)})
        return {"kind": "layernorm", "width": width, "stem": stem, "blocks": blocks}

    def fork(self, width) -> dict:
        self.tags.add("several_outputs")
        shared = self.p(0.7)
        spec = {"kind": "fork", "width": 2, "shared": shared}
        if shared:
            self.tags.add("shared_producer")
            spec["next"] = self.group(width, same=True)
        return spec

    def shared_act(self, width) -> dict:
        self.tags.add("shared_inside_group")
        layer = self.pick(["relu", "dropout", "activation"])
        self.tags.add({"relu": "relu_layer", "dropout": "dropout",
                       "activation": "relu_activation"}[layer])
        # Two groups of one width whose activation (or dropout after it) is one layer.
        groups = [{"producer": self.producer(width, same=True), "bn": self.bn()}
                  for _ in range(2)]
        return {"kind": "shared_act", "layer": layer, "groups": groups}

    def pinned(self) -> dict:
        self.tags.add("pinned_layer")
        return {"kind": "pinned", "layer": self.pick(["unit_norm", "group_norm"])}

    def stage(self, width, kinds) -> dict:
        names, weights = zip(*[(k, w) for k, w in kinds
                                if self.dims or k != "inverted"])  # depthwise: conv only
        kind = self.pick(list(names), weights)
        if kind in ("group", "pass", "preact", "layernorm", "pinned"):
            return {"group": self.group, "pass": self.passthrough, "preact": self.preact,
                    "layernorm": self.layernorm, "pinned": self.pinned}[kind]()
        return getattr(self, kind)(width)


def stage_width(stage, width) -> int:
    """The number of channels a stage outputs, given its input's."""
    kind = stage["kind"]
    if kind == "group":
        return stage["producer"]["width"]
    if kind in ("pass", "fork", "pinned"):
        return stage["next"]["producer"]["width"] if stage.get("next") else width
    if kind == "residual":
        return stage["final"]["width"]
    if kind == "preact":
        return stage["stem"]["width"]
    if kind == "inverted":
        return stage["project"]["width"]
    if kind == "densenet":
        return width + sum(g["width"] for g in stage["growth"])
    if kind == "concat":
        return sum(b["group"]["producer"]["width"] for b in stage["branches"])
    if kind == "se":
        return stage["project"]["width"]
    if kind == "layernorm":
        return stage["width"]
    if kind == "shared_act":
        return stage["groups"][-1]["producer"]["width"]
    raise ValueError(kind)


# Stage kinds by model form: (kind, weight).
_BODY = [("group", 18), ("pass", 18), ("residual", 14), ("preact", 8), ("inverted", 18),
         ("concat", 16), ("se", 11), ("layernorm", 7), ("fork", 9), ("shared_act", 8),
         ("pinned", 5)]
_CHAIN = [("group", 50), ("pass", 25), ("inverted", 15), ("pinned", 6)]
_BN_FREE = [("group", 70), ("pass", 30)]
_HEAD = [("group", 60), ("pass", 10), ("residual", 10), ("concat", 8), ("se", 6),
         ("layernorm", 6)]


def _draw_run(d: _Drawer, plan_tags) -> dict:
    """The compression run: API, cost, actions, budgets, correction, search."""
    rng, tags = d.rng, plan_tags
    run = {}
    cost = d.pick(["hope", "paper", "no_streams"], [50, 28, 22])
    tags.add(f"cost_{cost}")
    run["cost"] = cost
    run["merge_scale"] = "paper" if d.p(0.3) else "sum"
    run["kernel"] = "exact" if d.p(0.25) else "approx"
    run["mean_compensation"] = d.p(0.25)
    run["cost_as_config"] = d.p(0.2)
    tags.update(t for t, on in (("merge_scale_paper", run["merge_scale"] == "paper"),
                                ("kernel_exact", run["kernel"] == "exact"),
                                ("mean_compensation", run["mean_compensation"]),
                                ("cost_config", run["cost_as_config"])) if on)
    names = list(ACTION_SETS)
    actions = d.pick(names, [34] + [11] * 6)
    tags.add(actions)
    run["actions"] = ACTION_SETS[actions]
    kind = d.pick(["density", "params", "flops", "steps", "none", "two"],
                  [30, 20, 20, 12, 8, 10])
    if kind == "two":
        tags.add("two_budgets")
        first = d.pick(["density", "params", "flops"])
        second = d.pick([k for k in BUDGET_KINDS if k != first])
        budgets = [first, second]
    else:
        budgets = [] if kind == "none" else [kind]
    for b in budgets or ["none"]:
        tags.add(f"budget_{b}")
    # Where in the reachable range each target lies (fuzz_networks.choose_targets).
    run["budgets"] = {b: float(rng.uniform(0.05, 0.95)) for b in budgets}
    correction = d.pick(["auto", "surrogate", "off", "data"], [7, 38, 17, 38])
    run["correction"] = correction
    if correction == "data":
        run["data"] = d.pick(["array", "dataset"], [70, 30])
        tags.add(f"data_{run['data']}")
    else:
        tags.add(f"correction_{correction}")
    # hope_keras.compress corrects data-free ("auto") or on data=; the Encoder takes
    # every correction and the search options.
    run["api"] = ("compress" if correction in ("auto", "data") and d.p(0.6)
                  else "encoder")
    tags.add(f"api_{run['api']}")
    search = {}
    if run["api"] == "encoder":
        if d.p(0.3):
            search["refresh"] = "neighbors"
            tags.add("refresh_neighbors")
        r = rng.random()
        if r < 0.25:
            search["merge_candidates"] = int(rng.integers(1, 5))
            tags.add("merge_candidates_k")
        elif r < 0.5:
            search["merge_candidates"] = None
            tags.add("merge_candidates_none")
        if d.p(0.3):
            search["merge_search"] = "top_k"
            tags.add("merge_search_top_k")
    run["search"] = search
    run["again"] = float(rng.uniform(0.05, 0.95)) if d.p(0.12) else None
    if run["again"] is not None:
        tags.add("compress_again")
    return run


def draw(seed: int) -> Plan:
    """The plan of network `seed` (deterministic)."""
    rng = np.random.default_rng([seed, 47])
    container = str(rng.choice(["functional", "sequential", "subclassed"],
                               p=[0.64, 0.18, 0.18]))
    dims = int(rng.choice([0, 1, 2, 3], p=[0.3, 0.2, 0.35, 0.15]))
    bn_free = bool(rng.random() < 0.1)
    mixed = str(rng.choice(["none", "model", "layers"], p=[0.76, 0.12, 0.12]))
    spatial = {0: 0, 1: int(rng.integers(8, 13)), 2: int(rng.integers(6, 9)),
               3: int(rng.integers(4, 6))}[dims]
    channels = int(rng.integers(3, 9)) if dims == 0 else int(rng.integers(1, 4))
    shape = (channels,) if dims == 0 else (spatial,) * dims + (channels,)
    chain = container != "functional"
    d = _Drawer(rng, dims, spatial, bn_free=bn_free, chain=chain,
                ops=container != "sequential")
    d.tags.add(container)
    # (its own stream of draws: the other choices of a seed stay as they were)
    unknown = bool(dims and container != "subclassed" and not bn_free
                   and np.random.default_rng([seed, 52]).random() < 0.12)
    if unknown:
        d.tags.add("unknown_spatial_dims")
    if mixed != "none":
        d.tags.add("mixed_precision")
    if bn_free:
        d.tags.add("bn_free_calibrate")
    second = None
    if not chain and not bn_free and not unknown and rng.random() < 0.16:
        d.tags.add("several_inputs")
        late = dims > 0 and rng.random() < 0.4
        second = {"where": "late" if late else "early",
                  "merge": "concat" if late or rng.random() < 0.5 else "add"}
    early = second is not None and second["where"] == "early"
    # The stem; an early second input joins its output (same spatial size).
    stages = [d.group(relu=d.p(0.5), same=early)]
    width = stage_width(stages[0], channels)
    if early:
        second["shape"] = shape
        second["group"] = d.group(width if second["merge"] == "add" else None, same=True)
        if second["merge"] == "concat":
            width += second["group"]["producer"]["width"]
    kinds = _BN_FREE if bn_free else (_CHAIN if chain else _BODY)
    for _ in range(int(rng.integers(1, 5))):
        stage = d.stage(width, kinds)
        stages.append(stage)
        width = stage_width(stage, width)
    vector = None
    head_stages: List[dict] = []
    if dims:
        vector = d.pick(["flatten", "flatten_channels_first", "global_avg_pool",
                         "global_max_pool"], [40, 12, 33, 15])
        if unknown and vector.startswith("flatten"):  # needs every dimension
            vector = "global_avg_pool" if vector == "flatten" else "global_max_pool"
        d.tags.add(vector)
        if vector.startswith("flatten"):
            width *= d.spatial ** dims
        d.dims = 0
        if second is not None and second["where"] == "late":
            second["shape"] = (int(rng.integers(2, 6)),)
            second["group"] = d.group()
            width += second["group"]["producer"]["width"]
        if rng.random() < 0.7:
            head_kinds = [("group", 1)] if chain or bn_free else _HEAD
            head_stages.append(d.stage(width, head_kinds))
    nested = None
    if not chain and not bn_free and rng.random() < 0.4:
        nested = _draw_nested(rng, stages, d.tags, first=1 if early else 0)
    run = _draw_run(d, d.tags)
    # (its own stream of draws, as `unknown`: the other choices stay as they were)
    r_rng = np.random.default_rng([seed, 53])
    if run["api"] == "encoder" and r_rng.random() < 0.3:
        run["search"]["round_to"] = int(r_rng.choice([2, 4, 8]))
        d.tags.add("round_to")
    l_rng = np.random.default_rng([seed, 54])
    run["latency"] = float(l_rng.uniform(0.05, 0.95)) if l_rng.random() < 0.12 else None
    if run["latency"] is not None:
        d.tags.add("budget_latency")
    return Plan(seed=seed, container=container, dims=dims, shape=shape, mixed=mixed,
                bn_free=bn_free, unknown_spatial=unknown, stages=stages, vector=vector, head_stages=head_stages,
                second_input=second, nested=nested, run=run, patterns=frozenset(d.tags))


def _uses_ops(spec) -> bool:
    """Whether a stage applies a keras.ops call (not a layer: no Sequential)."""
    if isinstance(spec, dict):
        return spec.get("form") == "ops" or any(_uses_ops(v) for v in spec.values())
    if isinstance(spec, list):
        return any(_uses_ops(v) for v in spec)
    return False


def _chain_only(stage) -> bool:
    """Whether a stage is a chain of layers (it fits in a keras.Sequential)."""
    return (stage["kind"] in ("group", "pass", "pinned")
            or (stage["kind"] == "inverted" and not stage["residual"])) \
        and not _uses_ops(stage)


def _draw_nested(rng, stages, tags, first=0) -> Optional[dict]:
    """A contiguous run of body stages (from `first`: not the stem when a second input
    joins it; no fork: a backbone has one output) wrapped into a backbone model: a
    Sequential one when the run is a chain of layers and the draw says so."""
    ok = [s["kind"] != "fork" for s in stages]
    runs = [(a, b) for a in range(first, len(stages)) for b in range(a + 1, len(stages) + 1)
            if all(ok[a:b])]
    chains = [(a, b) for a, b in runs if all(_chain_only(s) for s in stages[a:b])]
    if chains and rng.random() < 0.6:
        start, stop = chains[int(rng.integers(len(chains)))]
        kind = "sequential"
    elif runs:
        start, stop = runs[int(rng.integers(len(runs)))]
        kind = "functional"
    else:
        return None
    tags.add(f"nested_{kind}")
    return {"kind": kind, "start": start, "stop": stop}


def coverage(seeds) -> dict:
    """``{pattern: number of the seeds' plans that draw it}`` for every pattern."""
    counts = dict.fromkeys(PATTERNS, 0)
    for seed in seeds:
        for tag in draw(seed).patterns:
            counts[tag] += 1
    return counts


def covering_seeds(seeds) -> List[int]:
    """A few of `seeds` whose plans together draw every pattern the whole range draws
    (greedy: each next seed the one adding the most patterns, the first on a tie)."""
    plans = {seed: draw(seed).patterns for seed in seeds}
    left, chosen = set().union(*plans.values()), []
    while left:
        best = max(plans, key=lambda seed: (len(plans[seed] & left), -seed))
        chosen.append(best)
        left -= plans[best]
    return sorted(chosen)
