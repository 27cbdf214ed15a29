"""Seeded random networks for fuzzing compress / slim / replay.

`build(seed)` returns a small random Keras model (Sequential or Functional; Dense or
Conv2D; identity and projection residual blocks; forks to a second output, half
of them through a layer called twice; max /
average / global pooling, Flatten, Dropout; producers with and without bias; BN with
center / scale off, negative γ and random moving statistics; mixed precision on the
whole model or on some layers). Half of the groups get a planted noisy near-duplicate
neuron and 70 % of the identity blocks a weak branch, so that merges and evictions
actually happen. `check(seed)` compresses it to a random density with every action (random cost,
merge scale and mean compensation) and asserts that

* `slim(model)` computes what the edited model computes (1e-5 relative in float32;
  5e-3 relative where float16 computes, see `MIXED_RTOL`),
* `slim(model).count_params()` is the live count the engine reports
  (`CompressionResult.params_ratio` × the original count),
* `Trajectory.replay` on the original weights gives bit-identical weights.

Run from the repository root: ``python tests/fuzz_networks.py --n 500`` prints how
often each action happened; `make fuzz` runs the same checks as tests.
"""

from __future__ import annotations

import collections
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hope_keras  # noqa: E402

L = keras.layers
# float16 compute: outputs keep ~3 significant digits, and slimming changes the order
# of the float16 sums.
MIXED_RTOL = 5e-3
FLOAT32_RTOL = 1e-5


class _Builder:
    def __init__(self, rng, conv, mixed):
        self.rng, self.conv, self.mixed = rng, conv, mixed
        self.count = collections.Counter()

    def name(self, base):
        self.count[base] += 1
        return f"{base}{self.count[base]}"

    def dtype(self):
        if self.mixed == "model" or (self.mixed == "layers" and self.rng.random() < 0.5):
            return "mixed_float16"
        return None

    def producer(self, width, kernel=None):
        bias = bool(self.rng.random() < 0.7)
        if self.conv:
            k = kernel or int(self.rng.choice([1, 3]))
            return L.Conv2D(width, k, padding="same", use_bias=bias, dtype=self.dtype(),
                            name=self.name("conv"))
        return L.Dense(width, use_bias=bias, dtype=self.dtype(), name=self.name("dense"))

    def bn(self):
        return L.BatchNormalization(center=bool(self.rng.random() > 0.2),
                                    scale=bool(self.rng.random() > 0.2), dtype=self.dtype(),
                                    name=self.name("bn"))

    def relu(self):
        if self.rng.random() < 0.2:
            return L.Activation("relu", dtype=self.dtype(), name=self.name("act"))
        return L.ReLU(dtype=self.dtype(), name=self.name("relu"))

    def group(self, width):
        return [self.producer(width), self.bn(), self.relu()]

    def passthrough(self, spatial):
        """A random channel-preserving layer (or none); returns (layers, new spatial)."""
        r = self.rng.random()
        if self.conv and spatial >= 4 and r < 0.35:
            pool = L.MaxPooling2D if self.rng.random() < 0.5 else L.AveragePooling2D
            return [pool(2, dtype=self.dtype(), name=self.name("pool"))], spatial // 2
        if r < 0.55:
            drop = (L.SpatialDropout2D if self.conv and self.rng.random() < 0.5 else L.Dropout)
            return [drop(0.3, dtype=self.dtype(), name=self.name("drop"))], spatial
        return [], spatial

    def to_vector(self):
        if not self.conv:
            return []
        r = self.rng.random()
        if r < 0.45:
            return [L.Flatten(dtype=self.dtype(), name=self.name("flat"))]
        if r < 0.8:
            return [L.GlobalAveragePooling2D(dtype=self.dtype(), name=self.name("gap"))]
        return [L.GlobalMaxPooling2D(dtype=self.dtype(), name=self.name("gmp"))]


def _apply(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _input_shape(b, rng):
    if b.conv:
        s = int(rng.choice([6, 8]))
        return (s, s, int(rng.integers(1, 4))), s
    return (int(rng.integers(3, 8)),), 0


def _sequential(seed, rng, b):
    shape, spatial = _input_shape(b, rng)
    layers = []
    for _ in range(int(rng.integers(1, 4))):
        layers += b.group(int(rng.integers(2, 7)))
        extra, spatial = b.passthrough(spatial)
        layers += extra
    layers += b.to_vector()
    conv, b.conv = b.conv, False  # Dense from here on
    if not conv or rng.random() < 0.7:
        layers += b.group(int(rng.integers(2, 7)))
        layers += b.passthrough(0)[0]
    layers.append(L.Dense(3, name="head"))
    return keras.Sequential([keras.Input(shape)] + layers, name=f"fuzz_seq_{seed}")


def _functional(seed, rng, b):
    shape, spatial = _input_shape(b, rng)
    inputs = keras.Input(shape)
    width = int(rng.integers(2, 7))
    x = _apply(b.group(width), inputs)
    outputs = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["plain", "identity", "projection", "fork"], p=[0.25, 0.45, 0.1, 0.2])
        if kind in ("identity", "projection"):
            new_width = width if kind == "identity" else int(rng.integers(2, 7))
            y = x
            for _ in range(int(rng.integers(1, 3))):
                y = _apply(b.group(int(rng.integers(2, 7))), y)
            y = b.bn()(b.producer(new_width)(y))
            shortcut = x
            if kind == "projection":
                shortcut = b.bn()(b.producer(new_width, kernel=1)(x))
            x = L.Add(dtype=b.dtype(), name=b.name("add"))([shortcut, y])
            x = b.relu()(x)
            width = new_width
            continue
        if kind == "fork":  # a second consumer of x's channels, ending in an output
            fork_layer = b.producer(2)
            fork = fork_layer(x)
            outputs.append(L.GlobalAveragePooling2D()(fork) if b.conv else fork)
            if rng.random() < 0.5:
                # The same layer called again, on the next group's output (same width).
                x = _apply(b.group(width), x)
                fork = fork_layer(x)
                outputs.append(L.GlobalAveragePooling2D()(fork) if b.conv else fork)
        width = int(rng.integers(2, 7))
        x = _apply(b.group(width), x)
        extra, spatial = b.passthrough(spatial)
        x = _apply(extra, x)
    x = _apply(b.to_vector(), x)
    conv, b.conv = b.conv, False  # Dense from here on
    if not conv or rng.random() < 0.7:
        x = _apply(b.group(int(rng.integers(2, 7))), x)
        x = _apply(b.passthrough(0)[0], x)
    outputs.append(L.Dense(3, name="head")(x))
    return keras.Model(inputs, outputs if len(outputs) > 1 else outputs[0],
                       name=f"fuzz_fn_{seed}")


def _randomize(model, rng):
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.moving_mean.shape[0]
            if layer.scale:
                g = rng.uniform(0.3, 1.5, n) * np.where(rng.random(n) < 0.15, -1.0, 1.0)
                layer.gamma.assign(g.astype("float32"))
            if layer.center:
                layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
            layer.moving_mean.assign(rng.normal(0, 0.3, n).astype("float32"))
            layer.moving_variance.assign(rng.uniform(0.3, 2.0, n).astype("float32"))
        elif getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.3, layer.bias.shape).astype("float32"))


def _consumer_rows(kernel, conv, channels, c):
    """Index of channel c's slice in a consumer kernel (channel-last Flatten order)."""
    if conv:
        return (Ellipsis, c, slice(None))
    return (np.arange(c, kernel.shape[0], channels), slice(None))


def _plant_twins(model, rng, graph):
    """A noisy copy of one neuron in about half of the groups (a cheap merge)."""
    planted = 0
    for g in graph.groups.values():
        if g.kind != "neurons" or g.size < 3 or rng.random() < 0.5:
            continue
        src, dst = (int(v) for v in rng.choice(g.size, 2, replace=False))
        noise = float(rng.uniform(0.01, 0.1))
        p, bn = model.get_layer(g.producer), model.get_layer(g.bn)
        k = p.kernel.numpy()
        k[..., dst] = k[..., src] * (1 + noise * rng.normal(size=k[..., src].shape))
        p.kernel.assign(k)
        if p.use_bias:
            bias = p.bias.numpy()
            bias[dst] = bias[src]
            p.bias.assign(bias)
        for w in bn.weights:
            a = w.numpy()
            a[dst] = a[src]
            w.assign(a)
        for c in g.consumers:
            layer = model.get_layer(c.layer)
            u = layer.kernel.numpy()
            conv = c.kind == "conv"
            i_src, i_dst = (_consumer_rows(u, conv, g.size, x) for x in (src, dst))
            u[i_dst] = u[i_src] * (1 + noise * rng.normal(size=u[i_src].shape))
            layer.kernel.assign(u)
        planted += 1
    return planted


def _weaken_blocks(model, rng, graph):
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
            bn = model.get_layer(bn_name)
            for attr in ("gamma", "beta"):
                v = getattr(bn, attr, None)
                if v is not None:
                    v.assign(v.numpy() * factor)
        weak += 1
    return weak


def build(seed):
    """A random model for `seed` and a dict describing it."""
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    sequential = bool(rng.random() < 0.3)
    conv = bool(rng.random() < 0.5)
    mixed = str(rng.choice(["none", "model", "layers"], p=[0.7, 0.15, 0.15]))
    b = _Builder(rng, conv, mixed)
    model = (_sequential if sequential else _functional)(seed, rng, b)
    _randomize(model, rng)
    graph = hope_keras.walk(model)
    info = {
        "sequential": sequential, "conv": conv, "mixed": mixed,
        "groups": len(graph.groups), "neurons": sum(g.size for g in graph.groups.values()),
        "blocks": len(graph.blocks), "evictable": sum(bl.evictable for bl in graph.blocks),
        "shared": any(len(layer._inbound_nodes) > 1 for layer in model.layers),
        "twins": _plant_twins(model, rng, graph),
        "weak_blocks": _weaken_blocks(model, rng, graph),
    }
    return model, info


def _outputs(model, x):
    return [np.asarray(y, dtype=np.float64) for y in keras.tree.flatten(model(x))]


def check(seed):
    """Compresses `build(seed)` and checks slim, the live count and replay; returns stats."""
    model, info = build(seed)
    rng = np.random.default_rng(10_000 + seed)
    original = model.get_weights()  # (a clone costs as much as the whole check)
    count0 = model.count_params()
    options = {"merge_scale": str(rng.choice(["sum", "paper"])),
               "cost": str(rng.choice(["hope", "hope_nostreams", "paper"])),
               "mean_compensation": bool(rng.random() < 0.3)}
    # The stream readers' correction (synthetic inputs, ~1 s a network) on one network
    # in five, drawn apart so that each seed's network and options stay as they were.
    options["correct_statistics"] = ("auto" if np.random.default_rng(seed + 10**6).random()
                                     < 0.2 else "surrogate")
    info["options"] = dict(options)
    # Each cost prices its own groups: the paper's only its neuron layers (producer →
    # BN → ReLU), the default every group, "hope_nostreams" all but the residual streams.
    costs = hope_keras.costs
    settings = {"merge_scale": options["merge_scale"],
                "mean_compensation": options["mean_compensation"]}
    cost = (costs.HopeCost(groups="no_streams", **settings)
            if options["cost"] == "hope_nostreams"
            else costs.get({"name": options["cost"], **settings}))
    groups = hope_keras.walk(model).groups.values()
    sizes = [grp.size for grp in groups if costs.in_scope(cost.groups, grp)]
    if not sizes:
        cost = costs.HopeCost(groups="all", **settings)
        info["options"]["cost"] = "hope"
        sizes = [grp.size for grp in groups]
    n, g = sum(sizes), len(sizes)
    # A target between one neuron per group and all but one: never met, never out of reach.
    if n <= g:
        info["kinds"] = collections.Counter()
        return info
    target = int(rng.integers(g, n))
    density = (target + 0.5) / n
    result = hope_keras.Encoder(model, cost=cost, correction=options["correct_statistics"],
                                verbose=False).compress(density=density)
    steps = result.trajectory.steps
    info["kinds"] = collections.Counter(s.kind for s in steps)
    assert result.stopped == "budget" and result.density <= density
    # Exactly the target, or one below when the last step is a merge whose parent is
    # inactive (γ_k² < ε: both children go).
    assert steps[-1].active_after == target or (
        steps[-1].active_after == target - 1 and steps[-1].kind == "merge"), seed

    x = rng.normal(size=(4,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    small = hope_keras.slim(model)
    rtol = FLOAT32_RTOL if info["mixed"] == "none" else MIXED_RTOL
    info["slim_rel_err"] = 0.0
    for a, b in zip(_outputs(model, x), _outputs(small, x)):
        scale = max(np.abs(a).max(), 1e-3)
        err = np.abs(a - b).max()
        info["slim_rel_err"] = max(info["slim_rel_err"], err / scale)
        assert err <= rtol * scale, f"seed {seed}: slim differs by {err:.3g} (scale {scale:.3g})"
    assert small.count_params() == round(result.params_ratio * count0), seed

    compressed = model.get_weights()
    model.set_weights(original)  # the original model again: replay onto it
    result.trajectory.replay(model, step=len(steps))
    for w, w0, w1 in zip(model.weights, model.get_weights(), compressed):
        assert np.array_equal(w0, w1), (seed, w.path)
    return info


def summarize(infos):
    """Fractions of networks in which each action happened (of those compressed)."""
    done = [i for i in infos if sum(i["kinds"].values())]
    out = {"networks": len(infos), "compressed": len(done)}
    for kind in ("prune", "merge", "evict"):
        out[kind] = sum(i["kinds"][kind] > 0 for i in done) / max(len(done), 1)
    with_blocks = [i for i in done if i["evictable"]]
    out["evict_of_evictable"] = (sum(i["kinds"]["evict"] > 0 for i in with_blocks)
                                 / max(len(with_blocks), 1))
    out["sequential"] = sum(i["sequential"] for i in infos) / max(len(infos), 1)
    out["conv"] = sum(i["conv"] for i in infos) / max(len(infos), 1)
    out["mixed"] = sum(i["mixed"] != "none" for i in infos) / max(len(infos), 1)
    out["with_blocks"] = sum(i["blocks"] > 0 for i in infos) / max(len(infos), 1)
    out["shared"] = sum(i["shared"] for i in infos) / max(len(infos), 1)
    for what, test in (("float32", lambda i: i["mixed"] == "none"),
                       ("mixed", lambda i: i["mixed"] != "none")):
        errs = [i["slim_rel_err"] for i in done if test(i)]
        out[f"max_slim_rel_err_{what}"] = max(errs) if errs else 0.0
    return out


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500, help="number of networks")
    p.add_argument("--start", type=int, default=0, help="first seed")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    infos = [check(seed) for seed in range(args.start, args.start + args.n)]
    elapsed = time.perf_counter() - t0
    summary = summarize(infos)
    print(f"{args.n} networks (seeds {args.start}..{args.start + args.n - 1}) in "
          f"{elapsed:.1f} s: " + ", ".join(
              f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
              for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
