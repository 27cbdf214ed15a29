"""Matplotlib figures for HOPE runs (optional extra: ``pip install hope_keras[plots]``).

Every function draws on a given or new axis and returns it; `report` writes a
four-panel PNG.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hope_keras.plots needs matplotlib: pip install 'hope_keras[plots]'"
        ) from e
    return plt


def widths(trajectory, step: Optional[int] = None) -> Dict[str, tuple]:
    """``{group: (width before, width after step)}`` read off a trajectory.

    Example:

    >>> from hope_keras.search.trajectory import Step, Trajectory
    >>> t = Trajectory({"groups": [["fc", 4]], "blocks": [], "num_neurons": 4},
    ...                [Step("prune", "fc", 1, -1, 1.0, 10.0, 0.1, 2.0, 1.5, 3, 0.9)])
    >>> widths(t)
    {'fc': (4, 3)}
    """
    before = {name: int(size) for name, size in trajectory.meta["groups"]}
    after = dict(before)
    block_groups = trajectory.meta.get("block_groups", {})
    active = int(trajectory.meta["num_neurons"])
    for s in trajectory.steps[: len(trajectory.steps) if step is None else step]:
        if s.kind == "evict":
            for g in block_groups.get(s.unit, []):
                after[g] = 0
        else:  # a merge whose parent is inactive removes two neurons
            after[s.unit] -= active - s.active_after
        active = s.active_after
    return {name: (before[name], after[name]) for name in before}


def plot_widths(trajectory, ax=None, step=None):
    """Bar chart of each group's width before and after the run (or `step` steps)."""
    plt = _plt()
    ax = ax or plt.figure(figsize=(8, 4)).gca()
    w = widths(trajectory, step)
    names = list(w)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [w[n][0] for n in names], 0.4, label="before")
    ax.bar(x + 0.2, [w[n][1] for n in names], 0.4, label="after")
    ax.set_xticks(x, names, rotation=90, fontsize=6)
    ax.set_ylabel("neurons")
    ax.set_title("Width per group")
    ax.legend()
    return ax


def plot_dr(trajectory, ax=None):
    """Distortion rate of each executed step, coloured by action kind (log scale)."""
    plt = _plt()
    ax = ax or plt.figure(figsize=(6, 4)).gca()
    dr = trajectory.field("DR") if len(trajectory) else np.array([])
    kinds = trajectory.field("kind") if len(trajectory) else np.array([])
    for kind, colour in (("prune", "C0"), ("merge", "C1"), ("evict", "C3")):
        k = np.flatnonzero(kinds == kind)
        ax.scatter(k + 1, np.maximum(dr[k], 1e-12), s=6, c=colour, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("DR = J / P_init")
    ax.set_title("Distortion rate along the trajectory")
    ax.legend()
    return ax


def plot_capacity(trajectory, ax=None):
    """Initial layer capacity C of each group (recorded in the trajectory)."""
    plt = _plt()
    ax = ax or plt.figure(figsize=(8, 4)).gca()
    caps = trajectory.meta.get("capacities", {})
    names = list(caps)
    ax.bar(np.arange(len(names)), [caps[n] for n in names])
    ax.set_xticks(np.arange(len(names)), names, rotation=90, fontsize=6)
    ax.set_ylabel("C (l1 sum of ‖f_i‖)")
    ax.set_title("Initial capacity per group")
    return ax


def plot_capacity_histogram(analysis, ax=None, bins=40):
    """Histogram of the neuron capacities ‖f_i‖ of an `Analysis`, per group."""
    plt = _plt()
    ax = ax or plt.figure(figsize=(6, 4)).gca()
    for g in analysis.groups:
        ax.hist(g.capacities, bins=bins, histtype="step", label=g.name)
    ax.set_xlabel("‖f_i‖")
    ax.set_ylabel("neurons")
    ax.set_title("Neuron capacities")
    if len(analysis.groups) <= 10:
        ax.legend(fontsize=6)
    return ax


def plot_accuracy_vs_density(curves: Dict[str, tuple], ax=None, ylabel="accuracy"):
    """One line per method: ``curves = {name: (densities, values)}``."""
    plt = _plt()
    ax = ax or plt.figure(figsize=(6, 4)).gca()
    for name, (d, v) in curves.items():
        ax.plot(d, v, marker="o", label=name)
    ax.set_xlabel("neuron density")
    ax.set_ylabel(ylabel)
    ax.invert_xaxis()
    ax.legend(fontsize=7)
    return ax


def report(trajectory, path: str) -> str:
    """Writes a four-panel PNG: capacity per group, widths, DR and density per step.

    Example:

    >>> import keras, hope_keras
    >>> from hope_keras import plots
    >>> inputs = keras.Input((6,))
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs)))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> result = hope_keras.compress(model, steps=4, verbose=False)
    >>> plots.report(result.trajectory, "/tmp/doctest_report.png")
    '/tmp/doctest_report.png'
    """
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    plot_capacity(trajectory, axes[0, 0])
    plot_widths(trajectory, axes[0, 1])
    plot_dr(trajectory, axes[1, 0])
    ax = axes[1, 1]
    ax.plot(np.arange(1, len(trajectory) + 1), trajectory.densities(), label="neuron density")
    if len(trajectory):
        ax.plot(np.arange(1, len(trajectory) + 1), trajectory.field("params_after"),
                label="parameter ratio")
    ax.set_xlabel("step")
    ax.set_title("Density and parameters along the trajectory")
    ax.legend()
    fig.suptitle(f"HOPE run on '{trajectory.meta.get('model_name', '?')}'")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
