#!/usr/bin/env python
"""Regenerates the bundled demo model and data (``src/hope_keras/data``).

Run from the repository root::

    .venv/bin/python scripts/make_fixtures.py

It needs the Fashion-MNIST files of the Debian package ``dataset-fashion-mnist``
(``/usr/share/datasets/fashion-mnist/*-ubyte.gz``, the original gzipped IDX
files); when they are missing it runs ``apt-get install -y
dataset-fashion-mnist`` (as root) first. It then trains a small residual CNN
with Adam for a few epochs on CPU (fixed seeds), re-estimates the
BatchNormalization statistics with
:func:`hope_keras.stats.bn_stats.reestimate_batchnorm_statistics` over 24 training
batches of 256, prints the test accuracies before and after that, and writes:

``fmnist_cnn.keras``
    The Functional model "fmnist_cnn": input ``(28, 28, 1)`` float32 in
    ``[0, 1]``, output 10 softmax probabilities. Saved uncompiled and without
    optimizer state (``hope_keras.data.load_demo_model`` compiles it).
    Layers, in order::

        conv1 (Conv2D 32, 3x3, same) -> bn1 -> relu1 -> pool1 (2x2)
        conv2 (Conv2D 64, 3x3, same) -> bn2 -> relu2 -> pool2 (2x2)
        residual block on 64 channels, x = pool2:
            res_conv1 -> res_bn1 -> res_relu1 -> res_conv2 -> res_bn2
            res_add = Add([x, res_bn2]) -> res_relu
        conv3 (Conv2D 64, 3x3, same) -> bn3 -> relu3 -> pool3 (2x2)
        flatten -> fc1 (Dense 128) -> bn4 -> relu4 -> dropout (0.3)
        -> predictions (Dense 10, softmax)

    Every compressible neuron is Conv/Dense -> BatchNormalization -> a
    separate ``keras.layers.ReLU`` layer (no fused activations).

``fmnist_test_subset.npz``
    ``x_test``: uint8 ``(2000, 28, 28)``, a fixed random subset of the
    Fashion-MNIST test set; ``y_test``: uint8 ``(2000,)``, its labels (0-9);
    ``test_indices``: int32 ``(2000,)``, their positions in the 10 000-image
    test set (sorted); ``x_calib``: uint8 ``(512, 28, 28)``, training images
    for calibration / BN statistics; ``y_calib``: uint8 ``(512,)``, their
    labels; ``calib_indices``: int32 ``(512,)``, their positions in the
    60 000-image training set. Pixels are raw 0-255; the model wants
    ``x / 255`` with a trailing channel axis (see
    :func:`hope_keras.data.load_demo_data`).
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "hope_keras" / "data"


def ensure_dataset(directory: Path = FMNIST_DIR) -> None:
    """Installs ``dataset-fashion-mnist`` with apt-get if files are missing (unless
    ``HOPE_NO_INSTALL=1``, as in the benchmarks' quick tier: then it raises)."""
    if all((directory / name).exists() for name in FILES.values()):
        return
    if os.environ.get("HOPE_NO_INSTALL") == "1":
        raise FileNotFoundError(
            f"Fashion-MNIST is missing from {directory} and HOPE_NO_INSTALL=1: run "
            "`apt-get install -y dataset-fashion-mnist` first.")
    print("Fashion-MNIST files missing; apt-get install -y dataset-fashion-mnist")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(
        ["apt-get", "install", "-y", "dataset-fashion-mnist"], check=True, env=env
    )
    missing = [n for n in FILES.values() if not (directory / n).exists()]
    if missing:
        raise FileNotFoundError(f"still missing after apt-get: {missing}")


def read_idx(path: Path) -> np.ndarray:
    """Reads a gzipped IDX file (big-endian header, uint8 payload)."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # 0x0801 labels, 0x0803 images: uint8 payload
        raise ValueError(f"{path}: not a uint8 IDX file (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    return np.frombuffer(data, np.uint8, offset=offset).reshape(shape).copy()


def load_fashion_mnist(directory: Path = FMNIST_DIR) -> dict[str, np.ndarray]:
    """Returns uint8 ``x_train (60000, 28, 28)``, ``y_train``, ``x_test``, ``y_test``."""
    ensure_dataset(directory)
    return {key: read_idx(directory / name) for key, name in FILES.items()}


# Config keys that newer Keras writes with these default values and that older Keras
# releases in the supported range (pyproject.toml) reject as unknown arguments.
_NEW_DEFAULT_KEYS = {
    "input_axes": None, "output_axes": None,  # initializers, Keras 3.15
    "quantization_config": None,  # Dense/Conv
    "renorm": False, "renorm_clipping": None, "renorm_momentum": 0.99,  # BatchNormalization
    "optional": False,  # InputLayer
}


def make_portable(path: Path) -> None:
    """Rewrites a ``.keras`` file so that the oldest supported Keras loads it too.

    Drops the config keys of ``_NEW_DEFAULT_KEYS`` where they hold their default
    value (the newer Keras that wrote them fills in the same default when they are
    missing); the weights are copied byte for byte.
    """
    import json
    import zipfile

    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()
                    if not (k in _NEW_DEFAULT_KEYS and type(v) is type(_NEW_DEFAULT_KEYS[k])
                            and v == _NEW_DEFAULT_KEYS[k])}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "config.json":
                data = json.dumps(strip(json.loads(data))).encode()
            zout.writestr(info, data)
    tmp.replace(path)


def build_model(dropout: float = 0.3):
    """The fixture architecture (see the module docstring)."""
    import keras
    from keras import layers

    def conv_bn_relu(x, filters, conv_name, bn_name, relu_name):
        x = layers.Conv2D(filters, 3, padding="same", name=conv_name)(x)
        x = layers.BatchNormalization(name=bn_name)(x)
        return layers.ReLU(name=relu_name)(x)

    inputs = keras.Input((28, 28, 1), name="image")
    x = conv_bn_relu(inputs, 32, "conv1", "bn1", "relu1")
    x = layers.MaxPooling2D(2, name="pool1")(x)
    x = conv_bn_relu(x, 64, "conv2", "bn2", "relu2")
    x = layers.MaxPooling2D(2, name="pool2")(x)
    shortcut = x
    y = conv_bn_relu(x, 64, "res_conv1", "res_bn1", "res_relu1")
    y = layers.Conv2D(64, 3, padding="same", name="res_conv2")(y)
    y = layers.BatchNormalization(name="res_bn2")(y)
    x = layers.Add(name="res_add")([shortcut, y])
    x = layers.ReLU(name="res_relu")(x)
    x = conv_bn_relu(x, 64, "conv3", "bn3", "relu3")
    x = layers.MaxPooling2D(2, name="pool3")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(128, name="fc1")(x)
    x = layers.BatchNormalization(name="bn4")(x)
    x = layers.ReLU(name="relu4")(x)
    x = layers.Dropout(dropout, name="dropout")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="fmnist_cnn")


def to_model_input(x_uint8: np.ndarray) -> np.ndarray:
    return (x_uint8.astype(np.float32) / 255.0)[..., None]


def accuracy(model, x, y, batch_size=500) -> float:
    probs = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(probs, axis=1) == y))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bn-batches", type=int, default=24)
    parser.add_argument("--bn-batch-size", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    import keras

    from hope_keras.stats.bn_stats import reestimate_batchnorm_statistics

    t_start = time.time()
    keras.utils.set_random_seed(args.seed)
    data = load_fashion_mnist()
    x_train, y_train = to_model_input(data["x_train"]), data["y_train"]
    x_test, y_test = to_model_input(data["x_test"]), data["y_test"]
    print(f"train {x_train.shape}, test {x_test.shape}")

    rng = np.random.default_rng(args.seed)
    test_indices = np.sort(rng.choice(len(x_test), 2000, replace=False)).astype(np.int32)
    calib_indices = np.sort(rng.choice(len(x_train), 512, replace=False)).astype(np.int32)

    model = build_model()
    steps = args.epochs * int(np.ceil(len(x_train) / args.batch_size))
    schedule = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=steps, alpha=0.02)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    t0 = time.time()
    model.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
        shuffle=True, verbose=2,
    )
    print(f"training: {time.time() - t0:.0f} s")

    subset = (x_test[test_indices], y_test[test_indices])
    acc_full_before = accuracy(model, x_test, y_test)
    acc_sub_before = accuracy(model, *subset)
    print(f"before BN re-estimation: test accuracy {acc_full_before:.4f} (10000), "
          f"{acc_sub_before:.4f} (2000 subset)")

    order = rng.permutation(len(x_train))[: args.bn_batches * args.bn_batch_size]
    reestimate_batchnorm_statistics(
        model, x_train[order], batch_size=args.bn_batch_size, verbose=1
    )
    acc_full_after = accuracy(model, x_test, y_test)
    acc_sub_after = accuracy(model, *subset)
    print(f"after BN re-estimation:  test accuracy {acc_full_after:.4f} (10000), "
          f"{acc_sub_after:.4f} (2000 subset)")

    # Save an uncompiled copy: no optimizer state (keeps the file small) and
    # no compile config (hope_keras.data.load_demo_model compiles it).
    final = keras.Model.from_config(model.get_config())
    final.set_weights(model.get_weights())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.out_dir / "fmnist_cnn.keras"
    final.save(model_path)
    make_portable(model_path)
    data_path = args.out_dir / "fmnist_test_subset.npz"
    np.savez_compressed(
        data_path,
        x_test=data["x_test"][test_indices],
        y_test=data["y_test"][test_indices],
        test_indices=test_indices,
        x_calib=data["x_train"][calib_indices],
        y_calib=data["y_train"][calib_indices],
        calib_indices=calib_indices,
    )

    reloaded = keras.saving.load_model(model_path, compile=False)
    acc_reloaded = accuracy(reloaded, *subset)
    print(f"reloaded {model_path.name}: subset accuracy {acc_reloaded:.4f}")
    if abs(acc_reloaded - acc_sub_after) > 1e-9:
        print("ERROR: reloaded model disagrees with the trained one", file=sys.stderr)
        return 1
    print(f"{model_path}: {model_path.stat().st_size / 1e6:.2f} MB, "
          f"{final.count_params()} parameters")
    print(f"{data_path}: {data_path.stat().st_size / 1e6:.2f} MB")
    print(f"total time: {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
