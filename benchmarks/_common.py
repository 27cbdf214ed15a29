"""Helpers shared by the benchmark scripts (not part of the library)."""

import os
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def calibrated_resnet50(seed=0, images=4):
    """ResNet50(weights=None) at 224×224 with non-trivial BN (calibration pass on random
    images, random γ/β), the same preparation as the end-to-end test."""
    import hope_keras

    model = keras.applications.ResNet50(weights=None)
    rng = np.random.default_rng(seed)
    hope_keras.reestimate_batchnorm_statistics(
        model, rng.uniform(0, 255, (images, 224, 224, 3)).astype("float32"),
        batch_size=images)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.3, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
    return model


def flops(model) -> int:
    """Multiply-accumulates of the Dense/Conv layers for one example (×2 = FLOPs)."""
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            shape = layer.output.shape
            total += int(np.prod(shape[1:-1] or [1])) * int(np.prod(layer.kernel.shape))
        elif isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
            total += int(np.prod(layer.output.shape[1:-1])) * int(np.prod(layer.kernel.shape))
    return 2 * total


def latency(model, x, repeats=5) -> float:
    """Median seconds of one forward pass on `x` (after one warm-up call)."""
    model(x, training=False)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model(x, training=False)
        times.append(time.perf_counter() - t)
    return float(np.median(times))
