#!/usr/bin/env python
"""DEFT vs. four transfer baselines (paper appendix G protocol, offline, CPU-sized).

Source task: Fashion-MNIST (10 classes). Target task: scikit-learn's handwritten
digits (``load_digits``, 8×8, upsampled bilinearly to 28×28). Network: the
appendix-G VGG-style BN network with GAP and a Dense bottleneck, widths scaled down
(``--widths``). Source pre-training: SGD momentum 0.9, cosine decay 0.05 → 0.001, L2
5e-4 on kernels and BN γ. Fine-tuning (every method, same `hope_keras.deft.Trainer`
loop): SGD momentum 0.9, batch 16, a fixed learning rate, L2 5e-4 on tensors of rank
> 1, the epoch with the best validation H-score kept. Hyper-parameters are chosen on
seed 0's validation H-score from trimmed versions of the paper's grids, then every
seed is run with them and scored on the test sets (target test split, Fashion-MNIST
test subset with the source head grafted back, BN statistics restored).

Run from the repository root::

    .venv/bin/python benchmarks/deft_transfer.py            # full run (see --help)
    .venv/bin/python benchmarks/deft_transfer.py --quick    # smoke test, minutes

The table is printed and written to ``--out`` (markdown) with a JSON twin.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {"x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
         "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}

# The paper's grids (appendix G.5), trimmed to fit two shared CPU cores. DEFT's
# percentile grid {60, 40, 30, 20} is trimmed to 20 and extended with 10: on this
# short-trained source model the mask of higher percentiles cuts most of the source
# head's inputs (see docs/deft.md).
GRIDS = {
    "deft": [{"percentile": p, "lr": lr} for p in (20, 10) for lr in (0.02, 0.005)],
    "full": [{"lr": lr} for lr in (0.01, 0.001)],
    "head": [{"lr": lr} for lr in (0.04, 0.005)],
    "peft": [{"lr": lr} for lr in (0.01, 0.001)],
    "ewc": [{"lam": lam, "lr": lr} for lam in (1.0, 50.0) for lr in (0.005, 0.001)],
}
NAMES = {"deft": "DEFT", "head": "Head-only", "full": "Full FT", "ewc": "EWC",
         "peft": "PEFT"}


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape).copy()


def load_source(n_train, n_val, n_test, seed=0):
    missing = [n for n in FILES.values() if not (FMNIST_DIR / n).exists()]
    if missing:
        sys.exit(f"Fashion-MNIST missing ({missing}): apt-get install dataset-fashion-mnist")
    raw = {k: read_idx(FMNIST_DIR / f) for k, f in FILES.items()}
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(raw["x_train"]))
    tr, va = order[:n_train], order[n_train:n_train + n_val]
    te = np.sort(rng.permutation(len(raw["x_test"]))[:n_test])

    def img(x):
        return (x.astype(np.float32) / 255.0)[..., None]

    return {"train": (img(raw["x_train"][tr]), raw["y_train"][tr].astype(np.int64)),
            "val": (img(raw["x_train"][va]), raw["y_train"][va].astype(np.int64)),
            "test": (img(raw["x_test"][te]), raw["y_test"][te].astype(np.int64))}


def load_target(seed):
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


def build_vgg(widths, bottleneck, classes=10, name="vgg_bn"):
    """Appendix G.2 layout: [c1]-pool-[c2]-pool-[c3,c3]-pool-[c4,c4]-pool-GAP-fc-head."""
    import keras
    from keras import layers

    def cbr(x, f, n):
        x = layers.Conv2D(f, 3, padding="same", use_bias=False, name=n,
                          kernel_regularizer=keras.regularizers.L2(5e-4))(x)
        x = layers.BatchNormalization(name=n + "_bn",
                                      gamma_regularizer=keras.regularizers.L2(5e-4))(x)
        return layers.ReLU(name=n + "_relu")(x)

    w1, w2, w3, w4 = widths
    inputs = keras.Input((28, 28, 1), name="image")
    x = layers.MaxPooling2D(name="pool1")(cbr(inputs, w1, "conv1"))
    x = layers.MaxPooling2D(name="pool2")(cbr(x, w2, "conv2"))
    x = layers.MaxPooling2D(name="pool3")(cbr(cbr(x, w3, "conv3a"), w3, "conv3b"))
    x = layers.MaxPooling2D(name="pool4")(cbr(cbr(x, w4, "conv4a"), w4, "conv4b"))
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(bottleneck, use_bias=False, name="fc",
                     kernel_regularizer=keras.regularizers.L2(5e-4))(x)
    x = layers.BatchNormalization(name="fc_bn",
                                  gamma_regularizer=keras.regularizers.L2(5e-4))(x)
    x = layers.ReLU(name="fc_relu")(x)
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


def train_source(args, src, cache: Path):
    import keras

    from hope_keras import reestimate_batchnorm_statistics

    path = cache / f"source_{'-'.join(map(str, args.widths))}_{args.bottleneck}_" \
                   f"{args.source_train}_{args.source_epochs}.keras"
    if path.exists():
        return keras.saving.load_model(path, compile=False), path, None
    keras.utils.set_random_seed(0)
    model = build_vgg(args.widths, args.bottleneck)
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
    cache.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model, path, seconds


def run_one(method, hp, source, plans, fisher, src, tgt, epochs, seed,
            monitor="h_score"):
    """Fine-tunes one method; returns validation (best epoch) and test metrics."""
    import keras

    from hope_keras import deft

    keras.utils.set_random_seed(seed)
    model = keras.models.clone_model(source)
    model.set_weights(source.get_weights())
    plan = None
    if method == "deft":
        plan = plans[hp["percentile"]]
        plan.apply(model, seed=seed)
    retention = deft.SourceRetention(model, plan=plan)
    target = deft.replace_head(model, 10, seed=seed)
    emap = deft.method_elasticity(method, target, plan=plan)
    opt = deft.ElasticOptimizer(keras.optimizers.SGD(hp["lr"], momentum=0.9),
                                elasticity=emap)
    penalties = [deft.L2Penalty(5e-4)]
    if method == "ewc":
        penalties.append(deft.EWCPenalty(target, fisher, hp["lam"]))
    trainer = deft.Trainer(target, opt, retention=retention, penalties=penalties,
                           monitor=monitor)
    t0 = time.time()
    hist = trainer.fit(tgt["train"], epochs=epochs, batch_size=16, target_val=tgt["val"],
                       source_val=src["val"], seed=seed)
    test = trainer.evaluate(tgt["test"], src["test"])
    return {"method": method, "hp": hp, "seed": seed, "best_epoch": hist.best_epoch,
            "val": hist.best, "test": test, "seconds": time.time() - t0,
            "elastic_fraction": None if plan is None else plan.elastic_fraction()}


def percentile_sweep(args, source, src):
    """DEFT at several percentiles: elastic fraction, source validation accuracy after
    the merges alone and after merges + masks (before fine-tuning), and the fine-tuned
    validation/test metrics (seed 0)."""
    import keras

    from hope_keras import deft

    tgt = load_target(0)
    lines = ["| percentile | elastic neurons | source val: merges only | + masks | "
             "target val | H val | target test | source test | H test |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in args.percentile_sweep:
        plan = deft.plan(source, percentile=p)
        m = keras.models.clone_model(source)
        m.set_weights(source.get_weights())
        plan.apply(m, mask=False)
        merged = deft.SourceRetention(m).evaluate(m, *src["val"])
        m = keras.models.clone_model(source)
        m.set_weights(source.get_weights())
        plan.apply(m)
        start = deft.SourceRetention(m, plan=plan).evaluate(m, *src["val"])
        r = run_one("deft", {"percentile": p, "lr": args.sweep_lr}, source, {p: plan},
                    None, src, tgt, args.epochs, 0)
        lines.append(
            f"| {p:g} | {100 * plan.elastic_fraction():.1f}% | {100 * merged:.2f} | "
            f"{100 * start:.2f} | "
            f"{100 * r['val']['target_acc']:.2f} | {100 * r['val']['h_score']:.2f} | "
            f"{100 * r['test']['target_acc']:.2f} | {100 * r['test']['source_acc']:.2f} | "
            f"{100 * r['test']['h_score']:.2f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    args.out.write_text(table + "\n")
    print(f"written: {args.out}")
    return 0


def fmt(values):
    a = 100 * np.asarray(values, dtype=float)
    return f"{a.mean():.2f} ± {a.std(ddof=1) if a.size > 1 else 0.0:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs=4, default=[16, 32, 48, 48])
    ap.add_argument("--bottleneck", type=int, default=64)
    ap.add_argument("--source-train", type=int, default=20000)
    ap.add_argument("--source-val", type=int, default=1000)
    ap.add_argument("--source-test", type=int, default=2000)
    ap.add_argument("--source-epochs", type=int, default=4)
    ap.add_argument("--source-batch", type=int, default=64)
    ap.add_argument("--fisher-examples", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["deft", "head", "full", "peft", "ewc"])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--percentile-sweep", type=float, nargs="+", default=None,
                    help="instead of the comparison: DEFT at these percentiles "
                         "(lr --sweep-lr, seed 0), validation and test metrics")
    ap.add_argument("--sweep-lr", type=float, default=0.02)
    ap.add_argument("--monitor", choices=["h_score", "target_acc"], default="h_score",
                    help="which epoch to keep: best validation H-score (algorithm 3) "
                         "or best target validation accuracy (appendix G.5)")
    ap.add_argument("--hp-json", type=Path, default=None,
                    help="skip the grid: reuse the hyper-parameters chosen in this "
                         "earlier results JSON and run every seed on the test sets")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/hope_deft_bench"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/deft_transfer_results.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.source_train, args.source_epochs, args.epochs, args.seeds = 3000, 1, 2, 2
        args.fisher_examples = 256
        for k in GRIDS:
            GRIDS[k] = GRIDS[k][:1]

    import keras  # noqa: F401

    from hope_keras import deft

    t_start = time.time()
    src = load_source(args.source_train, args.source_val, args.source_test)
    source, path, src_seconds = train_source(args, src, args.cache)
    src_test_acc = deft.accuracy(source, *src["test"])
    print(f"source model {path.name}: Fashion-MNIST test-subset accuracy "
          f"{src_test_acc:.4f} (trained in {src_seconds or 0:.0f} s; 0 = cached)")

    if args.percentile_sweep:
        return percentile_sweep(args, source, src)
    fixed = None
    if args.hp_json:
        fixed = json.loads(args.hp_json.read_text())["summary"]
        for m in args.methods:
            GRIDS[m] = [fixed[m]["hp"]]
    t0 = time.time()
    plans = {}
    for hp in GRIDS["deft"]:
        p = hp["percentile"]
        if p not in plans:
            plans[p] = deft.plan(source, percentile=p)
            plans[p].summary()
    plan_seconds = time.time() - t0
    fisher = None
    if "ewc" in args.methods:
        t0 = time.time()
        n = min(args.fisher_examples, len(src["train"][0]))
        fisher = deft.diagonal_fisher(source, src["train"][0][:n], src["train"][1][:n],
                                      batch_size=64)
        print(f"Fisher over {n} source training examples: {time.time() - t0:.0f} s")

    records = []
    chosen = {}
    tgt0 = load_target(0)
    for method in args.methods:
        best = None
        for hp in GRIDS[method]:
            r = run_one(method, hp, source, plans, fisher, src, tgt0, args.epochs, 0,
                        args.monitor)
            records.append({**r, "phase": "grid"})
            print(f"[grid] {method:5s} {hp}: val H {r['val']['h_score']:.4f} "
                  f"(target {r['val']['target_acc']:.4f}, source "
                  f"{r['val']['source_acc']:.4f}, epoch {r['best_epoch']}) "
                  f"{r['seconds']:.0f} s", flush=True)
            if best is None or r["val"]["h_score"] > best["val"]["h_score"]:
                best = r
        chosen[method] = best
    finals = {m: [chosen[m]] for m in args.methods}  # seed 0 = the chosen grid run
    if fixed is not None:
        print("hyper-parameters from", args.hp_json)
    for seed in range(1, args.seeds):
        tgt = load_target(seed)
        for method in args.methods:
            r = run_one(method, chosen[method]["hp"], source, plans, fisher, src, tgt,
                        args.epochs, seed, args.monitor)
            records.append({**r, "phase": "final"})
            finals[method].append(r)
            print(f"[seed {seed}] {method:5s}: test target {r['test']['target_acc']:.4f} "
                  f"source {r['test']['source_acc']:.4f} H {r['test']['h_score']:.4f}",
                  flush=True)

    lines = [
        f"Source: Fashion-MNIST, VGG-BN widths {args.widths} + fc {args.bottleneck}, "
        f"{args.source_train} training images, {args.source_epochs} epochs; test-subset "
        f"accuracy {100 * src_test_acc:.2f}% ({args.source_test} images).",
        f"Target: load_digits → 28×28; {len(tgt0['train'][0])} train / "
        f"{len(tgt0['val'][0])} val / {len(tgt0['test'][0])} test; {args.epochs} epochs, "
        f"batch 16, SGD momentum 0.9; {args.seeds} seeds; kept epoch: best validation "
        f"{args.monitor}.",
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
        hp = ", ".join(f"{k}={v}" for k, v in chosen[m]["hp"].items())
        lines.append(f"| {NAMES[m]} | {hp} | {fmt(t)} | {fmt(s)} | {fmt(h)} |")
    best_m = max(summary, key=lambda m: np.mean(summary[m]["h"]))
    lines += ["", f"Best mean H-score: {NAMES[best_m]}. Plan time "
              f"{plan_seconds:.0f} s; total {time.time() - t_start:.0f} s."]
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
