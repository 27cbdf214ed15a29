"""A latency budget: ``compress(model, latency=r)`` runs until the slimmed model's
*measured* latency is at most ``r`` times the original's (docs/hope.md, "A latency
budget").

Latency is not a sum over layers the encoder could rank by: it depends on the machine,
the kernels each width gets and the batch size. The run therefore steers a FLOPs budget
by measurement. It runs to the FLOPs ratio ``f = r``, slims a copy of the model
(`hope_keras.slim`; the model being compressed is not changed) and times it against
the model itself, which keeps the original's layers and shapes and therefore its cost
(dense kernels do not skip zeros). While the measured ratio ``m`` is above ``r``, it
lowers the FLOPs target in proportion, ``f ← f · r / m`` (by at least
``MIN_STEP`` of ``f``, so every round removes something), and *continues the same
run*: the trajectory is one run, and replaying its steps gives the result exactly
(``trajectory.meta["latency"]["step"]``).

Two guards against the noise of a measurement. A ratio at or below ``r`` is measured
a second time, and the budget is met only when both are (the larger is reported): one
lucky median does not end the run. And the FLOPs target does not go below
``min_flops`` (default ``r / 4``): a latency that needs four times the FLOPs cut
asked for is held up by what FLOPs do not count (per-layer overhead at batch 1, memory
traffic), and the run stops there (``stopped == "min_flops"``) rather than remove
most of the model for it.

Timing: ``model(x, training=False)`` compiled once with ``tf.function`` (the
``"call"`` method of `hope_keras.profile`), on a normal-random batch of
``batch_size`` (default 1: one request at a time, the latency a single user sees),
in ``repeats`` rounds of one run of each model back to back (the order alternating),
and the median of the rounds' ratios (`hope_keras.deploy.profile.latency_ratio`): a
slow spell of a shared machine hits both runs of a round alike. The ratio is still a
measurement: on a loaded machine it moves between calls, so a result just under
``r`` may measure just over it on the next call. Each measurement
costs ``2 · (warmup + repeats)`` forward passes (shown under ``verbose``).
"""

from __future__ import annotations

import numbers
import time
import warnings
from typing import Callable, Optional

from hope_keras.deploy.fold import fold_batchnorm
from hope_keras.deploy.profile import latency_ratio
from hope_keras.edit.slim import slim
from hope_keras.progress import resolve_verbose

__all__ = ["LatencyBudget", "MIN_STEP"]

#: The least a round lowers the FLOPs target, as a fraction of it: a measured ratio
#: just above the budget (noise) still removes something at the next round.
MIN_STEP = 0.02

#: Rounds of measurement at most: the FLOPs target falls by at least `MIN_STEP` each
#: round, so 200 rounds reach below 2 % of the FLOPs; a run stops well before.
MAX_ROUNDS = 200


def _ratio(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"latency must be a number in (0, 1] (or a "
                         f"hope_keras.LatencyBudget). Received: latency={value!r} of type "
                         f"{type(value).__name__}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"latency must be in (0, 1]: the measured latency of the slimmed "
                         f"model over the original's. Received: latency={value}")
    return float(value)


class LatencyBudget:
    """A target ratio of measured latency, slimmed model / original, and how to time it.

    ``compress(model, latency=0.6)`` is ``compress(model,
    latency=LatencyBudget(0.6))``; pass a `LatencyBudget` to change how the latency
    is measured.

    Args:
        ratio: The target, in (0, 1].
        batch_size: Examples per timed batch (default 1).
        repeats: Timed runs of each model per measurement (the median is used).
        warmup: Untimed runs of each model first (tracing, allocation).
        min_flops: The lowest FLOPs ratio the run goes to (default ``ratio / 4``);
            below it the run stops with ``stopped == "min_flops"``.
        timer: Instead of timing, a function ``timer(small, reference)`` returning
            the latency ratio of ``small`` (the slimmed copy) to ``reference`` (the
            model being compressed, the original's shapes): for another runtime or
            device (a TFLite interpreter, a phone), or a deterministic test.
        fold_batchnorm: Time the slimmed copy with its BatchNormalizations folded
            into the layers before them (`hope_keras.fold_batchnorm`), as it would
            be deployed, against the model as it is (default False).

    Example:

    >>> import keras, hope_keras
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> flops = lambda small, reference: hope_keras.profile(
    ...     small, reference=reference, latency=False).ratio("flops")
    >>> budget = hope_keras.LatencyBudget(0.5, timer=flops)  # FLOPs as "latency"
    >>> result = hope_keras.compress(model, latency=budget, verbose=False)
    >>> result.latency_ratio <= 0.5
    True
    """

    def __init__(self, ratio, *, batch_size: int = 1, repeats: int = 30, warmup: int = 3,
                 min_flops: Optional[float] = None, timer: Optional[Callable] = None,
                 fold_batchnorm: bool = False):
        self.ratio = _ratio(ratio)
        if min_flops is not None and (isinstance(min_flops, bool) or not isinstance(
                min_flops, numbers.Real) or not 0.0 <= float(min_flops) <= self.ratio):
            raise ValueError(f"min_flops must be a number in [0, ratio={self.ratio}]. "
                             f"Received: min_flops={min_flops!r}")
        self.min_flops = self.ratio / 4 if min_flops is None else float(min_flops)
        for name, value, least in (("batch_size", batch_size, 1), ("repeats", repeats, 1),
                                   ("warmup", warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or value < least:
                raise ValueError(f"{name} must be an integer ≥ {least}. "
                                 f"Received: {name}={value!r}")
        if timer is not None and not callable(timer):
            raise ValueError(f"timer must be a function timer(small, reference) -> ratio. "
                             f"Received: timer={timer!r}")
        self.batch_size, self.repeats, self.warmup = int(batch_size), int(repeats), int(warmup)
        self.timer = timer
        if not isinstance(fold_batchnorm, bool):
            raise ValueError(f"fold_batchnorm must be True or False. "
                             f"Received: fold_batchnorm={fold_batchnorm!r}")
        self.fold_batchnorm = fold_batchnorm
        self.measurements = []

    def __repr__(self) -> str:
        how = (f"timer={self.timer!r}" if self.timer is not None else
               f"batch_size={self.batch_size}, repeats={self.repeats}")
        fold = ", fold_batchnorm=True" if self.fold_batchnorm else ""
        return f"LatencyBudget({self.ratio}, {how}{fold})"

    @classmethod
    def get(cls, latency) -> Optional["LatencyBudget"]:
        """None, a `LatencyBudget` (a fresh copy: its measurements are its run's), or
        a ratio; a clear error otherwise (before any edit)."""
        if latency is None:
            return None
        if isinstance(latency, cls):
            return cls(latency.ratio, batch_size=latency.batch_size,
                       repeats=latency.repeats, warmup=latency.warmup,
                       min_flops=latency.min_flops, timer=latency.timer,
                       fold_batchnorm=latency.fold_batchnorm)
        return cls(latency)

    def measure(self, model) -> float:
        """The latency ratio of ``slim(model)`` (folded with ``fold_batchnorm``) to
        ``model``."""
        small = slim(model)
        if self.fold_batchnorm:
            small = fold_batchnorm(small)
        if self.timer is not None:
            value = self.timer(small, model)
        else:
            value = latency_ratio(small, model, batch_size=self.batch_size,
                                  repeats=self.repeats, warmup=self.warmup)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"The latency timer must return a positive ratio. "
                             f"Received: {value!r}")
        return float(value)

    def reach(self, encoder, steps: Optional[int] = None) -> str:
        """Runs ``encoder`` (continuing its run) until the measured ratio is at most
        the budget; records the rounds in ``trajectory.meta["latency"]`` and returns
        why it stopped (``"budget"``, ``"steps"``, ``"no_action"`` or ``"min_flops"``)."""
        verbose = resolve_verbose(encoder.verbose)
        r, target, stopped = self.ratio, self.ratio, "budget"
        self.measurements = []
        meta = encoder.trajectory.meta
        for _ in range(MAX_ROUNDS):
            if encoder.sizes.flops_ratio > target + 1e-12:
                stopped = encoder.run(flops=target, steps=steps)
            start = time.perf_counter()
            times = [self.measure(encoder.model)]
            if times[0] <= r:  # a pass holds twice: one lucky median is not one
                times.append(self.measure(encoder.model))
            measured = max(times)
            self.measurements.append({
                "flops_target": target, "flops_ratio": encoder.sizes.flops_ratio,
                "step": len(encoder.trajectory), "measured": measured, "times": times,
                "seconds": time.perf_counter() - start})
            meta["latency"] = self.record()
            if verbose:
                print(f"Latency ratio {measured:.3f} (target {r}) at FLOPs ratio "
                      f"{encoder.sizes.flops_ratio:.3f}, step {len(encoder.trajectory)}; "
                      f"measured in {time.perf_counter() - start:.1f} s.")
            if measured <= r:
                return "budget"
            if stopped != "budget":  # out of steps or of actions: what it reached
                return stopped
            if encoder.sizes.flops_ratio <= self.min_flops + 1e-12:
                return "min_flops"
            target = max(min(target * r / measured, target * (1.0 - MIN_STEP),
                             encoder.sizes.flops_ratio * (1.0 - MIN_STEP)), self.min_flops)
        return "no_action"

    def warn_unmet(self, encoder, stopped: str) -> None:
        """Warns when `reach` stopped above the target latency (`stopped` is not
        ``"budget"``), saying what stopped it and what was measured."""
        if stopped == "budget" or self.measured is None or self.measured <= self.ratio:
            return
        why = {"min_flops": f"the FLOPs floor min_flops={self.min_flops:g} was reached "
                            "(LatencyBudget(..., min_flops=) lowers it; on a small model "
                            "fixed per-layer costs dominate, and fewer FLOPs stop paying)",
               "steps": "steps= was reached",
               "no_action": "no admissible action is left"}.get(stopped, stopped)
        warnings.warn(
            f"The run on '{encoder.model.name}' stopped before latency={self.ratio}: {why}. "
            f"The last measured latency ratio is {self.measured:.3f}, at FLOPs ratio "
            f"{encoder.sizes.flops_ratio:.4f} in {len(encoder.trajectory)} step(s).",
            UserWarning, stacklevel=4)

    def record(self) -> dict:
        """The budget and its rounds, as ``trajectory.meta["latency"]`` holds them."""
        last = self.measurements[-1] if self.measurements else {}
        return {"ratio": self.ratio, "batch_size": self.batch_size, "repeats": self.repeats,
                "warmup": self.warmup, "min_flops": self.min_flops,
                "method": "call" if self.timer is None else "timer",
                "fold_batchnorm": self.fold_batchnorm,
                "measured": last.get("measured"), "step": last.get("step"),
                "rounds": [dict(m) for m in self.measurements]}

    @property
    def measured(self) -> Optional[float]:
        """The last measured ratio (None before any)."""
        return self.measurements[-1]["measured"] if self.measurements else None
