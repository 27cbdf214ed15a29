"""DEFT: Dispersed Elastic Fine-Tuning (docs/theory.md §9).

Fine-tune a BatchNorm network on a new task while it keeps its source task:

* `plan` runs the HOPE encoder on a copy of the model, collects every neuron's
  ``J_prune``, and derives ``τ_lock``, the merges to replay, the elasticities and the
  structural masks (`DeftPlan`: inspect, ``save``/``load``, ``apply``).
* `ElasticOptimizer` wraps a Keras optimizer and scales each gradient by its
  neuron's elasticity.
* `Trainer` is a `tf.distribute` custom loop that keeps the epoch with the best
  H-score; `SourceRetention` measures the source task the paper's way.
* `replace_head`, `method_elasticity`, `diagonal_fisher`, `EWCPenalty`, `L2Penalty`
  run the baselines (full FT, head-only, PEFT, EWC) in the same harness.

See docs/deft.md.
"""

from hope_keras.deft.baselines import (
    METHODS,
    EWCPenalty,
    L2Penalty,
    diagonal_fisher,
    method_elasticity,
    replace_head,
)
from hope_keras.deft.optimizer import ElasticOptimizer
from hope_keras.deft.plan import (
    DeftPlan,
    apply_plan,
    find_head,
    layer_threshold,
    lock_threshold,
    plan,
)
from hope_keras.deft.retention import SourceRetention, accuracy, h_score
from hope_keras.deft.trainer import Trainer, TrainHistory

__all__ = [
    "METHODS",
    "DeftPlan",
    "EWCPenalty",
    "ElasticOptimizer",
    "L2Penalty",
    "SourceRetention",
    "TrainHistory",
    "Trainer",
    "accuracy",
    "apply_plan",
    "diagonal_fisher",
    "find_head",
    "h_score",
    "layer_threshold",
    "lock_threshold",
    "method_elasticity",
    "plan",
    "replace_head",
]
