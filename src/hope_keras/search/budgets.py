"""The budgets of a HOPE run: checked before it starts, tested after each step.

A run stops at the first budget met among a neuron density, a parameter ratio, a
FLOPs ratio (both of the slimmed model, `hope_keras.search.sizes.SizeCounter`) and a number
of steps. `Budget.refuse_unreachable` refuses, before any edit, a budget already met
or out of reach of the run's actions and the pinned layers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Optional

import numpy as np

from hope_keras.progress import WorkBar, resolve_verbose
from hope_keras.deploy.profile import node_flops

#: The budget kinds the encoder can rank actions for (`Encoder.set_budget`).
BUDGETS = ("density", "params", "flops")


def budget_fraction(name, value):
    """A budget in (0, 1] as a float (None stays None); a clear error otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in (0, 1]. Received: {name}={value!r} "
                         f"of type {type(value).__name__}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]. Received: {name}={value}")
    return float(value)


def _check_steps(steps) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral)
                              or steps < 0):
        raise ValueError(f"steps must be an integer ≥ 0. Received: steps={steps!r}")


def check_flops_countable(graph) -> None:
    """A FLOPs budget needs every layer's FLOPs: refused (before any edit) when a
    layer has an unknown spatial dimension, as `hope_keras.profile` refuses."""
    fg = graph.flat
    for node in fg.nodes:
        node_flops(node, fg)


def _min_live(group, actions, min_width) -> int:
    """The fewest live neurons prunes and merges can leave in a group: `min_width`
    of its live count with prunes; without them, merges join only the neurons of a
    mergeable group with a non-zero input vector (`GroupState.pair_ok`), down to one
    of those."""
    if "prune" in actions:
        return min_width(group.n)
    if "merge" not in actions or not group.mergeable:
        return group.n
    pairable = int(np.count_nonzero(group.active & (group.cache.wnorm > 0)))
    return max(group.n - max(pairable - 1, 0), min_width(group.n))


def min_reachable(groups, blocks, evicted, actions, sizes, min_width=lambda n: min(n, 1)):
    """(min active neurons, min parameter ratio, min FLOPs ratio) reachable with
    `actions` from the groups' live counts and the blocks not yet `evicted`;
    `min_width(n)`: the narrowest a group of n live channels gets by prunes and
    merges (`hope_keras.search.rounding.WidthRounding.min_width`)."""
    per_group = {n: _min_live(g, actions, min_width) for n, g in groups.items()}
    evicted_layers = []
    if "evict" in actions:
        for b in blocks.values():
            if b.evictable and b.name not in evicted:
                evicted_layers += list(b.branch_layers)
                for g in b.groups:
                    per_group[g] = 0
    params_ratio, flops_ratio = sizes.ratios_at(per_group, evicted_layers)
    return sum(per_group.values()), params_ratio, flops_ratio


@dataclasses.dataclass(frozen=True)
class Budget:
    """The targets of one run (None: not a target), checked on creation.

    Example:

    >>> from hope_keras.search.budgets import Budget
    >>> Budget.checked(density=0.5).kind("params")
    'density'
    """

    density: Optional[float] = None
    params: Optional[float] = None
    flops: Optional[float] = None
    steps: Optional[int] = None

    @classmethod
    def checked(cls, density=None, params=None, flops=None, steps=None) -> "Budget":
        density, params, flops = (budget_fraction(name, value) for name, value in (
            ("density", density), ("params", params), ("flops", flops)))
        _check_steps(steps)
        return cls(density, params, flops, steps)

    def check_for_compress(self, latency=None) -> None:
        """`compress` stops at a budget: none given is refused (the run would go on
        until every group is down to one neuron), and ``latency`` is given alone
        (``steps`` at most); before anything is changed."""
        if latency is not None and self.kind(None) is not None:
            raise ValueError(f"Give latency= alone (with steps= at most), not with "
                             f"{self.describe()}. Nothing was changed.")
        if self.kind(None) is None and self.steps is None and latency is None:
            raise ValueError(
                "compress needs a budget: density=, params=, flops=, latency= or steps=. "
                "Received none (the run would go on until every group is down to one "
                "neuron). Nothing was changed. To run to the end of the trajectory, use "
                "hope_keras.Encoder(model).run().")

    def kind(self, default: str) -> str:
        """The budget the ranking follows: the first given of density, params, flops."""
        return ("density" if self.density is not None else "params" if self.params is not None
                else "flops" if self.flops is not None else default)

    def describe(self) -> str:
        """The targets given, as ``compress`` announces them."""
        return ", ".join(f"{k}={v}" for k, v in (
            ("density", self.density), ("params", self.params), ("flops", self.flops),
            ("steps", self.steps)) if v is not None) or "no admissible action left"

    def target_active(self, num_neurons: int) -> Optional[int]:
        """Live neurons at which the density budget is met (None: no density budget)."""
        if self.density is None:
            return None
        return math.floor(self.density * num_neurons + 1e-9)

    def reached(self, active, sizes, num_steps, target_active) -> Optional[str]:
        """``"budget"`` or ``"steps"`` when the run is to stop, else None."""
        if target_active is not None and active <= target_active:
            return "budget"
        if self.params is not None and sizes.params_ratio <= self.params + 1e-12:
            return "budget"
        if self.flops is not None and sizes.flops_ratio <= self.flops + 1e-12:
            return "budget"
        return self.steps_reached(num_steps)

    def steps_reached(self, num_steps) -> Optional[str]:
        """``"steps"`` when the step budget is used up, else None."""
        if self.steps is not None and num_steps >= self.steps:
            return "steps"
        return None

    def refuse_unreachable(self, active, num_neurons, sizes, actions, reachable,
                           round_to: int = 1) -> None:
        """Raises ValueError when a budget is already met or out of reach;
        `reachable()`: ``(min active, min params ratio, min FLOPs ratio)``."""
        density, params, flops = self.density, self.params, self.flops
        if density is not None and active <= math.floor(density * num_neurons + 1e-9):
            raise ValueError(
                f"The budget density={density} is already met: the model has "
                f"{active} live compressible neurons of {num_neurons} (density "
                f"{active / num_neurons:.4f}). Nothing was changed.")
        if params is not None and sizes.params_ratio <= params:
            raise ValueError(f"The budget params={params} is already met (parameter ratio "
                             f"{sizes.params_ratio:.4f}). Nothing was changed.")
        if flops is not None and sizes.flops_ratio <= flops:
            raise ValueError(f"The budget flops={flops} is already met (FLOPs ratio "
                             f"{sizes.flops_ratio:.4f}). Nothing was changed.")
        min_active, min_params, min_flops = reachable()
        narrowest = (f" and groups no narrower than round_to={round_to}"
                     if round_to > 1 else "")
        if density is not None and min_active > density * num_neurons + 1e-9:
            raise ValueError(
                f"density={density} is out of reach with actions={sorted(actions)}: "
                f"at least {min_active} of {num_neurons} neurons remain (density "
                f"{min_active / num_neurons:.4f}). Nothing was changed.")
        if params is not None and min_params > params + 1e-12:
            raise ValueError(f"params={params} is out of reach: pinned layers{narrowest} keep "
                             f"at least {min_params:.4f} of the parameters. Nothing was changed.")
        if flops is not None and min_flops > flops + 1e-12:
            raise ValueError(f"flops={flops} is out of reach: pinned layers{narrowest} keep "
                             f"at least {min_flops:.4f} of the FLOPs. Nothing was changed.")

    def warn_unmet(self, encoder, stopped: Optional[str]) -> None:
        """Warns when a run that stopped for want of an action (`stopped` is
        ``"no_action"``) left its budgets unmet (the result is not what was asked),
        saying why: the next action is an eviction that would overshoot
        ``density=`` (skipped), or none is left."""
        if stopped != "no_action" or (
                self.density is None and self.params is None and self.flops is None):
            return
        following = encoder.next_action(None) if self.density is not None else None
        if following is not None and following.kind == "evict":
            missing = [a for a in ("prune", "merge") if a not in encoder.actions]
            why = (f"the only actions left evict blocks (next: '{following.unit}'), which "
                   f"would take the density below density={self.density} and are skipped "
                   "under a density budget: give params= or flops= alone"
                   + (f", or allow {' and '.join(missing)} (actions=)" if missing else ""))
        else:
            why = ("no admissible action is left (every group the actions can shrink is "
                   "at its narrowest)")
        warnings.warn(
            f"The run on '{encoder.model.name}' stopped before {self.describe()}: {why}. "
            f"It reached density {encoder.active / encoder.num_neurons:.4f}, params "
            f"ratio {encoder.sizes.params_ratio:.4f}, FLOPs ratio "
            f"{encoder.sizes.flops_ratio:.4f} in {len(encoder.trajectory)} step(s).",
            UserWarning, stacklevel=4)

    def progress_bar(self, encoder, target_active, verbose):
        """Announces the run (when `verbose` resolves true) and returns a bar over
        the planned work and a function giving the work done: neurons to remove under
        a density budget (or with no budget), parameters / FLOPs to remove, or steps."""
        if resolve_verbose(verbose):
            print(f"Compressing '{encoder.model.name}' ({self.describe()}): the cheapest "
                  f"of {'/'.join(sorted(encoder.actions))} at each step.")
        params, flops, steps, sizes = self.params, self.flops, self.steps, encoder.sizes
        if target_active is not None or (params is None and flops is None and steps is None):
            goal = target_active if target_active is not None else encoder.min_reachable()[0]
            start = encoder.active
            total, unit, now = start - goal, "neuron", lambda: start - encoder.active
        elif params is not None:
            start = sizes.params
            total = math.ceil(start - params * sizes.params0)
            unit, now = "param", lambda: start - sizes.params
        elif flops is not None:
            start = sizes.flops
            total = math.ceil(start - flops * sizes.flops0)
            unit, now = "flop", lambda: start - sizes.flops
        else:
            start = len(encoder.trajectory)
            total, unit, now = (steps - start, "step",
                                lambda: len(encoder.trajectory) - start)
        return WorkBar(max(int(total), 0), unit, verbose), now
