#!/usr/bin/env python
"""DEFT vs. four transfer baselines (paper appendix G protocol, offline, CPU-sized).

Two benchmarks (``--task``), one network:

* ``digits``: source Fashion-MNIST (10 classes), target scikit-learn's handwritten
  digits (``load_digits``, 8×8, upsampled bilinearly to 28×28; 64/16/20 % stratified
  train/val/test split per seed).
* ``split``: Split Fashion-MNIST, source classes 0–4, target classes 5–9 (relabelled
  0–4; per seed ``--target-train`` + ``--target-val`` images drawn from the training
  set, a fixed ``--target-test`` subset of the test set).

Network: the appendix-G VGG-style BN network with GAP and a Dense bottleneck, widths
scaled down (``--widths``, ``--bottleneck``). Source pre-training: SGD momentum 0.9,
cosine decay 0.05 → 0.001, L2 ``--source-l2`` on kernels and BN γ, ``--source-epochs``
epochs at batch ``--source-batch`` (the paper: 100 epochs, batch 16, L2 5e-4).
Fine-tuning (every method, same `hope_keras.deft.Trainer` loop): SGD momentum 0.9,
batch 16, a fixed learning rate, L2 5e-4 on tensors of rank > 1, the epoch with the
best validation H-score kept. Hyper-parameters are chosen on seed 0's validation
H-score from the grids below, then every seed is run with them and scored on the test
sets (target test split; source test subset with the source head grafted back, BN
statistics restored). For DEFT, the source accuracy right after ``plan.apply``
(validation and test) is recorded for every setting.

Modes (run from the repository root)::

    .venv/bin/python benchmarks/deft_transfer.py --task digits     # the comparison
    .venv/bin/python benchmarks/deft_transfer.py --task split
    .venv/bin/python benchmarks/deft_transfer.py --sweep ...       # DEFT settings only
    .venv/bin/python benchmarks/deft_transfer.py --histogram docs/img/x.png
    .venv/bin/python benchmarks/deft_transfer.py --quick           # every method once, seconds

Tables are printed and written to ``--out`` (markdown) with a JSON twin.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
from _common import add_quick, quick_dir, quick_path  # noqa: E402

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {"x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
         "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}

# The paper's grids (appendix G.5), trimmed to fit two shared CPU cores. DEFT also
# searches the encoder cost and the two thresholds (a global percentile, eq. 26, or
# one per layer). "deft" runs with the shock reduction (compensate="mean_var"),
# "deft_none" without it (the paper's bare mask); both search the same grid.
_DEFT_GRID = [{"cost": c, "threshold": t, "percentile": p, "lr": lr}
              for c in ("paper", "hope") for t in ("layer", "global") for p in (10, 5)
              for lr in (0.02, 0.005)]
GRIDS = {
    "deft": [{**hp, "compensate": "mean_var"} for hp in _DEFT_GRID],
    "deft_none": [{**hp, "compensate": "none"} for hp in _DEFT_GRID],
    "full": [{"lr": lr} for lr in (0.01, 0.001)],
    "head": [{"lr": lr} for lr in (0.04, 0.005)],
    "peft": [{"lr": lr} for lr in (0.01, 0.001)],
    "ewc": [{"lam": lam, "lr": lr} for lam in (1.0, 50.0) for lr in (0.005, 0.001)],
}
NAMES = {"deft": "DEFT (shock reduction)", "deft_none": "DEFT (bare mask)",
         "head": "Head-only", "full": "Full FT", "ewc": "EWC", "peft": "PEFT"}
DEFT_DEFAULTS = {"cost": "paper", "threshold": "layer", "compensate": "mean_var"}


# ------------------------------------------------------------------------- data
def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


_RAW = {}


def fmnist():
    if not _RAW:
        missing = [n for n in FILES.values() if not (FMNIST_DIR / n).exists()]
        if missing:
            sys.exit(f"Fashion-MNIST missing ({missing}): apt-get install "
                     "dataset-fashion-mnist")
        _RAW.update({k: read_idx(FMNIST_DIR / f) for k, f in FILES.items()})
    return _RAW


def _img(x):
    return (x.astype(np.float32) / 255.0)[..., None]


def fit_inputs(sets, shape):
    """Each ``(x, y)`` of `sets` with its (N, 28, 28, 1) images zero-padded to the
    model's input height and width and repeated on its channels (the ResNet-50
    fixture's 32 × 32 × 3: `scripts/make_benchmark_fixtures.py`'s ``rgb32``)."""
    h, w, c = (int(d) for d in shape)
    out = {}
    for k, (x, y) in sets.items():
        ph, pw = (h - x.shape[1]) // 2, (w - x.shape[2]) // 2
        x = np.pad(x, ((0, 0), (ph, h - x.shape[1] - ph), (pw, w - x.shape[2] - pw), (0, 0)))
        out[k] = (np.repeat(x, c, axis=-1) if c != x.shape[-1] else x, y)
    return out


def source_classes(task):
    return list(range(10)) if task == "digits" else [0, 1, 2, 3, 4]


def load_source(task, n_train, n_val, n_test, seed=0):
    """Fashion-MNIST images of the source classes: train / val (held-out training
    images) / test (a subset of the test set)."""
    raw = fmnist()
    keep = np.isin(raw["y_train"], source_classes(task))
    pool = np.flatnonzero(keep)
    rng = np.random.default_rng(seed)
    order = rng.permutation(pool)
    tr, va = order[:n_train], order[n_train:n_train + n_val]
    tpool = np.flatnonzero(np.isin(raw["y_test"], source_classes(task)))
    te = np.sort(rng.permutation(tpool)[:n_test])
    return {"train": (_img(raw["x_train"][tr]), raw["y_train"][tr].astype(np.int64)),
            "val": (_img(raw["x_train"][va]), raw["y_train"][va].astype(np.int64)),
            "test": (_img(raw["x_test"][te]), raw["y_test"][te].astype(np.int64))}


def load_target(task, seed, args):
    sets = _load_target(task, seed, args)
    shape = getattr(args, "input_shape", None)
    return fit_inputs(sets, shape) if shape is not None else sets


def _load_target(task, seed, args):
    if task == "digits":
        return load_digits_target(seed)
    raw = fmnist()
    pool = np.flatnonzero(raw["y_train"] >= 5)
    order = np.random.default_rng(1000 + seed).permutation(pool)
    tr = order[:args.target_train]
    va = order[args.target_train:args.target_train + args.target_val]
    tpool = np.flatnonzero(raw["y_test"] >= 5)
    te = np.sort(np.random.default_rng(999).permutation(tpool)[:args.target_test])

    def part(x, y, idx):
        return _img(x[idx]), (y[idx] - 5).astype(np.int64)

    return {"train": part(raw["x_train"], raw["y_train"], tr),
            "val": part(raw["x_train"], raw["y_train"], va),
            "test": part(raw["x_test"], raw["y_test"], te)}


def load_digits_target(seed):
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    x = tf.image.resize(x, (28, 28), method="bilinear").numpy().clip(0, 1)
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed,
                                              stratify=y)
    x_tr, x_va, y_tr, y_va = train_test_split(x_tr, y_tr, test_size=0.2,
                                              random_state=seed, stratify=y_tr)
    return {"train": (x_tr, y_tr), "val": (x_va, y_va), "test": (x_te, y_te)}


def target_classes(task):
    return 10 if task == "digits" else 5


# ------------------------------------------------------------------------ model
def build_vgg(widths, bottleneck, classes=10, l2=5e-4, name="vgg_bn", activation="relu"):
    """Appendix G.2 layout: [c1]-pool-[c2]-pool-[c3,c3]-pool-[c4,c4]-pool-GAP-fc-head.

    ``activation="relu6"``: every ReLU is ``ReLU(max_value=6)``, as in MobileNets; the
    paper's cost prices no group of such a network (its neurons are ReLU's)."""
    import keras
    from keras import layers

    def reg():
        return keras.regularizers.L2(l2) if l2 else None

    def cbr(x, f, n):
        x = layers.Conv2D(f, 3, padding="same", use_bias=False, name=n,
                          kernel_regularizer=reg())(x)
        x = layers.BatchNormalization(name=n + "_bn", gamma_regularizer=reg())(x)
        return act(n + "_relu")(x)

    def act(n):
        return layers.ReLU(max_value=6.0 if activation == "relu6" else None, name=n)

    w1, w2, w3, w4 = widths
    inputs = keras.Input((28, 28, 1), name="image")
    x = layers.MaxPooling2D(name="pool1")(cbr(inputs, w1, "conv1"))
    x = layers.MaxPooling2D(name="pool2")(cbr(x, w2, "conv2"))
    x = layers.MaxPooling2D(name="pool3")(cbr(cbr(x, w3, "conv3a"), w3, "conv3b"))
    x = layers.MaxPooling2D(name="pool4")(cbr(cbr(x, w4, "conv4a"), w4, "conv4b"))
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(bottleneck, use_bias=False, name="fc", kernel_regularizer=reg())(x)
    x = layers.BatchNormalization(name="fc_bn", gamma_regularizer=reg())(x)
    x = act("fc_relu")(x)
    outputs = layers.Dense(classes, name="head")(x)
    return keras.Model(inputs, outputs, name=name)


def strip_regularizers(model):
    """A copy without regularizers (fine-tuning adds its own L2 on rank > 1 tensors)."""
    import keras

    config = model.get_config()
    for layer in config["layers"]:
        for key in ("kernel_regularizer", "gamma_regularizer"):
            if key in layer["config"]:
                layer["config"][key] = None
    clone = keras.Model.from_config(config)
    clone.set_weights(model.get_weights())
    return clone


def source_path(args):
    return args.cache / (
        f"source_{args.task}_{'-'.join(map(str, args.widths))}_{args.bottleneck}_"
        f"{args.source_train}_{args.source_epochs}_b{args.source_batch}_"
        f"l2{args.source_l2:g}{'' if args.activation == 'relu' else '_' + args.activation}"
        ".keras")


def train_source(args, src):
    import keras

    from hope_keras import reestimate_batchnorm_statistics

    if args.source_model is not None:  # a model trained elsewhere (Fashion-MNIST)
        return keras.saving.load_model(args.source_model, compile=False), \
            args.source_model, None
    path = source_path(args)
    if path.exists():
        return keras.saving.load_model(path, compile=False), path, None
    keras.utils.set_random_seed(0)
    model = build_vgg(args.widths, args.bottleneck, len(source_classes(args.task)),
                      args.source_l2, activation=args.activation)
    steps = args.source_epochs * int(np.ceil(len(src["train"][0]) / args.source_batch))
    model.compile(
        keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(
            0.05, steps, alpha=0.001 / 0.05), momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    t0 = time.time()
    model.fit(*src["train"], batch_size=args.source_batch, epochs=args.source_epochs,
              verbose=2)
    reestimate_batchnorm_statistics(model, src["train"][0][:4096], batch_size=256)
    seconds = time.time() - t0
    model = strip_regularizers(model)
    args.cache.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model, path, seconds


# ------------------------------------------------------------------------- DEFT
class Plans:
    """DEFT plans by setting, computed once each."""

    def __init__(self, source):
        self.source = source
        self.cache = {}
        self.seconds = 0.0

    def get(self, hp):
        from hope_keras import deft

        s = {**DEFT_DEFAULTS, **hp}
        actions = tuple(s.get("actions", "prune,merge").split(","))
        key = (s["cost"], s["threshold"], float(s["percentile"]), actions)
        if key not in self.cache:
            t0 = time.time()
            self.cache[key] = deft.plan(self.source, percentile=s["percentile"],
                                        cost=s["cost"], threshold=s["threshold"],
                                        compensate=s["compensate"], actions=actions)
            self.seconds += time.time() - t0
        return self.cache[key], s["compensate"]


def copy_of(model):
    import keras

    m = keras.models.clone_model(model)
    m.set_weights(model.get_weights())
    return m


def after_apply(source, plan, compensate, src, seed=0, parts=("val",)):
    """Source accuracies right after ``plan.apply`` (before any fine-tuning)."""
    from hope_keras import deft

    m = copy_of(source)
    plan.apply(m, seed=seed, compensate=compensate)
    r = deft.SourceRetention(m, plan=plan, compensate=compensate)
    return {p: r.evaluate(m, *src[p]) for p in parts}


def run_one(method, hp, source, plans, fisher, src, tgt, args, seed):
    """Fine-tunes one method; returns validation (best epoch) and test metrics."""
    import keras

    from hope_keras import deft

    keras.utils.set_random_seed(seed)
    model = copy_of(source)
    plan, compensate, start = None, None, None
    if method.startswith("deft"):
        plan, compensate = plans.get(hp)
        plan.apply(model, seed=seed, compensate=compensate)
    retention = deft.SourceRetention(model, plan=plan, compensate=compensate)
    if plan is not None:  # the source accuracy right after plan.apply
        start = {p: retention.evaluate(model, *src[p]) for p in ("val", "test")}
    target = deft.replace_head(model, target_classes(args.task), seed=seed)
    emap = deft.method_elasticity("deft" if plan is not None else method, target,
                                  plan=plan)
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(hp["lr"], momentum=0.9),
                                elasticity=emap)
    penalties = [deft.L2Penalty(5e-4)]
    if method == "ewc":
        penalties.append(deft.EWCPenalty(target, fisher, hp["lam"]))
    trainer = deft.Trainer(target, opt, retention=retention, penalties=penalties,
                           monitor=args.monitor)
    t0 = time.time()
    hist = trainer.fit(tgt["train"], epochs=args.epochs, batch_size=16,
                       target_val=tgt["val"], source_val=src["val"], seed=seed)
    test = trainer.evaluate(tgt["test"], src["test"])
    return {"method": method, "hp": hp, "seed": seed, "best_epoch": hist.best_epoch,
            "val": hist.best, "test": test, "seconds": time.time() - t0,
            "after_apply": start,
            "elastic_fraction": None if plan is None else plan.elastic_fraction(),
            "head_inputs_cut": None if plan is None
            else int(np.count_nonzero(plan.head_input_drift))}


def sweep(args, source, src):
    """DEFT settings × percentiles: elastic fraction, source validation accuracy after
    the merges alone and after merges + masks (before fine-tuning), and optionally
    (``--sweep-lr``) the fine-tuned seed-0 validation H-score."""
    from hope_keras import deft

    plans = Plans(source)
    tgt = load_target(args.task, 0, args) if args.sweep_lr else None
    head = ("| cost | threshold | compensate | percentile | elastic | head inputs cut | "
            "source val: merges only | after apply |")
    sep = "|---|---|---|---|---|---|---|---|"
    if args.sweep_lr:
        head += " target val | H val |"
        sep += "---|---|"
    lines, records = [head, sep], []
    for cost, thr, comp, p in itertools.product(args.sweep_cost, args.sweep_threshold,
                                                args.sweep_compensate, args.sweep):
        hp = {"cost": cost, "threshold": thr, "compensate": comp, "percentile": p}
        plan, _ = plans.get(hp)
        m = copy_of(source)
        plan.apply(m, mask=False, compensate=comp)
        merged = deft.SourceRetention(m).evaluate(m, *src["val"])
        start = after_apply(source, plan, comp, src)["val"]
        rec = {**hp, "elastic": plan.elastic_fraction(), "merged": merged,
               "after_apply": start, "counts": plan.counts(),
               "head_cut": int(np.count_nonzero(plan.head_input_drift))}
        row = (f"| {cost} | {thr} | {comp} | {p:g} | {100 * rec['elastic']:.1f}% | "
               f"{rec['head_cut']}/{len(plan.head_input_drift)} | {100 * merged:.2f} | "
               f"{100 * start:.2f} |")
        if args.sweep_lr:
            r = run_one("deft", {**hp, "lr": args.sweep_lr}, source, plans, None, src,
                        tgt, args, 0)
            rec["fine_tuned"] = r
            row += f" {100 * r['val']['target_acc']:.2f} | {100 * r['val']['h_score']:.2f} |"
        lines.append(row)
        records.append(rec)
        print(row, flush=True)
    counts = ["", "Slack per layer (core/slack/vessels):"]
    for rec in records:
        c = ", ".join(f"{g} {a}/{b}/{v}" for g, (a, b, v) in rec["counts"].items())
        counts.append(f"* {rec['cost']}, {rec['threshold']}, p={rec['percentile']:g}: {c}")
    table = "\n".join(lines + sorted(set(counts), key=counts.index))
    print("\n" + table)
    return table, {"records": records, "plan_seconds": plans.seconds}


def histogram(args, source, path: Path):
    """Per-layer histograms of log10 J_prune (paper cost), one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hope_keras import deft

    plan = deft.plan(source, percentile=10, cost=args.hist_cost)
    groups = list(plan.groups)
    fig, axes = plt.subplots(1, len(groups), figsize=(2.3 * len(groups), 2.4),
                             sharey=False)
    stats = {}
    for ax, g in zip(np.atleast_1d(axes), groups):
        j = plan.j_prune[g][np.isfinite(plan.j_prune[g])]
        j = np.log10(np.maximum(j, 1e-8))
        ax.hist(j, bins=20, color="tab:blue")
        ax.axvline(np.log10(max(plan.tau_lock, 1e-8)), color="tab:red", lw=1)
        ax.set_title(f"{g} ({plan.groups[g]})", fontsize=8)
        ax.set_xlabel("log10 J_prune", fontsize=7)
        ax.tick_params(labelsize=6)
        stats[g] = {"min": float(j.min()) if j.size else None,
                    "median": float(np.median(j)) if j.size else None,
                    "max": float(j.max()) if j.size else None}
    fig.suptitle(f"{source_path(args).stem}: J_prune ({args.hist_cost} cost) per layer; "
                 "red: global τ_lock at p=10", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"written: {path}")
    for g, s in stats.items():
        print(f"{g}: log10 J_prune min {s['min']:.2f} median {s['median']:.2f} "
              f"max {s['max']:.2f}")
    return stats


def fmt(values):
    a = 100 * np.asarray(values, dtype=float)
    return f"{a.mean():.2f} ± {a.std(ddof=1) if a.size > 1 else 0.0:.2f}"


def hp_text(hp):
    return ", ".join(f"{k}={v}" for k, v in hp.items())


# ------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["digits", "split"], default="digits")
    ap.add_argument("--widths", type=int, nargs=4, default=[16, 32, 48, 48])
    ap.add_argument("--bottleneck", type=int, default=64)
    ap.add_argument("--source-model", type=Path, default=None,
                    help="a trained Fashion-MNIST classifier (.keras) as the source "
                         "instead of the VGG (--task digits; its inputs padded and "
                         "repeated to the model's shape), e.g. the ResNet-50 fixture")
    ap.add_argument("--activation", choices=["relu", "relu6"], default="relu",
                    help="the network's activations (relu6: every group coupled)")
    ap.add_argument("--source-train", type=int, default=20000)
    ap.add_argument("--source-val", type=int, default=1000)
    ap.add_argument("--source-test", type=int, default=2000)
    ap.add_argument("--source-epochs", type=int, default=4)
    ap.add_argument("--source-batch", type=int, default=64)
    ap.add_argument("--source-l2", type=float, default=5e-4)
    ap.add_argument("--target-train", type=int, default=1200, help="split task only")
    ap.add_argument("--target-val", type=int, default=300, help="split task only")
    ap.add_argument("--target-test", type=int, default=2000, help="split task only")
    ap.add_argument("--fisher-examples", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=list(GRIDS),
                    default=["deft", "deft_none", "head", "full", "ewc"])
    ap.add_argument("--deft", nargs="*", default=[], metavar="KEY=VALUE",
                    help="fix DEFT settings in its grid, e.g. compensate=none "
                         "threshold=global cost=hope")
    add_quick(ap)
    ap.add_argument("--sweep", type=float, nargs="+", default=None, metavar="P",
                    help="instead of the comparison: DEFT at these percentiles for every "
                         "--sweep-cost × --sweep-threshold × --sweep-compensate")
    ap.add_argument("--sweep-cost", nargs="+", default=["paper"])
    ap.add_argument("--sweep-threshold", nargs="+", default=["global"])
    ap.add_argument("--sweep-compensate", nargs="+", default=["none", "mean"])
    ap.add_argument("--sweep-lr", type=float, default=None,
                    help="also fine-tune every sweep setting (seed 0) at this lr")
    ap.add_argument("--histogram", type=Path, default=None,
                    help="instead of the comparison: plot J_prune per layer here")
    ap.add_argument("--hist-cost", default="paper")
    ap.add_argument("--monitor", choices=["h_score", "target_acc"], default="h_score",
                    help="which epoch to keep: best validation H-score (algorithm 3) "
                         "or best target validation accuracy (appendix G.5)")
    ap.add_argument("--hp-json", type=Path, default=None,
                    help="skip the grid: reuse the hyper-parameters chosen in this "
                         "earlier results JSON and run every seed on the test sets")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/hope_deft_bench"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/deft_transfer_results.md"))
    args = ap.parse_args(argv)
    if args.source_model is not None and args.task != "digits":
        ap.error("--source-model is a 10-class Fashion-MNIST classifier: --task digits")
    if args.quick:  # the first setting of DEFT, EWC, head-only; seeds 0 and 1; small sets
        args.source_train, args.source_epochs, args.epochs, args.seeds = 3000, 1, 1, 2
        if args.methods == ap.get_default("methods"):
            args.methods = ["deft", "ewc", "head"]
        args.source_val = args.source_test = args.target_test = 300
        args.target_train, args.target_val = 300, 100
        args.fisher_examples = 256
        args.cache, args.out = quick_dir() / "deft_cache", quick_path(args.out)
        if args.histogram:
            args.histogram = quick_path(args.histogram)
        for k in GRIDS:
            GRIDS[k] = GRIDS[k][:1]
    fixed_deft = {}
    for item in args.deft:
        k, _, v = item.partition("=")
        fixed_deft[k] = float(v) if k in ("percentile", "lr") else v  # actions=prune,merge
    for key in ("deft", "deft_none"):
        grid = [{**hp, **fixed_deft} for hp in GRIDS[key]]
        GRIDS[key] = [dict(t) for t in dict.fromkeys(tuple(sorted(hp.items()))
                                                     for hp in grid)]

    import keras  # noqa: F401

    from hope_keras import deft

    t_start = time.time()
    src = load_source(args.task, args.source_train, args.source_val, args.source_test)
    source, path, src_seconds = train_source(args, src)
    if args.source_model is not None:
        args.input_shape = tuple(source.input_shape[1:])
        src = fit_inputs(src, args.input_shape)
    src_test_acc = deft.accuracy(source, *src["test"])
    src_val_acc = deft.accuracy(source, *src["val"])
    print(f"source model {path.name}: test-subset accuracy {src_test_acc:.4f}, val "
          f"{src_val_acc:.4f} (trained in {src_seconds or 0:.0f} s; 0 = cached)")
    header = [
        f"Task {args.task}. Source: Fashion-MNIST classes {source_classes(args.task)}, "
        + (f"the trained model {path} ('{source.name}', inputs padded to "
           f"{args.input_shape}); " if args.source_model is not None else
           f"VGG-BN widths {args.widths} + fc {args.bottleneck}"
           f"{', every ReLU a ReLU6' if args.activation == 'relu6' else ''}, "
           f"{args.source_train} training images, {args.source_epochs} epochs, batch "
           f"{args.source_batch}, L2 {args.source_l2:g}; ")
        + f"test-subset accuracy {100 * src_test_acc:.2f}% "
        f"({args.source_test} images), validation {100 * src_val_acc:.2f}% "
        f"({args.source_val}).", ""]

    if args.histogram:
        stats = histogram(args, source, args.histogram)
        args.out.with_suffix(".json").write_text(json.dumps(stats, indent=1))
        return 0
    if args.sweep:
        table, data = sweep(args, source, src)
        args.out.write_text("\n".join(header) + table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, **data}, indent=1,
            default=float))
        print(f"written: {args.out}; {time.time() - t_start:.0f} s")
        return 0

    fixed = None
    if args.hp_json:
        fixed = json.loads(args.hp_json.read_text())["summary"]
        for m in args.methods:
            GRIDS[m] = [fixed[m]["hp"]]
    plans = Plans(source)
    fisher = None
    if "ewc" in args.methods:
        t0 = time.time()
        n = min(args.fisher_examples, len(src["train"][0]))
        fisher = deft.diagonal_fisher(source, src["train"][0][:n], src["train"][1][:n],
                                      batch_size=64)
        print(f"Fisher over {n} source training examples: {time.time() - t0:.0f} s")

    records = []
    chosen = {}
    tgt0 = load_target(args.task, 0, args)
    for method in args.methods:
        best = None
        for hp in GRIDS[method]:
            r = run_one(method, hp, source, plans, fisher, src, tgt0, args, 0)
            records.append({**r, "phase": "grid"})
            extra = ""
            if r["after_apply"] is not None:
                extra = (f" after apply {r['after_apply']['val']:.4f}, elastic "
                         f"{r['elastic_fraction']:.3f}")
            print(f"[grid] {method:5s} {hp}: val H {r['val']['h_score']:.4f} "
                  f"(target {r['val']['target_acc']:.4f}, source "
                  f"{r['val']['source_acc']:.4f}, epoch {r['best_epoch']}{extra}) "
                  f"{r['seconds']:.0f} s", flush=True)
            if best is None or r["val"]["h_score"] > best["val"]["h_score"]:
                best = r
        chosen[method] = best
    finals = {m: [chosen[m]] for m in args.methods}  # seed 0 = the chosen grid run
    if fixed is not None:
        print("hyper-parameters from", args.hp_json)
    for seed in range(1, args.seeds):
        tgt = load_target(args.task, seed, args)
        for method in args.methods:
            r = run_one(method, chosen[method]["hp"], source, plans, fisher, src, tgt,
                        args, seed)
            records.append({**r, "phase": "final"})
            finals[method].append(r)
            print(f"[seed {seed}] {method:5s}: test target {r['test']['target_acc']:.4f} "
                  f"source {r['test']['source_acc']:.4f} H {r['test']['h_score']:.4f}",
                  flush=True)

    lines = header + [
        f"Target: {len(tgt0['train'][0])} train / {len(tgt0['val'][0])} val / "
        f"{len(tgt0['test'][0])} test; {args.epochs} epochs, batch 16, SGD momentum 0.9; "
        f"{args.seeds} seeds; kept epoch: best validation {args.monitor}.",
        "",
        "| Method | Hyper-parameters (seed-0 val H) | Target acc (%) | Source retention (%)"
        " | H-score (%) |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for m in args.methods:
        t = [r["test"]["target_acc"] for r in finals[m]]
        s = [r["test"]["source_acc"] for r in finals[m]]
        h = [r["test"]["h_score"] for r in finals[m]]
        summary[m] = {"target": t, "source": s, "h": h, "hp": chosen[m]["hp"]}
        lines.append(f"| {NAMES[m]} | {hp_text(chosen[m]['hp'])} | {fmt(t)} | {fmt(s)} | "
                     f"{fmt(h)} |")
    best_m = max(summary, key=lambda m: np.mean(summary[m]["h"]))
    lines += ["", f"Best mean H-score: {NAMES[best_m]}. Plan time "
              f"{plans.seconds:.0f} s; total {time.time() - t_start:.0f} s."]
    grid = [r for r in records if r["method"].startswith("deft") and r["phase"] == "grid"]
    if grid:
        lines += ["", "DEFT grid (seed 0; source accuracy right after `plan.apply`, then "
                  "validation after fine-tuning):", "",
                  "| setting | elastic | source val after apply | source test after apply"
                  " | target val | H val |", "|---|---|---|---|---|---|"]
        for r in grid:
            lines.append(
                f"| {hp_text(r['hp'])} | {100 * r['elastic_fraction']:.1f}% | "
                f"{100 * r['after_apply']['val']:.2f} | {100 * r['after_apply']['test']:.2f}"
                f" | {100 * r['val']['target_acc']:.2f} | {100 * r['val']['h_score']:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    args.out.write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "records": records,
         "summary": summary}, indent=1, default=float))
    print(f"written: {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
