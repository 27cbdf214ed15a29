#!/usr/bin/env python
"""Trains the models of the compression-quality benchmark (``benchmarks/quality.py``).

Run from the repository root (CPU; ``nice`` it on a shared machine)::

    nice -n 10 .venv/bin/python scripts/make_benchmark_fixtures.py [--only lenet vgg swish resnet50]

Data: Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (read with
``scripts/make_fixtures.py``'s IDX reader; installed by apt-get if missing).
Every model is trained from scratch with fixed seeds, then (for BN models) its
BatchNormalization moving statistics are re-estimated with
``hope_keras.reestimate_batchnorm_statistics`` over 24 × 256 training images (short
CPU training leaves them stale). The test accuracy on the full 10 000-image test
set is written beside each model in ``<name>.json``.

``lenet300``  (``benchmarks/fixtures/lenet300.keras``, ~1 MB, committed)
    LeNet-300-100 as in the Neuron Merging paper: Flatten → Dense 300 (ReLU fused)
    → Dense 100 (ReLU fused) → Dense 10 softmax. No BatchNorm. Adam 1e-3, 12 epochs,
    batch 128.
``vgg8``      (``benchmarks/fixtures/vgg8.keras``, ~2 MB, committed)
    The paper's VGG-style 8-layer BN network (appendix G) with widths scaled down by 4
    for 2 CPU cores: conv 32 / pool / 64 / pool / 128-128 / pool / 128-128 / pool, GAP,
    Dense 128 + BN + ReLU, Dense 10 softmax. Every conv is Conv(3×3, same, no bias)
    → BN → ReLU (the paper disables the biases before BN). Adam 2e-3 cosine,
    ``--vgg-epochs`` (default 3) epochs, batch 128 (the paper: SGD, batch 16).
``swish``     (``benchmarks/fixtures/swish_cnn.keras``, ~0.7 MB, committed)
    The non-ReLU network: ``vgg8``'s layout at half the widths
    (conv 16 / pool / 32 / pool / 64-64 / pool / 64-64 / pool, GAP, Dense 64 + BN)
    with swish (SiLU) in place of every ReLU, as separate ``Activation("swish")``
    layers after each BN. Adam 2e-3 cosine, ``--swish-epochs`` (default 4) epochs,
    batch 128; BN statistics re-estimated as above.
``resnet50``  (``.cache/resnet50_fmnist.keras``, ~95 MB, git-ignored, NOT committed)
    ``keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)``
    on Fashion-MNIST zero-padded to 32×32 and repeated on 3 channels.
    Adam 1e-3, ``--resnet-steps`` (default 400) batches of 64. ``--resnet-size 64``
    trains the same network on 64×64 inputs (each pixel doubled, padded by 4:
    ``.cache/resnet50_fmnist64.keras``), where the last stage sees 2×2 positions per
    image instead of 1 (the synthetic inputs' batch size, docs/quality.md);
    ``--resnet-size 128`` on 128×128 (each pixel 4 times, padded by 8:
    ``.cache/resnet50_fmnist128.keras``, 4×4 positions at the last stage).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_fixtures import load_fashion_mnist  # noqa: E402

FIXTURES = REPO / "benchmarks" / "fixtures"
CACHE = REPO / ".cache"


def gray(x_uint8):
    """(N, 28, 28) uint8 → (N, 28, 28, 1) float32 in [0, 1] (LeNet, VGG input)."""
    return (x_uint8.astype(np.float32) / 255.0)[..., None]


def rgb32(x_uint8, size=32):
    """(N, 28, 28) uint8 → (N, size, size, 3) float32 in [0, 1]: each pixel repeated
    ``size // 32`` times along both axes, then zero-padded (32: padded by 2)."""
    k = size // 32
    x = np.repeat(np.repeat(x_uint8, k, axis=1), k, axis=2) if k > 1 else x_uint8
    x = np.pad(x, ((0, 0), (2 * k, 2 * k), (2 * k, 2 * k))).astype(np.float32) / 255.0
    return np.repeat(x[..., None], 3, axis=-1)


def build_lenet300():
    import keras
    from keras import layers

    inputs = keras.Input((28, 28, 1), name="image")
    x = layers.Flatten(name="flatten")(inputs)
    x = layers.Dense(300, activation="relu", name="fc1")(x)
    x = layers.Dense(100, activation="relu", name="fc2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="lenet300")


def build_vgg8(widths=(32, 64, 128, 128, 128, 128), dense=128):
    import keras
    from keras import layers

    inputs = keras.Input((28, 28, 1), name="image")
    x = inputs
    for k, f in enumerate(widths, start=1):
        x = layers.Conv2D(f, 3, padding="same", use_bias=False, name=f"conv{k}")(x)
        x = layers.BatchNormalization(name=f"bn{k}")(x)
        x = layers.ReLU(name=f"relu{k}")(x)
        if k in (1, 2, 4, 6):  # appendix G: a 2x2 max-pool ends each of the 4 blocks
            x = layers.MaxPooling2D(2, name=f"pool{k}")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(dense, use_bias=False, name="fc")(x)
    x = layers.BatchNormalization(name="bn_fc")(x)
    x = layers.ReLU(name="relu_fc")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="vgg8")


def build_swish_cnn(widths=(16, 32, 64, 64, 64, 64), dense=64):
    """vgg8's layout, half the widths, swish (SiLU) activations."""
    import keras
    from keras import layers

    inputs = keras.Input((28, 28, 1), name="image")
    x = inputs
    for k, f in enumerate(widths, start=1):
        x = layers.Conv2D(f, 3, padding="same", use_bias=False, name=f"conv{k}")(x)
        x = layers.BatchNormalization(name=f"bn{k}")(x)
        x = layers.Activation("swish", name=f"swish{k}")(x)
        if k in (1, 2, 4, 6):
            x = layers.MaxPooling2D(2, name=f"pool{k}")(x)
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    x = layers.Dense(dense, use_bias=False, name="fc")(x)
    x = layers.BatchNormalization(name="bn_fc")(x)
    x = layers.Activation("swish", name="swish_fc")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="swish_cnn")


def build_resnet50(size=32):
    import keras

    return keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=10, name="resnet50"
    )


def accuracy(model, x, y, batch_size=250) -> float:
    probs = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(probs, axis=1) == y))


def reestimate(model, x_train, convert, rng, batches=24, batch_size=256):
    from hope_keras.stats.bn_stats import reestimate_batchnorm_statistics

    idx = rng.permutation(len(x_train))[: batches * batch_size]
    reestimate_batchnorm_statistics(model, convert(x_train[idx]), batch_size=batch_size)


def train_lenet(data, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = build_lenet300()
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    t0 = time.time()
    model.fit(gray(data["x_train"]), data["y_train"], batch_size=128, epochs=12,
              shuffle=True, verbose=2)
    info = {"train_s": round(time.time() - t0, 1),
            "recipe": "Adam 1e-3, 12 epochs, batch 128, no BN"}
    return model, info


def train_vgg(data, seed, epochs=2, build=None):
    import keras

    keras.utils.set_random_seed(seed)
    model = (build or build_vgg8)()
    x = gray(data["x_train"])
    steps = epochs * int(np.ceil(len(x) / 128))
    sched = keras.optimizers.schedules.CosineDecay(2e-3, decay_steps=steps, alpha=0.02)
    model.compile(keras.optimizers.Adam(sched), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    t0 = time.time()
    model.fit(x, data["y_train"], batch_size=128, epochs=epochs, shuffle=True, verbose=2)
    info = {"train_s": round(time.time() - t0, 1),
            "recipe": f"Adam 2e-3 cosine, {epochs} epochs, batch 128"}
    reestimate(model, data["x_train"], gray, np.random.default_rng(seed))
    return model, info


def train_resnet(data, seed, steps=400, batch=64, size=32):
    import keras

    keras.utils.set_random_seed(seed)
    model = build_resnet50(size)
    convert = functools.partial(rgb32, size=size)
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(data["x_train"]))[: steps * batch]
    x, y = data["x_train"][idx], data["y_train"][idx]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return steps

        def __getitem__(self, k):
            s = slice(k * batch, (k + 1) * batch)
            return convert(x[s]), y[s]

    t0 = time.time()
    model.fit(Batches(), epochs=1, verbose=2)
    info = {"train_s": round(time.time() - t0, 1),
            "recipe": f"Adam 1e-3, {steps} steps of batch {batch} (one pass over "
                      f"{steps * batch} training images)"}
    x_te, y_te = convert(data["x_test"][:2000]), data["y_test"][:2000]
    info["test_acc_2000_stale_bn"] = accuracy(model, x_te, y_te)
    reestimate(model, data["x_train"], convert, np.random.default_rng(seed + 1))
    return model, info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=["lenet", "vgg", "swish", "resnet50"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vgg-epochs", type=int, default=3)
    parser.add_argument("--swish-epochs", type=int, default=4)
    parser.add_argument("--resnet-steps", type=int, default=400)
    parser.add_argument("--resnet-size", type=int, default=32, choices=(32, 64, 128),
                        help="input resolution of the ResNet-50 fixture (64, 128: "
                             ".cache/resnet50_fmnist<size>.keras, each pixel repeated "
                             "size / 32 times along both axes)")
    args = parser.parse_args(argv)
    import keras

    data = load_fashion_mnist()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(exist_ok=True)
    jobs = {
        "lenet": ("lenet300", FIXTURES, lambda: train_lenet(data, args.seed), gray),
        "vgg": ("vgg8", FIXTURES, lambda: train_vgg(data, args.seed, args.vgg_epochs), gray),
        "swish": ("swish_cnn", FIXTURES,
                  lambda: train_vgg(data, args.seed, args.swish_epochs, build_swish_cnn),
                  gray),
        "resnet50": ("resnet50_fmnist" + ("" if args.resnet_size == 32 else
                                          str(args.resnet_size)), CACHE,
                     lambda: train_resnet(data, args.seed, args.resnet_steps,
                                          size=args.resnet_size),
                     functools.partial(rgb32, size=args.resnet_size)),
    }
    for key in args.only:
        name, folder, train, convert = jobs[key]
        print(f"=== {name}", flush=True)
        model, info = train()
        info["test_acc"] = accuracy(model, convert(data["x_test"]), data["y_test"])
        info["params"] = int(model.count_params())
        info["keras"] = keras.__version__
        path = folder / f"{name}.keras"
        model.save(path)
        # Keras 3 saves the optimizer state with a compiled model (3x the size):
        # reload uncompiled and save again, weights only + architecture.
        reloaded = keras.models.load_model(path, compile=False)
        reloaded.save(path)
        reloaded = keras.models.load_model(path, compile=False)
        check = accuracy(reloaded, convert(data["x_test"][:1000]), data["y_test"][:1000])
        info["reload_check_acc_1000"] = check
        (folder / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"{name}: {json.dumps(info)} -> {path} "
              f"({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
