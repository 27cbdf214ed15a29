"""DEFT planning: core/slack partition, merges, elasticities and masks (docs/theory.md §9).

`plan` runs the HOPE encoder on a copy of the model until no action is admissible,
reads every neuron's ``J_prune`` from the trajectory, derives the locking threshold
``τ_lock`` (eqs. 25–26), chooses the merges to replay, and computes the elasticity of
every neuron (eq. 27) and the structural masks (eq. 28). `DeftPlan.apply` replays the
chosen merges on the real model and applies the masks.

Decisions (the paper leaves them open; see docs/deft.md):

* Merges replayed: the trajectory's merges with ``J_merge < τ_lock``, in trajectory
  order; a merge is skipped as well when one of its slots holds, in the trajectory,
  the parent of a merge that was skipped (its coefficients would refer to a neuron the
  real model does not have).
* Freed vessels get fresh weights (``reinit_vessels=True``): random input filter,
  BN ``γ = 1, β = 0``, zero output rows. A zeroed vessel (γ = β = 0, u = 0) has an
  exactly zero gradient and could never learn; zero output rows keep the function
  unchanged at the start of fine-tuning.
* Masks use each kernel input's *drift*: a channel drifts when any elastic parameter
  can change its value on source inputs (BN statistics restored). For a neuron → neuron
  connection that is the upstream elasticity of eq. 28; through an ``Add`` it is the
  channel-wise maximum of both inputs, so a core neuron never reads a residual-stream
  channel that carries slack signal. Layers the walker does not understand are
  treated conservatively (any drifting input makes every output channel drift).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import numbers
import os
import warnings
from typing import Dict, List, Optional, Tuple

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.scoring import costs
from hope_keras.graph import walker as graph_lib
from hope_keras.graph import layers as layer_rules
from hope_keras.deft.application import (  # noqa: F401 - COMPENSATIONS, apply_plan: given here
    COMPENSATIONS, apply_plan, as_vector, check_compensate, elasticities_and_drift,
    variable_elasticities)
from hope_keras.edit.editor import defer_keyboard_interrupt
from hope_keras.graph.fingerprint import fingerprint
from hope_keras.search.trajectory import Step
from hope_keras.search.encoder import Encoder

FORMAT = "hope_keras.deft_plan"
VERSION = 1
THRESHOLDS = ("global", "layer")


# ----------------------------------------------------------------------------- τ_lock
def lock_threshold(j_prune, c_rem, percentile: float, eps: float = 1e-6):
    """The locking threshold of eqs. 25–26.

    ``C = {J_prune(i) : C_rem(i) > ε}``; ``τ_p = percentile(C, p)``, ``τ_sup = max(C)``;
    ``τ_lock = τ_p`` if ``τ_p ≥ ε``, else ``τ_sup`` if ``τ_sup ≥ ε``, else 1. An empty
    ``C`` (nothing pruned with a live remainder) also gives 1.

    Args:
        j_prune: Prune costs of the pruned neurons (any shape).
        c_rem: The layer's remaining capacity after each prune (same shape).
        percentile: ``p`` in [0, 100] (numpy's linear interpolation).
        eps: ``ε`` of eqs. 25–26.

    Returns:
        ``(tau_lock, tau_p, tau_sup, size)``; ``tau_p``/``tau_sup`` are NaN when ``C``
        is empty; ``size`` is ``|C|``.

    Example:

    >>> lock_threshold([0.5, 1.0, 2.0, 9.0], [1.0, 1.0, 1.0, 0.0], 50)[:2]
    (1.0, 1.0)
    >>> lock_threshold([1e-9, 2e-9], [1.0, 1.0], 50)[0]   # τ_p, τ_sup < ε → 1
    1.0
    """
    if isinstance(percentile, (bool, str)) or not isinstance(percentile, numbers.Real) \
            or not 0.0 <= float(percentile) <= 100.0:
        raise ValueError(f"percentile must be a number in [0, 100]. Received: "
                         f"percentile={percentile!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0. Received: eps={eps}")
    j = np.asarray(j_prune, dtype=np.float64).ravel()
    c = np.asarray(c_rem, dtype=np.float64).ravel()
    if j.shape != c.shape:
        raise ValueError(f"j_prune and c_rem differ in size: {j.shape} vs {c.shape}")
    keep = np.isfinite(j) & (c > eps)
    costs = j[keep]
    if costs.size == 0:
        return 1.0, math.nan, math.nan, 0
    tau_p = float(np.percentile(costs, percentile))
    tau_sup = float(costs.max())
    if tau_p >= eps:
        tau = tau_p
    elif tau_sup >= eps:
        tau = tau_sup
    else:
        tau = 1.0
    return tau, tau_p, tau_sup, int(costs.size)


# ------------------------------------------------------------------------------ head
def find_head(model) -> str:
    """Name of the classification head: the Dense layer that produces the output.

    Walks back from the (single) model output through weightless layers (softmax
    ``Activation``, ``Dropout``, …) to the first ``Dense``.

    Raises:
        ValueError: for several outputs, or when no Dense layer produces the output.
    """
    fg = kg.flatten(model)
    if len(fg.outputs) != 1:
        raise ValueError(
            f"Model '{model.name}' has {len(fg.outputs)} outputs; pass head=<layer name> "
            "explicitly."
        )
    node = fg.producer_node(fg.outputs[0])
    seen = []
    while node is not None and layer_rules.get(node.op).kind != "dense":
        seen.append(node.key)
        if getattr(node.op, "weights", None) or len(node.inputs) != 1:
            break
        node = fg.producer_node(node.inputs[0])
    if node is None or layer_rules.get(node.op).kind != "dense":
        what = (f" '{node.key}' is a {type(node.op).__name__}, not a Dense layer (a "
                "MobileNetV3 ends in a 1 × 1 Conv2D): build the model without its top "
                "(include_top=False) and add a Dense head on pooled features."
                if node is not None and getattr(node.op, "weights", None) else
                " Pass head=<the name of a Dense layer>.")
        raise ValueError(
            f"No Dense head found behind the output of model '{model.name}' (walked "
            f"back through {seen}).{what} DEFT grafts and replaces Dense heads only."
        )
    return node.key


def feature_layer_of(model, head: str) -> str:
    """Name of the layer whose output feeds `head`."""
    fg = kg.flatten(model)
    if head not in fg.layers:
        raise ValueError(f"Model '{model.name}' has no layer named '{head}'.")
    node = fg.node_of(head)
    if len(node.inputs) != 1:
        raise ValueError(f"Head '{head}' has {len(node.inputs)} inputs; expected 1.")
    # The head produces a model output, through weightless layers only (softmax…).
    frontier, reached = [node], False
    while frontier and not reached:
        n = frontier.pop()
        reached = any(fg.is_output(t) for t in n.outputs)
        frontier += [c for c in fg.children(n) if not getattr(c.op, "weights", None)]
    if not reached:
        raise ValueError(
            f"Layer '{head}' is not a head of model '{model.name}': its output reaches "
            "no model output without passing other layers with weights. Pass the "
            "layer that produces the output (head=None finds it for one output).")
    parent = fg.producer_node(node.inputs[0])
    return parent.key if parent is not None else "input"


def _get_layer(model, name):
    layers = kg.flatten(model).layers
    if name not in layers:
        raise ValueError(f"Model '{model.name}' has no layer named '{name}'.")
    return layers[name]


# ------------------------------------------------------------------------------ plan
@dataclasses.dataclass
class DeftPlan:
    """What DEFT will do to a model; inspect it, save it, `apply` it.

    Attributes:
        percentile: ``p`` of eq. 26.
        eps: ``ε`` of eqs. 25–26.
        tau_lock, tau_p, tau_sup: The thresholds of eq. 26 (``tau_p``/``tau_sup`` NaN
            when no cost qualified).
        num_costs: ``|C|`` of eq. 25.
        head: The classification head (elastic; replaced for the target task).
        feature_layer: The layer whose output feeds the head.
        groups: ``{group: size}`` of the compressible neuron groups.
        j_prune, c_rem: Per group, each neuron's ``J_prune`` and the ``C_rem`` after
            its prune (``inf``/NaN for neurons the encoder never pruned).
        merges: The trajectory merges to replay (`hope_keras.Step`).
        vessels: Per group, the slots freed by the replayed merges.
        elasticity: Per group, ``e_i`` of eq. 27 (float32 0/1).
        layer_elasticity: Per layer with weights, the elasticity of its output
            channels (the gradient multiplier of eq. 29): a float or an array over
            the last axis.
        input_drift: Per kernel layer, whether each input channel (Dense: each kernel
            row) can drift; the mask of eq. 28 zeroes ``drift_in > 0`` × ``e_out = 0``.
        fingerprint: Fingerprint of the source weights the plan was made from.
        options: Encoder options and plan settings (``threshold``, ``compensate``).
        trajectory: The full encoder `Trajectory` (in memory only; not saved).
        tau_groups: Per group, the threshold its neurons were compared with
            (``tau_lock`` everywhere for ``threshold="global"``).
        variable_elasticity: ``{"layer/variable": elasticity}`` where a layer's
            channels are not on a variable's last axis: a depthwise kernel's
            ``(C, 1)``, a separable convolution's depthwise kernel (one value).
    """

    percentile: float
    eps: float
    tau_lock: float
    tau_p: float
    tau_sup: float
    num_costs: int
    head: str
    feature_layer: str
    groups: Dict[str, int]
    j_prune: Dict[str, np.ndarray]
    c_rem: Dict[str, np.ndarray]
    merges: List[Step]
    vessels: Dict[str, List[int]]
    elasticity: Dict[str, np.ndarray]
    layer_elasticity: Dict[str, object]
    input_drift: Dict[str, np.ndarray]
    fingerprint: str
    options: dict
    trajectory: object = None
    tau_groups: Optional[Dict[str, float]] = None
    variable_elasticity: Dict[str, object] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:  # one line: the per-neuron arrays are in `summary`
        neurons = sum(self.groups.values())
        slack = int(sum(np.count_nonzero(e) for e in self.elasticity.values()))
        return (f"DeftPlan(head={self.head!r}, feature_layer={self.feature_layer!r}, "
                f"groups={len(self.groups)}, neurons={neurons}, slack={slack}, "
                f"merges={len(self.merges)}, percentile={self.percentile:g}, "
                f"tau_lock={self.tau_lock:.6g})")

    def __post_init__(self):
        if self.tau_groups is None:
            self.tau_groups = {g: float(self.tau_lock) for g in self.groups}

    # --------------------------------------------------------------- inspection
    def counts(self) -> Dict[str, Tuple[int, int, int]]:
        """``{group: (core, slack, vessels)}``; slack excludes the vessels."""
        out = {}
        for g, e in self.elasticity.items():
            v = len(self.vessels.get(g, []))
            elastic = int(np.count_nonzero(e > 0))
            out[g] = (int(e.size - elastic), elastic - v, v)
        return out

    @property
    def head_input_drift(self) -> np.ndarray:
        """Drift of the head's input features (the source-head graft mask)."""
        return self.input_drift[self.head]

    def elastic_fraction(self) -> float:
        """Fraction of compressible neurons that are elastic."""
        total = sum(e.size for e in self.elasticity.values())
        return float(sum(np.count_nonzero(e > 0) for e in self.elasticity.values())
                     / max(total, 1))

    def mask(self, layer: str, kernel_shape, expand: int = 1,
             out_axis: int = -1) -> Optional[np.ndarray]:
        """The structural mask (eq. 28) of a kernel layer, broadcastable to its kernel,
        or None when it masks nothing. ``expand``: kernel rows per input channel (a
        separable convolution's pointwise kernel: its depth multiplier). ``out_axis``:
        the kernel axis of the outputs, −1, or −2 for a transposed convolution
        (``(*spatial, outputs, inputs)``)."""
        if layer not in self.input_drift:
            return None
        if out_axis not in (-1, -2):
            raise ValueError(f"out_axis must be -1 or -2. Received: out_axis={out_axis!r}")
        d_in = np.repeat(np.asarray(self.input_drift[layer]) > 0, expand)
        e_out = as_vector(self.layer_elasticity.get(layer, 1.0), kernel_shape[out_axis])
        cut = np.outer(d_in, e_out == 0) if out_axis == -1 else np.outer(e_out == 0, d_in)
        if not cut.any():
            return None
        m = (~cut).astype(np.float32)
        return m.reshape((1,) * (len(kernel_shape) - 2) + m.shape)

    def elasticity_map(self) -> Dict[str, object]:
        """``{layer: elasticity}`` for `ElasticOptimizer` (JSON-friendly), and
        ``{"layer/variable": elasticity}`` for `variable_elasticity`."""
        out = {}
        for name, e in {**self.layer_elasticity, **self.variable_elasticity}.items():
            arr = np.asarray(e, dtype=np.float64)
            if arr.ndim == 0 or np.all(arr == arr.ravel()[0]):
                out[name] = float(arr.ravel()[0])
            else:
                out[name] = arr.tolist()
        return out

    def summary(self, print_fn=print) -> None:
        """Prints the per-group core/slack/vessel counts, each group's threshold and
        median ``J_prune``, the global thresholds and the source head's cut inputs."""
        out = io.StringIO()
        w = 28
        line = "─" * (w + 70)
        mode = self.options.get("threshold", "global")
        comp = self.options.get("compensate", "none")
        out.write(f"DEFT plan (percentile {self.percentile:g}, threshold {mode}, "
                  f"compensate {comp}, ε {self.eps:g})\n{line}\n")
        out.write(f"{'Group':<{w}}{'neurons':>9}{'core':>8}{'slack':>8}{'vessels':>9}"
                  f"{'merges':>8}{'τ':>12}{'median J':>12}\n{line}\n")
        merges_per = {}
        for s in self.merges:
            merges_per[s.unit] = merges_per.get(s.unit, 0) + 1
        tot = np.zeros(4, dtype=int)
        counts = self.counts()
        for g, size in self.groups.items():
            core, slack, ves = counts[g]
            j = self.j_prune[g][np.isfinite(self.j_prune[g])]
            med = f"{np.median(j):.4g}" if j.size else "-"
            out.write(f"{g:<{w}}{size:>9}{core:>8}{slack:>8}{ves:>9}"
                      f"{merges_per.get(g, 0):>8}{self.tau_groups[g]:>12.4g}{med:>12}\n")
            tot += (size, core, slack, ves)
        out.write(f"{line}\n{'Total':<{w}}{tot[0]:>9}{tot[1]:>8}{tot[2]:>8}{tot[3]:>9}"
                  f"{len(self.merges):>8}\n{line}\n")
        out.write(f"τ_lock = {self.tau_lock:.6g}  (τ_p = {self.tau_p:.6g}, τ_sup = "
                  f"{self.tau_sup:.6g}, |C| = {self.num_costs})\n")
        frozen = [n for n, e in self.layer_elasticity.items()
                  if n not in self.groups and n not in {self._bn_of(g) for g in self.groups}
                  and np.all(np.asarray(e) == 0)]
        cut = int(np.count_nonzero(np.asarray(self.head_input_drift) > 0))
        out.write(f"Head (elastic): {self.head}, {cut} of {len(self.head_input_drift)} "
                  f"inputs from slack (zeroed in the source graft); other frozen layers "
                  f"with weights: {len(frozen)}\n{line}")
        print_fn(out.getvalue())

    def _bn_of(self, group):
        return self.options.get("bn_of", {}).get(group)

    # --------------------------------------------------------------------- apply
    def apply(self, model, merges: bool = True, mask: bool = True,
              reinit_vessels: bool = True, seed: int = 0, check: bool = True,
              compensate: Optional[str] = None):
        """Replays the chosen merges and applies the structural masks, in place.

        Args:
            model: The source model the plan was made from (same weights).
            merges: Replay the chosen merges (and free their vessels).
            mask: Apply ``W ← M ⊙ W`` (eq. 28) to every kernel.
            reinit_vessels: Give the freed vessels fresh weights (see module doc).
            seed: Seed of the vessel initialisation.
            check: Refuse a model whose weights differ from the planned ones (for
                example a model the plan was already applied to).
            compensate: Shock reduction of the mask (``"none"``, ``"mean"``,
                ``"mean_var"``); default: the plan's (``plan(compensate=...)``). Pass
                the same value to `SourceRetention` when you override it here.

        Returns:
            The same model.
        """
        return apply_plan(model, self, merges=merges, mask=mask,
                          reinit_vessels=reinit_vessels, seed=seed, check=check,
                          compensate=compensate)

    # --------------------------------------------------------------------- files
    def save(self, path: str) -> None:
        """Writes the plan (``.npz`` of arrays plus JSON metadata; no pickles)."""
        meta = {
            "format": FORMAT, "version": VERSION,
            "percentile": self.percentile, "eps": self.eps, "tau_lock": self.tau_lock,
            "tau_p": _json_float(self.tau_p), "tau_sup": _json_float(self.tau_sup),
            "num_costs": self.num_costs, "head": self.head,
            "feature_layer": self.feature_layer, "groups": list(self.groups.items()),
            "vessels": self.vessels, "fingerprint": self.fingerprint,
            "options": self.options,
            "merges": [_step_to_json(s) for s in self.merges],
            "layer_elasticity_names": list(self.layer_elasticity),
            "variable_elasticity_names": list(self.variable_elasticity),
            "input_drift_names": list(self.input_drift),
            "tau_groups": {g: float(t) for g, t in self.tau_groups.items()},
        }
        arrays = {"meta": np.array(json.dumps(meta))}
        for k, g in enumerate(self.groups):
            arrays[f"j_{k}"] = self.j_prune[g]
            arrays[f"c_{k}"] = self.c_rem[g]
            arrays[f"e_{k}"] = self.elasticity[g]
        for k, n in enumerate(self.layer_elasticity):
            arrays[f"le_{k}"] = np.asarray(self.layer_elasticity[n], dtype=np.float32)
        for k, n in enumerate(self.variable_elasticity):
            arrays[f"ve_{k}"] = np.asarray(self.variable_elasticity[n], dtype=np.float32)
        for k, n in enumerate(self.input_drift):
            arrays[f"d_{k}"] = np.asarray(self.input_drift[n], dtype=np.float32)
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str) -> "DeftPlan":
        """Reads a plan written by `save`."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"No DEFT plan file at '{path}'.")
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            meta = json.loads(str(arrays["meta"]))
        except Exception as e:
            raise ValueError(f"'{path}' is not a readable DEFT plan file ({e}).") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(
                f"'{path}' is not a hope_keras DEFT plan (format {meta.get('format')!r}, "
                f"version {meta.get('version')!r}; expected {FORMAT!r} version {VERSION})."
            )
        try:
            plan = cls._from_saved(meta, arrays)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing entry {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"'{path}' is not a valid DEFT plan file: {what}. Save "
                             f"the plan again with DeftPlan.save.") from None
        try:
            plan.validate()
        except ValueError as e:
            raise ValueError(f"'{path}': {e}") from None
        return plan

    def validate(self) -> None:
        """Checks that the plan is consistent (what `load` and `apply` rely on):
        per group, vectors of its width and elasticities in [0, 1]; vessels and
        merges inside their groups. Raises ValueError naming the first problem."""
        for g, n in self.groups.items():
            for what, arrs in (("j_prune", self.j_prune), ("c_rem", self.c_rem),
                               ("elasticity", self.elasticity)):
                a = np.asarray(arrs.get(g))
                if a.shape != (n,):
                    raise ValueError(f"the plan's {what} of group {g!r} has shape "
                                     f"{a.shape}, not ({n},) as the group's width.")
            e = np.asarray(self.elasticity[g], dtype=np.float64)
            if not np.all((e >= 0.0) & (e <= 1.0)):
                raise ValueError(f"the plan's elasticities of group {g!r} are not all in "
                                 f"[0, 1] (min {np.nanmin(e)}, max {np.nanmax(e)}).")
        for g, slots in self.vessels.items():
            if g not in self.groups:
                raise ValueError(f"the plan's vessels name group {g!r}, which it does "
                                 f"not have (groups: {sorted(self.groups)}).")
            bad = [j for j in slots if not 0 <= j < self.groups[g]]
            if bad:
                raise ValueError(f"the plan's vessels of group {g!r} ({self.groups[g]} "
                                 f"neurons) hold slots out of range: {bad[:5]}.")
        for k, st in enumerate(self.merges):
            n = self.groups.get(st.unit)
            whole = all(isinstance(x, numbers.Integral) for x in (st.i, st.j))
            if st.kind != "merge" or n is None or not whole \
                    or not (0 <= st.i < n and 0 <= st.j < n):
                raise ValueError(f"the plan's merge {k} ({st.kind} {st.unit!r}, "
                                 f"{st.i}, {st.j}) is not a merge of two neurons of one "
                                 f"of its groups.")

    @classmethod
    def _from_saved(cls, meta, arrays) -> "DeftPlan":
        groups = {g: int(n) for g, n in meta["groups"]}
        le = {}
        for k, n in enumerate(meta["layer_elasticity_names"]):
            a = arrays[f"le_{k}"]
            le[n] = float(a) if a.ndim == 0 else a
        ve = {}
        for k, n in enumerate(meta.get("variable_elasticity_names", [])):
            a = arrays[f"ve_{k}"]
            ve[n] = float(a) if a.ndim == 0 else a
        return cls(
            percentile=meta["percentile"], eps=meta["eps"], tau_lock=meta["tau_lock"],
            tau_p=float(meta["tau_p"]), tau_sup=float(meta["tau_sup"]),
            num_costs=meta["num_costs"], head=meta["head"],
            feature_layer=meta["feature_layer"], groups=groups,
            j_prune={g: arrays[f"j_{k}"] for k, g in enumerate(groups)},
            c_rem={g: arrays[f"c_{k}"] for k, g in enumerate(groups)},
            merges=[_step_from_json(s) for s in meta["merges"]],
            vessels={g: [_whole(i, f"vessel of {g!r}") for i in v]
                     for g, v in meta["vessels"].items()},
            elasticity={g: arrays[f"e_{k}"] for k, g in enumerate(groups)},
            layer_elasticity=le,
            input_drift={n: arrays[f"d_{k}"]
                         for k, n in enumerate(meta["input_drift_names"])},
            fingerprint=meta["fingerprint"], options=meta["options"],
            tau_groups=meta.get("tau_groups"), variable_elasticity=ve,
        )


def _auto_cost(model) -> str:
    """``cost="auto"``: the paper's cost where it can price a group of `model` (a
    Conv/Dense → BN → ReLU neuron layer), else the width-free one."""
    paper = getattr(costs.get("paper"), "groups", "all")
    groups = graph_lib.walk(model).groups.values()
    return "paper" if any(costs.in_scope(paper, g) for g in groups) else "hope"


def _whole(x, what: str) -> int:
    """`x` as an int, if it is a whole number (a slot index read from a file)."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, float)) \
            or not math.isfinite(x) or x != int(x):
        raise ValueError(f"a {what} is not a whole number: {x!r}")
    return int(x)


def _json_float(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _step_to_json(s: Step) -> dict:
    d = dataclasses.asdict(s)
    d["coef"] = [float(c) for c in s.coef]
    return d


def _step_from_json(d: dict) -> Step:
    d = dict(d)
    d["coef"] = tuple(float(c) for c in d["coef"])
    return Step(**d)


# --------------------------------------------------------------------- the planner
def plan(model, percentile: float = 10.0, *, head: Optional[str] = None,
         actions=("prune", "merge"), eps: float = 1e-6,
         pinned_elasticity: float = 0.0, verbose="auto",
         cost="auto", threshold: str = "layer", compensate: str = "mean_var"
         ) -> DeftPlan:
    """Plans DEFT fine-tuning of a BN network (docs/theory.md §9).

    Runs the HOPE encoder on a copy of `model` until no action is admissible, reads
    each neuron's ``J_prune``, and derives ``τ_lock`` (eqs. 25–26), the merges to
    replay, the elasticities (eq. 27) and the structural masks (eq. 28). The model
    itself is not changed (one Keras cannot clone, a subclassed model without
    ``get_config``, is run on and its weights put back); call `DeftPlan.apply` for
    that.

    Args:
        model: A built Functional/Sequential model with Conv/Dense → BN → ReLU
            neurons and a Dense classification head.
        percentile: ``p`` of eq. 26, in [0, 100]; neurons with ``J_prune < τ_p``
            become elastic (roughly ``p`` % of the pruned neurons). Default 10 (the
            paper's grid is 20–60; on sources that were not trained to empty their
            slack, docs/deft.md measured 5–10 best).
        head: The classification head; found automatically for one-output models.
        actions: Encoder actions; ``("prune", "merge")`` by default (eviction gives
            no per-neuron ``J_prune``, so it is left out).
        eps: ``ε`` of eqs. 25–26.
        pinned_elasticity: Elasticity of kernels that are not neuron groups (pinned
            producers such as the last convolution of a residual branch) and of
            their BN; 0 = core (the paper's default), 1 = elastic.
        verbose: ``"auto"`` (default), True or False: the encoder's progress bar.
        cost: The encoder's cost (`hope_keras.costs.get`): ``"paper"`` (the
            paper's ``J_prune`` over its neuron layers, Conv/Dense → BN → ReLU;
            residual streams stay core) or ``"hope"`` (every group, residual streams
            included, width-free costs), or a `hope_keras.costs.Cost` (its
            ``merge_scale`` is the scale of the merges the plan replays). ``"auto"``
            (default): ``"paper"`` when the model has a neuron layer, else
            ``"hope"`` (MobileNets, EfficientNets, ConvNeXt: every group is then
            pruned only, so no merge makes its neurons vessels; docs/deft.md).
        threshold: ``"layer"`` (default: eq. 26's ``τ_p`` within each group, so
            about ``percentile`` % of every group becomes slack; `layer_threshold`)
            or ``"global"`` (the
            paper's eq. 26: one ``τ_lock`` over every group's costs; slack then
            gathers in the group with the lowest costs, often the Dense bottleneck
            that feeds the head).
        compensate: What `DeftPlan.apply` does about the signal the mask cuts from
            each core neuron (and `SourceRetention` about the grafted head's zeroed
            slack inputs): ``"mean"`` moves its data-free mean (weights × the
            surrogate's ``E[x]``) into the core neuron's bias or BN moving mean;
            ``"mean_var"`` (default) also shrinks the BN moving variance by the
            share of the variance that was cut; ``"none"`` cuts only (the paper).

    Returns:
        A `DeftPlan`.

    Example:

    >>> import keras
    >>> from hope_keras import deft
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16, use_bias=False)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    >>> p = deft.plan(model, percentile=50)
    >>> p.head, sum(sum(c) for c in p.counts().values())
    ('head', 16)
    """
    if pinned_elasticity not in (0, 1, 0.0, 1.0):
        raise ValueError(
            f"pinned_elasticity must be 0 or 1. Received: {pinned_elasticity}")
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}. Received: "
                         f"threshold={threshold!r}")
    check_compensate(compensate)
    head = head or find_head(model)
    head_layer = _get_layer(model, head)
    if layer_rules.get(head_layer).kind != "dense":
        raise ValueError(
            f"The head '{head}' must be a Dense layer. Received: "
            f"{type(head_layer).__name__}.")
    feature_layer = feature_layer_of(model, head)
    # Only the trajectory's costs are read: the copy's BN statistics do not matter.
    with _scratch_copy(model) as copy:
        cost = costs.get(_auto_cost(copy) if isinstance(cost, str) and cost == "auto"
                         else cost)
        encoder = Encoder(copy, cost=cost, actions=actions, correction=False,
                          verbose=verbose)
        encoder.run()
    traj = encoder.trajectory
    graph = encoder.analysis.graph
    scope = getattr(cost, "groups", "all")
    if scope != "all":  # the groups the cost priced (paper: its neuron layers)
        graph = graph.with_groups({k: v for k, v in graph.groups.items()
                                   if costs.in_scope(scope, v)}, blocks=())
    sizes = {g: grp.size for g, grp in graph.groups.items()}
    j_prune = {g: np.full(n, np.inf) for g, n in sizes.items()}
    c_rem = {g: np.full(n, np.nan) for g, n in sizes.items()}
    for (g, i), (J, c) in traj.prune_costs().items():
        j_prune[g][i], c_rem[g][i] = J, c
    all_j = np.concatenate([j_prune[g] for g in sizes]) if sizes else np.zeros(0)
    all_c = np.concatenate([c_rem[g] for g in sizes]) if sizes else np.zeros(0)
    tau, tau_p, tau_sup, size = lock_threshold(all_j, all_c, percentile, eps)
    if threshold == "layer":
        tau_groups = {g: layer_threshold(j_prune[g], c_rem[g], percentile, eps)
                      for g in sizes}
    else:
        tau_groups = {g: tau for g in sizes}

    merges, vessels = _choose_merges(model, graph, traj.steps, tau_groups)
    elasticity = {}
    flat = graph.flat if getattr(graph, "flat", None) is not None else kg.flatten(model)
    for g, n in sizes.items():
        e = (j_prune[g] < tau_groups[g]).astype(np.float32)
        if not vessels[g] and graph_lib.normalised_together(graph.groups[g], graph.layer):
            e[:] = 0.0  # a LayerNormalization reads it: one drifting channel moves all
        e[vessels[g]] = 1.0
        elasticity[g] = e
    layer_e, drift = elasticities_and_drift(model, graph, elasticity, head,
                                             float(pinned_elasticity))
    if any(e.any() for e in elasticity.values()) and not np.any(drift[head] > 0):
        # Slack that cannot reach the head learns nothing the target sees, and its
        # masks and merges only cost the source: the plan keeps every neuron core.
        warnings.warn(
            f"No slack channel of this plan reaches the head '{head}': every slack "
            "neuron feeds only core layers, which the masks would cut it from. The plan "
            "keeps every neuron core (no merge, no mask): fine-tuning moves the head "
            "alone, as head-only fine-tuning does. With the paper's cost the residual "
            "streams and concatenations stay core (ResNets, DenseNets, Inceptions); "
            "cost='hope', actions=('prune',) gives them slack of their own, at a larger "
            "cost to the source (docs/deft.md, 'Limits'). A stream a LayerNormalization "
            "reads (ConvNeXt) stays core.", stacklevel=2)
        merges, vessels = [], {g: [] for g in vessels}
        elasticity = {g: np.zeros_like(e) for g, e in elasticity.items()}
        layer_e, drift = elasticities_and_drift(model, graph, elasticity, head,
                                                 float(pinned_elasticity))
    return DeftPlan(
        percentile=float(percentile), eps=float(eps), tau_lock=tau, tau_p=tau_p,
        tau_sup=tau_sup, num_costs=size, head=head, feature_layer=feature_layer,
        groups=sizes, j_prune=j_prune, c_rem=c_rem, merges=merges, vessels=vessels,
        elasticity=elasticity, layer_elasticity=layer_e, input_drift=drift,
        fingerprint=fingerprint(model, _source_graph(model, graph)),
        options={"actions": list(actions), "merge_scale": cost.merge_scale,
                 "cost": cost.get_config(),
                 "pinned_elasticity": float(pinned_elasticity),
                 "threshold": threshold, "compensate": compensate,
                 "bn_of": {g: grp.bn for g, grp in graph.groups.items()},
                 "encoder_steps": len(traj)},
        trajectory=traj, tau_groups=tau_groups,
        variable_elasticity=variable_elasticities(flat, layer_e),
    )


@contextlib.contextmanager
def _scratch_copy(model):
    """A model with `model`'s weights for the encoder to edit: a clone, or, for a
    model Keras cannot clone (a subclassed model without ``get_config``), `model`
    itself, its weights put back when the block ends (after an error or a Ctrl-C
    too), so `plan` never changes the model either way."""
    try:
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
    except Exception:  # noqa: BLE001 - any clone failure: edit the model, then restore
        copy = None
    if copy is not None:
        yield copy
        return
    saved = model.get_weights()
    try:
        yield model
    finally:
        with defer_keyboard_interrupt():
            model.set_weights(saved)


def layer_threshold(j_prune, c_rem, percentile: float, eps: float = 1e-6) -> float:
    """One group's threshold for ``threshold="layer"``: eq. 26's ``τ_p`` over the
    group's costs, but ``ε`` where ``τ_p < ε`` or the group has no cost (eq. 26 falls
    back to ``τ_sup`` there, which would make every pruned neuron of the group slack;
    per group, that happens whenever more than ``percentile`` % of it is dead).

    Example:

    >>> from hope_keras.deft.plan import layer_threshold
    >>> layer_threshold([0.5, 1.0, 2.0, 4.0], [1.0] * 4, 50)
    1.5
    >>> layer_threshold([0.0, 0.0, 0.0, 4.0], [1.0] * 4, 50)  # dead neurons only
    1e-06
    """
    tau_p = lock_threshold(j_prune, c_rem, percentile, eps)[1]
    return float(tau_p) if np.isfinite(tau_p) and tau_p >= eps else float(eps)



def _source_graph(model, graph):
    """`graph`'s groups, read on `model` itself (the plan ran on a copy)."""
    g = graph_lib.walk(model)
    return g.with_groups({k: g.groups[k] for k in graph.groups if k in g.groups}, blocks=())


def _choose_merges(model, graph, steps, tau):
    """The merges to replay (J < τ of their group, clean slots) and the vessels they
    free."""
    vessels = {g: [] for g in graph.groups}
    dirty = {g: set() for g in graph.groups}
    chosen = []
    for s in steps:
        if s.kind != "merge":
            continue
        d = dirty[s.unit]
        if s.J < tau[s.unit] and s.i not in d and s.j not in d:
            chosen.append(s)
            vessels[s.unit].append(s.j)
            eps = float(graph.layer(graph.groups[s.unit].bn).epsilon)
            if not (s.coef[4] ** 2 >= eps):  # inactive parent: both slots freed
                vessels[s.unit].append(s.i)
        else:
            d.add(s.i)
    return chosen, {g: sorted(set(v)) for g, v in vessels.items()}
