"""Helpers shared by the benchmark scripts (not part of the library)."""

import os
import resource

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Benchmarks make compress's synthetic inputs every time (their timings include
# them); HOPE_KERAS_CACHE=<dir> in the environment reuses them across runs.
os.environ.setdefault("HOPE_KERAS_CACHE", "off")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def calibrated_resnet50(seed=0, images=4, builder=None):
    """ResNet50(weights=None) at 224×224 with non-trivial BN (calibration pass on random
    images, random γ/β), the same preparation as the end-to-end test. ``builder``: another
    `keras.applications` constructor (e.g. ResNet152) prepared the same way."""
    import hope_keras

    model = (builder or keras.applications.ResNet50)(weights=None)
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
