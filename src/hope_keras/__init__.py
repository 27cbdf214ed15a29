"""hope_keras: data-free, Keras-native compression of neural networks.

* `analyze` finds every compressible channel of a Keras model and scores it (HOPE);
  `layers` is the registry of what it knows about each layer type.
* `compress` runs the HOPE greedy encoder in place; `slim` rebuilds a smaller model;
  `Trajectory` saves, loads and replays a run.
* `recover` wins back accuracy after compression: BN re-estimation, then knowledge
  distillation from the original on a little unlabeled data (`Distiller`, Keras `fit`).
* `profile` counts parameters and FLOPs and times a model (against a reference);
  `export_tflite` converts a (slimmed) model to TensorFlow Lite.
* `reestimate_batchnorm_statistics` refreshes stale BN moving statistics;
  `calibrate` makes BN-free ReLU networks compressible (docs/theory.md §7).
* `costs`: the prices and rankings of HOPE's actions (`cost="hope"` or `"paper"`).
* `baselines`: magnitude pruning criteria and Neuron Merging, through the same edits.
* `deft` fine-tunes on a new task while keeping the old one (DEFT).
* `derivative_matching` compresses MLPs with analytic activations.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# Public name → the submodule that defines it, imported on first use: `import
# hope_keras` (and `hope-keras --help`) does not import TensorFlow.
_EXPORTS = {
    "Analysis": "analysis", "BlockReport": "analysis", "GroupReport": "analysis",
    "analyze": "analysis",
    "correct_statistics": "bn_stats", "reestimate_batchnorm_statistics": "bn_stats",
    "calibrate": "calibration",
    "CompressionInterrupted": "engine", "CompressionResult": "engine", "Encoder": "engine",
    "SearchOptions": "engine", "compress": "engine",
    "StatisticsCorrection": "correction",
    "Coupling": "graph", "ModelGraph": "graph", "NeuronGroup": "graph", "Pinned": "graph",
    "ResidualBlock": "graph", "walk": "graph",
    "slim": "slim",
    "synthesize_inputs": "synthetic",
    "Step": "trajectory", "Trajectory": "trajectory",
    "export_tflite": "export",
    "Profile": "profile", "profile": "profile",
    "Distiller": "recover", "recover": "recover",
}

__all__ = sorted([*_EXPORTS, "baselines", "costs", "deft", "derivative_matching", "layers"])


class _LazyPackage(types.ModuleType):
    def __getattr__(self, name):
        if name in _EXPORTS:
            value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        else:
            try:
                value = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        self.__dict__[name] = value
        return value

    def __setattr__(self, name, value):
        # Importing the submodule `hope_keras.slim` binds the attribute `slim` to the
        # module; `hope_keras.slim` stays the function.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _LazyPackage
