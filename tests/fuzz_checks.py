"""The fuzzer's checks: compress each random network and check every claim.

`check(seed)` draws the plan (tests/fuzz_plan.py), builds the network
(tests/fuzz_networks.py), checks that it holds every pattern the plan names, then
compresses it with the plan's run (API, cost, actions, budgets — each target drawn
inside what the run can reach —, statistics correction, search options) and asserts:

* budgets already met or out of reach are refused before any edit (weights
  unchanged); ``data=`` is an array (one per input) or a ``tf.data.Dataset``;
* the run stops at the first budget met and not a step later; a density budget is
  met exactly (or one below after a merge whose parent is inactive; from below by at
  most a round with ``round_to``); a run stops for want of actions only where none
  is admissible;
* `slim(model)` computes what the edited model computes, on every output (1e-5
  relative in float32, `MIXED_RTOL` where float16 computes);
* its parameter count is the engine's live count, and `profile`'s FLOPs ratio of
  the slim model to the edited one is the engine's;
* the slim model reloads from ``.keras`` in safe mode with the same outputs;
* the trajectory, saved and loaded, replayed on the original weights gives
  bit-identical weights (statistics correction included);
* a BN-free network's `calibrate`d model computes the same function;
* flops= and `profile` refuse a model with unknown spatial dimensions;
* shared layers, and the layers the registry does not know, lie in no group;
* with ``round_to``, every group the run narrowed ends at a multiple of it (or
  whole), budgets are met between rounds only, and no group goes below it but by an
  eviction;
* ``latency=`` (a deterministic timer) from the original weights: met or a
  documented stop, its rounds recorded, the trajectory replayed bit for bit;
* compressed again, a model starts from what is left (counts equal to slim's), a
  budget it meets is refused and a lower one continues, slim still exact.

``python tests/fuzz_report.py --n 500`` prints the coverage table (tests/fuzz_report.py).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import fuzz_networks  # noqa: E402
import fuzz_plan  # noqa: E402
import hope_keras  # noqa: E402
from conftest import widths_by_step  # noqa: E402
from hope_keras.graph import adapter as kg  # noqa: E402

L = keras.layers
# float16 compute: outputs keep ~3 significant digits, and slimming changes the order
# of the float16 sums.
MIXED_RTOL = 5e-3
FLOAT32_RTOL = 1e-5
# Patterns of the run (options passed to compress): realised by construction.
RUN_PATTERNS = frozenset(k for k in fuzz_plan.PATTERNS if k.startswith((
    "api_", "cost_", "merge_scale", "kernel_", "mean_comp", "budget_", "two_budgets",
    "actions_", "correction_", "data_", "refresh_", "merge_candidates", "merge_search",
    "compress_again", "round_to")))
# Patterns whose layers the docs say are pinned: no group may flow through them.
PINNED_PATTERNS = frozenset(("shared_producer", "shared_inside_group", "pinned_layer"))
# Patterns of the whole model: no layer of their own for a group to flow through.
MODEL_PATTERNS = frozenset(("functional", "sequential", "subclassed", "several_inputs",
                            "several_outputs", "mixed_precision", "bn_free_calibrate",
                            "unknown_spatial_dims"))


# ---------------------------------------------------------------- observed patterns
def _act_name(fn):
    name = getattr(fn, "__name__", str(fn))
    return {"silu": "swish", "hard_silu": "hard_swish", "relu": "relu_activation"}.get(
        name, name)


_OP_ACTS = {"Relu": "relu_layer", "Relu6": "relu6", "LeakyRelu": "leaky_relu",
            "Silu": "swish", "HardSilu": "hard_swish", "Gelu": "gelu", "Tanh": "tanh",
            "Sigmoid": "sigmoid", "Selu": "selu", "Softplus": "softplus"}
_TRANSPOSED = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
_SOURCES = (L.Dense, L.Conv1D, L.Conv2D, L.Conv3D, L.SeparableConv1D,
            L.SeparableConv2D) + _TRANSPOSED


def _node_patterns(node, fg):
    """The patterns one call of a layer (or operation) shows."""
    op, out = node.op, set()
    cls = type(op)
    groups = int(getattr(op, "groups", 1) or 1)
    if cls is L.Dense:
        rank = len(fg.shapes[node.inputs[0]])
        out.add("dense" if rank == 2 else "dense_on_spatial")
    for d, conv in ((1, L.Conv1D), (2, L.Conv2D), (3, L.Conv3D)):
        if cls is conv:
            out.add(f"conv{d}d" if groups == 1 else "grouped_depthwise")
    if isinstance(op, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        out.add("depthwise")
    if isinstance(op, _TRANSPOSED):
        out.add("conv_transpose")
    if isinstance(op, (L.SeparableConv1D, L.SeparableConv2D)):
        out.add("separable")
        if int(op.depth_multiplier) > 1:
            out.add("separable_multiplier")
    if hasattr(op, "strides") and hasattr(op, "kernel_size") and max(op.strides) > 1:
        out.add("strides")
    if max(getattr(op, "dilation_rate", (1,))) > 1:
        out.add("dilation")
    if isinstance(op, _SOURCES + (L.DepthwiseConv1D, L.DepthwiseConv2D)) \
            and not op.use_bias:
        out.add("no_bias")
    # activations: layers, fused into producers, keras.ops calls
    if cls is L.ReLU:
        out.add("relu6" if op.max_value == 6.0 else "relu_layer")
    elif cls is L.LeakyReLU:
        out.add("leaky_relu")
    elif cls is L.ELU:
        out.add("elu")
    elif cls is L.Activation:
        out.add(_act_name(op.activation))
    elif isinstance(op, _SOURCES) and _act_name(op.activation) != "linear" \
            and not node.key.startswith("squeeze"):  # (an SE gate's own activations)
        out.add("fused_activation")
        if _act_name(op.activation) != "relu_activation":
            out.add(_act_name(op.activation))
    elif type(op).__name__ in _OP_ACTS:
        out.add("ops_activation")
        if _OP_ACTS[type(op).__name__] != "relu_layer":
            out.add(_OP_ACTS[type(op).__name__])
    if cls is L.BatchNormalization:
        parent = fg.producer_node(node.inputs[0])
        if parent is not None and (
                isinstance(parent.op, (L.ReLU, L.LeakyReLU, L.ELU, L.Activation))
                or type(parent.op).__name__ in _OP_ACTS
                or (isinstance(parent.op, _SOURCES)
                    and _act_name(parent.op.activation) != "linear")):
            out.add("bn_after_activation")
        out.update(t for t, on in (("bn_no_center", not op.center),
                                   ("bn_no_scale", not op.scale)) if on)
    if cls is L.Concatenate:
        out.add("concatenate")
        first = node.inputs[0]
        if len(fg.consumers.get(first, ())) > 1:  # the stream is read on, too
            out.add("densenet_concat")
    if type(op).__name__ == "CustomScaleLayer":
        out.add("scaled_sum")
    if (cls is L.Add or type(op).__name__ == "CustomScaleLayer") and any(
            p is not None and isinstance(p.op, L.Concatenate)
            for p in map(fg.producer_node, node.inputs)):
        out.add("concat_stream_add")
    if cls is L.Multiply:
        out.add("se_gate")
    if type(op).__name__ in ("Add", "Multiply") and not isinstance(op, keras.layers.Layer) \
            and len(node.inputs) == 1:
        out.add("hard_sigmoid_ops")  # `x + 3.0`, `x * (1 / 6)`
    if isinstance(op, L.LayerNormalization):
        out.add("layernorm_stream")
    if type(op).__name__ == "LayerScale":
        out.add("layer_scale")
    if isinstance(op, (L.UnitNormalization, L.GroupNormalization)):
        out.add("pinned_layer")
    if fg.calls.get(node.key, 1) > 1:
        out.add("shared_producer" if isinstance(op, _SOURCES) else "shared_inside_group")
    if node.path:
        out.add("nested_sequential" if any(
            isinstance(layer, keras.Sequential) for layer in _nested_models(fg.model)
            if layer.name in node.path) else "nested_functional")
    kinds = {"max_pool": ("MaxPooling",), "avg_pool": ("AveragePooling",),
             "global_avg_pool": ("GlobalAveragePooling",),
             "global_max_pool": ("GlobalMaxPooling",), "spatial_dropout": ("SpatialDropout",),
             "zero_padding": ("ZeroPadding",), "cropping": ("Cropping",),
             "upsampling": ("UpSampling",),
             "dropout": ("Dropout", "GaussianNoise", "Identity")}
    name = cls.__name__
    for tag, prefixes in kinds.items():
        if name.startswith(prefixes) and not (tag == "dropout" and "Spatial" in name):
            out.add(tag)
    if name.startswith("MaxPooling") and max(op.pool_size) == 1:
        out.add("pooled_identity")
    if cls is L.Flatten:
        out.add("flatten_channels_first" if op.data_format == "channels_first" else "flatten")
    return out


def _nested_models(model):
    return [layer for layer in getattr(model, "layers", []) if isinstance(layer, keras.Model)]


def _block_patterns(blk, graph):
    found = {"identity_block" if blk.shortcut == "identity" else "projection_block"}
    if blk.final_bn is None and blk.input_reader_bn:
        found.add("preact_block")
    if any(isinstance(graph.layer(n), (L.DepthwiseConv1D, L.DepthwiseConv2D))
           or int(getattr(graph.layer(n), "groups", 1) or 1) > 1 for n in blk.branch_layers):
        found.add("inverted_residual")
    return found


def observed_patterns(model, graph):
    """``(present, in_group)``: the structural patterns the built model shows, and those
    shown by a layer that some group's channels flow through (compressible there)."""
    fg = graph.flat
    present, in_group = set(), set()
    grouped = set()
    for g in graph.groups.values():
        grouped.update(g.tensors)
    for node in fg.nodes:
        tags = _node_patterns(node, fg)
        present |= tags
        if any(t in grouped for t in node.outputs + node.inputs):
            in_group |= tags
    src = fg.model
    present.add("sequential" if isinstance(src, keras.Sequential) else
                "subclassed" if kg.is_subclassed(src) else "functional")
    if len(fg.outputs) > 1:
        present.add("several_outputs")
    if len(fg.inputs) > 1:
        present.add("several_inputs")
    if any(None in fg.shapes[t][1:] for t, _ in fg.inputs):
        present.add("unknown_spatial_dims")
    if any(layer.dtype_policy.name == "mixed_float16" for layer in fg.layers.values()
           if hasattr(layer, "dtype_policy")):
        present.add("mixed_precision")
    if getattr(model, "calibration", None):
        present.add("bn_free_calibrate")
    for blk in graph.blocks:
        present |= _block_patterns(blk, graph)
        in_group |= _block_patterns(blk, graph)
    for g in graph.groups.values():
        if g.stream and any(isinstance(graph.layer(c.layer), L.LayerNormalization)
                            for c in g.couplings):
            in_group.add("layernorm_stream")
    return present, in_group


# ------------------------------------------------------------------------- helpers
def _inputs(plan, rng, n):
    shapes = [plan.shape] + ([plan.second_input["shape"]] if plan.second_input else [])
    xs = [rng.normal(size=(n,) + tuple(s)).astype("float32") for s in shapes]
    return xs if len(xs) > 1 else xs[0]


def _outputs(model, x):
    return [np.asarray(y, dtype=np.float64) for y in keras.tree.flatten(model(x))]


def _max_rel_err(a_model, b_model, x):
    """Largest error over the outputs, relative to each output's scale; either model
    may be given as its outputs already computed."""
    err = 0.0
    outs = [m if isinstance(m, list) else _outputs(m, x) for m in (a_model, b_model)]
    for a, b in zip(*outs, strict=True):
        scale = max(np.abs(a).max(), 1e-3)
        err = max(err, float(np.abs(a - b).max()) / scale)
    return err


def _same_weights(model, weights):
    return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights,
                                                    strict=True))


def _cost(run, groups="all"):
    settings = {"merge_scale": run["merge_scale"], "kernel": run["kernel"],
                "mean_compensation": run["mean_compensation"]}
    if run["cost"] == "no_streams" and groups == "all":
        groups = "no_streams"
    name = "paper" if run["cost"] == "paper" and groups != "fallback" else "hope"
    config = {"name": name, **settings}
    if name == "hope":
        config["groups"] = "all" if groups == "fallback" else groups
    if run["cost_as_config"]:
        return config
    return hope_keras.costs.get(config)


def _data(run, x):
    if run["correction"] != "data":
        return None
    if run["data"] == "dataset":
        import tensorflow as tf

        # Two inputs: elements ``((x1, x2),)`` (a bare pair would read as (x, y)).
        return tf.data.Dataset.from_tensor_slices(
            ((tuple(x),) if isinstance(x, list) else x)).batch(16)
    return x


def _expect_refusal(fn, match, model, weights, what):
    try:
        fn()
    except ValueError as e:
        assert any(m in str(e) for m in match), f"{what}: {e}"
        assert _same_weights(model, weights), f"{what}: the refusal changed the model"
        return str(e)
    raise AssertionError(f"{what}: expected a ValueError ({match})")


def choose_targets(budgets, enc):
    """``(targets, reachable)``: each budget's target at its drawn place inside the
    range the encoder says it can reach; where that range is empty, a target just
    below the start (which the run must refuse), and ``reachable`` False."""
    min_active, min_params, min_flops = enc.min_reachable()
    out, reachable = {}, True
    for kind, u in budgets.items():
        if kind == "density":
            room = enc.active - min_active
            target = min_active + min(math.floor(u * room), room - 1)
            out[kind] = (target if room > 0 else enc.active - 1) / enc.num_neurons \
                + 0.5 / enc.num_neurons
        elif kind in ("params", "flops"):
            now = getattr(enc.sizes, f"{kind}_ratio")
            low = min_params if kind == "params" else min_flops
            room = now - low
            out[kind] = low + u * room if room > 1e-9 else now * (1 - 1e-6)
        else:
            room = 1
            out[kind] = 1 + int(u * max(1, enc.active - min_active))
        reachable &= room > (1e-9 if kind in ("params", "flops") else 0)
    return out, reachable


# ----------------------------------------------------------------------- the check
@dataclasses.dataclass
class _Case:
    """One network under check: its plan, model (planted), inputs and what happened."""

    seed: int
    plan: fuzz_plan.Plan
    run: dict
    model: keras.Model
    graph: object
    x: object
    info: dict
    rng: np.random.Generator
    original: list = None
    count0: int = 0
    t0: float = 0.0

    @property
    def rtol(self):
        return FLOAT32_RTOL if self.plan.mixed == "none" else MIXED_RTOL


def check(seed):
    """Builds, compresses and checks network `seed`; returns what happened."""
    case = _prepare(seed)
    if not case.graph.groups:  # every channel pinned: refused, nothing changed
        case.info["refusals"].append(_expect_refusal(
            lambda: hope_keras.Encoder(case.model, verbose=False), ["no compressible"],
            case.model, case.original, f"seed {seed}: no group"))
        return _check_unchanged(case)
    result, data = _compress(case)
    if result is None:  # the walker's groups all lack statistics: refused, nothing changed
        return _check_unchanged(case)
    _check_result(case, result, data)
    if case.run["latency"] is not None:
        _check_latency(case, data)
    case.info["seconds"] = time.perf_counter() - case.t0
    return case.info


def _prepare(seed) -> _Case:
    """The plan's network (calibrated when BN-free), checked to hold every pattern
    the plan names, with its planted twins and weak blocks."""
    t0 = time.perf_counter()
    plan = fuzz_plan.draw(seed)
    model = fuzz_networks.build(plan)
    rng = np.random.default_rng([seed, 49])
    x = _inputs(plan, rng, 4)
    info = {"seed": seed, "patterns": set(plan.patterns), "refusals": [],
            "kinds": collections.Counter(), "stopped": "refused", "actions": (),
            "mixed": plan.mixed != "none"}
    graph = hope_keras.walk(model)
    present, in_group = observed_patterns(model, graph)
    if plan.bn_free:  # (calibrate puts each fused activation into a layer of its own)
        calibrated = hope_keras.calibrate(model, _inputs(plan, rng, 256))
        err = _max_rel_err(model, calibrated, x)
        tol = 1e-4 if plan.mixed == "none" else MIXED_RTOL
        assert err <= tol, f"seed {seed}: calibrate changed the outputs by {err:.3g}"
        model = calibrated
        graph = hope_keras.walk(model)
        present_after, in_group = observed_patterns(model, graph)
        present |= present_after
    missing = plan.patterns - RUN_PATTERNS - present
    assert not missing, f"seed {seed}: the model lacks the planned {sorted(missing)}"
    # docs/hope.md: shared layers are never edited, nor is what reaches them; the
    # channels around a layer the registry does not know stay whole.
    assert not in_group & PINNED_PATTERNS, f"seed {seed}: {in_group & PINNED_PATTERNS}"
    info["in_group"] = in_group & plan.patterns
    prng = np.random.default_rng([seed, 51])
    info["twins"] = fuzz_networks.plant_twins(graph, prng)
    info["weak_blocks"] = fuzz_networks.weaken_blocks(graph, prng)
    # (the original weights, not a clone: a clone costs as much as the whole check)
    return _Case(seed, plan, dict(plan.run), model, graph, x, info, rng,
                 original=model.get_weights(), count0=model.count_params(), t0=t0)


def _compress(case: _Case):
    """Runs the plan's compression, each documented refusal met on the way asserted
    (nothing changed) and the run then adjusted; checks where it stopped. Returns the
    result (None when analyze leaves no group to run) and the data= given."""
    seed, run, model, info = case.seed, case.run, case.model, case.info
    data = _data(run, _inputs(case.plan, case.rng, 64))
    correction = {"off": False, "data": "auto"}.get(run["correction"], run["correction"])

    def encoder(cost, actions, data):
        return hope_keras.Encoder(model, cost=cost, actions=actions, data=data,
                                  correction=correction, search=run["search"] or None,
                                  verbose=False)

    cost, actions = _cost(run), run["actions"]
    try:
        enc = encoder(cost, actions, data)
    except ValueError as e:  # no group the cost can price: refused, nothing changed
        if "no compressible neuron group" in str(e):
            # The walker found groups, but `analyze` pins them all (e.g. a coupled
            # group no BatchNormalization describes): there is nothing to run.
            assert _same_weights(model, case.original), f"seed {seed}: {e}"
            info["refusals"].append(str(e))
            return None, data
        assert "no neuron group the cost" in str(e), e
        assert _same_weights(model, case.original)
        info["refusals"].append(str(e))
        cost = _cost(run, "fallback")
        enc = encoder(cost, actions, data)
    if case.plan.unknown_spatial:
        # FLOPs need every dimension but the batch: flops= is refused before any edit,
        # and the run takes a params= budget instead.
        info["refusals"].append(_expect_refusal(
            lambda: enc.compress(flops=0.5), ["fixed input shape"], model, case.original,
            f"seed {seed}: flops= with unknown spatial dimensions"))
        budgets = dict(run["budgets"])
        u = budgets.pop("flops", None)
        if u is not None:
            budgets.setdefault("params", u)
        run["budgets"] = budgets
    targets, reachable = choose_targets(run["budgets"], enc)
    if not reachable:
        # Out of reach with these actions: refused before any edit; then all actions.
        info["refusals"].append(_expect_refusal(
            lambda: enc.compress(**targets), ["out of reach", "already met"], model,
            case.original, f"seed {seed}: unreachable {targets} with {actions}"))
        actions = fuzz_plan.ACTION_SETS["actions_all"]
        enc = encoder(cost, actions, data)
        targets, reachable = choose_targets(run["budgets"], enc)
        if not reachable and run["search"].get("round_to", 1) > 1:
            # Groups of round_to channels or fewer stay whole: refused again, then
            # any width.
            info["refusals"].append(_expect_refusal(
                lambda: enc.compress(**targets), ["out of reach", "already met"], model,
                case.original, f"seed {seed}: unreachable {targets} with round_to"))
            run["search"] = {k: v for k, v in run["search"].items() if k != "round_to"}
            enc = encoder(cost, actions, data)
            targets, reachable = choose_targets(run["budgets"], enc)
        assert reachable, f"seed {seed}: nothing reachable with every action"
    info.update(actions=actions, targets=targets, cost=cost)
    start = (enc.active, enc.sizes.params_ratio, enc.sizes.flops_ratio)
    try:
        result, after = _run(case, enc, encoder, cost, actions, targets, data)
    except FloatingPointError as e:
        # Without prunes, a merge whose parent would overflow float32 is refused, the
        # steps before it kept (docs/hope.md, "Choices the paper leaves open"); then
        # every action.
        assert "prune" not in actions and "Allow prunes" in str(e), f"seed {seed}: {e}"
        info["refusals"].append(str(e))
        model.set_weights(case.original)
        actions = fuzz_plan.ACTION_SETS["actions_all"]
        enc = encoder(cost, actions, data)
        targets, _ = choose_targets(run["budgets"], enc)
        info.update(actions=actions, targets=targets)
        start = (enc.active, enc.sizes.params_ratio, enc.sizes.flops_ratio)
        result, after = _run(case, enc, encoder, cost, actions, targets, data)
    _check_stop(seed, result, targets, start, after, actions)
    return result, data


def _run(case, enc, encoder, cost, actions, targets, data):
    """The planned run: ``(result, after)``, ``after()`` an encoder of the model as
    the run left it."""
    model, run, seed = case.model, case.run, case.seed
    if not targets:
        # No budget: `compress` refuses before any edit; `Encoder.run` goes to the end.
        case.info["refusals"].append(_expect_refusal(
            lambda: (hope_keras.compress(model, cost=cost, actions=actions, data=data,
                                         verbose=False) if run["api"] == "compress"
                     else enc.compress()),
            ["needs a budget"], model, case.original, f"seed {seed}: no budget"))
        return hope_keras.CompressionResult.of(enc, enc.run()), lambda: enc
    if run["api"] == "compress":
        result = hope_keras.compress(model, cost=cost, actions=actions, data=data,
                                     verbose=False, **targets)
        return result, lambda: encoder(cost, actions, None)  # (on the compressed model)
    return enc.compress(**targets), lambda: enc


def _check_result(case: _Case, result, data):
    """slim against in place, the counts against slim and `profile`, the `.keras`
    reload, the replay of the saved trajectory, and a second run when planned."""
    seed, model, x, info = case.seed, case.model, case.x, case.info
    steps = result.trajectory.steps
    info["kinds"] = collections.Counter(s.kind for s in steps)
    info["stopped"] = result.stopped
    info["edited"] = _edited_patterns(case.graph, steps) & case.plan.patterns

    small = hope_keras.slim(model)
    small_out = _outputs(small, x)
    info["slim_rel_err"] = err = _max_rel_err(model, small_out, x)
    assert err <= case.rtol, f"seed {seed}: slim differs by {err:.3g} (relative)"
    assert small.count_params() == round(result.params_ratio * case.count0), seed
    _check_profile(seed, small, model, result.flops_ratio, case.plan.unknown_spatial)
    info["zero_padded_ln"] = any(
        isinstance(layer, hope_keras.layers.ZeroPaddedLayerNormalization)
        for layer in small.layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "small.keras")
        small.save(path)
        reloaded = keras.models.load_model(path, safe_mode=True)
        assert _max_rel_err(small_out, reloaded, x) <= 1e-6, seed
        traj_path = os.path.join(tmp, "run.npz")
        result.trajectory.save(traj_path)
        trajectory = hope_keras.Trajectory.load(traj_path)
    compressed = model.get_weights()
    model.set_weights(case.original)  # the original model again: replay onto it
    trajectory.replay(model, step=len(steps), data=data)
    for w, w0, w1 in zip(model.weights, model.get_weights(), compressed, strict=True):
        assert np.array_equal(w0, w1), (seed, w.path)
    targets = info["targets"]
    for kind in ("params", "flops"):  # replay by the budget finds the same step
        if targets.get(kind) is not None and result.stopped == "budget" and \
                getattr(result, f"{kind}_ratio") <= targets[kind] + 1e-12:
            assert trajectory.step_for(**{kind: targets[kind]}) == len(steps), seed
    _check_rounded(case, result.trajectory, result.stopped)
    lines = []
    result.analysis.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert all(name in text for name in result.analysis.graph.groups), seed
    if case.run["again"] is not None and steps:
        _check_again(case, result)


def _check_rounded(case: _Case, trajectory, stopped):
    """With ``round_to = r`` (docs/hope.md, "Widths that suit the hardware"): followed
    step by step from the trajectory, outside a round every group is a multiple of
    `r` or as it started, inside one exactly one group is not, and no group goes below
    `r` channels but by an eviction."""
    r = trajectory.meta["options"].get("round_to", 1)
    if r == 1:
        return
    whole = dict(trajectory.meta["groups"])
    inside = set(trajectory.meta.get("unrounded_steps", ()))
    for k, s, width in widths_by_step(trajectory):
        if s.kind != "evict":
            assert width[s.unit] >= min(r, whole[s.unit]), (case.seed, k, s.unit)
        off = sorted(g for g, n in width.items() if n % r and n != whole[g])
        expected = 1 if k in inside else 0
        assert len(off) == expected or (k == len(trajectory.steps) and stopped == "steps"
                                        and len(off) <= 1), (case.seed, k, r, off)


class _FlopsTimer:
    """A deterministic latency timer: the FLOPs ratio plus what does not shrink."""

    OVERHEAD = 0.05

    def __init__(self):
        self.calls = []

    def __call__(self, small, reference):
        value = hope_keras.profile(small, reference=reference,
                                   latency=False).ratio("flops") + self.OVERHEAD
        self.calls.append(value)
        return value


def _check_latency(case: _Case, data):
    """docs/hope.md, "A latency budget": from the original weights, `latency=` with
    the run's options lowers the FLOPs target round by round until the timer's ratio
    of the slimmed model is met (or a documented stop), records its rounds, and the
    trajectory replays bit for bit; refused, nothing changed, without fixed shapes."""
    model, info, seed = case.model, case.info, case.seed
    model.set_weights(case.original)
    timer = _FlopsTimer()
    enc = hope_keras.Encoder(model, cost=info["cost"], actions=info["actions"], data=data,
                             correction={"off": False, "data": "auto"}.get(
                                 case.run["correction"], case.run["correction"]),
                             search=case.run["search"] or None, verbose=False)
    if case.plan.unknown_spatial:
        info["refusals"].append(_expect_refusal(
            lambda: enc.compress(latency=0.5), ["fixed input shape"], model,
            case.original, f"seed {seed}: latency= with unknown spatial dimensions"))
        return
    floor = enc.min_reachable()[2]
    ratio = floor + _FlopsTimer.OVERHEAD + case.run["latency"] * (
        1.0 - floor - _FlopsTimer.OVERHEAD)
    where = f"seed {seed}: latency={ratio:.4f}"
    if not ratio <= 1.0:  # the timer's overhead alone is above any ratio allowed
        info["refusals"].append(_expect_refusal(
            lambda: enc.compress(latency=ratio), ["latency must be in (0, 1]"], model,
            case.original, where))
        return
    budget = hope_keras.LatencyBudget(ratio, timer=timer, min_flops=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a documented stop above the ratio
        result = enc.compress(latency=budget)
    meta = result.trajectory.meta["latency"]
    rounds = meta["rounds"]
    assert [t for r in rounds for t in r["times"]] == timer.calls, where
    assert result.latency_ratio == meta["measured"] == rounds[-1]["measured"], where
    assert meta["step"] == len(result.trajectory) == rounds[-1]["step"], where
    if result.stopped == "budget":
        assert result.latency_ratio <= ratio, where
    else:
        assert result.stopped in ("min_flops", "no_action", "steps"), where
        assert result.latency_ratio > ratio, where
    for before, after in zip(rounds, rounds[1:]):
        assert after["flops_target"] < before["flops_target"], where
        assert after["step"] >= before["step"], where
    small = hope_keras.slim(model)
    assert _max_rel_err(model, small, case.x) <= case.rtol, where
    assert math.isclose(result.latency_ratio, timer(small, model), rel_tol=1e-9), where
    compressed = model.get_weights()
    model.set_weights(case.original)
    result.trajectory.replay(model, step=len(result.trajectory), data=data)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), compressed)), where
    info["latency_stopped"] = result.stopped


def _check_unchanged(case: _Case):
    """A model nothing can compress: `slim` still rebuilds it exactly."""
    small = hope_keras.slim(case.model)
    case.info["slim_rel_err"] = err = _max_rel_err(case.model, small, case.x)
    assert err <= case.rtol and small.count_params() == case.count0, case.seed
    case.info["edited"], case.info["seconds"] = set(), time.perf_counter() - case.t0
    return case.info


def _check_profile(seed, small, model, flops_ratio, unknown_spatial):
    """`profile` counts the slim model's parameters, and its FLOPs ratio to the edited
    model is the engine's; with unknown spatial dimensions it refuses to count FLOPs."""
    if unknown_spatial:
        _expect_refusal(lambda: hope_keras.profile(small, latency=False),
                        ["fixed input shape"], small, small.get_weights(),
                        f"seed {seed}: profile with unknown spatial dimensions")
        return
    prof = hope_keras.profile(small, reference=model, latency=False)
    assert prof.params == small.count_params(), seed
    assert math.isclose(prof.ratio("flops"), flops_ratio, rel_tol=1e-9), (
        seed, prof.ratio("flops"), flops_ratio)


def _check_again(case: _Case, result):
    """docs/hope.md: a compressed model starts from what is left (its densities and
    ratios are slim's), a budget it already meets is refused, and a lower one
    continues; slim stays exact and its counts the engine's."""
    model, info = case.model, case.info
    enc = hope_keras.Encoder(model, cost=info["cost"], actions=info["actions"],
                             correction="surrogate", verbose=False)
    where = f"seed {case.seed}: compressed again from {result}"
    assert enc.active == result.trajectory[-1].active_after, where
    assert math.isclose(enc.sizes.params_ratio, result.params_ratio, rel_tol=1e-12), where
    assert math.isclose(enc.sizes.flops_ratio, result.flops_ratio, rel_tol=1e-12), where
    weights = model.get_weights()
    if enc.active < enc.num_neurons:
        _expect_refusal(lambda: enc.compress(density=(enc.active + 0.5) / enc.num_neurons),
                        ["already met"], model, weights, where)
    if enc.active == 0:  # nothing left: every density is met (refused above)
        return
    targets, reachable = choose_targets({"density": case.run["again"]}, enc)
    if not reachable:
        _expect_refusal(lambda: enc.compress(**targets), ["out of reach"], model, weights,
                        where)
        return
    again = enc.compress(**targets)
    assert again.stopped in ("budget", "no_action"), where
    small = hope_keras.slim(model)
    err = _max_rel_err(model, small, case.x)
    assert err <= case.rtol, f"{where}: slim differs by {err:.3g}"
    assert small.count_params() == round(again.params_ratio * case.count0), where
    _check_profile(case.seed, small, model, again.flops_ratio, case.plan.unknown_spatial)


def _met(targets, num_neurons, active, params, flops, n_steps):
    """Which budgets are met in this state."""
    met = set()
    if targets.get("density") is not None and active <= math.floor(
            targets["density"] * num_neurons + 1e-9):
        met.add("density")
    for kind, value in (("params", params), ("flops", flops)):
        if targets.get(kind) is not None and value <= targets[kind] + 1e-12:
            met.add(kind)
    if targets.get("steps") is not None and n_steps >= targets["steps"]:
        met.add("steps")
    return met


def _check_stop(seed, result, targets, start, encoder, actions):
    """The run stopped at the first budget met, exactly where the docs say;
    ``encoder()``: the run's encoder, or one on the compressed model."""
    steps = result.trajectory.steps
    n = result.trajectory.meta["num_neurons"]
    rounded = result.trajectory.meta["options"].get("round_to", 1) > 1
    # With round_to, budgets are tested between rounds only (docs/hope.md).
    inside = set(result.trajectory.meta.get("unrounded_steps", ()))
    end = (_met(targets, n, steps[-1].active_after, steps[-1].params_after,
                steps[-1].flops_after, len(steps)) if steps else set())
    k = max((k for k in range(len(steps)) if k not in inside), default=0)  # last round start
    before = (_met(targets, n, steps[k - 1].active_after, steps[k - 1].params_after,
                   steps[k - 1].flops_after, k) - {"steps"} if k
              else _met(targets, n, *start, 0))
    if len(steps) > 1:
        before |= _met({"steps": targets.get("steps")}, n, 0, 0, 0, len(steps) - 1)
    where = f"seed {seed}: {result} targets {targets}"
    assert not before, f"{where}: went on after {before} was met"
    if result.stopped != "steps":  # a steps= budget may stop inside a round
        assert len(steps) not in inside, f"{where}: stopped inside a round"
    assert not steps or math.isclose(result.density, steps[-1].active_after / n), where
    if steps:
        assert result.params_ratio == steps[-1].params_after, where
        assert result.flops_ratio == steps[-1].flops_after, where
    if result.stopped == "budget":
        assert end - {"steps"}, where
    elif result.stopped == "steps":
        assert end == {"steps"} or "steps" in end, where
    else:
        assert result.stopped == "no_action" and not end, where
        # Every target is inside the reachable range (`choose_targets`): only a density
        # budget can leave the run without an action, by evictions that would overshoot
        # it (skipped), and with it the budgets those evictions would have met; or,
        # without prunes, merges that end early: a merge into an inactive parent takes
        # both neurons, and one that would leave a group no live neuron is not taken
        # (docs/hope.md), which the reachable range does not foresee.
        fractions = {k for k in ("density", "params", "flops") if targets.get(k) is not None}
        merges_only = "prune" not in actions and "evict" not in actions
        assert not fractions or "density" in fractions or merges_only, where
        enc = encoder()  # on the compressed model for `compress`: it starts from there
        left = None
        if "density" in fractions:
            left = enc.active - math.floor(targets["density"] * enc.num_neurons + 1e-9)
            following = enc.next_action(None)
            assert following is None or following.kind == "evict", (where, following)
        assert enc.next_action(left) is None, where
    if "density" in end and not rounded:
        # Met exactly (without round_to, which meets it from below by at most a
        # round): an eviction that would overshoot is skipped.
        target = math.floor(targets["density"] * n + 1e-9)
        last = steps[-1]
        assert last.active_after == target or (
            last.active_after == target - 1 and last.kind == "merge"), where


def _edited_patterns(graph, steps):
    """Structural patterns shown by a layer a step's group (or block) flows through."""
    units = {s.unit for s in steps}
    tensors = set()
    for blk in graph.blocks:
        if blk.name in units:
            units |= set(blk.groups)
    for name in units:
        if name in graph.groups:
            tensors.update(graph.groups[name].tensors)
    out = set()
    for node in graph.flat.nodes:
        if any(t in tensors for t in node.outputs + node.inputs):
            out |= _node_patterns(node, graph.flat)
    for blk in graph.blocks:  # a block is edited when a step touched its groups
        if blk.name in units or units & set(blk.groups):
            out |= _block_patterns(blk, graph)
    return out
