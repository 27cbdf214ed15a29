"""HOPE action costs: the `Cost` objects and their registry (docs/theory.md §3, §4).

A `Cost` prices prune, merge and evict candidates with the formulas of
`hope_keras.scoring.cost_formulas` (``J_prune``, ``α*``, ``J_merge``, ``J_evict``, the merged
parent), which this module re-exports: ``costs.j_merge`` and the rest stay here.
Pure numpy float64 math, no Keras.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from hope_keras.scoring.cost_formulas import (  # noqa: F401 - re-exported: costs.j_merge, costs.FLOOR, ...
    FLOOR,
    MergeSolution,
    ParentCoefficients,
    alpha_star,
    j_evict,
    j_merge,
    j_merge_residual,
    j_prune,
    merge_solution,
    merge_solution_one,
    parent_coefficients,
)

__all__ = [
    "Cost",
    "PaperCost",
    "HopeCost",
    "PruneCandidates",
    "MergeCandidates",
    "EvictCandidate",
    "RankInfo",
    "get",
    "FLOOR",
    "j_prune",
    "alpha_star",
    "j_merge",
    "j_merge_residual",
    "j_evict",
    "MergeSolution",
    "ParentCoefficients",
    "merge_solution",
    "parent_coefficients",
]


# ------------------------------------------------------------------- cost objects
#
# A cost prices the three actions and ranks them. It is a small object of pure
# functions (in the spirit of optax's transformations): the engine hands it arrays
# describing the candidates of one group or block and gets back ``J`` and the
# ranking key ``DR``; it never sees Keras objects.


class PruneCandidates(NamedTuple):
    """The prune candidates of one group (every live neuron).

    Attributes:
        capacity: ``‖f_i‖ = ‖u_i‖·sqrt(K(i,i))`` of each candidate.
        C: the group's live capacity.
        n: the group's live neuron count (before the action).
        n0: the group's initial neuron count.
        k_self: ``K(i,i)``, the second moment of the neuron's activation.
        u_norm: ``‖u_i‖``, the norm of its output vector.
        gamma: ``|γ_i|``, its surrogate pre-activation standard deviation.
    """

    capacity: np.ndarray
    C: float
    n: int
    n0: int
    k_self: Optional[np.ndarray] = None
    u_norm: Optional[np.ndarray] = None
    gamma: Optional[np.ndarray] = None


class MergeCandidates(NamedTuple):
    """The merge candidates (pairs) of one group.

    Attributes:
        A: ``‖f_i‖² + ‖f_j‖²``.
        B: the merge objective ``<φ, f_i + f_j>`` of the best parent.
        c_rem: ``C − ‖f_i‖ − ‖f_j‖``.
        norm_sum_sq: ``‖f_i + f_j‖² = A + 2<f_i, f_j>``.
        n, n0: live and initial neuron counts of the group.
    """

    A: np.ndarray
    B: np.ndarray
    c_rem: np.ndarray
    norm_sum_sq: np.ndarray
    n: int
    n0: int


class EvictCandidate(NamedTuple):
    """A residual block that may be evicted.

    Attributes:
        n_layers: live neuron counts of the block's internal groups.
        c_layers: their live capacities.
        c_identity: ``Σ_c sqrt(γ_c² + β_c²)`` over the BN conditioning the block
            input (or the appendix F.3 fallback).
        c_branch: ``Σ_c sqrt(γ_c² + β_c²)`` over the branch's final BN: the RMS the
            branch adds to the stream.
        c_stream: ``Σ_c sqrt(μ_c² + σ_c²)`` of the block input under the propagated
            moments: the RMS of the stream the branch is added to (NaN: unknown).
    """

    n_layers: np.ndarray
    c_layers: np.ndarray
    c_identity: float
    c_branch: float
    c_stream: float = float("nan")


class RankInfo(NamedTuple):
    """What an action removes, for ranking (arrays broadcast with ``J``).

    Attributes:
        kind: ``"prune"``, ``"merge"`` or ``"evict"``.
        neurons: compressible neurons removed.
        p_init: the static parameter footprint ``P_init`` (docs/theory.md §3).
        params: parameters the slimmed model loses.
        flops: FLOPs per example the slimmed model loses.
        budget: what the run's budget counts: ``"density"``, ``"params"``,
            ``"flops"`` or ``"steps"``.
        readers: the number of layers that read the group's channels (a residual
            stream's: every block of its stage and the next stage's first; 1 for
            an eviction).
    """

    kind: str
    neurons: np.ndarray
    p_init: np.ndarray
    params: np.ndarray
    flops: np.ndarray
    budget: str
    readers: float = 1.0


class Cost:
    """How HOPE prices prunes, merges and evictions, and how it ranks them.

    Subclass it (or build one with `Cost.from_functions`) to try another cost;
    ``hope_keras.compress(model, cost=my_cost)`` and `hope_keras.costs.get` accept
    it. The four methods are pure array functions.

    Attributes:
        name: recorded in the trajectory's options.
        groups: which groups the cost can price: ``"all"`` (default),
            ``"no_streams"`` (every group but the residual streams, the channels
            that flow through an ``Add``) or ``"neurons"`` (only the paper's
            neuron layers, producer → BN → ReLU → consumers). Groups outside the
            scope are left whole and do not count towards ``density``.

    Example:

    >>> import numpy as np
    >>> from hope_keras import costs
    >>> c = costs.get("hope")
    >>> float(c.prune(costs.PruneCandidates(np.array([1.0]), 4.0, 3, 3))[0])
    0.3333333333333333
    >>> costs.get("paper").name
    'paper'
    """

    name = "custom"
    groups = "all"
    #: How an executed merge scales its parent: ``"sum"`` (capacity ``B``: the
    #: pair's summed output) or ``"paper"`` (the paper's α*). ``J`` always uses α*.
    merge_scale = "sum"
    #: The cross-kernel of the caches: ``"approx"`` (zero-bias) or ``"exact"``.
    kernel = "approx"
    #: Whether a prune moves the pruned neuron's mean output into its consumers'
    #: biases (under the BN surrogate).
    mean_compensation = False

    def prune(self, c: PruneCandidates) -> np.ndarray:
        """``J`` of each prune candidate."""
        raise NotImplementedError

    def merge(self, c: MergeCandidates) -> np.ndarray:
        """``J`` of each merge candidate."""
        raise NotImplementedError

    def evict(self, c: EvictCandidate) -> float:
        """``J`` of evicting the block."""
        raise NotImplementedError

    def rank(self, J: np.ndarray, info: RankInfo) -> np.ndarray:
        """The key the engine minimises (``DR``) for actions of cost ``J``."""
        raise NotImplementedError

    def _set_options(self, merge_scale=None, kernel=None, mean_compensation=None) -> None:
        """Validates and sets the settings every built-in cost takes; ``None`` keeps
        the class's (so a subclass may declare them as class attributes)."""
        cls = type(self)
        merge_scale = cls.merge_scale if merge_scale is None else merge_scale
        kernel = cls.kernel if kernel is None else kernel
        if mean_compensation is None:
            mean_compensation = cls.mean_compensation
        if merge_scale not in MERGE_SCALES:
            raise ValueError(f"merge_scale must be one of {MERGE_SCALES}. "
                             f"Received: merge_scale={merge_scale!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}. Received: kernel={kernel!r}")
        if not isinstance(mean_compensation, (bool, np.bool_)):
            raise ValueError(f"mean_compensation must be True or False. "
                             f"Received: mean_compensation={mean_compensation!r}")
        self.merge_scale, self.kernel = merge_scale, kernel
        self.mean_compensation = bool(mean_compensation)

    def options(self) -> dict:
        """The settings that act outside the four price functions (recorded in a
        trajectory's options): ``merge_scale``, ``kernel``, ``mean_compensation``."""
        return {"merge_scale": self.merge_scale, "kernel": self.kernel,
                "mean_compensation": bool(self.mean_compensation)}

    def get_config(self) -> dict:
        return {"name": self.name}

    def __repr__(self) -> str:
        extra = {k: v for k, v in self.get_config().items()
                 if k != "name" and v != _DEFAULTS.get(k, v)}
        return f"<Cost {self.name!r}" + "".join(f" {k}={v!r}" for k, v in extra.items()) + ">"

    @classmethod
    def from_functions(cls, name, prune, merge, evict, rank) -> "Cost":
        """A cost from four functions with the signatures of the methods.

        Example:

        >>> import numpy as np
        >>> from hope_keras import costs
        >>> hope = costs.get("hope")
        >>> per_param = costs.Cost.from_functions(
        ...     "per_param", hope.prune, hope.merge, hope.evict,
        ...     lambda J, info: J / info.p_init)
        >>> per_param.name
        'per_param'
        """
        obj = cls()
        obj.name = name
        obj.prune, obj.merge, obj.evict, obj.rank = prune, merge, evict, rank
        return obj


class PaperCost(Cost):
    """The paper's cost (docs/theory.md §3): ``DR = J / P_init``.

    ``J_prune = n‖f_i‖/(C − ‖f_i‖)``, ``J_merge = n·sqrt(2α*² − 2α*B + A)/(C_rem + α*)``,
    ``J_evict = Σ_l n_l C_l / C_identity``; every action is ranked by its distortion
    per parameter of the static footprint ``P_init``, whatever the budget. Only the
    paper's neuron layers are priced (``groups = "neurons"``): residual streams and
    the other coupled groups are outside the paper.
    """

    name = "paper"
    groups = "neurons"

    def __init__(self, merge_scale: Optional[str] = None, kernel: Optional[str] = None,
                 mean_compensation: Optional[bool] = None):
        self._set_options(merge_scale, kernel, mean_compensation)

    def prune(self, c):
        return j_prune(c.capacity, c.C, c.n)

    def merge(self, c):
        return j_merge(c.A, c.B, c.c_rem, c.n)

    def evict(self, c):
        return float(j_evict(c.n_layers, c.c_layers, c.c_identity))

    def rank(self, J, info):
        return J / info.p_init

    def get_config(self) -> dict:
        return {"name": self.name, **self.options()}


class HopeCost(Cost):
    """The library's default: a width-free cost, ranked per unit of the budget.

    * prune: ``J = ‖f_i‖/(C − ‖f_i‖)``, the relative capacity the layer loses
      (emptying a layer from ``n0`` to ``n`` neurons costs about ``log(n0/n)``);
    * merge: the residual of the parent the engine builds with the default
      ``merge_scale="sum"`` (capacity ``B``), relative to what the layer keeps:
      ``J = sqrt(max(‖f_i + f_j‖² − B², 0)) / (C_rem + B)`` (the sum-consistent
      cost, without ``n``). It is never much above the cost of pruning the weaker
      neuron, since a merge is that prune with the best compensation the other
      neuron can give. (The paper's ``J_merge`` prices the α*-scaled parent that
      ``merge_scale="paper"`` builds.)
    * evict: ``J = C_branch / C_stream``, the relative RMS the stream loses
      (``C_stream``: the summed RMS of the block input under the propagated
      moments, which grows along a stage as branches add to it; the paper's
      ``C_identity``, one BN's, where the moments do not reach the block input);
    * rank: ``J`` times the number of layers ``R`` that read the group's
      channels, per neuron removed (an eviction removes every live neuron of its
      block, ``R = 1``) under a density or a params budget; under a FLOPs budget
      per geometric mean of the neurons ``k`` and the FLOPs ``S`` the action
      removes, ``R·J / sqrt(k·S)``. ``J`` is the relative capacity the group's
      readers lose together (their capacities pooled); removing a channel takes
      that share from each of them, so the loss counts once per reader: a
      residual stream's channel, read by every block of its stage, costs ``R``
      (3–7 on ResNet-50) times a layer's channel of the same share; a layer with
      one consumer is unchanged. Per neuron, a FLOPs budget is bought without
      looking at what it counts (FLOPs per neuron differ ~100× between an early
      convolution and a Dense layer); per FLOP (``J / S``), the layers with the
      costliest neurons are thinned until they break. See docs/theory.md for the
      derivation and docs/quality.md for the measurements behind the choice;
    * scope: every group (``groups="all"``), the residual streams included.
      ``HopeCost(groups="no_streams")`` leaves the streams whole (the default
      before every reader was counted; docs/quality.md, "Every layer that reads a group counts").

    Args:
        groups: The scope, see `Cost` (``"all"``, ``"no_streams"``, ``"neurons"``).
            Each argument left at None keeps the class's setting (``"all"``,
            ``"sum"``, ``"approx"``, False here; a subclass may declare its own).
        merge_scale: How an executed merge scales its parent: ``"sum"`` (default,
            capacity ``B``: the pair's summed output is kept) or ``"paper"`` (the
            paper's α*). Measured on the quality benchmark, ``"paper"`` loses up to
            31 points (docs/hope.md, "Merge scale").
        kernel: The cross-kernel ``K(i, j)`` of the caches: ``"approx"`` (default,
            the zero-bias approximation) or ``"exact"`` (docs/theory.md).
        mean_compensation: Move each pruned neuron's mean output (under the BN
            surrogate) into its consumers' biases (default False: measured without
            gain on the default run, docs/hope.md).

    Example:

    >>> from hope_keras import costs
    >>> costs.get("hope").groups, costs.HopeCost(groups="no_streams").groups
    ('all', 'no_streams')
    >>> costs.HopeCost(merge_scale="paper")
    <Cost 'hope' merge_scale='paper'>
    """

    name = "hope"

    def __init__(self, groups: Optional[str] = None, merge_scale: Optional[str] = None,
                 kernel: Optional[str] = None, mean_compensation: Optional[bool] = None):
        # None keeps the class's setting: a subclass may declare `groups = ...`.
        groups = type(self).groups if groups is None else groups
        if groups not in SCOPES:
            raise ValueError(f"groups must be one of {SCOPES}. Received: groups={groups!r}")
        self.groups = groups
        self._set_options(merge_scale, kernel, mean_compensation)

    def prune(self, c):
        return j_prune(c.capacity, c.C, 1.0)

    def merge(self, c):
        return j_merge_residual(c.norm_sum_sq, c.B, c.c_rem, 1.0)

    def evict(self, c):
        stream = float(c.c_stream)
        if not (np.isfinite(stream) and stream > 0):
            stream = float(c.c_identity)
        return float(c.c_branch / max(stream, FLOOR))

    def rank(self, J, info):
        k = np.maximum(info.neurons, 1)
        J = J * info.readers
        if info.budget == "flops":
            return J / np.sqrt(k * np.maximum(info.flops, 1.0))
        return J / k

    def get_config(self) -> dict:
        return {"name": self.name, "groups": self.groups, **self.options()}


_COSTS = {"paper": PaperCost, "hope": HopeCost}
SCOPES = ("all", "no_streams", "neurons")
MERGE_SCALES = ("sum", "paper")
KERNELS = ("approx", "exact")
_DEFAULTS = {"groups": "all", "merge_scale": "sum", "kernel": "approx",
             "mean_compensation": False}


def in_scope(scope: str, group) -> bool:
    """Whether a `NeuronGroup` is inside a cost's ``groups`` scope."""
    if scope == "all":
        return True
    if scope == "no_streams":
        return not group.stream
    if scope == "neurons":
        return group.kind == "neurons"
    raise ValueError(f"A cost's groups must be one of {SCOPES}. Received: {scope!r}")


def rank_reads_sizes(cost: Cost, budget: str) -> bool:
    """Whether ``cost.rank`` reads what an action saves (`RankInfo`'s ``params`` and
    ``flops``, which change as the run narrows neighbouring layers): the default's
    under a FLOPs budget, never the paper's, and any other cost's (it may)."""
    if type(cost) is PaperCost:
        return False
    if type(cost) is HopeCost:
        return budget == "flops"
    return True


def get(identifier) -> Cost:
    """Resolves a cost, Keras-style: a name (``"hope"``, ``"paper"``), a config dict
    (`Cost.get_config`'s, as a trajectory records it) or a `Cost`.

    Example:

    >>> from hope_keras import costs
    >>> costs.get("paper"), costs.get(costs.get("hope"))
    (<Cost 'paper'>, <Cost 'hope'>)
    >>> costs.get({"name": "hope", "kernel": "exact"})
    <Cost 'hope' kernel='exact'>
    """
    if isinstance(identifier, Cost):
        return identifier
    if isinstance(identifier, str) and identifier in _COSTS:
        return _COSTS[identifier]()
    if isinstance(identifier, dict) and identifier.get("name") in _COSTS:
        config = {k: v for k, v in identifier.items() if k != "name"}
        try:
            return _COSTS[identifier["name"]](**config)
        except TypeError as e:
            raise ValueError(f"Cannot build cost {identifier['name']!r} from {identifier!r}: "
                             f"{e}") from None
    raise ValueError(
        f"Unknown cost. Expected one of {sorted(_COSTS)} or a hope_keras.costs.Cost "
        f"instance. Received: cost={identifier!r}"
    )
