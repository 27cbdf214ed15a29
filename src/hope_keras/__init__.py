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
  `calibrate` makes BN-free ReLU networks compressible (spec section 7).
* `costs`: the prices and rankings of HOPE's actions (`cost="hope"` or `"paper"`).
* `baselines`: magnitude pruning criteria and Neuron Merging, through the same edits.
* `deft` fine-tunes on a new task while keeping the old one (DEFT).
* `derivative_matching` compresses MLPs with analytic activations.
"""

from hope_keras import baselines, costs, deft, derivative_matching, layers
from hope_keras.analysis import Analysis, BlockReport, GroupReport, analyze
from hope_keras.bn_stats import reestimate_batchnorm_statistics
from hope_keras.calibration import calibrate
from hope_keras.engine import CompressionResult, Encoder, compress
from hope_keras.graph import Coupling, ModelGraph, NeuronGroup, Pinned, ResidualBlock, walk
from hope_keras.export import export_tflite
from hope_keras.profile import Profile, profile
from hope_keras.recover import Distiller, recover
from hope_keras.slim import slim
from hope_keras.trajectory import Step, Trajectory

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "BlockReport",
    "CompressionResult",
    "Coupling",
    "Distiller",
    "Encoder",
    "GroupReport",
    "ModelGraph",
    "NeuronGroup",
    "Pinned",
    "Profile",
    "ResidualBlock",
    "Step",
    "Trajectory",
    "analyze",
    "baselines",
    "calibrate",
    "costs",
    "compress",
    "deft",
    "derivative_matching",
    "export_tflite",
    "layers",
    "profile",
    "recover",
    "reestimate_batchnorm_statistics",
    "slim",
    "walk",
]
