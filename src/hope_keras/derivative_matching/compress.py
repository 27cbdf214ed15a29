"""Derivative matching for Keras MLPs: ``compress_mlp``, ``sup_error``, features.

Implements docs/theory.md §10 (the "width-independent
compressibility" construction): for each hidden layer ℓ, the derivative features
of its neurons at the center up to order ``k`` form ``Z`` (``D_k × d_ℓ``); a
maximum-volume set ``K`` of ``rank(Z)`` neurons is kept and the next layer's
weights become ``W^(ℓ+1) Cᵀ`` with ``C = Z_K⁺ Z`` (Keras layout: ``C @ kernel``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
import warnings
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

import keras

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules
from hope_keras.activations.lookup import activation_name, layer_activation

from .activations import (
    NON_ANALYTIC_ACTIVATIONS,
    AnalyticActivation,
    get_analytic_activation,
)
from .jets import compose_activation, estimate_memory, hidden_jets, multi_indices, num_features
from .maxvol import maxvol_columns
from .report import CompressionReport, LayerReport

__all__ = [
    "LayerReport",
    "CompressionReport",
    "compress_mlp",
    "derivative_features",
    "sup_error",
    "sample_ball",
]

_DEFAULT_MAX_MEMORY = 4 * 2**30


# --------------------------------------------------------------------------- #
# Parsing a Keras MLP
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _Step:
    dense: keras.layers.Layer
    act_layer: Optional[keras.layers.Layer]
    activation: object  # the callable actually applied after the Dense

    @property
    def name(self) -> str:
        return self.dense.name


def _is_activation_layer(layer) -> bool:
    """A weightless channelwise layer that applies an activation, as the layer
    registry says (``Activation``, ``ReLU``, ``ELU``, ...; `hope_keras.layers`)."""
    rule = layer_rules.get(layer)
    return (layer_rules.role_of(layer) == "channelwise" and not rule.channel_weights(layer)
            and layer_activation(layer) is not None)


def _parse_mlp(model) -> tuple:
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"compress_mlp expects a keras.Model. Received: model={type(model).__name__}"
        )
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(
            "Derivative matching supports single-input, single-output MLPs. "
            f"Received a model with {len(model.inputs)} inputs and {len(model.outputs)} outputs."
        )
    in_shape = tuple(model.inputs[0].shape)
    if len(in_shape) != 2 or in_shape[1] is None:
        raise ValueError(
            "Derivative matching needs a flat input of shape (batch, d_in). "
            f"Received input shape {in_shape}."
        )
    layers = [l for l in model.layers if not kg.is_input_layer(l)]
    functional = not isinstance(model, keras.Sequential)
    prev_out = model.inputs[0]
    steps: List[_Step] = []
    for layer in layers:
        if functional:
            try:
                ok = layer.input is prev_out
            except (AttributeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(
                    f"Layer {layer.name!r} is not fed by the previous layer's output: "
                    "derivative matching supports plain chains of Dense (and Activation) "
                    "layers only."
                )
            prev_out = layer.output
        rule = layer_rules.get(layer)
        if rule.kind == "dense":
            steps.append(_Step(layer, None, layer_activation(layer)))
        elif _is_activation_layer(layer):
            if not steps or steps[-1].act_layer is not None or (
                activation_name(steps[-1].activation) != "linear"
            ):
                raise ValueError(
                    f"Activation layer {layer.name!r} must directly follow a Dense layer "
                    "with a linear activation (one activation per Dense)."
                )
            steps[-1].act_layer = layer
            steps[-1].activation = layer_activation(layer)
        else:
            fold = (" A BatchNormalization after a Dense is affine at inference: fold it "
                    "in first, `hope_keras.fold_batchnorm(model)`."
                    if rule.normalization == "batch" and steps else "")
            raise ValueError(
                f"Layer {layer.name!r} of type {type(layer).__name__} is not supported: "
                "derivative matching compresses stacks of Dense layers (optionally each "
                f"followed by an Activation layer).{fold}"
            )
    if len(steps) < 2:
        raise ValueError(
            "Derivative matching needs at least one hidden Dense layer followed by an "
            f"output Dense layer. Received {len(steps)} Dense layer(s)."
        )
    for s in steps:
        if len(s.dense.kernel.shape) != 2:
            raise ValueError(f"Dense layer {s.name!r} must have a 2-D kernel.")
    return steps, int(in_shape[1]), functional


def _resolve_hidden_activations(steps: Sequence[_Step], upto: int) -> List[AnalyticActivation]:
    specs = []
    for s in steps[: upto + 1]:
        spec = get_analytic_activation(s.activation)
        if spec is None:
            name = activation_name(s.activation)
            where = f"layer {s.name!r}" + (
                f" (via Activation layer {s.act_layer.name!r})" if s.act_layer else ""
            )
            if name in NON_ANALYTIC_ACTIVATIONS:
                raise ValueError(
                    f"Hidden {where} uses activation {name!r}, which is not real-analytic: "
                    "derivative matching needs sigmoid, tanh, GELU, softplus, SiLU (or a "
                    "registered analytic activation). For ReLU-family networks use HOPE: "
                    "`hope_keras.compress`."
                )
            raise ValueError(
                f"Hidden {where} uses activation {name!r}, which derivative matching does not "
                "know. Supported: sigmoid, tanh, gelu, gelu_approximate, softplus, silu, "
                "linear. Register an analytic one with "
                "`hope_keras.derivative_matching.register_activation`; for non-analytic "
                "activations (ReLU family) use HOPE: `hope_keras.compress`."
            )
        specs.append(spec)
    return specs


def _weights(steps: Sequence[_Step]):
    kernels, biases = [], []
    for s in steps:
        k = np.asarray(s.dense.kernel.numpy()).astype(np.float64)
        if s.dense.use_bias:
            b = np.asarray(s.dense.bias.numpy()).astype(np.float64)
        else:
            b = np.zeros(k.shape[1])
        kernels.append(k)
        biases.append(b)
    return kernels, biases


def _center(center, d_in: int) -> np.ndarray:
    if center is None:
        return np.zeros(d_in)
    c = np.asarray(center, dtype=np.float64).reshape(-1)
    if c.shape != (d_in,):
        raise ValueError(
            f"center must have shape ({d_in},) to match the model input. "
            f"Received shape {np.shape(center)}."
        )
    return c


# --------------------------------------------------------------------------- #
# Public helpers
# --------------------------------------------------------------------------- #


def sample_ball(n: int, d: int, radius: float, center=None, seed: int = 0) -> np.ndarray:
    """Uniform samples of the closed Euclidean ball (the center is always included).

    Args:
        n: Number of points (``≥ 1``).
        d: Dimension.
        radius: Ball radius ``R``.
        center: Ball center ``(d,)`` (default origin).
        seed: Random seed.

    Returns:
        float64 array ``(n, d)``; row 0 is the center.

    Example:

    ```python
    from hope_keras.derivative_matching import sample_ball
    x = sample_ball(1000, 2, radius=2.0)
    assert (x ** 2).sum(1).max() <= 4.0 + 1e-12
    ```
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"The number of sample points must be an integer ≥ 1 (the "
                         f"center is one of them). Received: {n!r}")
    rng = np.random.default_rng(seed)
    c = _center(center, d)
    g = rng.normal(size=(n, d))
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    r = radius * rng.uniform(size=(n, 1)) ** (1.0 / d)
    x = c + g * r
    x[0] = c
    return x


def sup_error(
    teacher,
    student,
    radius: float = 1.0,
    samples: int = 20000,
    *,
    center=None,
    seed: int = 0,
    batch_size: int = 8192,
    points: Optional[np.ndarray] = None,
) -> float:
    """Estimated ``sup_{‖x − x0‖ ≤ R} ‖teacher(x) − student(x)‖_∞`` on uniform samples.

    Args:
        teacher: Reference Keras model.
        student: Model to compare (same input and output shapes).
        radius: Ball radius ``R``.
        samples: Number of uniform points in the ball (the center is one of them).
        center: Ball center (default origin).
        seed: Sampling seed.
        batch_size: Prediction batch size.
        points: Evaluate on these points instead of sampling.

    Returns:
        The largest absolute output difference over the points (float).

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import compress_mlp, sup_error
    keras.utils.set_random_seed(0)
    teacher = keras.Sequential([keras.Input((2,)),
                                keras.layers.Dense(128, activation="tanh"),
                                keras.layers.Dense(1)])
    student, report = compress_mlp(teacher, order=6)
    print(sup_error(teacher, student, radius=1.0, samples=2000))
    ```
    """
    d_in = int(teacher.inputs[0].shape[-1])
    if points is None and not (isinstance(radius, (int, float, np.floating)) and radius > 0
                               and np.isfinite(radius)):
        raise ValueError(f"radius must be a positive number. Received: radius={radius!r}")
    x = sample_ball(samples, d_in, radius, center, seed) if points is None else np.asarray(points)
    dtype = teacher.inputs[0].dtype or "float32"
    worst = 0.0
    for lo in range(0, x.shape[0], batch_size):
        xb = x[lo : lo + batch_size].astype(dtype)
        yt = keras.ops.convert_to_numpy(teacher(xb, training=False)).astype(np.float64)
        ys = keras.ops.convert_to_numpy(student(xb.astype(student.inputs[0].dtype or dtype), training=False)).astype(np.float64)
        if yt.shape != ys.shape:
            raise ValueError(
                f"Teacher and student outputs differ in shape: {yt.shape} vs {ys.shape}."
            )
        worst = max(worst, float(np.max(np.abs(yt - ys))))
    return worst


def derivative_features(model, layer, order: int, center=None) -> tuple:
    """Derivative features ``Φ(w_i) = [∂_x^α g(x0, w_i)]_{|α|≤k}`` of one hidden layer.

    Exact (truncated Taylor jets in float64), vectorised over neurons.

    Args:
        model: A Dense-stack Keras model (see :func:`compress_mlp`).
        layer: Hidden layer name or index among the Dense layers (0 = first).
        order: Highest derivative order ``k``.
        center: Expansion point ``x0`` (default origin).

    Returns:
        ``(phi, alphas)``: ``phi`` of shape ``(D_k, d_ℓ)`` with
        ``phi[r, i] = ∂^α g_i(x0)`` for ``α = alphas[r]``; ``alphas`` ``(D_k, d_in)``.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import derivative_features
    model = keras.Sequential([keras.Input((2,)),
                              keras.layers.Dense(16, activation="sigmoid"),
                              keras.layers.Dense(1)])
    phi, alphas = derivative_features(model, 0, order=4)
    assert phi.shape == (15, 16)
    ```
    """
    steps, d_in, _ = _parse_mlp(model)
    ell = _layer_index(steps, layer)
    if ell >= len(steps) - 1:
        raise ValueError(f"Layer {steps[ell].name!r} is the output layer, not a hidden layer.")
    specs = _resolve_hidden_activations(steps, ell)
    kernels, biases = _weights(steps)
    c = _center(center, d_in)
    jet = hidden_jets(kernels, biases, specs, c, int(order), ell)[ell]
    alphas = multi_indices(d_in, int(order))
    fact = np.prod([[math.factorial(int(a)) for a in row] for row in alphas], axis=1)
    return jet * fact[:, None], alphas


def _layer_index(steps, layer) -> int:
    if isinstance(layer, (int, np.integer)):
        idx = int(layer)
        if not 0 <= idx < len(steps):
            raise ValueError(
                f"Layer index {layer} out of range: the model has {len(steps)} Dense layers."
            )
        return idx
    names = [s.name for s in steps]
    if layer in names:
        return names.index(layer)
    for i, s in enumerate(steps):
        if s.act_layer is not None and s.act_layer.name == layer:
            return i
    raise ValueError(f"No Dense layer named {layer!r}. Dense layers: {names}.")


# --------------------------------------------------------------------------- #
# Core
# --------------------------------------------------------------------------- #


def _np_forward(kernels, biases, act_fns, x, start=0, h=None):
    out = np.asarray(x, dtype=np.float64) if h is None else h
    for ell in range(start, len(kernels)):
        out = act_fns[ell](out @ kernels[ell] + biases[ell])
    return out


def _output_activation_np(activation):
    spec = get_analytic_activation(activation)
    if spec is not None:
        return spec.forward

    def fn(z):
        t = keras.ops.convert_to_tensor(z, dtype="float64")
        return keras.ops.convert_to_numpy(activation(t)).astype(np.float64)

    return fn


def _max_row_l1(kernel: np.ndarray) -> float:
    # Keras kernel (in, out); paper rows = outputs -> column sums of |kernel|.
    return float(np.max(np.sum(np.abs(kernel), axis=0))) if kernel.size else 0.0


def _select(jet_scaled: np.ndarray, dk: int, rtol: float, tol: float, keep: str):
    z = jet_scaled[:dk]
    numerical = maxvol_columns(z, rtol=rtol, tol=tol)
    sel = numerical
    if keep == "dk":
        sel = maxvol_columns(z, rank=min(dk, z.shape[1]), tol=tol)
    if sel.rank == 0:
        # All matched derivatives vanish: keep one neuron with zero outgoing weights
        # (Keras layers need at least one unit).
        sel = dataclasses.replace(
            sel, columns=np.zeros(1, dtype=np.int64),
            coefficients=np.zeros((1, z.shape[1])), rank=1, max_coefficient=0.0,
        )
    return sel, numerical.rank


def _apply(kernels, biases, ell, sel, cast):
    new_k = list(kernels)
    new_b = list(biases)
    cols = sel.columns
    new_k[ell] = kernels[ell][:, cols]
    new_b[ell] = biases[ell][cols]
    new_k[ell + 1] = cast(sel.coefficients @ kernels[ell + 1])
    return new_k, new_b


def compress_mlp(
    model,
    order: Union[int, Sequence[int], None] = None,
    *,
    target_error: Optional[float] = None,
    radius: float = 1.0,
    direction: str = "backward",
    center=None,
    layers: Optional[Sequence[Union[int, str]]] = None,
    max_order: int = 12,
    samples: int = 4096,
    seed: int = 0,
    rank_rtol: float = 1e-12,
    keep: str = "rank",
    maxvol_tol: float = 0.01,
    max_memory_bytes: int = _DEFAULT_MAX_MEMORY,
    measure: bool = False,
    verbose: int = 0,
):
    """Compress the hidden layers of an analytic MLP by derivative matching.

    For each hidden layer ℓ (backward: last hidden layer first), the derivative
    features of its neurons at ``center`` up to order ``k`` are computed exactly
    (float64 jets), ``rank(Z) ≤ D_k`` neurons of maximal volume are kept and the
    next layer's kernel becomes ``C @ kernel`` with ``C = Z_K⁺ Z``. All input
    derivatives of the network output at the center up to order ``k`` are then
    unchanged, and the error on a ball of radius ``R`` decays like
    ``(R/ρ₀)^{k+1}``.

    Give exactly one of ``order`` and ``target_error``. With ``target_error=ε``
    the budget is split uniformly over the compressed layers, ``ε_ℓ = ε / n``
    (the paper's ``ε / ((L−1) Λ̄)`` with ``Λ̄ = 1``: each step's error is measured at
    the network output, so the downstream Lipschitz factor is already included),
    and each layer gets the smallest ``k ≤ max_order`` whose measured step error
    on ``samples`` uniform points of the ball meets ``ε_ℓ``; by the triangle
    inequality the total error on those points is ``≤ ε``.

    Args:
        model: ``keras.Sequential`` or functional chain of ``Dense`` layers (each
            optionally followed by an ``Activation`` layer), one flat input.
            Hidden activations must be real-analytic (sigmoid, tanh, gelu,
            gelu_approximate, softplus, silu, linear, or registered); the output
            activation may be anything.
        order: Matching order ``k`` (one int, or one per compressed layer in
            layer order).
        target_error: Sup-error budget ``ε`` on the ball (instead of ``order``).
        radius: Ball radius ``R`` (error measurement and feature scaling: the
            rank is decided on Taylor coefficients scaled by ``R^|α|``).
        direction: ``"backward"`` (last hidden layer first, as the theory
            requires) or ``"forward"``.
        center: Expansion point ``x0`` ``(d_in,)`` (default the origin).
        layers: Hidden layers to compress (names or Dense indices; default all).
        max_order: Largest order tried in ``target_error`` mode.
        samples: Points of the ball for the ``target_error`` search.
        seed: Sampling seed.
        rank_rtol: Relative threshold of the numerical rank (pivoted QR) on the
            radius-scaled Taylor coefficients.
        keep: ``"rank"`` keeps the numerical rank ``n ≤ D_k`` neurons (default);
            ``"dk"`` keeps up to ``min(D_k, width)`` neurons as the paper's
            experiments do: directions below the rank threshold are matched too
            (``max |C|`` stays ``≤ 1 + maxvol_tol`` thanks to maxvol), only exactly
            vanishing pivots (e.g. even derivatives of sigmoid at 0) are skipped.
        maxvol_tol: Maxvol stops when ``max |C| ≤ 1 + maxvol_tol``.
        max_memory_bytes: Refuse (with the estimate) when the features would need more.
        measure: Also measure the final sup error on the samples in fixed-order mode.
        verbose: 1 prints one line per layer.

    Returns:
        ``(student, report)``: a new Keras model of the same depth, layer names,
        activations and dtype, and a :class:`CompressionReport`.

    Raises:
        ValueError: Unsupported architecture or activation (ReLU: use
            ``hope_keras.compress``), bad arguments, or features needing more than
            ``max_memory_bytes``.

    Example:

    ```python
    import keras
    from hope_keras.derivative_matching import compress_mlp, sup_error
    keras.utils.set_random_seed(0)
    teacher = keras.Sequential([
        keras.Input((2,)),
        keras.layers.Dense(256, activation="gelu"),
        keras.layers.Dense(256, activation="gelu"),
        keras.layers.Dense(2),
    ])
    student, report = compress_mlp(teacher, order=8, radius=1.0)
    print(report)                       # hidden widths <= D_8 = 45
    print(sup_error(teacher, student, radius=1.0))
    ```
    """
    t_start = time.perf_counter()
    steps, d_in, functional = _parse_mlp(model)
    n_hidden = len(steps) - 1
    if (order is None) == (target_error is None):
        raise ValueError(
            "Give exactly one of order=k and target_error=eps. "
            f"Received: order={order!r}, target_error={target_error!r}"
        )
    if direction not in ("backward", "forward"):
        raise ValueError(
            f"direction must be 'backward' or 'forward'. Received: direction={direction!r}"
        )
    if keep not in ("rank", "dk"):
        raise ValueError(f"keep must be 'rank' or 'dk'. Received: keep={keep!r}")
    if not (radius > 0 and np.isfinite(radius)):
        raise ValueError(f"radius must be a positive number. Received: radius={radius!r}")
    c0 = _center(center, d_in)

    if layers is None:
        todo = list(range(n_hidden))
    else:
        todo = sorted({_layer_index(steps, l) for l in layers})
        for i in todo:
            if i >= n_hidden:
                raise ValueError(
                    f"Layer {steps[i].name!r} is the output layer; only hidden layers "
                    "can be compressed."
                )
    if order is not None:
        orders = [order] * len(todo) if np.isscalar(order) else list(order)
        if len(orders) != len(todo):
            raise ValueError(
                f"order has {len(orders)} entries but {len(todo)} layers are compressed."
            )
        for o in orders:
            if int(o) != o or o < 0:
                raise ValueError(f"order must be a non-negative integer. Received: order={order!r}")
        if any(int(o) == 0 for o in orders):
            warnings.warn(
                "order=0 matches the teacher's value at the center only: each layer "
                "compressed with it keeps a single neuron (D_0 = 1), whatever its width. "
                f"Use order ≥ 1 for a useful student. Received: order={order!r}",
                stacklevel=2)
        layer_order = dict(zip(todo, [int(o) for o in orders]))
    else:
        if not target_error > 0:
            raise ValueError(f"target_error must be > 0. Received: target_error={target_error!r}")
        if int(max_order) != max_order or max_order < 0:
            raise ValueError(f"max_order must be a non-negative integer. Received: {max_order!r}")
        layer_order = {i: int(max_order) for i in todo}

    # Checks the whole upstream chain of every compressed layer is analytic.
    kmax = max(layer_order.values()) if layer_order else 0
    widths = [int(s.dense.kernel.shape[1]) for s in steps]
    need = estimate_memory(d_in, kmax, max(widths[:-1]))
    dk_max = num_features(d_in, kmax)
    if need > max_memory_bytes:
        raise ValueError(
            f"Derivative features of order k={kmax} in d_in={d_in} variables need "
            f"D_k={dk_max} derivatives per neuron and about {need / 2**30:.2f} GiB "
            f"(limit max_memory_bytes={max_memory_bytes / 2**30:.2f} GiB). Lower the order, "
            "reduce d_in, or raise max_memory_bytes."
        )
    for i in todo:
        dk = num_features(d_in, layer_order[i])
        if order is not None and dk >= widths[i]:
            warnings.warn(
                f"Layer {steps[i].name!r} has width {widths[i]} <= D_k={dk} "
                f"(d_in={d_in}, k={layer_order[i]}): it can only shrink if its features "
                "are rank-deficient.",
                RuntimeWarning,
                stacklevel=2,
            )

    dtype = np.dtype(keras.backend.standardize_dtype(steps[0].dense.kernel.dtype))
    cast = lambda a: np.asarray(a, dtype=dtype).astype(np.float64)  # noqa: E731
    kernels, biases = _weights(steps)
    hidden_fwd = []
    for s in steps[:-1]:
        spec = get_analytic_activation(s.activation)
        hidden_fwd.append(spec.forward if spec is not None else _output_activation_np(s.activation))
    act_fns = hidden_fwd + [_output_activation_np(steps[-1].activation)]

    xs = None
    if target_error is not None or measure:
        xs = sample_ball(samples, d_in, radius, c0, seed)
        y_teacher = _np_forward(kernels, biases, act_fns, xs)

    seq = sorted(todo, reverse=(direction == "backward"))
    reports: List[LayerReport] = []
    if target_error is not None:
        eps_layer = float(target_error) / max(len(todo), 1)
    jet_cache: Dict[int, np.ndarray] = {}
    alphas_all = multi_indices(d_in, kmax)
    all_specs = _resolve_hidden_activations(steps, max(todo)) if todo else []

    def layer_jet(ell: int) -> np.ndarray:
        # Jets of layer ell's outputs in the *current* network, at degree kmax.
        if ell not in jet_cache:
            start = max([j for j in jet_cache if j < ell], default=-1)
            if start >= 0:
                prev = jet_cache[start]
            else:
                prev = None
            for j in range(start + 1, ell + 1):
                if prev is None:
                    out = hidden_jets(kernels, biases, all_specs, c0, kmax, 0)[0]
                else:
                    pre = prev @ kernels[j]
                    pre[0] += biases[j]
                    coeffs = all_specs[j].taylor(pre[0], kmax)
                    out = compose_activation(pre, np.asarray(coeffs, np.float64), d_in, kmax)
                jet_cache[j] = out
                prev = out
        return jet_cache[ell]

    for ell in seq:
        t0 = time.perf_counter()
        k_top = layer_order[ell]
        dk_top = num_features(d_in, k_top)
        jet = layer_jet(ell)[:dk_top]
        scale = float(radius) ** alphas_all[:dk_top].sum(axis=1).astype(np.float64)
        jet_scaled = jet * scale[:, None]
        width = kernels[ell].shape[1]
        old_l1 = _max_row_l1(kernels[ell + 1])
        chosen = None
        step_err = None
        num_rank = None
        if target_error is None:
            sel, num_rank = _select(jet_scaled, dk_top, rank_rtol, maxvol_tol, keep)
            chosen = (k_top, sel)
        else:
            h_up = _np_forward(kernels[:ell], biases[:ell], act_fns[:ell], xs)
            y_cur = _np_forward(kernels, biases, act_fns, xs, start=ell, h=h_up)
            for k in range(0, k_top + 1):
                dk = num_features(d_in, k)
                sel, num_rank = _select(jet_scaled, dk, rank_rtol, maxvol_tol, keep)
                if sel.rank >= width:
                    break
                nk, nb = _apply(kernels, biases, ell, sel, cast)
                y_new = _np_forward(nk, nb, act_fns, xs, start=ell, h=h_up)
                err = float(np.max(np.abs(y_new - y_cur)))
                if err <= eps_layer:
                    chosen, step_err = (k, sel), err
                    break
            if chosen is None:
                warnings.warn(
                    f"Layer {steps[ell].name!r}: no order k <= {k_top} with fewer than "
                    f"{width} neurons meets the per-layer budget {eps_layer:.3e}; the layer "
                    "is left uncompressed. Raise max_order or target_error.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if chosen is None or chosen[1].rank >= width:
            k_used = k_top if chosen is None else chosen[0]
            rank = width if num_rank is None else num_rank
            reports.append(
                LayerReport(
                    name=steps[ell].name, index=ell, original_width=width, kept_width=width,
                    order=k_used, d_k=num_features(d_in, k_used), rank=rank,
                    l1_inflation=1.0, max_coefficient=1.0, selection_residual=0.0,
                    step_error=None if chosen is None else 0.0,
                    kept_indices=np.arange(width), seconds=time.perf_counter() - t0,
                    compressed=False,
                )
            )
            continue
        k_used, sel = chosen
        kernels, biases = _apply(kernels, biases, ell, sel, cast)
        kernels[ell] = cast(kernels[ell])
        # Kept neurons keep their functions: slice the cached jet, drop the ones downstream.
        jet_cache[ell] = jet_cache[ell][:, sel.columns]
        for j in [j for j in jet_cache if j > ell]:
            del jet_cache[j]
        new_l1 = _max_row_l1(kernels[ell + 1])
        rep = LayerReport(
            name=steps[ell].name,
            index=ell,
            original_width=width,
            kept_width=int(sel.rank),
            order=k_used,
            d_k=num_features(d_in, k_used),
            rank=int(num_rank),
            l1_inflation=new_l1 / old_l1 if old_l1 > 0 else float("inf"),
            max_coefficient=sel.max_coefficient,
            selection_residual=sel.residual,
            step_error=step_err,
            kept_indices=sel.columns.copy(),
            seconds=time.perf_counter() - t0,
        )
        reports.append(rep)
        if verbose:
            print(
                f"[derivative_matching] {rep.name}: {width} -> {rep.kept_width} "
                f"(k={k_used}, D_k={rep.d_k}, l1 x{rep.l1_inflation:.2f}, {rep.seconds:.2f}s)"
            )

    measured = None
    if xs is not None:
        measured = float(np.max(np.abs(_np_forward(kernels, biases, act_fns, xs) - y_teacher)))
        if target_error is not None and measured > target_error:
            warnings.warn(
                f"Measured sup error {measured:.3e} exceeds target_error={target_error:.3e}.",
                RuntimeWarning,
                stacklevel=2,
            )
    student = _rebuild(model, steps, kernels, biases, functional, d_in)
    params_before = int(model.count_params())
    params_after = int(student.count_params())
    report = CompressionReport(
        layers=reports,
        direction=direction,
        radius=float(radius),
        center=c0,
        target_error=None if target_error is None else float(target_error),
        measured_error=measured,
        params_before=params_before,
        params_after=params_after,
        seconds=time.perf_counter() - t_start,
    )
    return student, report


def _rebuild(model, steps, kernels, biases, functional, d_in):
    in_tensor = model.inputs[0]
    new_layers = []
    pairs = []
    for s, k in zip(steps, kernels):
        cfg = s.dense.get_config()
        cfg["units"] = int(k.shape[1])
        cfg["activation"] = "linear"  # set the very same callable below (custom ones too)
        dense = s.dense.__class__.from_config(cfg)
        dense.activation = s.dense.activation
        pairs.append((dense, s))
        new_layers.append(dense)
        if s.act_layer is not None:
            acfg = s.act_layer.get_config()
            holds_fn = "activation" in acfg  # Activation(fn); ReLU, ELU, ... hold numbers
            if holds_fn:
                acfg["activation"] = "linear"
            act = s.act_layer.__class__.from_config(acfg)
            if holds_fn:
                act.activation = s.act_layer.activation
            new_layers.append(act)
    if functional:
        inputs = keras.Input(shape=(d_in,), dtype=in_tensor.dtype, name=in_tensor.name)
        x = inputs
        for layer in new_layers:
            x = layer(x)
        student = keras.Model(inputs, x, name=model.name)
    else:
        student = keras.Sequential(
            [keras.Input(shape=(d_in,), dtype=in_tensor.dtype)] + new_layers, name=model.name
        )
    for (dense, s), k, b in zip(pairs, kernels, biases):
        dt = keras.backend.standardize_dtype(s.dense.kernel.dtype)
        if s.dense.use_bias:
            dense.set_weights([k.astype(dt), b.astype(dt)])
        else:
            dense.set_weights([k.astype(dt)])
    return student
