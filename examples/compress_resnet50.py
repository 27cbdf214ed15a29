"""Compress keras.applications.ResNet50 with HOPE, data-free, and slim it.

Uses the ImageNet weights when Keras has them cached locally
(~/.keras/models/resnet50_weights_tf_dim_ordering_tf_kernels.h5); otherwise it says
so and falls back to an offline model: ResNet50(weights=None) whose BatchNorm
statistics are re-estimated on random images (a stand-in: its accuracy means
nothing, but every step of the pipeline runs).

    .venv/bin/python examples/compress_resnet50.py --density 0.5 --out /tmp/resnet50_slim.keras
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hope_keras  # noqa: E402

WEIGHTS = os.path.join(os.path.expanduser("~"), ".keras", "models",
                       "resnet50_weights_tf_dim_ordering_tf_kernels.h5")


def load_model():
    if os.path.exists(WEIGHTS):
        print(f"Using the cached ImageNet weights: {WEIGHTS}")
        return keras.applications.ResNet50(weights="imagenet"), True
    print("ImageNet weights are not cached on this machine (and cannot be downloaded "
          "offline).\nFalling back to ResNet50(weights=None) with BN statistics "
          "re-estimated on random images: the pipeline runs, the accuracy is meaningless.")
    model = keras.applications.ResNet50(weights=None)
    rng = np.random.default_rng(0)
    images = keras.applications.resnet50.preprocess_input(
        rng.uniform(0, 255, (8, 224, 224, 3)).astype("float32"))
    hope_keras.reestimate_batchnorm_statistics(model, images, batch_size=8)
    return model, False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--out", default="resnet50_slim.keras")
    args = parser.parse_args()
    model, pretrained = load_model()
    hope_keras.analyze(model).summary()
    t = time.perf_counter()
    result = hope_keras.compress(model, density=args.density)
    print(f"Compressed to density {result.density:.3f} in {time.perf_counter() - t:.1f} s "
          f"({len(result.trajectory)} steps).")
    small = hope_keras.slim(model)
    print(f"Parameters: {small.count_params():,} (was "
          f"{round(small.count_params() / result.params_ratio):,})")
    small.save(args.out)
    result.trajectory.save(os.path.splitext(args.out)[0] + "_trajectory.npz")
    print(f"Saved {args.out}" + ("" if pretrained else " (offline stand-in model)"))


if __name__ == "__main__":
    main()
