"""Bundled demo fixtures: a small Fashion-MNIST CNN and some of its data.

The files in this package are produced by ``scripts/make_fixtures.py`` (see
``docs/fixtures.md`` for the architecture and the measured accuracies):

* ``fmnist_cnn.keras``: a Functional Keras model "fmnist_cnn", input
  ``(28, 28, 1)`` float32 in ``[0, 1]``, 10 softmax outputs. Its compressible
  neurons are Conv2D/Dense -> BatchNormalization -> ReLU, and it contains one
  identity residual block.
* ``fmnist_test_subset.npz``: 2000 Fashion-MNIST test images with labels and
  512 training images for calibration, all uint8.
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple

import numpy as np

__all__ = ["DemoData", "load_demo_model", "load_demo_data", "CLASS_NAMES"]

MODEL_FILE = "fmnist_cnn.keras"
DATA_FILE = "fmnist_test_subset.npz"

#: Fashion-MNIST class names, indexed by label.
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


class DemoData(NamedTuple):
    """The demo data, ready to feed to the demo model.

    Attributes:
        x_test: float32 ``(2000, 28, 28, 1)`` test images scaled to ``[0, 1]``.
        y_test: int64 ``(2000,)`` labels 0-9 (see ``CLASS_NAMES``).
        x_calib: float32 ``(512, 28, 28, 1)`` training images scaled to
            ``[0, 1]``, for calibration (e.g. BatchNormalization statistics
            or data-driven baselines); disjoint from the test images.
        y_calib: int64 ``(512,)`` labels of ``x_calib``.
    """

    x_test: np.ndarray
    y_test: np.ndarray
    x_calib: np.ndarray
    y_calib: np.ndarray

    def __repr__(self) -> str:  # shapes, not the 1.6 million pixels
        fields = ", ".join(f"{k}=<{v.dtype} {v.shape}>" for k, v in self._asdict().items())
        return f"DemoData({fields})"


def load_demo_model():
    """Loads a fresh copy of the bundled Fashion-MNIST CNN.

    Each call reads the packaged ``fmnist_cnn.keras`` again, so the returned
    model can be compressed or modified freely. It comes compiled (a fresh
    Adam, sparse categorical cross-entropy, accuracy metric), so
    ``model.evaluate`` works directly.

    Returns:
        keras.Model: The Functional model "fmnist_cnn".

    Example:
        >>> from hope_keras.data import load_demo_model, load_demo_data
        >>> model = load_demo_model()
        >>> model.input_shape, model.output_shape
        ((None, 28, 28, 1), (None, 10))
        >>> data = load_demo_data()
        >>> probs = model.predict(data.x_test[:100], verbose=0)
        >>> probs.shape
        (100, 10)
    """
    import keras

    with resources.as_file(resources.files(__name__) / MODEL_FILE) as path:
        model = keras.saving.load_model(path, compile=False)
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def load_demo_data() -> DemoData:
    """Loads the bundled Fashion-MNIST test subset and calibration images.

    Returns:
        DemoData: A named tuple ``(x_test, y_test, x_calib, y_calib)``; the
        images are float32 in ``[0, 1]`` with a trailing channel axis, as
        the demo model expects.

    Example:
        >>> import numpy as np
        >>> from hope_keras.data import load_demo_data
        >>> data = load_demo_data()
        >>> data.x_test.shape, data.x_test.dtype, data.y_test.shape
        ((2000, 28, 28, 1), dtype('float32'), (2000,))
        >>> data.x_calib.shape
        (512, 28, 28, 1)
        >>> bool(data.x_test.min() >= 0.0 and data.x_test.max() <= 1.0)
        True
    """
    with resources.as_file(resources.files(__name__) / DATA_FILE) as path:
        with np.load(path) as npz:
            raw = {key: npz[key] for key in npz.files}

    def images(x):
        return (x.astype(np.float32) / 255.0)[..., None]

    return DemoData(
        x_test=images(raw["x_test"]),
        y_test=raw["y_test"].astype(np.int64),
        x_calib=images(raw["x_calib"]),
        y_calib=raw["y_calib"].astype(np.int64),
    )
