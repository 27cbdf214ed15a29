"""DEFT: fine-tune the bundled Fashion-MNIST CNN on scikit-learn's digits while it keeps
Fashion-MNIST, and compare with full fine-tuning.

    .venv/bin/python examples/deft_transfer.py --epochs 3

The full protocol (seeds, learning-rate grids, all baselines) is
benchmarks/deft_transfer.py; this is the short version a user copies from.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from hope_keras import deft  # noqa: E402
from hope_keras.data import load_demo_data, load_demo_model  # noqa: E402


def digits(n_train=1200):
    d = load_digits()
    x = tf.image.resize(d.images[..., None] / 16.0, (28, 28)).numpy().astype("float32")
    return (x[:n_train], d.target[:n_train]), (x[n_train:], d.target[n_train:])


def run(method, args, source_data, target_data):
    source = load_demo_model()
    plan = None
    if method == "deft":
        plan = deft.plan(source, percentile=args.percentile)
        plan.apply(source)
    retention = deft.SourceRetention(source, plan=plan)
    target = deft.replace_head(source, units=10, seed=0)
    inner = keras.optimizers.SGD(args.lr, momentum=0.9)
    optimizer = deft.ElasticOptimizer(inner, plan) if plan is not None else inner
    trainer = deft.Trainer(target, optimizer, retention=retention)
    history = trainer.fit(target_data[0], epochs=args.epochs, batch_size=16,
                          target_val=target_data[1], source_val=source_data, verbose=False)
    return history.best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--percentile", type=float, default=10)
    args = parser.parse_args()
    data = load_demo_data()
    source_data = (data.x_test[:1000], data.y_test[:1000])
    target_data = digits()
    for method in ("deft", "full"):
        print(method, run(method, args, source_data, target_data))


if __name__ == "__main__":
    main()
