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
import importlib.abc
import importlib.util
import sys
import types

__version__ = "0.1.0"

# Public name → the submodule that defines it, imported on first use: `import
# hope_keras` (and `hope-keras --help`) does not import TensorFlow.
_EXPORTS = {
    "Analysis": "scoring.analysis", "BlockReport": "scoring.analysis",
    "GroupReport": "scoring.analysis", "analyze": "scoring.analysis",
    "correct_statistics": "stats.bn_stats", "reestimate_batchnorm_statistics": "stats.bn_stats",
    "calibrate": "stats.calibration",
    "StatisticsCorrection": "stats.correction",
    "synthesize_inputs": "stats.synthetic",
    "CompressionInterrupted": "search.encoder", "CompressionResult": "search.encoder",
    "Encoder": "search.encoder", "SearchOptions": "search.encoder", "compress": "search.encoder",
    "LatencyBudget": "search.latency",
    "Step": "search.trajectory", "Trajectory": "search.trajectory",
    "Coupling": "graph.walker", "ModelGraph": "graph.walker", "NeuronGroup": "graph.walker",
    "Pinned": "graph.walker", "ResidualBlock": "graph.walker", "walk": "graph.walker",
    "slim": "edit.slim",
    "export_tflite": "deploy.export", "fold_batchnorm": "deploy.fold",
    "Profile": "deploy.profile", "profile": "deploy.profile",
    "latency_ratio": "deploy.profile",
    "Distiller": "deploy.recover", "recover": "deploy.recover",
}

# Public modules that live inside a stage's sub-package: `hope_keras.costs`,
# `import hope_keras.layers` and `from hope_keras import baselines` all name them.
_MODULE_ALIASES = {
    "costs": "scoring.costs", "layers": "graph.layers", "baselines": "search.baselines",
}

__all__ = sorted([*_EXPORTS, *_MODULE_ALIASES, "activations", "deft", "derivative_matching"])


class _LazyPackage(types.ModuleType):
    def __getattr__(self, name):
        if name in _EXPORTS:
            value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        elif name in _MODULE_ALIASES:
            value = importlib.import_module(f"{__name__}.{name}")
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
        # Importing a submodule named like a public function (`hope_keras.edit.slim`,
        # `hope_keras.deploy.profile`) never rebinds the function's name.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(__all__))


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``hope_keras.<alias>`` as the module it names (one module object)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MODULE_ALIASES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        name = spec.name.rpartition(".")[2]
        module = importlib.import_module(f"{__name__}.{_MODULE_ALIASES[name]}")
        self._specs = {**getattr(self, "_specs", {}), spec.name: module.__spec__}
        return module

    def exec_module(self, module):
        # The import system set the alias's spec on the module: give its own back.
        module.__spec__ = self._specs[module.__spec__.name]


sys.modules[__name__].__class__ = _LazyPackage
sys.meta_path.append(_AliasFinder())
