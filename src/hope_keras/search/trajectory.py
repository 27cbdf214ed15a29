"""The action log of a HOPE run: save, load, replay.

File format (``.npz``, numpy's zip of arrays; no pickles):

* ``meta``: a 0-d unicode array holding JSON: ``format`` (``"hope_keras.trajectory"``),
  ``version`` (1), ``model_name``, ``fingerprint`` (sha256 of the weights HOPE
  reads, taken before the first step), ``groups`` (``[[name, size], …]``),
  ``blocks``, ``num_neurons`` (initial compressible neurons), ``num_params``
  (original parameter count), ``num_flops`` (original FLOPs per example) and
  ``options`` (the cost's config, actions, merge scale, refresh, kernel).
* one array per step field, all of length ``num_steps``: ``kind`` (``"prune"``,
  ``"merge"``, ``"evict"``), ``unit`` (group or block name), ``i``, ``j`` (slot
  indices, −1 when unused), ``J``, ``P_init``, ``DR``, ``c_before`` and
  ``c_after`` (the group's live capacity C around the step; for evictions the
  block's internal capacity), ``active_after`` (compressible neurons left),
  ``params_after`` (live parameter ratio) and ``coef`` (``(num_steps, 6)``:
  a1, a2, m1, m2, γ_k, β_k of a merge's parent; NaN otherwise).

Replaying applies the same edits with the same coefficients, so it reproduces the
direct run's weights exactly.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import zipfile
from typing import List, Optional

import numpy as np

from hope_keras.search.budgets import budget_fraction
from hope_keras.graph.fingerprint import fingerprint
from hope_keras.edit.editor import ParentCoefficients
from hope_keras.edit import editor as edit
from hope_keras.graph import walker as graph_lib
from hope_keras.scoring import moments as moments_lib
from hope_keras.stats.correction import StatisticsCorrection

FORMAT = "hope_keras.trajectory"
VERSION = 2
# Version 1 files (no ``flops_after``) still load, with NaN FLOPs ratios.
_READABLE_VERSIONS = (1, 2)
_FIELDS = ("kind", "unit", "i", "j", "J", "P_init", "DR", "c_before", "c_after",
           "active_after", "params_after", "coef", "flops_after")


@dataclasses.dataclass(frozen=True)
class Step:
    """One executed action."""

    kind: str
    unit: str
    i: int
    j: int
    J: float
    P_init: float
    DR: float
    c_before: float
    c_after: float
    active_after: int
    params_after: float
    coef: tuple = (np.nan,) * 6
    flops_after: float = np.nan


class Trajectory:
    """The steps of a HOPE run and what is needed to replay them.

    Attributes:
        steps: The executed `Step` list, in order.
        meta: Model identity and run options (see the module docstring).

    Example:

    >>> import hope_keras, keras, numpy as np
    >>> inputs = keras.Input((6,))
    >>> x = keras.layers.Dense(8)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> original = keras.models.clone_model(model); original.set_weights(model.get_weights())
    >>> result = hope_keras.compress(model, steps=3, verbose=False)
    >>> result.trajectory.save("/tmp/doctest_traj.npz")
    >>> t = hope_keras.Trajectory.load("/tmp/doctest_traj.npz")
    >>> _ = t.replay(original, step=3)
    >>> all(np.array_equal(a, b) for a, b in zip(original.get_weights(), model.get_weights()))
    True
    """

    def __init__(self, meta: dict, steps: Optional[List[Step]] = None):
        self.meta = meta
        self.steps: List[Step] = list(steps or [])
        self.source: Optional[str] = None  # the file it was loaded from

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index):
        """``trajectory[k]``: the k-th `Step` (a slice: a list of steps)."""
        return self.steps[index]

    def __iter__(self):
        return iter(self.steps)

    def __repr__(self) -> str:
        return (f"Trajectory(model={self.meta.get('model_name')!r}, "
                f"steps={len(self.steps)})")

    def append(self, step: Step) -> None:
        self.steps.append(step)

    # ----------------------------------------------------------------- queries
    def field(self, name: str) -> np.ndarray:
        """One field of every step as an array (e.g. ``t.field("DR")``)."""
        if name not in _FIELDS:
            raise ValueError(f"Unknown step field {name!r}. Fields: {_FIELDS}")
        return np.array([getattr(s, name) for s in self.steps])

    def densities(self) -> np.ndarray:
        """Neuron density after each step."""
        return self.field("active_after") / float(self.meta["num_neurons"])

    def step_for_density(self, density: float) -> int:
        """The number of steps after which the density is first ≤ `density`."""
        return self._first_step("density", self.densities(), density)

    def step_for(self, density=None, params=None, flops=None) -> int:
        """The number of steps after which the one given budget is first met.

        ``density``: neuron density; ``params`` / ``flops``: live parameter / FLOPs
        ratio of the slimmed model. A budget of 1.0 (or more) is met by 0 steps.
        """
        given = {k: v for k, v in (("density", density), ("params", params),
                                   ("flops", flops)) if v is not None}
        if len(given) != 1:
            raise ValueError(f"Give exactly one of density=, params=, flops=. "
                             f"Received: {given or 'none'}")
        (what, value), = given.items()
        series = {"density": self.densities, "params": lambda: self.field("params_after"),
                  "flops": lambda: self.field("flops_after")}[what]()
        return self._first_step(what, series, value)

    def _first_step(self, what, series, value) -> int:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be a number. Received: {what}={value!r}") from None
        if not value > 0:
            raise ValueError(f"{what} must be > 0. Received: {what}={value}")
        if value >= 1.0:
            return 0
        if what == "flops" and np.isnan(series).any():
            raise ValueError("This trajectory records no FLOPs (written by version 1); "
                             "replay it by density, params or step.")
        met = series <= value + 1e-12
        # A run with round_to stops between rounds only (`hope_keras.search.rounding`).
        inside = np.asarray(self.meta.get("unrounded_steps", []), dtype=np.int64) - 1
        met[inside[(inside >= 0) & (inside < met.size)]] = False
        hit = np.flatnonzero(met)
        if hit.size == 0:
            end = series[-1] if series.size else 1.0
            raise ValueError(
                f"The trajectory ends at {what} {end:.4f}; it never reaches "
                f"{what}={value}. Received: {what}={value}"
            )
        return int(hit[0]) + 1

    def prune_costs(self) -> dict:
        """``{(group, neuron): (J_prune, C_rem)}`` for every neuron pruned (for DEFT)."""
        out = {}
        for s in self.steps:
            if s.kind == "prune":
                out[(s.unit, s.i)] = (s.J, s.c_after)
        return out

    # ------------------------------------------------------------------- files
    def save(self, path: str) -> None:
        """Writes the trajectory to `path` (``.npz``; see the module docstring)."""
        arrays = {"meta": np.array(json.dumps({**self.meta, "format": FORMAT,
                                               "version": VERSION}))}
        for name in _FIELDS:
            values = [getattr(s, name) for s in self.steps]
            if name == "coef":
                arrays[name] = np.array(values, dtype=np.float64).reshape(-1, 6)
            elif name in ("kind", "unit"):
                arrays[name] = np.array(values, dtype=str)
            elif name in ("i", "j", "active_after"):
                arrays[name] = np.array(values, dtype=np.int64)
            else:
                arrays[name] = np.array(values, dtype=np.float64)
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str) -> "Trajectory":
        """Reads a trajectory written by `save`; a clear error if the file is not one."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Trajectory.load takes a file path (str or os.PathLike). "
                            f"Received: {path!r} of type {type(path).__name__}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"No trajectory file at '{path}'.")
        hint = "Re-create it with hope_keras.compress(...).trajectory.save(path)."
        if os.path.isdir(path) or not zipfile.is_zipfile(path):
            raise ValueError(f"'{path}' is not a hope_keras trajectory file: it is not an "
                             f".npz archive. {hint}")
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            meta = json.loads(str(arrays["meta"]))
        except Exception as e:  # zip, json or key errors: all mean "not a trajectory"
            why = ("it holds Python objects, not arrays" if "pickle" in str(e)
                   else f"{type(e).__name__}: {e}")
            raise ValueError(
                f"'{path}' is not a readable hope_keras trajectory file ({why}). {hint}"
            ) from None
        if not isinstance(meta, dict):
            raise ValueError(f"'{path}' is not a hope_keras trajectory: its metadata is a "
                             f"{type(meta).__name__}, not a JSON object. {hint}")
        if meta.get("format") != FORMAT or meta.get("version") not in _READABLE_VERSIONS:
            raise ValueError(
                f"'{path}' is not a hope_keras trajectory (format {meta.get('format')!r}, "
                f"version {meta.get('version')!r}; expected {FORMAT!r} version {VERSION})."
            )
        if "flops_after" not in arrays and meta.get("version") == 1 and "kind" in arrays:
            arrays["flops_after"] = np.full(len(arrays["kind"]), np.nan)
        missing = [k for k in _FIELDS if k not in arrays]
        lengths = {k: len(arrays[k]) for k in _FIELDS if k in arrays}
        if missing or len(set(lengths.values())) > 1:
            raise ValueError(
                f"Trajectory file '{path}' is corrupt: missing fields {missing}, "
                f"field lengths {lengths}."
            )
        where = f"Trajectory file '{path}' is corrupt"
        shapes = {k: arrays[k].shape for k in _FIELDS}
        if any(len(shape) != (2 if k == "coef" else 1) for k, shape in shapes.items()) \
                or shapes["coef"][1:] != (6,):
            raise ValueError(f"{where}: field shapes {shapes} (one value per step; coef: "
                             "six per step).")
        for k in _FIELDS:
            if k not in ("kind", "unit") and not np.issubdtype(arrays[k].dtype, np.number):
                raise ValueError(f"{where}: field {k!r} holds {arrays[k].dtype} values, "
                                 "not numbers.")
        for k in ("i", "j", "active_after"):
            a = arrays[k]
            if not np.issubdtype(a.dtype, np.integer):
                whole = np.isfinite(a) & (a == np.round(a))
                if not whole.all():
                    raise ValueError(f"{where}: field {k!r} holds values that are not "
                                     f"whole numbers (step {int(np.argmin(whole))}: "
                                     f"{float(a[np.argmin(whole)])!r}).")
        if not isinstance(meta.get("fingerprint"), str) or not isinstance(
                meta.get("options", {}), dict):
            raise ValueError(f"{where}: its fingerprint / options metadata is missing or "
                             "malformed.")
        kinds = set(arrays["kind"].tolist())
        if not kinds <= {"prune", "merge", "evict"}:
            raise ValueError(f"Trajectory file '{path}' is corrupt: unknown kinds {kinds}.")
        steps = [
            Step(
                kind=str(arrays["kind"][k]), unit=str(arrays["unit"][k]),
                i=int(arrays["i"][k]), j=int(arrays["j"][k]), J=float(arrays["J"][k]),
                P_init=float(arrays["P_init"][k]), DR=float(arrays["DR"][k]),
                c_before=float(arrays["c_before"][k]), c_after=float(arrays["c_after"][k]),
                active_after=int(arrays["active_after"][k]),
                params_after=float(arrays["params_after"][k]),
                coef=tuple(float(x) for x in arrays["coef"][k]),
                flops_after=float(arrays["flops_after"][k]),
            )
            for k in range(lengths["kind"])
        ]
        try:
            groups = {str(name): int(size) for name, size in meta["groups"]}
            blocks = {str(b) for b in meta["blocks"]}
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: its groups / blocks metadata is unreadable.") from None
        trajectory = cls(meta, steps)
        trajectory._check_steps(groups, blocks, len(steps), where)
        trajectory.source = path
        return trajectory

    def _check_steps(self, groups: dict, blocks: set, n_steps: int, where: str) -> None:
        """Raises ValueError (naming `where` and the step) for the first of the first
        `n_steps` steps that does not fit `groups` ({name: size}) and `blocks`."""
        for k, s in enumerate(self.steps[:n_steps]):
            problem = _step_problem(s, groups, blocks)
            if problem:
                raise ValueError(f"{where}: step {k} ({s.kind} of '{s.unit}') {problem}.")

    # ------------------------------------------------------------------ replay
    def replay(self, model, density: Optional[float] = None, step: Optional[int] = None,
               check: bool = True, params: Optional[float] = None,
               flops: Optional[float] = None, data=None):
        """Applies the first steps of the trajectory to the original model, in place.

        Options that `compress` recorded act as they did there: mean compensation at
        each prune, and the statistics correction after the last step replayed
        (decided on the steps replayed). A run made with ``data=`` is corrected on
        the ``data`` given here (without it, its statistics are left as the edits
        wrote them, with a warning).

        Args:
            model: The model the trajectory was recorded on, before compression
                (checked by fingerprint unless ``check=False``).
            density: Replay until the neuron density is first ≤ this value.
            step: Or replay exactly this many steps.
            check: Verify the model's fingerprint first.
            params: Or replay until the live parameter ratio is first ≤ this value.
            flops: Or replay until the live FLOPs ratio is first ≤ this value.
            data: Unlabeled inputs for a run recorded with ``data=``.

        Returns:
            The same model, edited.

        Raises:
            ValueError: if the model is not the one recorded (it is left untouched),
                or the requested density/step is out of range.
        """

        density, params, flops = (budget_fraction(name, value) for name, value in (
            ("density", density), ("params", params), ("flops", flops)))
        given = [k for k, v in (("density", density), ("step", step), ("params", params),
                                ("flops", flops)) if v is not None]
        if len(given) != 1:
            raise ValueError(
                f"Give exactly one of density=, params=, flops= or step=. Received: "
                f"density={density}, params={params}, flops={flops}, step={step}"
            )
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise ValueError(f"step must be an integer. Received: step={step!r}")
        n_steps = (int(step) if step is not None
                   else self.step_for(density=density, params=params, flops=flops))
        if not 0 <= n_steps <= len(self.steps):
            raise ValueError(
                f"step must be in [0, {len(self.steps)}]. Received: step={step}"
            )
        g = graph_lib.walk(model)
        sizes = [[name, grp.size] for name, grp in g.groups.items()]
        known = {name for name, _ in self.meta["groups"]}
        g = g.with_groups(
            {k: v for k, v in g.groups.items() if k in known},
            blocks=tuple(b for b in g.blocks if b.name in set(self.meta["blocks"])))
        if check:
            recorded = {name: size for name, size in self.meta["groups"]}
            current = {name: size for name, size in sizes if name in recorded}
            if current != recorded or fingerprint(model, g) != self.meta["fingerprint"]:
                name = self.meta.get("model_name", "?")
                differ = sorted(set(recorded) ^ set(current)) or sorted(
                    k for k in recorded if recorded[k] != current[k])
                what = (f"other layers than model '{model.name}' (its channel groups "
                        f"differ: {differ[:4]})" if current != recorded else
                        f"other weights than model '{model.name}' has now (fingerprint "
                        "mismatch)")
                raise ValueError(
                    f"This trajectory was recorded on model '{name}' with {what}. Replay "
                    "it on the original, uncompressed model (e.g. reload it from its "
                    "file), or pass check=False."
                )
        where = (f"Trajectory {'file ' + repr(self.source) + ' ' if self.source else ''}"
                 f"does not fit model '{model.name}'")
        self._check_steps({k: v.size for k, v in g.groups.items()},
                          {b.name for b in g.blocks if b.evictable}, n_steps, where)
        options = self.meta.get("options", {})
        compensate = options.get("mean_compensation", False)
        correct = options.get("correct_statistics", False)
        if correct == "data" and data is None:
            import warnings

            warnings.warn("This trajectory was recorded with compress(data=...): pass "
                          "data= to replay to correct the BatchNormalization statistics "
                          "on it; they are left as the edits wrote them.", stacklevel=2)
        correction = StatisticsCorrection(False if correct == "data" else correct,
                                          data=data, verbose=False)
        moments = None
        if compensate or correct:
            moments = moments_lib.propagate(g.flat)
        correction.start(model, g, moments)
        editor = edit.ModelEditor(model, g, mean_compensation=compensate, moments=moments)
        for s in self.steps[:n_steps]:
            with editor.step():
                apply_step(editor, s)
        editor.commit()
        correction.finish(self.steps[:n_steps])
        return model


def _names(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f", … ({len(names)} in all)" if len(names) > 5 else "")


def _step_problem(s: Step, groups: dict, blocks: set) -> Optional[str]:
    """Why step `s` cannot apply to these groups ({name: size}) and blocks, or None."""
    if s.kind == "evict":
        if s.unit not in blocks:
            return f"names no evictable residual block (blocks: {_names(blocks) or 'none'})"
        return None if s.i == s.j == -1 else f"has slots i={s.i}, j={s.j} (expected -1)"
    if s.unit not in groups:
        return f"names no neuron group (groups: {_names(groups) or 'none'})"
    n = groups[s.unit]
    if not 0 <= s.i < n:
        return f"has slot i={s.i} outside [0, {n})"
    if s.kind == "prune" and s.j != -1:
        return f"has slot j={s.j} (expected -1 for a prune)"
    if s.kind == "merge":
        if not 0 <= s.j < n or s.j == s.i:
            return f"has slot j={s.j} outside [0, {n}) or equal to i={s.i}"
        if len(s.coef) != 6:
            return f"has {len(s.coef)} parent coefficients (expected 6)"
        if not np.all(np.isfinite(s.coef)) or np.max(np.abs(s.coef)) >= 1e30:
            # (the engine never records one of 1e30 or more: float32 would overflow)
            return f"has non-finite or overflowing parent coefficients {tuple(s.coef)}"
    return None


def apply_step(editor, s: Step) -> None:
    """Applies one recorded step with `editor` (shared by the engine and replay)."""
    if s.kind == "prune":
        editor.prune(s.unit, s.i)
    elif s.kind == "merge":
        editor.merge(s.unit, s.i, s.j, ParentCoefficients(*s.coef))
    else:
        editor.evict(s.unit)
