"""hope_keras: data-free, Keras-native compression of neural networks.

* `analyze` finds every compressible neuron of a Keras model and scores it (HOPE).
* `reestimate_batchnorm_statistics` refreshes stale BN moving statistics.
"""

from hope_keras.analysis import Analysis, BlockReport, GroupReport, analyze
from hope_keras.bn_stats import reestimate_batchnorm_statistics
from hope_keras.graph import ModelGraph, NeuronGroup, Pinned, ResidualBlock, walk

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "BlockReport",
    "GroupReport",
    "ModelGraph",
    "NeuronGroup",
    "Pinned",
    "ResidualBlock",
    "analyze",
    "reestimate_batchnorm_statistics",
    "walk",
]
