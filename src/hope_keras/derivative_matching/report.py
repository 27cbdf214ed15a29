"""The reports of `hope_keras.derivative_matching.compress_mlp`: `LayerReport` per
layer and `CompressionReport` for the model (docs/theory.md §10)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np


@dataclasses.dataclass
class LayerReport:
    """Per-layer outcome of :func:`compress_mlp`.

    Attributes:
        name: Dense layer name.
        index: Index among the Dense layers.
        original_width: Width before compression.
        kept_width: Width after compression (``≤ D_k``).
        order: Matching order ``k`` used for this layer.
        d_k: ``C(d_in + k, d_in)``.
        rank: Numerical rank of the feature matrix.
        l1_inflation: Ratio of the max row l1-norms (paper layout) of the next
            layer's weights, after / before this step (``≤ D_k`` in theory).
        max_coefficient: ``max |C|`` (≤ 1 + maxvol tol).
        selection_residual: ``‖Z − Z_K C‖ / ‖Z‖`` on the scaled features.
        step_error: Measured sup error of this step on the samples (target mode).
        kept_indices: Original indices of the kept neurons.
        seconds: Wall time of this step.
        compressed: False when the layer was left as is (rank ≥ width or budget not met).
    """

    name: str
    index: int
    original_width: int
    kept_width: int
    order: int
    d_k: int
    rank: int
    l1_inflation: float
    max_coefficient: float
    selection_residual: float
    step_error: Optional[float]
    kept_indices: np.ndarray
    seconds: float
    compressed: bool = True

    def __repr__(self) -> str:  # the kept indices' count, not the array
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["kept_indices"] = f"<{np.size(self.kept_indices)} indices>"
        return "LayerReport(" + ", ".join(
            f"{k}={v}" if k == "kept_indices" else f"{k}={v!r}" for k, v in fields.items()) + ")"


@dataclasses.dataclass
class CompressionReport:
    """What :func:`compress_mlp` did.

    Attributes:
        layers: One :class:`LayerReport` per compressed hidden layer, in the
            order they were processed.
        direction: ``"backward"`` or ``"forward"``.
        radius: Ball radius used for feature scaling and error measurement.
        center: Expansion point.
        target_error: The requested budget (``None`` in fixed-order mode).
        measured_error: Sup error of the student on the samples (float64
            evaluation of the stored weights; ``None`` in fixed-order mode unless
            ``measure=True``).
        params_before: Parameter count of the teacher.
        params_after: Parameter count of the student.
        seconds: Total wall time.
    """

    layers: List[LayerReport]
    direction: str
    radius: float
    center: np.ndarray
    target_error: Optional[float]
    measured_error: Optional[float]
    params_before: int
    params_after: int
    seconds: float

    @property
    def widths(self) -> Dict[str, int]:
        """Kept width per compressed layer name."""
        return {l.name: l.kept_width for l in self.layers}

    @property
    def reduction(self) -> float:
        """Parameter reduction factor ``params_before / params_after``."""
        return self.params_before / max(self.params_after, 1)

    def __str__(self) -> str:
        head = (
            f"{'layer':<16}{'width':>7}{'kept':>6}{'k':>4}{'D_k':>6}{'rank':>6}"
            f"{'l1 infl.':>10}{'max|C|':>8}{'step err':>11}{'s':>7}"
        )
        lines = [head, "-" * len(head)]
        for l in self.layers:
            err = "" if l.step_error is None else f"{l.step_error:.2e}"
            lines.append(
                f"{l.name:<16}{l.original_width:>7}{l.kept_width:>6}{l.order:>4}{l.d_k:>6}"
                f"{l.rank:>6}{l.l1_inflation:>10.2f}{l.max_coefficient:>8.3f}{err:>11}"
                f"{l.seconds:>7.2f}"
            )
        tail = (
            f"direction={self.direction} radius={self.radius} params {self.params_before} -> "
            f"{self.params_after} ({self.reduction:.1f}x) in {self.seconds:.2f}s"
        )
        if self.measured_error is not None:
            tail += f"; measured sup error {self.measured_error:.3e}"
        return "\n".join(lines + [tail])
