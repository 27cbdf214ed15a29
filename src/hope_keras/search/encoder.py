"""The HOPE greedy encoder (docs/theory.md §3–§5).

Every step executes the admissible action with the lowest ranking key ``DR`` among
all prunes, merges and evictions (``DR = cost.rank(J, ...)``: ``J`` per neuron
removed for the default cost, ``J / P_init`` for the paper's), edits the model
(through `hope_keras.edit`), records the step (`hope_keras.search.trajectory`), then
refreshes only what changed: the touched group's best action and the eviction cost
of the block that holds it. A group's best merge comes from its bounded candidate
table (`hope_keras.search.candidates.MergeTable`: each neuron's ``k`` best partners, lazy
per-row bounds, exact for the built-in costs), so a step touches O(n) bounds and a
few rows rather than the n²/2 pairs; a merge recomputes the parent's row in O(n)
kernel work. Each group's and block's best action sits in a heap, so a step does not
grow with the number of layers.

The `Encoder` keeps the greedy loop and delegates: the merge tables and a group's best
action to `hope_keras.search`, the heap to `hope_keras.search.actions`, block evictions to
`hope_keras.search.evictions`, the live parameter and FLOPs counts to `hope_keras.search.sizes`,
the budgets to `hope_keras.search.budgets`, and the trajectory to `hope_keras.search.recording`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.scoring import costs
from hope_keras.search._threads import run_threads
from hope_keras.search.actions import Action, ActionQueue
from hope_keras.scoring.analysis import Analysis, analyze
from hope_keras.search.budgets import BUDGETS, Budget
from hope_keras.search.budgets import check_flops_countable, min_reachable
from hope_keras.scoring.cache import SketchCache, background_worker
from hope_keras.search.evictions import Evictions
from hope_keras.search.latency import LatencyBudget
from hope_keras.edit.editor import ModelEditor, ParentCoefficients, defer_keyboard_interrupt
from hope_keras.graph import layers as layer_rules
from hope_keras.progress import resolve_verbose
from hope_keras.search.recording import StepRecorder, new_trajectory
from hope_keras.search.rounding import WidthRounding
from hope_keras.search.merge_search import (MergeSearch, SearchOptions, GroupState, exact_source,
                               neighbor_map)
from hope_keras.search.sizes import SizeCounter, start_from_live_channels
from hope_keras.graph.fingerprint import fingerprint
from hope_keras.search.trajectory import Step, Trajectory
from hope_keras.stats.correction import StatisticsCorrection
from hope_keras.deploy.recover import recover
from hope_keras.deploy.profile import profile
from hope_keras.edit.slim import slim

ACTIONS = ("prune", "merge", "evict")

# Bytes of a sketched group's producer-kernel columns the editor keeps (`ModelEditor.
# cache_columns`): exact re-pricing reads the same neurons' weights step after step.
# 16 MB: 512 columns of an 8192 × 8192 float32 kernel, 4096 of a 1024 × 8192 one.
COLUMN_CACHE_BYTES = 16 << 20


@dataclasses.dataclass
class CompressionResult:
    """What `compress` returns.

    Attributes:
        trajectory: The executed steps (`hope_keras.Trajectory`).
        density: Reached neuron density (active / initial compressible neurons).
        params_ratio: Live parameters of the slimmed model / original parameters.
        flops_ratio: FLOPs per example of the slimmed model / original FLOPs.
        stopped: Why the run stopped: ``"budget"``, ``"no_action"`` or ``"steps"``
            (under a latency budget also ``"min_flops"``, `hope_keras.LatencyBudget`).
        analysis: The `Analysis` of the model before compression.
        model: The compressed model (edited in place).
        corrected: Names of the BatchNormalization layers whose statistics the run
            corrected after its steps.
        data: The ``data=`` given to `compress` (`recover` reuses it).
        latency_ratio: Under a latency budget, the last measured latency ratio of the
            slimmed model to the original (`hope_keras.LatencyBudget`); else None.
    """

    trajectory: Trajectory
    density: float
    params_ratio: float
    flops_ratio: float
    stopped: str
    analysis: Analysis
    model: Optional[keras.Model] = dataclasses.field(default=None, repr=False,
                                                     compare=False)
    corrected: list = dataclasses.field(default_factory=list, repr=False)
    data: object = dataclasses.field(default=None, repr=False, compare=False)
    latency_ratio: Optional[float] = None

    def __repr__(self) -> str:  # one line: the analysis' caches are not printed
        return (f"CompressionResult(model={self.trajectory.meta.get('model_name')!r}, "
                f"steps={len(self.trajectory)}, density={self.density:.4f}, "
                f"params_ratio={self.params_ratio:.4f}, flops_ratio={self.flops_ratio:.4f}, "
                + ("" if self.latency_ratio is None else
                   f"latency_ratio={self.latency_ratio:.4f}, ")
                + f"stopped={self.stopped!r})")

    @classmethod
    def of(cls, encoder, stopped: str, latency_ratio=None) -> "CompressionResult":
        """The result of `encoder`'s run, stopped for the reason `stopped`."""
        return cls(
            latency_ratio=latency_ratio,
            trajectory=encoder.trajectory,
            density=encoder.active / encoder.num_neurons,
            params_ratio=encoder.sizes.params_ratio,
            flops_ratio=encoder.sizes.flops_ratio,
            stopped=stopped,
            analysis=encoder.analysis,
            model=encoder.model,
            corrected=sorted(encoder.correction.last),
            data=encoder.correction.data,
        )

    def recover(self, teacher=None, data=None, **kwargs):
        """`hope_keras.recover` of the compressed model on the ``data`` given to
        `compress`: distillation from ``teacher``, without the BatchNormalization
        re-estimation before it (`compress` has just made it on the same data).
        Other ``data`` (e.g. after a data-free `compress`): re-estimated on it first,
        as `hope_keras.recover` does.

        Call it before `hope_keras.slim` (pruned channels stay exactly zero, so
        ``slim`` removes the same ones). Keyword arguments go to `hope_keras.recover`.

        Example:

        >>> import keras, numpy as np, hope_keras
        >>> inputs = keras.Input((8,))
        >>> h = keras.layers.Dense(16)(inputs)
        >>> h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        >>> teacher = keras.Model(inputs, keras.layers.Dense(3)(h))
        >>> model = keras.models.clone_model(teacher)
        >>> model.set_weights(teacher.get_weights())
        >>> x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
        >>> result = hope_keras.compress(model, density=0.5, data=x, verbose=False)
        >>> history = result.recover(teacher=teacher, epochs=1, verbose=0)
        >>> sorted(history.history)
        ['distillation_loss', 'loss']
        """
        if self.model is None or (data is None and self.data is None):
            raise ValueError("CompressionResult.recover needs data: this run had no data= "
                             "given to compress; pass result.recover(teacher=..., data=x).")
        if data is None:
            data = self.data
            kwargs.setdefault("reestimate", "after")
        return recover(self.model, data, teacher=teacher, **kwargs)

    def profile(self, **kwargs):
        """`hope_keras.profile` of ``slim(model)`` against the model as compressed.

        Computed on demand (``compress`` itself measures nothing). The reference is
        the in-place model: the original's layers and shapes, so the original's
        parameters, FLOPs and latency (dense kernels do not skip zeros). Keyword
        arguments go to `hope_keras.profile` (``latency=False``: counts only).
        """

        if self.model is None:
            raise ValueError("This CompressionResult holds no model to profile.")
        return profile(slim(self.model), reference=self.model, **kwargs)


def _check_finite_weights(model, flat=None) -> None:
    """Raises ValueError, naming the variables, when any float weight of `model` is
    NaN or infinite, or a BN's moving variance negative: its outputs are not finite,
    and an edit would only hide it. `flat`: the model's `FlatGraph`, if at hand."""
    bad = []
    for v in model.weights:
        if not np.issubdtype(np.dtype(keras.backend.standardize_dtype(v.dtype)),
                             np.floating):
            continue
        arr = kg.weight_view(v)  # no copy of a wide kernel
        # A float64 sum of float32 values cannot overflow: not finite iff NaN/Inf.
        if not np.isfinite(np.sum(arr, dtype=np.float64)):
            bad.append(f"{v.path} ({int(arr.size - np.count_nonzero(np.isfinite(arr)))} "
                       "NaN/Inf)")
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"Model '{model.name}' has NaN/Inf weights: {shown}. Its outputs are not "
            "finite; fix or re-train those weights first (or reload them from a "
            "checkpoint). Nothing was changed.")
    for layer in (flat or kg.flatten(model)).layers.values():
        if layer_rules.get(layer).normalization == "batch":
            var = np.asarray(layer.moving_variance.numpy(), dtype=np.float64)
            if np.any(var + float(layer.epsilon) <= 0):
                raise ValueError(
                    f"BatchNormalization '{layer.name}' has a negative moving variance "
                    f"(min {var.min():.4g}): its outputs are not finite. Re-estimate its "
                    "statistics (hope_keras.reestimate_batchnorm_statistics). Nothing "
                    "was changed.")


class CompressionInterrupted(KeyboardInterrupt):
    """`compress` was interrupted (Ctrl-C); nothing of the run is lost.

    The model holds exactly the steps of ``trajectory`` (the write-back into its
    variables is never cut short), so the run can be saved
    (``e.trajectory.save(path)``) or continued (``e.encoder.run(density=...)``).

    Attributes:
        trajectory: The steps executed before the interruption.
        encoder: The `Encoder` of the run.

    Example:

    >>> import hope_keras
    >>> issubclass(hope_keras.CompressionInterrupted, KeyboardInterrupt)
    True
    """

    def __init__(self, trajectory, encoder):
        super().__init__(
            f"compress was interrupted after {len(trajectory)} steps; the model holds "
            "exactly those steps. Save them with e.trajectory.save(path) or continue "
            "with e.encoder.run(...).")
        self.trajectory = trajectory
        self.encoder = encoder



class Encoder:
    """The receding-horizon greedy HOPE encoder over one model.

    Most users call `hope_keras.compress` (which is ``Encoder(...).run(...)`` with
    its arguments checked first); the encoder is exposed for custom loops:
    `next_action` returns the cheapest `Action`, `execute` applies it, and `run`
    executes actions until a budget is met, then corrects the BatchNormalization
    statistics the run left stale (`hope_keras.stats.correction.StatisticsCorrection`).
    A custom loop calls `correct_statistics` itself when it is done.

    Args:
        model: The Keras model to compress in place.
        cost: A `hope_keras.costs.Cost`, its name (``"hope"``, the default: the
            width-free cost of docs/theory.md; ``"paper"``: the paper's
            ``J / P_init``) or its config dict. The cost also carries the merge
            scale, the cross-kernel and mean compensation (`hope_keras.costs.HopeCost`).
        actions: Subset of ``("prune", "merge", "evict")``.
        analysis: Its `Analysis` (computed if omitted), made with the cost's kernel.
        search: `SearchOptions` (or a dict of its fields): how merges are searched,
            and ``round_to``, the multiple of channels each narrowed group ends at.
        data: Unlabeled inputs (array, ``tf.data.Dataset`` or iterable of batches;
            labels are ignored): the BatchNormalization statistics the run leaves
            stale are re-estimated on them, and nothing synthetic is made.
        correction: Without ``data``, how the statistics are corrected data-free:
            ``"auto"`` (default), ``"surrogate"``, True or False
            (`hope_keras.stats.correction`), or a `StatisticsCorrection`.
        verbose: ``"auto"`` (default: progress bars when standard output is a
            terminal or a notebook), True or False.

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> enc = hope_keras.Encoder(model, verbose=False)
    >>> action = enc.next_action()
    >>> step = enc.execute(action)
    >>> enc.active, enc.num_neurons
    (15, 16)
    >>> fresh = keras.models.clone_model(model)  # widths 16 → 12 → 8: multiples of 4
    >>> hope_keras.Encoder(fresh, search={"round_to": 4}, verbose=False).compress(density=0.6).density
    0.5
    """

    def __init__(self, model, *, cost="hope", actions=ACTIONS,
                 analysis: Optional[Analysis] = None, search=None, data=None,
                 correction="auto", verbose="auto"):
        actions = _checked_actions(actions)
        self.search = search = SearchOptions.get(search)
        self.rounding = WidthRounding(search.round_to)
        self.correction = _statistics_correction(correction, data, verbose)
        resolve_verbose(verbose)
        self.verbose = verbose
        self.cost = costs.get(cost)
        self.merges = MergeSearch(search, self.cost)
        self.model = model
        self.analysis = a = _own_analysis(model, analysis, self.cost, verbose)
        _check_finite_weights(model, a.graph.flat)
        # The trajectory's fingerprint is hashed on a thread while the tables fill
        # (hashlib releases the GIL; nothing edits the model before __init__ ends).
        hashed = background_worker().submit(fingerprint, model, a.graph)
        self.actions = set(actions)
        self.merge_scale, self.kernel = self.cost.merge_scale, self.cost.kernel
        self.refresh, self.budget = search.refresh, "density"
        self.graph = a.graph
        # The cost says which groups it can price (the paper's: its neuron layers).
        scope = getattr(self.cost, "groups", "all")
        self.groups = {name: GroupState(name, a.caches[name], a.states[name].p_init,
                                         self.graph.groups[name].num_readers, a.states[name].eps)
                       for name in a.caches
                       if costs.in_scope(scope, self.graph.groups[name])}
        self.evictions = Evictions(self.graph, self.groups, a.blocks, self.actions)
        self.blocks, self.block_reports = self.evictions.blocks, self.evictions.reports
        self.block_of, self.evicted = self.evictions.block_of, self.evictions.evicted
        if "merge" in self.actions:
            for gs in self.groups.values():
                gs.free_prunes = "prune" in self.actions
            self.merges.set_tables([gs for gs in self.groups.values() if gs.mergeable])
        self.num_neurons = int(sum(gs.size0 for gs in self.groups.values()))
        if self.num_neurons == 0:
            _no_group(model, a, self.cost)
        self.active = self.num_neurons
        self.sizes = SizeCounter(model, a)
        self.editor = ModelEditor(model, self.graph,
                                  mean_compensation=self.cost.mean_compensation,
                                  moments=a.moments)
        # Sketched groups read exact rows from the kernel's columns (editor-cached).
        self._exact_source = lambda name: exact_source(self.editor, self.graph.groups[name],
                                                       COLUMN_CACHE_BYTES)
        for name, gs in self.groups.items():
            if isinstance(gs.cache, SketchCache):  # exact entries for executed merges
                gs.cache.source = self._exact_source(name)
        self._neighbors = (neighbor_map(self.graph, self.groups)
                           if self.refresh == "neighbors" else {})
        self.queue = ActionQueue()
        self._stale = False  # interrupted inside a step's bookkeeping: cannot continue
        self.active -= start_from_live_channels(model, self.graph, self.groups, self.sizes,
                                                self.evictions)
        self._push_all()
        self.trajectory = new_trajectory(self, hashed.result())
        self._recorder = StepRecorder(self.trajectory, self.sizes, self.blocks)

    def set_budget(self, budget: str) -> None:
        """Re-ranks every action for another budget kind."""
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}. Received: budget={budget!r}")
        if budget == "flops":
            check_flops_countable(self.graph)  # before any edit
        if budget != self.budget:
            self.budget = budget
            self._push_all()

    def _push_all(self) -> None:
        self.queue.clear()
        for name in self.groups:
            self._push_group(name)
        for name in self.blocks:
            self._push_block(name)

    def _rank_info(self, kind, unit, neurons, p_init, group=None, sizes=None):
        """`costs.RankInfo` of actions on `unit`; what they save: `sizes`, else
        `group` losing a neuron, else block `unit`'s eviction."""
        if sizes is None:
            sizes = (self.sizes.marginal(group, 1) if group is not None
                     else self.sizes.savings(self.blocks[unit].branch_layers))
        dp, df = sizes
        readers = 1.0 if kind == "evict" else self.groups[unit].readers
        return costs.RankInfo(kind, np.asarray(neurons, dtype=np.float64),
                              np.asarray(p_init, dtype=np.float64),
                              np.asarray(float(dp)), np.asarray(float(df)), self.budget,
                              readers)

    def best_group_action(self, name: str) -> Optional[Action]:
        """The group's cheapest prune or merge under the run's cost, or None."""
        gs = self.groups[name]
        if gs.frozen or gs.n <= 1 or self.rounding.target(gs.n) is None:
            return None
        sizes = self.sizes.marginal(name, 1)
        return self.merges.best_action(gs, self.cost, self.actions, lambda kind, p_init: (
            self._rank_info(kind, name, 1, p_init, sizes=sizes)))

    def eviction_action(self, name: str) -> Action:
        """The eviction of block `name` as an `Action` (J and DR under the run's cost)."""
        return self.evictions.action(name, self.cost, lambda removed, p_init: (
            self._rank_info("evict", name, removed, p_init)))

    def _push_group(self, name: str) -> None:
        gs = self.groups[name]
        gs.version += 1
        best = self.best_group_action(name)
        if best is not None:
            self.queue.push_group(best, gs.version)

    def _push_block(self, name: str) -> None:
        if self.evictions.open(name):
            self.queue.push_block(self.eviction_action(name))

    def _valid(self, kind, name, version) -> bool:
        if kind == "g":
            return self.groups[name].version == version and not self.groups[name].frozen
        return name not in self.evicted

    def next_action(self, max_removed: Optional[int] = None) -> Optional[Action]:
        """The cheapest valid `Action` (evictions removing more than `max_removed`
        neurons are skipped), or None."""
        self._check_not_stale()
        if self.rounding.open is not None:  # a group's round goes on (`rounding`)
            action = self.best_group_action(self.rounding.open[0])
            if action is not None:
                return action
            self.rounding.open = None  # its block was evicted by a custom loop
        return self.queue.cheapest(self._valid, max_removed)

    def _check_not_stale(self) -> None:
        if self._stale:
            raise RuntimeError(
                "This encoder was interrupted while updating its tables after step "
                f"{len(self.trajectory)}: it cannot continue. The model and its trajectory "
                "agree: save the trajectory, or replay it on the original model and start "
                "a new run.")

    def execute(self, action: Action) -> Step:
        """Executes one action: edit the model, record, refresh the caches.

        If it fails (or is interrupted) after the step was recorded, the model and
        the trajectory hold the step but the tables may be half updated: the encoder
        then refuses to go on (`next_action`, `execute` and `run` raise)."""
        if not isinstance(action, Action):
            raise TypeError(f"execute takes an engine Action (see Encoder.next_action). "
                            f"Received: {action!r}")
        self._check_not_stale()
        self._start_correction()
        recorded, was_open = len(self.trajectory), self.rounding.open
        try:
            if action.kind != "evict":
                self.rounding.start(action.unit, self.groups[action.unit].n)
            step = self._execute(action)
            if action.kind != "evict":
                self.rounding.after(action.unit, self.groups[action.unit].n,
                                    self.trajectory)
            return step
        except BaseException:
            # Recorded, then interrupted: the tables may be half updated.
            self._stale = len(self.trajectory) > recorded
            if not self._stale:
                self.rounding.open = was_open
            raise

    def _execute(self, action: Action) -> Step:
        if action.kind == "evict":
            return self._evict(action)
        unit, i, j = action.unit, action.i, action.j
        gs = self.groups[unit]
        c_before = gs.C
        coef = (np.nan,) * 6
        if action.kind == "prune":
            c_after = max(gs.C - gs.cache.capacity[i], costs.FLOOR)
            active_after = self.active - 1
            with self.editor.step():
                self.editor.prune(unit, i)
                step = self._record(action, c_before, c_after, active_after, coef, [unit])
            gs.after_prune(i)
        else:
            eps = float(self.editor.layer(self.graph.groups[unit].bn).epsilon)
            coef, c_after, dead_parent = gs.merge_parent(i, j, self.merge_scale, eps)
            keep_one = dead_parent and gs.n == 2  # a group keeps one (`after_merge`)
            active_after = self.active - (2 if dead_parent and not keep_one else 1)
            with self.editor.step():
                self.editor.merge(unit, i, j, ParentCoefficients(*coef))
                step = self._record(action, c_before, c_after, active_after, coef, [unit])
            gs.after_merge(i, j, coef, dead_parent, keep_slot=keep_one)
        gs.C = step.c_after
        self._after_group_change(unit)
        return step

    def _record(self, action: Action, c_before, c_after, active_after, coef,
                changed_groups, evict=False):
        """Counts the step and appends it to the trajectory (`StepRecorder`)."""
        step = self._recorder.record(action, c_before, c_after, self.active, active_after,
                                     coef, changed_groups, evict)
        self.active = active_after
        return step

    def _evict(self, action: Action) -> Step:
        unit = action.unit
        b = self.blocks[unit]
        removed = self.evictions.live_neurons(unit)
        c_before = float(sum(self.groups[g].C for g in b.groups))
        with self.editor.step():
            self.editor.evict(unit)
            step = self._record(action, c_before, 0.0, self.active - removed,
                                (np.nan,) * 6, list(b.groups), evict=True)
        self.evictions.freeze(unit)
        layers = set(b.branch_layers).union(*(self.sizes.layers_of[g] for g in b.groups))
        _rerank_sharing(self, layers)
        return step

    def _after_group_change(self, name: str, neighbors: bool = True) -> None:
        self._push_group(name)
        if name in self.block_of:
            self._push_block(self.block_of[name])
        if neighbors:  # an executed action (not a rebuild): live sizes changed
            _rerank_sharing(self, self.sizes.layers_of[name], skip=name)
        for nb in self._neighbors.get(name, ()) if neighbors else ():
            self._rebuild(nb)

    def _rebuild(self, name: str) -> None:
        """refresh="neighbors": re-extract a group from the edited weights."""
        gs = self.groups[name]
        if gs.frozen:
            return
        gs.rebuild(self.editor.mirror_model(), self.graph.groups[name], self.kernel,
                   self._exact_source, self.analysis.moments)
        if gs.merges:
            self.merges.set_table(gs)
        self._after_group_change(name, neighbors=False)

    def compress(self, density=None, params=None, flops=None, steps=None,
                 latency=None) -> CompressionResult:
        """`run` to the first budget given, as `hope_keras.compress` does: budgets
        already met or out of reach are refused first (nothing changed), Ctrl-C raises
        `CompressionInterrupted`, and the result is a `CompressionResult`. ``latency``:
        a ratio or a `hope_keras.LatencyBudget` (`LatencyBudget.reach`), with ``steps``.

        Example:

        >>> import keras, hope_keras
        >>> inputs = keras.Input((8,))
        >>> x = keras.layers.Dense(16)(inputs)
        >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
        >>> enc = hope_keras.Encoder(model, search={"merge_search": "top_k"}, verbose=False)
        >>> enc.compress(density=0.5).density
        0.5
        """
        budget, timed = Budget.checked(density, params, flops, steps), LatencyBudget.get(latency)
        budget.check_for_compress(timed)
        self.check_budget(density=budget.density, params=budget.params, flops=budget.flops)
        try:
            stopped = (timed.reach(self, steps) if timed is not None else
                       self.run(density=budget.density, params=budget.params,
                                flops=budget.flops, steps=steps))
        except KeyboardInterrupt as e:
            raise CompressionInterrupted(self.trajectory, self) from e
        (timed if timed is not None else budget).warn_unmet(self, stopped)
        return CompressionResult.of(self, stopped, timed and timed.measured)

    def check_budget(self, density=None, params=None, flops=None) -> None:
        """Raises ValueError (nothing changed) when a budget is already met or out of
        reach of this encoder's actions and the pinned layers."""
        if flops is not None:  # whichever budget ranks the actions
            check_flops_countable(self.graph)
        Budget(density, params, flops).refuse_unreachable(
            self.active, self.num_neurons, self.sizes, self.actions, self.min_reachable,
            self.rounding.multiple)

    def min_reachable(self):
        """(min active neurons, min parameter ratio, min FLOPs ratio) reachable."""
        return min_reachable(self.groups, self.blocks, self.evicted, self.actions, self.sizes,
                             self.rounding.min_width)

    def correct_statistics(self) -> dict:
        """Corrects the BatchNormalization statistics after the steps so far (the
        encoder's `correction`); `run` calls it at its end. A later step or `run`
        first puts back what it wrote. Returns ``{BN name: (mean, variance)}``."""
        self._start_correction()
        return self._finish_correction()

    def _start_correction(self) -> None:
        """Before an edit: the correction reads the model (once), undoes its last."""
        self.correction.start(self.model, self.graph, self.analysis.moments)
        self.trajectory.meta["options"]["correct_statistics"] = False

    def _finish_correction(self) -> dict:
        """Corrects after the steps so far and records it (a replay does the same)."""
        written = self.correction.finish(self.trajectory.steps)
        self.trajectory.meta["options"]["correct_statistics"] = self.correction.name
        return written

    def run(self, density=None, params=None, flops=None, steps=None, verbose=None) -> str:
        """Runs until the first budget is met or no action is admissible, then
        corrects the BatchNormalization statistics (`correct_statistics`).

        The ranking follows the first budget given (density, then params, then
        flops). Returns why it stopped: ``"budget"``, ``"steps"`` or
        ``"no_action"``. If interrupted, the model's variables hold exactly the
        steps of `trajectory` (Ctrl-C takes effect between steps; the statistics of
        an interrupted run are not corrected), and `run` can be called again to
        continue. ``verbose``: progress bar, ``"auto"`` (when standard output is a
        terminal), True or False; None: the encoder's.
        """
        verbose = self.verbose if verbose is None else verbose
        budget = Budget.checked(density, params, flops, steps)
        if budget.flops is not None:
            check_flops_countable(self.graph)
        target_active = budget.target_active(self.num_neurons)
        self.set_budget(budget.kind(self.budget))
        self._check_not_stale()
        self._start_correction()
        bar, work_done = budget.progress_bar(self, target_active, verbose)

        def show():
            bar.update(work_done(), density=self.active / self.num_neurons,
                       params=self.sizes.params_ratio)

        reason = None
        try:
            # Ctrl-C takes effect between steps: held back for the whole loop (one
            # signal handler, not two per step) and raised before the next step.
            sketched = any(isinstance(gs.cache, SketchCache) and gs.merges
                           for gs in self.groups.values())
            with defer_keyboard_interrupt() as deliver_pending, run_threads(sketched):
                while True:
                    deliver_pending()
                    # Budgets are met between rounds only (`rounding`); steps always.
                    reason = (budget.reached(self.active, self.sizes, len(self.trajectory),
                                             target_active) if self.rounding.open is None
                              else budget.steps_reached(len(self.trajectory)))
                    if reason:
                        break
                    max_removed = ((self.active - target_active)
                                   if target_active is not None else None)
                    action = self.next_action(max_removed)
                    if action is None:
                        reason = "no_action"
                        break
                    self.execute(action)
                    show()
        finally:
            try:
                self.editor.commit()
            finally:
                show()
                bar.close()
        self._finish_correction()
        return reason


def _rerank_sharing(enc: Encoder, layers, skip=None) -> None:
    """Re-ranks `enc`'s groups (but `skip`) and open blocks whose savings count one of
    `layers`, layers whose live sizes an action just changed (a Dense layer's FLOPs per
    output channel fall with its live inputs), when its cost's ranking reads them
    (`costs.RankInfo`'s ``params``, ``flops``)."""
    if not layers or not costs.rank_reads_sizes(enc.cost, enc.budget):
        return
    for name, gs in enc.groups.items():
        if name != skip and not gs.frozen and not layers.isdisjoint(enc.sizes.layers_of[name]):
            enc._push_group(name)
    for name, b in enc.blocks.items():
        if enc.evictions.open(name) and not layers.isdisjoint(b.branch_layers):
            enc._push_block(name)


def compress(model, *, density: Optional[float] = None, params: Optional[float] = None,
             flops: Optional[float] = None, steps: Optional[int] = None, cost="hope",
             actions=ACTIONS, data=None, verbose="auto", latency=None) -> CompressionResult:
    """Compresses a Keras model in place with HOPE.

    The greedy encoder executes, one step at a time, the prune, merge or block
    eviction with the lowest distortion for what it saves, until the first budget
    given is met (or no action is admissible). Every step is
    recorded in the returned trajectory; `hope_keras.slim` then turns the edited
    model into a physically smaller one. The choice of steps is data-free (it reads
    the weights and the BatchNormalization statistics); after the run, the
    BatchNormalization statistics the steps left stale are corrected: on ``data``
    when given (a few forward passes), else data-free (docs/hope.md, "Statistics
    after compression"). ``compress`` is ``Encoder(model, cost=cost,
    actions=actions, data=data).run(...)`` with its arguments checked first: use
    `hope_keras.Encoder` for the search options and custom loops.

    Args:
        model: A built Functional or Sequential `keras.Model`, edited in place.
        density: Target neuron density: compressible neurons kept / compressible
            neurons at the start (``analyze(model).num_neurons``).
        params: Target ratio of live (slimmed) parameters to the original count.
        flops: Target ratio of the slimmed model's FLOPs per example to the original.
        steps: Maximum number of actions.
        cost: ``"hope"`` (default: the width-free cost, docs/theory.md),
            ``"paper"`` (the paper's ``J / P_init``), a `hope_keras.costs.Cost`
            such as ``HopeCost(merge_scale="paper")``, or a cost's config dict.
        actions: Any subset of ``("prune", "merge", "evict")``.
        data: Unlabeled inputs of the model (a numpy array; a list or dict of
            arrays for a model of several inputs; a ``tf.data.Dataset`` or an
            iterable of batches; ``(x, y)``: labels are ignored;
            `hope_keras.stats.inputs`). The
            BatchNormalization layers downstream of the edits are re-estimated on
            enough of them that each sees 1024 values per channel (a 7 × 7 map: 21
            inputs; at least 16; `hope_keras.stats.correction.DATA_VALUES_PER_CHANNEL`);
            nothing synthetic is made. None (default): the data-free
            correction, which makes synthetic inputs only when the run moved a
            residual stream (`hope_keras.stats.correction`).
        verbose: ``"auto"`` (default: progress bars and one line per long stage
            when standard output is a terminal or a notebook), True or False.
        latency: Target ratio of the slimmed model's *measured* latency to the
            original's, in (0, 1], or a `hope_keras.LatencyBudget` (batch size,
            repeats, another timer). The run steers a FLOPs budget by measurement:
            it runs to FLOPs ratio ``latency``, times ``slim(model)`` against the
            model (a compiled ``model(x)``, batch 1, interleaved medians), and while
            the ratio is above the target lowers the FLOPs target in proportion and
            continues the same run (docs/hope.md, "A latency budget"). Given alone
            (``steps`` may limit it).

    Returns:
        A `CompressionResult` (``trajectory``, ``density``, ``params_ratio``,
        ``flops_ratio``, ``stopped``, ``corrected``; ``latency_ratio`` under a
        latency budget).

    Raises:
        ValueError: on no budget, a budget already met or out of reach, or a model
            with no compressible group; the model is then left unchanged.
        CompressionInterrupted: on Ctrl-C (a `KeyboardInterrupt`): the model holds
            exactly the steps of the exception's ``trajectory``.

    Warns:
        UserWarning: when the run stops for want of an action before its budget
            (``stopped == "no_action"``; e.g. only evictions that would overshoot
            ``density`` are left), or above ``latency``, with what it reached.

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> result = hope_keras.compress(model, density=0.5, verbose=False)
    >>> result.density, len(result.trajectory)
    (0.5, 8)
    """
    budget, latency = Budget.checked(density, params, flops, steps), LatencyBudget.get(latency)
    budget.check_for_compress(latency)
    return Encoder(model, cost=cost, actions=actions, data=data, verbose=verbose).compress(
        density=budget.density, params=budget.params, flops=budget.flops, steps=steps,
        latency=latency)


def _check_analysis(analysis) -> None:
    if not isinstance(analysis, Analysis):
        raise TypeError(f"analysis must be a hope_keras.Analysis (hope_keras.analyze(model)). "
                        f"Received: {analysis!r} of type {type(analysis).__name__}")


def _own_analysis(model, analysis, cost, verbose) -> Analysis:
    """The run's `Analysis`: computed with the cost's kernel, or a copy of the
    caller's (checked to be of this model and that kernel) whose caches the run
    may mutate."""
    kernel = cost.kernel
    if analysis is None:
        return analyze(model, kernel=kernel, verbose=verbose)
    _check_analysis(analysis)
    analysis.check(model)  # of this model, and not stale
    if analysis.kernel != kernel:
        raise ValueError(
            f"The analysis was made with kernel={analysis.kernel!r} and the cost "
            f"{cost!r} uses kernel={kernel!r}: pass "
            f"hope_keras.analyze(model, kernel={kernel!r}) or no analysis.")
    return dataclasses.replace(
        analysis, caches={k: v.copy() for k, v in analysis.caches.items()})


def _checked_actions(actions) -> tuple:
    actions = tuple(actions) if not isinstance(actions, str) else (actions,)
    bad = [a for a in actions if a not in ACTIONS]
    if bad or not actions:
        raise ValueError(f"actions must be a non-empty subset of {ACTIONS}. "
                         f"Received: actions={actions}")
    return actions


def _statistics_correction(correction, data, verbose):
    """The run's `StatisticsCorrection`: the one given, or made from its mode."""
    if isinstance(correction, StatisticsCorrection):
        if data is not None:
            raise ValueError("Give data= or a StatisticsCorrection, not both.")
        return correction
    return StatisticsCorrection(correction, data=data, verbose=verbose)


def _no_group(model, analysis, cost) -> None:
    """Raises the ValueError of a model with no group the run can compress."""
    what = ("no compressible neuron group" if not analysis.groups else
            f"no neuron group the cost {cost.name!r} can price")
    raise ValueError(
        f"Model '{model.name}' has {what}. Pinned layers: "
        f"{analysis.pinned_summary() or 'none (no Dense/Conv layers)'}. "
        "See hope_keras.analyze(model).summary() for every reason.")
