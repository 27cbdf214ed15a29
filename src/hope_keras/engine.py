"""The HOPE greedy encoder (spec sections 3–5).

Every step executes the admissible action with the lowest distortion rate
``DR = J / P_init`` among all prunes, merges and evictions, edits the model
(through `hope_keras.edit`), records the step (`hope_keras.trajectory`), then
refreshes only what changed: the touched group's best action (O(n²) elementwise
over its pair table, with the merged parent's row recomputed in O(n) kernel work)
and the eviction cost of the block that holds it. Each group's and block's best
action sits in a heap, so a step does not grow with the number of layers.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
from typing import Dict, Iterable, Optional

import keras
import numpy as np

from hope_keras import costs
from hope_keras.analysis import Analysis, analyze
from hope_keras.cache import build_group_cache
from hope_keras.edit import ModelEditor, ParentCoefficients
from hope_keras.neurons import extract_group
from hope_keras.trajectory import Step, Trajectory, fingerprint

ACTIONS = ("prune", "merge", "evict")


@dataclasses.dataclass
class CompressionResult:
    """What `compress` returns.

    Attributes:
        trajectory: The executed steps (`hope_keras.Trajectory`).
        density: Reached neuron density (active / initial compressible neurons).
        params_ratio: Live parameters of the slimmed model / original parameters.
        stopped: Why the run stopped: ``"budget"``, ``"no_action"`` or ``"steps"``.
        analysis: The `Analysis` of the model before compression.
        model: The compressed model (edited in place).
    """

    trajectory: Trajectory
    density: float
    params_ratio: float
    stopped: str
    analysis: Analysis
    model: Optional[keras.Model] = dataclasses.field(default=None, repr=False,
                                                     compare=False)

    def profile(self, **kwargs):
        """`hope_keras.profile` of ``slim(model)`` against the model as compressed.

        Computed on demand (``compress`` itself measures nothing). The reference is
        the in-place model: the original's layers and shapes, so the original's
        parameters, FLOPs and latency (dense kernels do not skip zeros). Keyword
        arguments go to `hope_keras.profile` (``latency=False``: counts only).
        """
        from hope_keras.profile import profile
        from hope_keras.slim import slim

        if self.model is None:
            raise ValueError("This CompressionResult holds no model to profile.")
        return profile(slim(self.model), reference=self.model, **kwargs)


class _ParamCounter:
    """Live parameter count of the slimmed model, updated per touched layer."""

    def __init__(self, model, analysis: Analysis):
        g = analysis.graph
        self.total0 = int(model.count_params())
        self.live = dict.fromkeys(g.groups, 0)
        self.size0 = {name: grp.size for name, grp in g.groups.items()}
        self.in_group: Dict[str, str] = {}
        self.out_group: Dict[str, str] = {}
        self.info: Dict[str, tuple] = {}
        for name, grp in g.groups.items():
            self.live[name] = grp.size
            self.out_group[grp.producer] = name
            self.out_group[grp.bn] = name
            for c in grp.consumers:
                self.in_group[c.layer] = name
        layers = set(self.in_group) | set(self.out_group)
        for b in g.blocks:
            layers |= set(b.branch_layers)
        self.orig, self.now = {}, {}
        for name in layers:
            layer = model.get_layer(name)
            self.orig[name] = self.now[name] = int(layer.count_params())
            if hasattr(layer, "kernel"):
                kshape = tuple(layer.kernel.shape)
                bias = int(getattr(layer, "use_bias", False))
                self.info[name] = ("kernel", (int(np.prod(kshape[:-1])), kshape[-1]), bias)
            elif isinstance(layer, keras.layers.BatchNormalization):
                per = len(layer.weights)
                self.info[name] = ("bn", int(layer.moving_mean.shape[0]), per)
            else:
                self.info[name] = ("none", 0, 0)
        self.evicted: set = set()
        self.total = self.total0

    def _count(self, name: str) -> int:
        if name in self.evicted:
            return 0
        kind, shape, extra = self.info[name]
        if kind == "none":
            return 0
        if kind == "bn":
            g = self.out_group.get(name)
            return extra * (self.live[g] if g else shape)
        rows, out = shape
        if name in self.out_group:
            out = self.live[self.out_group[name]]
        if name in self.in_group:
            g = self.in_group[name]
            rows = rows // self.size0[g] * self.live[g]
        return rows * out + extra * out

    def update(self, names: Iterable[str]) -> None:
        for name in names:
            new = self._count(name)
            self.total += new - self.now[name]
            self.now[name] = new

    @property
    def ratio(self) -> float:
        return self.total / self.total0


class _GroupState:
    """A group's live state during a run: active set, n, C_rem, pair mask."""

    def __init__(self, name, cache, p_init):
        self.name = name
        self.cache = cache
        self.p_init = p_init
        n = cache.size
        self.active = np.ones(n, dtype=bool)
        self.n = n
        self.C = max(cache.layer_capacity(), costs.FLOOR)
        self.C_init = self.C
        self.frozen = False
        ok = cache.wnorm > 0
        self.pair_ok = np.triu(np.outer(ok, ok), k=1)
        self.version = 0

    def refresh_pair_mask(self, i: int) -> None:
        ok = self.active & (self.cache.wnorm > 0)
        self.pair_ok[i, :], self.pair_ok[:, i] = False, False
        if ok[i]:
            self.pair_ok[i, i + 1:] = ok[i + 1:]
            self.pair_ok[:i, i] = ok[:i]

    def remove(self, j: int) -> None:
        self.active[j] = False
        self.pair_ok[j, :], self.pair_ok[:, j] = False, False
        self.n -= 1


class Encoder:
    """The receding-horizon greedy HOPE encoder over one model.

    Most users call `hope_keras.compress`; the encoder is exposed for custom loops.

    Args:
        model: The Keras model to compress in place.
        analysis: Its `Analysis` (computed if omitted).
        actions: Subset of ``("prune", "merge", "evict")``.
        merge_scale: ``"sum"`` (parent capacity B, keeps the summed output) or
            ``"paper"`` (α*, eq. 12). The cost J always uses α*.
        refresh: ``"local"`` (paper's decoupled cache) or ``"neighbors"`` (also
            rebuild the caches of the producer- and consumer-side groups).
        kernel: ``"approx"`` or ``"exact"`` cross-kernel.
        rate: ``"params"`` (the spec's ``DR = J / P_init``) or ``"neurons"``
            (distortion per neuron removed: ``DR = J`` for prunes and merges,
            ``J / neurons removed`` for evictions; see docs/quality.md).
        width: The ``n`` in front of the prune and merge costs: ``"live"`` (the
            spec's active count) or ``"initial"`` (the group's initial width, so a
            neuron costs more as its layer empties; an experiment of docs/quality.md).
        merge_cost: ``"paper"`` (eq. 6 with α*) or ``"residual"`` (the pair's
            function-space residual ``n·sqrt(‖f_i+f_j‖² − B²)/(C_rem + B)``, spec
            section 5; experimental).
    """

    def __init__(self, model, analysis: Optional[Analysis] = None,
                 actions=ACTIONS, merge_scale: str = "sum", refresh: str = "local",
                 kernel: str = "approx", verbose: bool = False, rate: str = "params",
                 width: str = "live", merge_cost: str = "paper"):
        actions = tuple(actions)
        bad = [a for a in actions if a not in ACTIONS]
        if bad or not actions:
            raise ValueError(f"actions must be a non-empty subset of {ACTIONS}. "
                             f"Received: actions={actions}")
        if merge_scale not in ("sum", "paper"):
            raise ValueError(f"merge_scale must be 'sum' or 'paper'. "
                             f"Received: merge_scale={merge_scale!r}")
        if merge_cost not in ("paper", "residual"):
            raise ValueError(f"merge_cost must be 'paper' or 'residual'. "
                             f"Received: merge_cost={merge_cost!r}")
        if width not in ("live", "initial"):
            raise ValueError(f"width must be 'live' or 'initial'. Received: width={width!r}")
        if rate not in ("params", "neurons"):
            raise ValueError(f"rate must be 'params' or 'neurons'. Received: rate={rate!r}")
        if refresh not in ("local", "neighbors"):
            raise ValueError(f"refresh must be 'local' or 'neighbors'. "
                             f"Received: refresh={refresh!r}")
        self.model = model
        if analysis is None:
            analysis = analyze(model, kernel=kernel, verbose=verbose)
        else:  # the run mutates the caches: keep the caller's analysis intact
            analysis = copy.deepcopy(analysis)
        self.analysis = analysis
        self.actions = set(actions)
        self.merge_scale = merge_scale
        self.refresh = refresh
        self.kernel = kernel
        self.rate = rate
        self.width = width
        self.merge_cost = merge_cost
        a = self.analysis
        self.graph = a.graph
        self.groups = {name: _GroupState(name, a.caches[name], a.states[name].p_init)
                       for name in a.caches}
        self.blocks = {b.name: b for b in self.graph.blocks}
        self.block_reports = {b.name: b for b in a.blocks}
        self.block_of = self.graph.block_of_group()
        self.evicted: set = set()
        self.num_neurons = a.num_neurons
        self.active = self.num_neurons
        self.params = _ParamCounter(model, a)
        self.editor = ModelEditor(model, self.graph)
        self._neighbors = self._neighbor_map() if refresh == "neighbors" else {}
        self._heap: list = []
        self._seq = 0
        self._block_version: Dict[tuple, int] = {}
        for name in self.groups:
            self._push_group(name)
        for name in self.blocks:
            self._push_block(name)
        self.trajectory = Trajectory({
            "model_name": model.name,
            "fingerprint": fingerprint(model, self.graph),
            "groups": [[n, g.size] for n, g in self.graph.groups.items()],
            "blocks": [b.name for b in self.graph.blocks],
            "block_groups": {b.name: list(b.groups) for b in self.graph.blocks},
            "num_neurons": self.num_neurons,
            "num_params": self.params.total0,
            "capacities": {n: g.C_init for n, g in self.groups.items()},
            "options": {"actions": sorted(self.actions), "merge_scale": merge_scale,
                        "refresh": refresh, "kernel": kernel, "rate": rate,
                        "width": width, "merge_cost": merge_cost},
        })

    # ----------------------------------------------------------- best actions
    def _neighbor_map(self):
        producer_of = {g.producer: name for name, g in self.graph.groups.items()}
        out = {}
        for name, g in self.graph.groups.items():
            nb = {producer_of[c.layer] for c in g.consumers if c.layer in producer_of}
            nb |= {other for other, h in self.graph.groups.items()
                   if any(c.layer == g.producer for c in h.consumers)}
            out[name] = nb - {name}
        return out

    def best_group_action(self, name: str):
        """(DR, kind, i, j, J, P) of the group's cheapest action, or None."""
        gs = self.groups[name]
        if gs.frozen or gs.n == 0:
            return None
        cache, best = gs.cache, None
        cap = cache.capacity
        n = gs.n if self.width == "live" else cache.size
        if "prune" in self.actions and gs.n > 1:
            idx = np.flatnonzero(gs.active)
            J = costs.j_prune(cap[idx], gs.C, n)
            dr = J / gs.p_init[idx] if self.rate == "params" else J
            k = int(np.argmin(dr))
            best = (float(dr[k]), "prune", int(idx[k]), -1, float(J[k]),
                    float(gs.p_init[idx[k]]))
        if "merge" in self.actions and gs.n > 1:
            ii, jj = np.nonzero(gs.pair_ok)
            if ii.size:
                A = cap[ii] ** 2 + cap[jj] ** 2
                c_rem = gs.C - cap[ii] - cap[jj]
                if self.merge_cost == "residual":  # spec section 5, sum-consistent
                    norm_sum_sq = A + 2.0 * cache.k_cross[ii, jj] * cache.gram_u[ii, jj]
                    J = costs.j_merge_residual(norm_sum_sq, cache.B[ii, jj], c_rem, n)
                else:
                    J = costs.j_merge(A, cache.B[ii, jj], c_rem, n)
                P = gs.p_init[jj]
                dr = J / P if self.rate == "params" else J
                k = int(np.argmin(dr))
                if best is None or dr[k] < best[0]:
                    best = (float(dr[k]), "merge", int(ii[k]), int(jj[k]), float(J[k]),
                            float(P[k]))
        return best

    def eviction_cost(self, name: str):
        """(DR, J, P) of evicting block `name`."""
        b, rep = self.blocks[name], self.block_reports[name]
        J = float(costs.j_evict(
            np.array([self.groups[g].n for g in b.groups], dtype=np.float64),
            np.array([self.groups[g].C for g in b.groups]), rep.c_identity))
        if self.rate == "params":
            return J / rep.p_init, J, rep.p_init
        removed = sum(self.groups[g].n for g in b.groups)
        return J / max(removed, 1), J, rep.p_init

    def _push_group(self, name: str) -> None:
        gs = self.groups[name]
        gs.version += 1
        best = self.best_group_action(name)
        if best is not None:
            self._seq += 1
            heapq.heappush(self._heap, (best[0], self._seq, "g", name, gs.version, best))

    def _push_block(self, name: str) -> None:
        if "evict" not in self.actions or not self.blocks[name].evictable:
            return
        if name in self.evicted:
            return
        dr, J, P = self.eviction_cost(name)
        self._seq += 1
        key = ("b", name)
        v = self._block_version.get(key, 0) + 1
        self._block_version[key] = v
        heapq.heappush(self._heap, (dr, self._seq, "b", name, v,
                                    (dr, "evict", -1, -1, J, P)))

    def _valid(self, entry) -> bool:
        _, _, kind, name, version, _ = entry
        if kind == "g":
            return self.groups[name].version == version and not self.groups[name].frozen
        return (name not in self.evicted
                and self._block_version.get(("b", name)) == version)

    def next_action(self, max_removed: Optional[int] = None):
        """Pops the cheapest valid action (evictions removing more than `max_removed`
        neurons are skipped), or returns None."""
        skipped = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            if entry[2] == "b" and max_removed is not None:
                removed = sum(self.groups[g].n for g in self.blocks[entry[3]].groups)
                if removed > max_removed:
                    skipped.append(entry)
                    continue
            found = entry
            break
        for e in skipped:
            heapq.heappush(self._heap, e)
        if found is not None:
            heapq.heappush(self._heap, found)  # stays until executed
        return None if found is None else (found[3], found[5])

    # --------------------------------------------------------------- execute
    def execute(self, unit: str, action) -> Step:
        """Executes one action: edit the model, record, refresh the caches."""
        dr, kind, i, j, J, P = action
        if kind == "evict":
            return self._evict(unit, dr, J, P)
        gs = self.groups[unit]
        c_before = gs.C
        coef = (np.nan,) * 6
        if kind == "prune":
            c_after = max(gs.C - gs.cache.capacity[i], costs.FLOOR)
            active_after = self.active - 1
            with self.editor.step():
                self.editor.prune(unit, i)
                step = self._record(kind, unit, i, -1, J, P, dr, c_before, c_after,
                                    active_after, coef, [unit])
            gs.remove(i)
            gs.cache.clear(i)
        else:
            cache = gs.cache
            sol = cache.solve_pair(i, j)
            cap = cache.capacity
            A = cap[i] ** 2 + cap[j] ** 2
            c_rem = gs.C - cap[i] - cap[j]
            scale = sol.B if self.merge_scale == "sum" else costs.alpha_star(A, sol.B, c_rem)
            pc = costs.parent_coefficients(sol, scale, cache.gram_v[i, i], cache.gram_v[j, j],
                                           cache.gram_u[i, i], cache.gram_u[j, j],
                                           cache.gram_u[i, j])
            coef = tuple(float(x) for x in pc)
            eps = float(self.editor.layer(self.graph.groups[unit].bn).epsilon)
            dead_parent = coef[4] ** 2 < eps
            active_after = self.active - (2 if dead_parent else 1)
            c_after = max(c_rem + (0.0 if dead_parent else float(scale)), costs.FLOOR)
            with self.editor.step():
                self.editor.merge(unit, i, j, ParentCoefficients(*coef))
                step = self._record(kind, unit, i, j, J, P, dr, c_before, c_after,
                                    active_after, coef, [unit])
            gs.remove(j)
            if dead_parent:
                gs.remove(i)
                cache.clear(i)
                cache.clear(j)
            else:
                cache.replace_with_parent(i, j, *coef)
                gs.refresh_pair_mask(i)
        gs.C = step.c_after
        self._after_group_change(unit)
        return step

    def _record(self, kind, unit, i, j, J, P, dr, c_before, c_after, active_after, coef,
                changed_groups, evict=False):
        """Updates the live parameter count and appends the step (O(touched layers))."""
        counter = self.params
        touched = set()
        for g in changed_groups:
            grp = self.graph.groups[g]
            touched |= {grp.producer, grp.bn} | {c.layer for c in grp.consumers}
        if evict:
            touched |= set(self.blocks[unit].branch_layers)
        lives = {unit} if not evict else set(self.blocks[unit].groups)
        saved = ({k: counter.now[k] for k in touched}, counter.total,
                 {g: counter.live[g] for g in lives}, set(counter.evicted) if evict else None)
        try:
            if evict:
                counter.evicted |= set(self.blocks[unit].branch_layers)
                for g in self.blocks[unit].groups:
                    counter.live[g] = 0
            else:
                counter.live[unit] -= self.active - active_after
            counter.update(touched)
            step = Step(kind, unit, int(i), int(j), float(J), float(P), float(dr),
                        float(c_before), float(c_after), int(active_after),
                        float(counter.ratio), tuple(coef))
            self.trajectory.append(step)
            self.active = active_after
        except BaseException:
            counter.now.update(saved[0])
            counter.total = saved[1]
            counter.live.update(saved[2])
            if evict:
                counter.evicted = saved[3]
            raise
        return step

    def _evict(self, unit, dr, J, P) -> Step:
        b = self.blocks[unit]
        removed = sum(self.groups[g].n for g in b.groups)
        c_before = float(sum(self.groups[g].C for g in b.groups))
        with self.editor.step():
            self.editor.evict(unit)
            step = self._record("evict", unit, -1, -1, J, P, dr, c_before, 0.0,
                                self.active - removed, (np.nan,) * 6, list(b.groups),
                                evict=True)
        self.evicted.add(unit)
        for g in b.groups:
            self.groups[g].frozen = True
            self.groups[g].n = 0
            self.groups[g].version += 1
        return step

    def _after_group_change(self, name: str) -> None:
        self._push_group(name)
        if name in self.block_of:
            self._push_block(self.block_of[name])
        for nb in self._neighbors.get(name, ()):
            self._rebuild(nb)

    def _rebuild(self, name: str) -> None:
        """refresh="neighbors": re-extract a group from the edited weights."""
        gs = self.groups[name]
        if gs.frozen:
            return
        state = extract_group(self.editor.mirror_model(), self.graph.groups[name])
        gs.cache = build_group_cache(state, kernel=self.kernel)
        for j in np.flatnonzero(~gs.active):
            gs.cache.clear(int(j))
        ok = gs.active & (gs.cache.wnorm > 0)
        gs.pair_ok = np.triu(np.outer(ok, ok), k=1)
        gs.C = max(gs.cache.layer_capacity(gs.active), costs.FLOOR)
        self._push_group(name)
        if name in self.block_of:
            self._push_block(self.block_of[name])

    # ------------------------------------------------------------------- run
    def min_reachable(self):
        """(min active neurons, min parameter ratio) reachable with these actions."""
        if not self.actions & {"prune", "merge"}:
            per_group = {n: g.n for n, g in self.groups.items()}
        else:
            per_group = {n: min(g.n, 1) for n, g in self.groups.items()}
        evictable = set()
        if "evict" in self.actions:
            for b in self.blocks.values():
                if b.evictable and b.name not in self.evicted:
                    evictable.add(b.name)
                    for g in b.groups:
                        per_group[g] = 0
        counter = _ParamCounter(self.model, self.analysis)
        counter.live.update({n: max(v, 0) for n, v in per_group.items()})
        for b in evictable:
            counter.evicted |= set(self.blocks[b].branch_layers)
        counter.update(list(counter.now))
        return sum(per_group.values()), counter.ratio

    def run(self, density=None, params=None, steps=None, verbose=True) -> str:
        """Runs until the first budget is met or no action is admissible.

        Returns why it stopped: ``"budget"``, ``"steps"`` or ``"no_action"``. The
        model's variables hold the last completed step even if interrupted.
        """
        target_active = (math.floor(density * self.num_neurons + 1e-9)
                         if density is not None else None)

        def done():
            if target_active is not None and self.active <= target_active:
                return "budget"
            if params is not None and self.params.ratio <= params + 1e-12:
                return "budget"
            if steps is not None and len(self.trajectory) >= steps:
                return "steps"
            return None

        total = steps or ((self.active - target_active) if target_active is not None else None)
        bar = None
        if verbose:
            import keras

            bar = keras.utils.Progbar(total, unit_name="step")
        start = len(self.trajectory)
        reason = None
        try:
            while True:
                reason = done()
                if reason:
                    break
                max_removed = (self.active - target_active) if target_active is not None else None
                nxt = self.next_action(max_removed)
                if nxt is None:
                    reason = "no_action"
                    break
                unit, action = nxt
                self.execute(unit, action)
                if bar is not None:
                    bar.update(len(self.trajectory) - start,
                               values=[("density", self.active / self.num_neurons)])
        finally:
            self.editor.commit()
        return reason


def compress(model, density: Optional[float] = None, params: Optional[float] = None,
             steps: Optional[int] = None, actions=ACTIONS, merge_scale: str = "sum",
             refresh: str = "local", kernel: str = "approx", verbose: bool = True,
             analysis: Optional[Analysis] = None, rate: str = "params",
             width: str = "live") -> CompressionResult:
    """Compresses a Keras model in place with HOPE, data-free.

    The greedy encoder executes, one step at a time, the prune, merge or block
    eviction with the lowest distortion per parameter saved, until the first budget
    given is met (or no action is admissible when none is given). Every step is
    recorded in the returned trajectory; `hope_keras.slim` then turns the edited
    model into a physically smaller one.

    Args:
        model: A built Functional or Sequential `keras.Model`, edited in place.
        density: Target neuron density (active / initial compressible neurons).
        params: Target ratio of live (slimmed) parameters to the original count.
        steps: Maximum number of actions.
        actions: Any subset of ``("prune", "merge", "evict")``.
        merge_scale: ``"sum"`` (default; keeps the pair's summed output) or
            ``"paper"`` (the paper's α*). See docs/hope.md.
        refresh: ``"local"`` (default, the paper's decoupled cache) or
            ``"neighbors"``.
        kernel: ``"approx"`` (default) or ``"exact"`` cross-kernel.
        verbose: Show a progress bar.
        analysis: A precomputed `hope_keras.analyze(model, kernel=...)` result.
        rate: What the distortion rate divides ``J`` by: ``"params"`` (default, the
            spec's ``DR = J / P_init``) or ``"neurons"`` (distortion per neuron
            removed). Neither wins everywhere: ``"neurons"`` keeps plain CNNs and
            MLPs far more accurate under a density budget, the spec's rate keeps
            ResNet-50 (docs/hope.md "Known limits", docs/quality.md).
        width: ``"live"`` (the spec's active count ``n`` in the costs) or
            ``"initial"`` (the group's initial width; experimental).

    Returns:
        A `CompressionResult` (``trajectory``, ``density``, ``params_ratio``,
        ``stopped``).

    Raises:
        ValueError: on a budget already met or out of reach, or a model with no
            compressible group; the model is then left unchanged.

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
    for name, value in (("density", density), ("params", params)):
        if value is not None and not (0.0 < value <= 1.0):
            raise ValueError(f"{name} must be in (0, 1]. Received: {name}={value}")
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be ≥ 0. Received: steps={steps}")
    enc = Encoder(model, analysis=analysis, actions=actions, merge_scale=merge_scale,
                  refresh=refresh, kernel=kernel, verbose=verbose, rate=rate, width=width)
    if density is not None and enc.active <= math.floor(density * enc.num_neurons + 1e-9):
        raise ValueError(
            f"The budget density={density} is already met: the model has "
            f"{enc.active} compressible neurons (density 1.0). Nothing was changed."
        )
    if params is not None and enc.params.ratio <= params:
        raise ValueError(f"The budget params={params} is already met. Nothing was changed.")
    min_active, min_ratio = enc.min_reachable()
    if density is not None and min_active > density * enc.num_neurons + 1e-9:
        raise ValueError(
            f"density={density} is out of reach with actions={sorted(enc.actions)}: at "
            f"least {min_active} of {enc.num_neurons} neurons remain (density "
            f"{min_active / enc.num_neurons:.4f}). Nothing was changed."
        )
    if params is not None and min_ratio > params + 1e-12:
        raise ValueError(
            f"params={params} is out of reach: pinned layers keep at least "
            f"{min_ratio:.4f} of the parameters. Nothing was changed."
        )
    stopped = enc.run(density=density, params=params, steps=steps, verbose=verbose)
    return CompressionResult(
        trajectory=enc.trajectory,
        density=enc.active / enc.num_neurons,
        params_ratio=enc.params.ratio,
        stopped=stopped,
        analysis=enc.analysis,
        model=model,
    )
