#!/usr/bin/env python
"""A convolutional autoencoder, decoded by transposed convolutions: reconstruction
error after compression, HOPE against magnitude pruning.

The model (trained here on Fashion-MNIST, once, then loaded from
``.cache/autoencoder_fmnist.keras``): two strided Conv2D + BN + ReLU encode 28 × 28
to 7 × 7 × 32, two strided Conv2DTranspose + BN + ReLU decode, a Conv2D + sigmoid
writes the image; every hidden group is a ``"neurons"`` group (the decoder's written
and read by transposed convolutions). Its BN statistics are re-estimated on the
training images at the end of training.

At each density, the same trained model is compressed by

* ``hope``: ``compress(density=d)``, data-free (no residual stream: nothing
  synthetic is made);
* ``hope_data``: ``compress(density=d, data=x)`` on 1024 training images;
* ``hope_recover``: ``hope_data``, then ``recover(teacher=original,
  distillation="mse", epochs=2)`` on 2048 training images (the 1024 among them);
* ``l1`` / ``bn_scale``: `hope_keras.baselines.prune` with the ℓ1 norm of each
  neuron's filter or its BN's |γ|, one global ranking;
* ``l1_data``: ``l1``, then `hope_keras.reestimate_batchnorm_statistics` on the
  same 1024 images (what ``hope_data`` is given);
* ``nm``: Neuron Merging (`hope_keras.baselines.neuron_merging`, its defaults);

and scored by the mean squared reconstruction error on the last 5000 test images
(held out: nothing here is chosen on them, nor on the first 5000, which are not
used). The table prints each method's error against the uncompressed model's.

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/autoencoder_quality.py

Results: ``benchmarks/results/autoencoder_quality.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
from _common import add_quick, write_results  # noqa: E402

METHODS = ("hope", "hope_data", "hope_recover", "l1", "l1_data", "bn_scale", "nm")


def build(keras):
    L = keras.layers
    inputs = keras.Input((28, 28, 1))
    x = inputs
    for width in (16, 32):
        x = L.ReLU()(L.BatchNormalization()(L.Conv2D(width, 3, strides=2, padding="same")(x)))
    for width in (32, 16):
        x = L.Conv2DTranspose(width, 3, strides=2, padding="same")(x)
        x = L.ReLU()(L.BatchNormalization()(x))
    outputs = L.Conv2D(1, 3, padding="same", activation="sigmoid")(x)
    return keras.Model(inputs, outputs, name="autoencoder")


def trained(path: Path, x_train, epochs: int):
    """The autoencoder trained on `x_train` (loaded from `path` when it exists)."""
    import keras

    import hope_keras

    if path.exists():
        return keras.models.load_model(path, compile=False)
    keras.utils.set_random_seed(0)
    model = build(keras)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    t = time.perf_counter()
    model.fit(x_train, x_train, batch_size=128, epochs=epochs, verbose=0)
    # Short CPU training leaves the moving statistics behind the weights.
    hope_keras.reestimate_batchnorm_statistics(model, x_train[:4096])
    print(f"trained {epochs} epoch(s) on {len(x_train)} images in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return model


def mse(model, x) -> float:
    y = model.predict(x, batch_size=500, verbose=0)
    return float(np.mean((np.asarray(y, dtype=np.float64) - x) ** 2))


def compress_with(method, model, density, x_data, x_recover, teacher):
    import hope_keras
    from hope_keras import baselines

    if method.startswith("hope"):
        data = x_data if method != "hope" else None
        r = hope_keras.compress(model, density=density, data=data, verbose=False)
        if method == "hope_recover":
            hope_keras.recover(model, x_recover, teacher=teacher, epochs=2, verbose=0,
                               distillation="mse")
        return r.params_ratio
    if method == "nm":
        baselines.neuron_merging(model, density)
    else:
        baselines.prune(model, density, "bn_scale" if method == "bn_scale" else "l1_input")
    if method == "l1_data":
        hope_keras.reestimate_batchnorm_statistics(model, x_data)
    return hope_keras.slim(model).count_params() / model.count_params()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--densities", type=float, nargs="*", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    ap.add_argument("--train", type=int, default=30000, help="training images")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--data", type=int, default=1024, help="images given as data=")
    ap.add_argument("--heldout", type=int, default=5000, help="the last N test images")
    ap.add_argument("--model", default=str(REPO / ".cache" / "autoencoder_fmnist.keras"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"
                                         / "autoencoder_quality.json"))
    add_quick(ap)  # a model trained on 512 images for one epoch, one density
    args = ap.parse_args(argv)
    if args.quick:
        args.densities, args.train, args.epochs, args.data, args.heldout = [0.7], 512, 1, 64, 256
        args.model = None

    import keras

    from make_fixtures import load_fashion_mnist

    fm = load_fashion_mnist()
    x_train = (fm["x_train"][:args.train].astype("float32") / 255.0)[..., None]
    x_test = (fm["x_test"][-args.heldout:].astype("float32") / 255.0)[..., None]
    pick = np.random.default_rng(1).choice(len(x_train), 2 * args.data, replace=False)
    x_data, x_recover = x_train[pick[:args.data]], x_train[pick]
    if args.model is None:  # --quick: trained here, not saved
        import tempfile
        path = Path(tempfile.mkdtemp()) / "autoencoder.keras"
    else:
        path = Path(args.model)
    original = trained(path, x_train, args.epochs)
    base = mse(original, x_test)
    print(f"autoencoder: {original.count_params()} parameters; held-out MSE {base:.5f} "
          f"on {len(x_test)} test images; keras {keras.__version__}", flush=True)
    print(f"{'density':>7} " + " ".join(f"{m:>14}" for m in METHODS)
          + "   (MSE / uncompressed; params ratio)")
    rows = []
    for d in args.densities:
        row = {"density": d}
        for method in METHODS:
            model = keras.models.load_model(path, compile=False)
            params = compress_with(method, model, d, x_data, x_recover, original)
            row[method] = {"mse": mse(model, x_test), "params_ratio": params}
        rows.append(row)
        print(f"{d:>7.2f} " + " ".join(
            f"{row[m]['mse'] / base:>7.2f} ({row[m]['params_ratio']:.2f})" for m in METHODS),
            flush=True)
    out = {"command": " ".join(["benchmarks/autoencoder_quality.py"] + (argv or sys.argv[1:])),
           "uncompressed_mse": base, "heldout": len(x_test), "train": args.train,
           "epochs": args.epochs, "data": args.data, "keras": keras.__version__, "rows": rows}
    print(f"wrote {write_results(args.out, out, quick=args.quick)}")


if __name__ == "__main__":
    main()
