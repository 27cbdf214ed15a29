#!/usr/bin/env python
"""Compression quality: HOPE's default cost against its variants and the baselines.

For one trained Fashion-MNIST model, data-free (except `calibrate` for the BN-free
LeNet, which reads the 512 unlabeled calibration images), no fine-tuning, it measures
test accuracy and top-1 agreement with the uncompressed model along three axes:

* neuron density (active / initial compressible neurons, every group `analyze` finds,
  residual-stream groups included): 0.9 … 0.3 (LeNet … 0.2);
* live parameter ratio and FLOPs ratio of the slimmed model: 0.9 … 0.3 (points a
  method cannot reach are left out). FLOPs are 2 × multiply-adds of the layers with a
  kernel, for one example (`hope_keras.search.sizes.SizeCounter`, the count HOPE's
  trajectories record as ``flops_after`` and `hope_keras.profile` gives; checked
  against ``profile`` of a slimmed model per run); the baselines are counted alike.

on two disjoint splits of the Fashion-MNIST test set (the models were trained on the
60 000 training images):

* ``sel`` — the selection split: the 2000 test images bundled with the package
  (`hope_keras.data.load_demo_data`). Every default and variant is chosen on it.
* ``heldout`` — 3000 other test images (``/usr/share/datasets/fashion-mnist``), which
  chose nothing. The targets (the default against the best baseline) are checked on it.

Methods (``--methods``; default: ``DEFAULT_METHODS``, ResNet-50 ``RESNET_METHODS``):

* HOPE on the density axis: ``hope`` (the default, ``cost="hope"``),
  ``hope_topk`` (the default with ``merge_search="top_k"``: uncertified candidate
  rows; on every axis, as ``hope``), ``hope_round8`` (the default with
  ``round_to=8``: every layer a run narrows ends at a multiple of 8 channels),
  ``hope_topk_auto`` (``hope_topk`` with the default's statistics correction: the
  default but for the merge search),
  ``hope_alpha_merge`` (merges priced with the paper's α*-scaled parent, ``J_merge``
  without ``n``: an earlier default), ``hope_prev`` (the same on every
  axis, ranked per neuron under every budget), ``hope_paper`` (``cost="paper"``; it
  prices only the paper's neuron layers, so its own density counts fewer neurons:
  the benchmark converts, see `Bench.run_hope`), ``hope_neurons`` (the default cost
  on the paper's neuron layers only, as ``cost="paper"``: residual streams and other
  coupled groups stay whole), ``hope_nostreams`` (``HopeCost(groups="no_streams")``:
  the residual streams whole, the previous default), ``hope_one_reader``
  (streams priced, every group ranked as if one layer read it: no factor ``R``),
  ``hope_neighbors`` (``refresh="neighbors"``), ``hope_prune`` (prune only),
  ``hope_noevict`` (no evictions: ``actions=("prune", "merge")``), ``hope_prune_sc``
  (prune only + statistics correction, below),
  ``hope_mc``, ``hope_prune_mc`` (``mean_compensation=True``),
  ``hope_merge_paper`` (``merge_scale="paper"`` with the α* merge cost that prices
  it), ``hope_width_b50`` (each layer's costs weighted by ``sqrt(n0 / mean n0)``),
  and the within-layer ranking experiments ``rank_k`` / ``rank_gamma`` / ``rank_u``
  (and ``*_prune``, prune only): width-free prune cost ``J = s_i / (Σ s − s_i)`` with
  ``s = sqrt(K(i,i))``, ``|γ_i|`` or ``‖u_i‖`` instead of the capacity
  ``‖u_i‖·sqrt(K(i,i))``.
* HOPE under ``params=`` / ``flops=`` budgets: ``hope``, ``hope_prev``, ``hope_mc``,
  ``hope_paper`` and the orderings ``order_a0`` … ``order_param``: rank an action by
  ``J / (k · (S / (k·m))^α)`` for an action removing ``k`` neurons and saving ``S``
  parameters (FLOPs), ``m`` the mean saving per neuron of the uncompressed model
  (a constant: it scales every key alike). α = 0 is ``J`` per neuron (the default
  under ``params=``), α = 0.5 the default under ``flops=`` (``J / sqrt(k·S)``),
  α = 1 ``J`` per parameter (FLOP) saved.
* Baselines (`hope_keras.baselines`): ``{l1_input,l1_joint,bn_scale}_{global,layer}``
  and the same with ``_mc`` (``mean_compensation=True``); ``nm_global`` /
  ``nm_layer`` (Neuron Merging, t = 0). On the params / FLOPs axes a baseline's
  neuron count is searched (bisection) for the first point at or below the ratio.
* ``hope_auto``, ``hope_prune_auto``, ``hope_nocorr``: the default and prune-only
  HOPE with ``compress(correct_statistics="auto")`` (the default since it was
  measured; ``hope_nocorr``: False) (BN statistics corrected after the run
  where `hope_keras.stats.bn_stats.untrusted_tensors` trusts the prediction; replays
  apply it).
* Statistics correction: ``hope_sc``, ``hope_prune_sc`` and every baseline name with ``_sc``
  (``bn_scale_layer_sc``, ``nm_layer_sc`` …): the method, then, at every point, on
  the model edited in place (after each replay or direct run),
  ``hope_keras.correct_statistics(model, analysis, trajectory=steps)`` with the analysis
  of the uncompressed model (and, for HOPE, the steps to that point: merged parents
  keep their statistics), before evaluating; ``hope_sc_moved``: the same without the
  steps (every live channel moved, parents too).
* BN re-estimation (uses data; a diagnostic, not a data-free method): ``hope_re`` and
  every baseline name with ``_re``: the method, then, at every point,
  ``hope_keras.reestimate_batchnorm_statistics(model, x_calib)`` on the 512
  calibration images (training images; ResNet-50: the same, padded to 32×32×3). What
  is left after it is what the selection costs; what it restores is what the stale
  BN statistics cost.
* Stream readers' correction (data-free): every baseline name with ``_syn``: the
  method, then, at every point, `hope_keras.stats.synthetic.correct_stream_readers` (the
  part of ``compress(correct_statistics="auto")`` that measures the BNs reading a
  residual stream on synthetic inputs, recorded once on the uncompressed model), for
  every stream reader.

HOPE densities are replays of one run to the lowest density, except on models with
an evictable residual block (demo CNN, ResNet-50): an eviction removes many neurons at
once, so every density there is its own `compress(density=d)` run (the engine skips
an eviction that would overshoot a density budget, as a user's call does). Params /
FLOPs points are replays of one run with the lowest ratio as budget
(`Trajectory.replay(params=|flops=)`).

Usage (repository root; one model at a time: 5–20 min each on 2 shared cores)::

    nice -n 10 .venv/bin/python benchmarks/quality.py --model demo --fresh
    nice -n 10 .venv/bin/python benchmarks/quality.py --model resnet50 --fresh
    .venv/bin/python benchmarks/quality.py --report   # tables + docs/img/quality_*.png

Models: ``demo`` (bundled), ``lenet300`` and ``vgg8`` (``benchmarks/fixtures``),
``resnet50`` (``.cache/resnet50_fmnist.keras``, ``scripts/make_benchmark_fixtures.py``).
Results: ``benchmarks/results/quality_<model>.json`` (a partial run with ``--methods``
updates only those methods).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Benchmarks make compress's synthetic inputs every time (their timings include
# them); HOPE_KERAS_CACHE=<dir> in the environment reuses them across runs.
os.environ.setdefault("HOPE_KERAS_CACHE", "off")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when imported by path
from _common import add_quick, compress, encoder, quick_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
IMG = REPO / "docs" / "img"
MODELS = ("demo", "lenet300", "vgg8", "resnet50")
DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
AXES = ("density", "params", "flops")
SPLITS = ("sel", "heldout")
SPLIT_NAMES = {"sel": "selection split (2000 bundled test images)",
               "heldout": "held-out split (3000 other test images)"}
# Neuron Merging paper (Kim et al. 2020), LeNet-300-100 on Fashion-MNIST,
# 80 % of the hidden neurons removed per layer, no fine-tuning.
NM_PAPER_LENET = {"baseline": 89.80, "prune": 66.76, "neuron_merging": 80.02}


# -------------------------------------------------------------- experimental costs
def _costs():
    from hope_keras.scoring import costs

    class ScoreRankCost(costs.HopeCost):
        """The default cost with another per-neuron score in the prune cost:
        ``J = s_i / (Σ_live s − s_i)`` (the width-free form with ``s`` in place of
        the capacity). Merges, evictions and the ranking are the default's."""

        def __init__(self, score):
            super().__init__(groups="no_streams")  # the default's scope when measured
            self.score = score
            self.name = f"hope_rank_{score}"

        def prune(self, c):
            s = {"k": np.sqrt(np.maximum(c.k_self, 0.0)), "gamma": np.abs(c.gamma),
                 "u": c.u_norm}[self.score]
            return s / np.maximum(np.sum(s) - s, costs.FLOOR)

    class OrderCost(costs.HopeCost):
        """The default cost, ranked under a params / FLOPs budget by
        ``J / (k · (S / (k·m))^α)`` (k neurons removed, S parameters or FLOPs saved,
        m the mean saving per neuron of the uncompressed model); ``J / k`` under a
        density budget. ``alpha_merge``: price merges with the paper's α*-scaled
        parent (``J_merge`` without ``n``), as the default did before this benchmark."""

        def __init__(self, alpha, mean_params, mean_flops, alpha_merge=False):
            super().__init__(groups="no_streams")  # the default's scope when measured
            self.alpha, self.m = alpha, {"params": mean_params, "flops": mean_flops}
            self.alpha_merge = alpha_merge
            self.name = f"hope_order_a{alpha:g}" + ("_alpha_merge" if alpha_merge else "")

        def merge(self, c):
            if self.alpha_merge:
                return costs.j_merge(c.A, c.B, c.c_rem, 1.0)
            return super().merge(c)

        def rank(self, J, info):
            k = np.maximum(info.neurons, 1.0)
            if info.budget not in ("params", "flops") or self.alpha == 0:
                return J / k
            saved = np.maximum(info.params if info.budget == "params" else info.flops, 1.0)
            return J / (k * (saved / (k * self.m[info.budget])) ** self.alpha)

    class WidthWeightedCost(costs.HopeCost):
        """The default cost with each layer's prunes and merges weighted by
        ``(n0 / mean n0)^β`` (n0: the layer's initial width, a constant, so a layer
        still gets dearer as it empties): β = 0 is the default (equal widths in the
        log-capacity model), β = 1 keeps equal fractions per layer."""

        def __init__(self, beta, mean_n0):
            super().__init__(groups="no_streams")  # the default's scope when measured
            self.beta, self.mean_n0 = beta, mean_n0
            self.name = f"hope_width_b{beta:g}"

        def prune(self, c):
            return super().prune(c) * (c.n0 / self.mean_n0) ** self.beta

        def merge(self, c):
            return super().merge(c) * (c.n0 / self.mean_n0) ** self.beta

    class NeuronsOnlyCost(costs.HopeCost):
        """The default cost on the paper's neuron layers only (``groups="neurons"``,
        as `cost="paper"`): residual streams and other coupled groups stay whole."""

        name = "hope_neurons_only"

        def __init__(self):
            # An argument, not a class attribute: HopeCost.__init__ sets the scope.
            super().__init__(groups="neurons")

    class OneReaderCost(costs.HopeCost):
        """The default cost with every group ranked as if one layer read it (no
        factor ``R``): residual stream channels priced like a layer's channel."""

        name = "hope_one_reader"

        def rank(self, J, info):
            return super().rank(J, info._replace(readers=1.0))

    return ScoreRankCost, OrderCost, WidthWeightedCost, NeuronsOnlyCost, OneReaderCost


def hope_methods(ctx):
    """{name: (compress options, axes)}; `ctx` holds the model's mean savings."""
    ScoreRankCost, OrderCost, WidthWeightedCost, NeuronsOnlyCost, OneReaderCost = _costs()
    from hope_keras.scoring import costs

    def order(alpha, alpha_merge=False):
        return OrderCost(alpha, ctx["mean_params"], ctx["mean_flops"], alpha_merge)

    return {
        "hope": (dict(), AXES),
        "hope_topk": (dict(merge_search="top_k"), AXES),
        # the default with every touched layer at a multiple of 8 channels
        "hope_round8": (dict(round_to=8, correct_statistics="auto"), AXES),
        "hope_topk_auto": (dict(merge_search="top_k", correct_statistics="auto"), AXES),
        "hope_sc": (dict(), AXES),  # + correct_statistics at every point (Bench.point)
        # ... without the run's trajectory: merged parents moved like every channel
        "hope_sc_moved": (dict(), AXES),
        "hope_re": (dict(), AXES),  # + BN statistics re-estimated on data (Bench.point)
        "hope_auto": (dict(correct_statistics="auto"), AXES),
        # the default's correction with the surrogate trusted behind merges too
        # (`surrogate_behind_merges`)
        "hope_trust_merges": (dict(correct_statistics="auto"), AXES),
        "hope_nocorr": (dict(correct_statistics=False), AXES),
        # the previous default (streams whole), and streams priced as one
        # reader's channel
        "hope_nostreams": (dict(cost=costs.HopeCost(groups="no_streams"),
                                correct_statistics="auto"), AXES),
        "hope_one_reader": (dict(cost=OneReaderCost(), correct_statistics="auto"), AXES),
        # the streams whole without the correction: the reference of the α orderings
        "hope_nostreams_nocorr": (dict(cost=costs.HopeCost(groups="no_streams")), AXES),
        "hope_prune_auto": (dict(actions=("prune",), correct_statistics="auto"), ("density",)),
        "hope_alpha_merge": (dict(cost=order(0.0, alpha_merge=True)), ("density",)),
        "hope_prev": (dict(cost=order(0.0, alpha_merge=True)), AXES),
        "hope_paper": (dict(cost="paper"), AXES),
        "hope_neurons": (dict(cost=NeuronsOnlyCost()), AXES),
        "hope_mc": (dict(mean_compensation=True), AXES),
        "hope_neighbors": (dict(refresh="neighbors"), ("density",)),
        "hope_prune": (dict(actions=("prune",)), ("density",)),
        "hope_noevict": (dict(actions=("prune", "merge")), ("density", "flops")),
        "hope_prune_sc": (dict(actions=("prune",)), ("density",)),  # + correct_statistics
        "hope_prune_mc": (dict(actions=("prune",), mean_compensation=True), ("density",)),
        "hope_merge_paper": (dict(merge_scale="paper", cost=order(0.0, alpha_merge=True)),
                             ("density",)),
        "rank_k": (dict(cost=ScoreRankCost("k")), ("density",)),
        "rank_gamma": (dict(cost=ScoreRankCost("gamma")), ("density",)),
        "rank_u": (dict(cost=ScoreRankCost("u")), ("density",)),
        "rank_k_prune": (dict(cost=ScoreRankCost("k"), actions=("prune",)), ("density",)),
        "rank_gamma_prune": (dict(cost=ScoreRankCost("gamma"), actions=("prune",)),
                             ("density",)),
        "rank_u_prune": (dict(cost=ScoreRankCost("u"), actions=("prune",)), ("density",)),
        "hope_width_b50": (dict(cost=WidthWeightedCost(0.5, ctx["mean_n0"])), ("density",)),
        "order_a0": (dict(cost=order(0.0)), ("params", "flops")),
        "order_a25": (dict(cost=order(0.25)), ("params", "flops")),
        "order_a50": (dict(cost=order(0.5)), ("params", "flops")),
        "order_a75": (dict(cost=order(0.75)), ("params", "flops")),
        "order_param": (dict(cost=order(1.0)), ("params", "flops")),
    }


HOPE_NAMES = ("hope", "hope_sc", "hope_sc_moved", "hope_trust_merges", "hope_re", "hope_auto", "hope_nocorr", "hope_nostreams",
              "hope_nostreams_nocorr", "hope_one_reader", "hope_topk", "hope_round8", "hope_topk_auto",
              "hope_alpha_merge", "hope_prev", "hope_paper", "hope_neurons", "hope_mc",
              "hope_neighbors", "hope_prune", "hope_noevict", "hope_prune_sc", "hope_prune_auto", "hope_prune_mc",
              "hope_merge_paper", "rank_k", "rank_gamma", "rank_u", "rank_k_prune",
              "rank_gamma_prune", "rank_u_prune", "hope_width_b50", "order_a0", "order_a25",
              "order_a50", "order_a75", "order_param")
BASELINES = tuple(f"{m}_{s}{mc}" for m in ("l1_input", "l1_joint", "bn_scale")
                  for s in ("global", "layer") for mc in ("", "_mc")) + ("nm_global",
                                                                          "nm_layer")
# The baselines followed by `correct_statistics` (data-free BN statistics correction).
BASELINES_SC = tuple(b + "_sc" for b in BASELINES)
# The baselines followed by BN statistics re-estimated on the calibration images (uses
# data: a diagnostic of what the data-free statistics cost, never a "best baseline").
BASELINES_RE = tuple(b + "_re" for b in BASELINES)
# The baselines followed by the correction `compress(correct_statistics="auto")` gives
# the BNs that read residual streams (synthetic inputs; data-free), for models with one.
BASELINES_SYN = tuple(b + "_syn" for b in BASELINES)
ALL_METHODS = HOPE_NAMES + BASELINES + BASELINES_SC + BASELINES_RE + BASELINES_SYN
# The "best baseline": the magnitude baselines global and per layer, and
# Neuron Merging, all without mean compensation (an option added with this issue).
PLAIN_BASELINES = tuple(b for b in BASELINES if not b.endswith("_mc"))
# Run without --methods: the default, the paper's cost, prune-only, the α* merge cost
# and the plain baselines (2 shared cores; the other variants on request).
DEFAULT_METHODS = ("hope", "hope_paper", "hope_prune", "hope_alpha_merge") + PLAIN_BASELINES
# ResNet-50 (≈ 6 s per evaluation of 2000 images on 2 shared cores): the default, the
# paper's cost and the baselines that were best there before.
RESNET_METHODS = ("hope", "hope_paper", "bn_scale_global", "bn_scale_layer",
                  "l1_joint_layer", "nm_layer")


# --------------------------------------------------------------------------- data
def heldout_test(n: int):
    """The first `n` Fashion-MNIST test images NOT in the bundled 2000 (float32, labels)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_fixtures import load_fashion_mnist

    with np.load(REPO / "src" / "hope_keras" / "data" / "fmnist_test_subset.npz") as f:
        used = set(f["test_indices"].tolist())
    data = load_fashion_mnist()
    idx = np.array([i for i in range(len(data["x_test"])) if i not in used])[:n]
    x = (data["x_test"][idx].astype(np.float32) / 255.0)[..., None]
    return x, data["y_test"][idx].astype(np.int64)


def load(model_name: str, split: str = "subset"):
    """(model, x_test, y_test, x_calib) for one split: ``"subset"`` (the bundled 2000
    images) or ``"heldout"`` (2000 others). Used by benchmarks/pipeline.py."""
    model, splits, xc = load_splits(model_name, 2000, 2000)
    x, y = splits["heldout" if split == "heldout" else "sel"]
    return model, x, y, xc


def load_splits(model_name: str, n_sel: int, n_heldout: int):
    """(model, {split: (x, y)}, x_calib) for a benchmark model."""
    import keras

    from hope_keras.data import load_demo_data, load_demo_model

    data = load_demo_data()
    splits = {"sel": (data.x_test[:n_sel], data.y_test[:n_sel]),
              "heldout": heldout_test(n_heldout)}
    xc = data.x_calib
    if model_name == "demo":
        return load_demo_model(), splits, xc
    if model_name in ("resnet50", "resnet50_64", "resnet50_128"):
        # The fixture's input: 32×32×3, grey repeated; "resnet50_64" / "resnet50_128"
        # (not in MODELS: synthetic_settings.py only) each pixel repeated 2 / 4 times
        # along both axes, 64×64×3 / 128×128×3.
        k = 1 if model_name == "resnet50" else int(model_name.split("_")[1]) // 32

        def rgb(a):
            a = np.repeat(np.repeat(a[..., 0], k, axis=1), k, axis=2)
            a = np.pad(a, ((0, 0), (2 * k, 2 * k), (2 * k, 2 * k)))
            return np.repeat(a[..., None], 3, axis=-1)

        splits = {k: (rgb(x), y) for k, (x, y) in splits.items()}
        xc = rgb(xc)
    return keras.models.load_model(model_path(model_name), compile=False), splits, xc


def model_path(model_name: str) -> Path:
    """The saved benchmark model (not the demo, which ships in the package)."""
    if model_name in ("resnet50", "resnet50_64", "resnet50_128"):
        k = 1 if model_name == "resnet50" else int(model_name.split("_")[1]) // 32
        return REPO / ".cache" / f"resnet50_fmnist{'' if k == 1 else 32 * k}.keras"
    return REPO / "benchmarks" / "fixtures" / f"{model_name}.keras"


class Evaluator:
    """Accuracy and top-1 agreement with the uncompressed model on every split."""

    def __init__(self, model, splits, batch_size=500):
        import tensorflow as tf

        self.names = list(splits)
        self.x = np.concatenate([splits[k][0] for k in self.names])
        self.y = {k: splits[k][1] for k in self.names}
        ends = np.cumsum([len(splits[k][0]) for k in self.names])
        self.slices = {k: slice(e - len(splits[k][0]), e) for k, e in zip(self.names, ends)}
        self.bs = batch_size
        self.fn = tf.function(lambda t: model(t, training=False), reduce_retracing=True)
        self.reference = self.predict()

    def predict(self):
        out = [np.asarray(self.fn(self.x[k:k + self.bs]))
               for k in range(0, len(self.x), self.bs)]
        return np.argmax(np.concatenate(out), axis=1)

    def __call__(self):
        p = self.predict()
        acc = {k: float(np.mean(p[s] == self.y[k])) for k, s in self.slices.items()}
        agree = {k: float(np.mean(p[s] == self.reference[s])) for k, s in self.slices.items()}
        return acc, agree


class Sizes:
    """Live parameter and FLOPs ratios of the slimmed model for given live widths
    (the engine's own counter, so HOPE and the baselines are counted alike)."""

    def __init__(self, model, analysis):
        from hope_keras.search.sizes import SizeCounter

        self.counter = SizeCounter(model, analysis)  # pristine; copied per count
        self.sizes = {g.name: g.size for g in analysis.groups}
        self.branch = {b.name: set(b.branch_layers) for b in analysis.graph.blocks}
        full = dict(self.sizes)
        n = sum(full.values())
        marg = {g: self.counter.marginal(g, 1) for g in full}
        self.mean_params = sum(full[g] * marg[g][0] for g in full) / n
        self.mean_flops = sum(full[g] * marg[g][1] for g in full) / n

    def __call__(self, alive, evicted=()):
        c = self.counter.copy()
        for g, n in alive.items():
            if n != c.live[g]:
                c.remove(g, c.live[g] - n)
        for b in evicted:
            c.evicted |= self.branch[b]
        c.update(list(c.params_now))
        return c.params_ratio, c.flops_ratio


def alive_after(traj, n_steps, sizes, block_groups):
    """({group: live neurons}, evicted blocks) after the first `n_steps` steps."""
    alive, evicted = dict(sizes), []
    active = int(traj.meta["num_neurons"])  # the neurons the run's cost prices
    for s in traj.steps[:n_steps]:
        if s.kind == "evict":
            evicted.append(s.unit)
            for g in block_groups[s.unit]:
                alive[g] = 0
        else:  # a merge removes one neuron (two if the parent is dead)
            alive[s.unit] -= active - s.active_after
        active = s.active_after
    return alive, evicted


def stream_groups(analysis) -> list:
    """Names of the groups whose channels flow through an ``Add`` (residual streams)."""
    return sorted(name for name, g in analysis.graph.groups.items() if g.stream)


# ---------------------------------------------------------------------- the runs
class Bench:
    def __init__(self, model_name, n_sel, n_heldout, densities):
        import hope_keras
        from hope_keras.stats.calibration import calibrate

        model, splits, xc = load_splits(model_name, n_sel, n_heldout)
        info = {"model": model_name, "params": int(model.count_params()),
                "n": {k: int(len(v[0])) for k, v in splits.items()}}
        if model_name == "lenet300":
            t0 = time.perf_counter()
            model = calibrate(model, xc)
            info["calibrate_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        self.analysis = hope_keras.analyze(model)
        info["analyze_s"] = round(time.perf_counter() - t0, 2)
        a = self.analysis
        info.update(neurons=a.num_neurons, groups={g.name: g.size for g in a.groups},
                    streams=stream_groups(a), blocks=sum(b.evictable for b in a.blocks))
        self.model, self.info, self.densities = model, info, tuple(densities)
        self.original = [w.numpy().copy() for w in model.weights]
        self.ev = Evaluator(model, splits)
        self.sizes = Sizes(model, a)
        self.block_groups = {b.name: list(b.groups) for b in a.graph.blocks}
        acc, _ = self.ev()
        info["accuracy"] = acc
        info["flops"] = int(self.sizes.counter.flops0)
        info["mean_params_per_neuron"] = self.sizes.mean_params
        info["mean_flops_per_neuron"] = self.sizes.mean_flops
        # Models with an evictable block: one compress() per density (see module
        # docstring); otherwise replays of one run.
        self.direct = info["blocks"] > 0
        info["hope_densities"] = "direct runs" if self.direct else "replays of one run"
        self.correct = False  # `point` corrects the BN statistics first (methods *_sc)
        self.keep_parents = True  # ... given HOPE's steps (not hope_sc_moved)
        self.reestimate = False  # or re-estimates them on `xc` (methods *_re; uses data)
        self.synthetic = False  # or corrects the stream readers (methods *_syn)
        self.stream_reference = None
        self.xc = xc
        self.hope = hope_methods({"mean_params": self.sizes.mean_params,
                                  "mean_flops": self.sizes.mean_flops,
                                  "mean_n0": float(np.mean(list(self.sizes.sizes.values())))})

    def reset(self):
        for w, v in zip(self.model.weights, self.original):
            w.assign(v)

    def targets(self, axis):
        return self.densities if axis == "density" else RATIOS

    def point(self, target, density, alive, evicted, extra=None, steps=None):
        """Evaluates the model as edited in place (after the `_sc` methods' correction
        or the `_re` methods' re-estimation). `steps`: HOPE's steps to this point (the
        correction keeps their merged parents' statistics)."""
        import hope_keras

        if self.correct:  # the analysis of the uncompressed model: the reference
            hope_keras.correct_statistics(self.model, self.analysis,
                                          trajectory=steps if self.keep_parents else None)
        if self.reestimate:
            hope_keras.reestimate_batchnorm_statistics(self.model, self.xc)
        if self.synthetic and self.stream_reference is not None:
            from hope_keras.stats.synthetic import correct_stream_readers

            correct_stream_readers(self.stream_reference, set(self.analysis.graph.flat.shapes))
        params, flops = self.sizes(alive, evicted)
        acc, agree = self.ev()
        p = {"target": target, "density": density, "params": params, "flops": flops,
             "acc": acc, "agree": agree, "alive": alive, "evicted": list(evicted)}
        if extra:
            p.update(extra)
        return p

    # ------------------------------------------------------------------- HOPE
    def run_hope(self, name, axis):
        """HOPE points of method `name` on `axis`.

        Densities are fractions of every compressible neuron of the model (N). A
        cost that prices only some groups (``cost="paper"``: the paper's neuron
        layers) counts its own density over its N_c neurons; the other N − N_c stay,
        so the benchmark's density d is its density ``(floor(d·N) − (N − N_c)) / N_c``.
        """
        opts, _ = self.hope[name]
        opts = dict(opts)
        # compress's step after the run (the Encoder does not take it): `hope` is the
        # default; every other variant measures its own change alone (no statistics
        # correction) unless it sets one (the `_sc` methods correct in `point`).
        correct = opts.pop("correct_statistics",  # compress's default correction: "auto"
                           "auto" if name == "hope" else False)
        N = self.analysis.num_neurons
        targets = self.targets(axis)
        points, note = [], {}
        self.reset()
        t0 = time.perf_counter()
        enc = encoder(self.model, analysis=self.analysis, correct_statistics=correct, **opts)
        Nc = enc.num_neurons
        note["neurons_priced"] = int(Nc)

        def own_density(d):  # the cost's own density for benchmark density d (or None)
            keep = math.floor(d * N + 1e-9) - (N - Nc)
            if Nc == N:
                return d
            return keep / Nc if keep > 0 else None

        if axis == "density":
            low = [own_density(t) for t in targets if own_density(t) is not None]
            reason = enc.run(density=min(low), verbose=False) if low else "unreachable"
        else:
            reason = enc.run(**{axis: min(targets)}, verbose=False)
        note["seconds"] = round(time.perf_counter() - t0, 2)
        traj = enc.trajectory
        traj.meta["options"]["correct_statistics"] = correct  # replays apply it, as compress
        note["stopped"] = reason
        note["steps"] = {k: int(np.sum(traj.field("kind") == k))
                         for k in ("prune", "merge", "evict")} if len(traj) else {}
        note["sum_J"] = float(sum(s.J for s in traj.steps))
        for t in targets:
            self.reset()
            if axis == "density":
                d = own_density(t)
                if d is None:
                    continue
                if self.direct:
                    res = compress(self.model, density=d, analysis=self.analysis,
                                   correct_statistics=correct, **opts)
                    tr, n = res.trajectory, len(res.trajectory)
                else:
                    tr = traj
                    try:
                        n = tr.step_for(density=d)
                    except ValueError:  # never reached (no admissible action left)
                        continue
                    tr.replay(self.model, step=n, check=False)
            else:
                tr = traj
                try:
                    n = tr.step_for(**{axis: t})
                except ValueError:
                    continue
                tr.replay(self.model, step=n, check=False)
            alive, evicted = alive_after(tr, n, self.sizes.sizes, self.block_groups)
            density = sum(alive.values()) / N
            p = self.point(t, density, alive, evicted, steps=tr.steps[:n])
            if n:  # the engine's own count, which `point` recomputed independently
                s = tr.steps[n - 1]
                assert abs(p["params"] - s.params_after) < 1e-9, (p["params"], s)
                assert abs(p["flops"] - s.flops_after) < 1e-9, (p["flops"], s)
            points.append(p)
        return points, note

    # -------------------------------------------------------------- baselines
    def _baseline_parts(self, name):
        parts = name.removesuffix("_sc").removesuffix("_re").removesuffix("_syn").split("_")
        mc = parts[-1] == "mc"
        if mc:
            parts = parts[:-1]
        return "_".join(parts[:-1]), parts[-1], mc

    def _scores(self, method):
        import keras

        from hope_keras.search import baselines

        if method != "nm":
            return baselines.scores(self.analysis, method)
        out = {}  # Neuron Merging's criterion="auto": l1 for conv producers, l2 for Dense
        for name, st in self.analysis.states.items():
            dense = isinstance(self.analysis.graph.layer(st.group.producer),
                               keras.layers.Dense)
            out[name] = baselines.scores(self.analysis, "l2" if dense else "l1")[name]
        return out

    def _apply_baseline(self, method, scope, mc, density):
        from hope_keras.search import baselines

        if method == "nm":
            return baselines.neuron_merging(self.model, density, scope=scope,
                                            analysis=self.analysis)
        return baselines.prune(self.model, density, method=method, scope=scope,
                               analysis=self.analysis, mean_compensation=mc)

    def _alive(self, removed):
        alive = dict(self.sizes.sizes)
        for g, _ in removed:
            alive[g] -= 1
        return alive

    def _density_for_ratio(self, scores, scope, axis, ratio):
        """The highest density whose removal set reaches ≤ `ratio`, or None."""
        from hope_keras.search import baselines

        N = self.analysis.num_neurons
        col = 0 if axis == "params" else 1
        if scope == "global":
            order = baselines.removal_order(scores)

            def size(k):
                return self.sizes(self._alive(order[:k]))[col]

            if size(len(order)) > ratio + 1e-12:
                return None
            lo, hi = 0, len(order)  # size(hi) <= ratio
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if size(mid) <= ratio + 1e-12:
                    hi = mid
                else:
                    lo = mid
            return (N - hi) / N

        def size_d(i):
            return self.sizes(self._alive(baselines.layer_removals(scores, i / 1000)))[col]

        if size_d(1) > ratio + 1e-12:
            return None
        lo, hi = 1, 1000  # size_d(lo) <= ratio
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if size_d(mid) <= ratio + 1e-12:
                lo = mid
            else:
                hi = mid
        return lo / 1000

    def run_baseline(self, name, axis):
        method, scope, mc = self._baseline_parts(name)
        scores = self._scores(method)
        points, note = [], {}
        for t in self.targets(axis):
            d = t if axis == "density" else self._density_for_ratio(scores, scope, axis, t)
            if d is None:
                continue
            self.reset()
            t0 = time.perf_counter()
            r = self._apply_baseline(method, scope, mc, d)
            note.setdefault("seconds", round(time.perf_counter() - t0, 2))
            extra = {"merged": len(r.merges)} if method == "nm" else None
            points.append(self.point(t, r.density, self._alive(r.removed), (), extra))
        return points, note

    def check_slim_flops(self):
        """The counter against `hope_keras.profile` of the slimmed model."""
        import hope_keras

        self.reset()
        res = compress(self.model, density=0.6, analysis=self.analysis)
        slim = hope_keras.slim(self.model)
        self.reset()
        base = hope_keras.profile(self.model, latency=False).flops
        ratio = hope_keras.profile(slim, latency=False).flops / base
        out = {"counter_flops0": self.sizes.counter.flops0, "profile_flops0": base,
               "counter_ratio": res.flops_ratio, "slim_ratio": ratio,
               "counter_params_ratio": res.params_ratio,
               "slim_params_ratio": slim.count_params() / self.model.count_params()}
        print(f"  slim check: {out}", flush=True)
        return out


def run(model_name, n_sel, n_heldout, methods=None, densities=DENSITIES,
        axes=AXES):
    bench = Bench(model_name, n_sel, n_heldout, densities)
    print(f"{model_name}: {json.dumps({k: v for k, v in bench.info.items() if k != 'groups'})}",
          flush=True)
    extra = {"slim_check": bench.check_slim_flops()}
    for name in methods or ALL_METHODS:
        if name in bench.hope:
            method_axes = [a for a in bench.hope[name][1] if a in axes]
        elif name in BASELINES + BASELINES_SC + BASELINES_RE + BASELINES_SYN:
            method_axes = list(axes)
        else:
            raise SystemExit(f"unknown method {name!r}; known: {ALL_METHODS}")
        bench.correct = name.endswith(("_sc", "_sc_moved"))
        bench.keep_parents = not name.endswith("_moved")
        bench.reestimate = name.endswith("_re")
        bench.synthetic = name.endswith("_syn")
        if bench.synthetic and bench.stream_reference is None:
            from hope_keras.stats import bn_stats
            from hope_keras.stats import synthetic

            bench.reset()  # recorded on the original model
            x = bn_stats.synthetic_inputs(bench.model, verbose=False)
            bench.stream_reference = None if x is None else synthetic.StreamReference(
                bench.model, bench.analysis.graph, x)
        for axis in method_axes:
            fn = bench.run_hope if name in bench.hope else bench.run_baseline
            with surrogate_behind_merges(name == "hope_trust_merges"):
                points, note = fn(name, axis)
            row = " ".join(f"{p['target']:g}:{100 * p['acc']['sel']:.1f}/"
                           f"{100 * p['acc']['heldout']:.1f}" for p in points)
            print(f"  {name:18s} {axis:7s} {row}  {note}", flush=True)
            save(model_name, bench.info, {name: {axis: points}}, {name: {axis: note}},
                 extra)
    bench.correct = bench.reestimate = bench.synthetic = False
    bench.reset()


@contextlib.contextmanager
def surrogate_behind_merges(on: bool):
    """While `on`: the data-free correction trusts the surrogate behind merged groups
    (`bn_stats.untrusted_tensors(..., trust_merges=True)`; evicted blocks and moved
    residual sums still untrusted), which merged parents keeping their statistics may
    allow."""
    import functools

    from hope_keras.stats import bn_stats

    original = bn_stats.untrusted_tensors
    if on:
        bn_stats.untrusted_tensors = functools.partial(original, trust_merges=True)
    try:
        yield
    finally:
        bn_stats.untrusted_tensors = original


def save(model_name, info, results, notes, extra):
    """Merges into benchmarks/results/quality_<model>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"quality_{model_name}.json"
    out = {"info": info, "results": {}, "notes": {}, "extra": {}}
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("info", {}).get("n") == info["n"] and "extra" in old:
            out.update(results=old["results"], notes=old["notes"], extra=old["extra"])
    for key, new in (("results", results), ("notes", notes)):
        for m, per_axis in new.items():
            out[key].setdefault(m, {}).update(per_axis)
    out["extra"].update(extra)
    order = [m for m in ALL_METHODS if m in out["results"]]
    out["results"] = {m: out["results"][m] for m in order}
    out["notes"] = {m: out["notes"].get(m, {}) for m in order}
    path.write_text(json.dumps(out, indent=0) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--n-sel", type=int,
                   help="selection-split images (default: the bundled 2000; ResNet-50: "
                        "the first 1000 of them)")
    p.add_argument("--n-heldout", type=int,
                   help="held-out images (default 3000; ResNet-50: 1000)")
    p.add_argument("--methods", nargs="*",
                   help=f"subset of {ALL_METHODS} (default: {DEFAULT_METHODS}; "
                        f"ResNet-50: {RESNET_METHODS})")
    p.add_argument("--fresh", action="store_true",
                   help="discard the model's stored results first (e.g. after an engine "
                        "change), instead of updating the methods run")
    p.add_argument("--axes", nargs="*", default=list(AXES), choices=AXES)
    p.add_argument("--report", action="store_true", help="print tables, write the PNGs")
    p.add_argument("--compare", nargs=2, metavar=("FIRST", "SECOND"),
                   help="print how method SECOND scores against FIRST, per model")
    p.add_argument("--kept", nargs="+", metavar="METHOD",
                   help="print the stream channels and other neurons each stored point of "
                        "the methods keeps (the --model's results, default resnet50)")
    p.add_argument("--results", type=Path,
                   help="the folder of quality_<model>.json (default benchmarks/results/)")
    p.add_argument("--synthetic-seed", type=int,
                   help="seed of the data-free correction's synthetic inputs "
                        "(`stats.synthetic.SYNTHETIC_SEED`, default the library's); the "
                        "results file does not record it: give each seed its own --results")
    add_quick(p)  # the demo CNN, 200 + 200 images, density 0.8, HOPE and one baseline
    args = p.parse_args(argv)
    global RESULTS, IMG
    import _quality_report as quality_report

    if args.results:
        RESULTS = args.results
    if args.synthetic_seed is not None:
        from hope_keras.stats import synthetic

        synthetic.SYNTHETIC_SEED = args.synthetic_seed
    if args.quick:
        RESULTS = IMG = quick_dir()
        run("demo", 200, 200, methods=["hope", "bn_scale_layer"], densities=(0.8,),
            axes=("density", "flops"))
        return 0
    if args.model and not args.kept:
        resnet = args.model == "resnet50"
        densities = DENSITIES + ((0.2,) if args.model == "lenet300" else ())
        path = RESULTS / f"quality_{args.model}.json"
        if args.fresh and path.exists():
            path.unlink()
        run(args.model, args.n_sel or (1000 if resnet else 2000),
            args.n_heldout or (1000 if resnet else 3000),
            methods=args.methods or (RESNET_METHODS if resnet else DEFAULT_METHODS),
            densities=densities, axes=tuple(args.axes))
    quality_report.RESULTS, quality_report.IMG = RESULTS, IMG
    if args.report:
        quality_report.report()
    if args.compare:
        quality_report.compare(*args.compare)
    if args.kept:
        quality_report.kept(args.model or "resnet50", args.kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())
