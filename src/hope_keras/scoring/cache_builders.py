"""Building a group's cache from the model's weights (docs/theory.md §1, §3 and §4).

`build_group_cache` turns a `hope_keras.scoring.neurons.LayerState` into a
`hope_keras.scoring.cache.GroupCache` (the Gram matrices, row-chunked); `build_sketch_cache`
reads a very wide group's weights once into the random projections of a
`hope_keras.scoring.cache.SketchCache`; `extract_rows` reads rows of a group's folded
vectors from the current weights (the sketched groups' exact re-pricing);
`OnDemandState` stands for a sketched group's `LayerState` without its arrays.
The sizes that choose between the two caches (`SKETCH_WIDTH`, `SKETCH_WORK`,
`SKETCH_DIM`, `SKETCH_SEED`, `CHUNK_ROWS`, `FLOAT32_WIDTH`) are read from
`hope_keras.scoring.cache` at each call, so setting them there takes effect;
`hope_keras.scoring.cache` also gives every name here.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from hope_keras.scoring import cache as cache_lib
from hope_keras.activations import kernels
from hope_keras.graph import layers as layer_rules
from hope_keras._host_buffers import read_values
from hope_keras.scoring.neurons import LayerState, bn_arrays, check_finite, extract_group


def extract_rows(array, get, group, rows, dtype=np.float64, columns=None):
    """Rows of a ``"neurons"`` group's folded vectors, read from the current weights.

    Args:
        array: ``array(layer_name, attr) -> numpy array`` of a weight (the model's,
            or `hope_keras.edit.editor.ModelEditor.array` for the edited mirror).
        get: ``get(layer_name) -> keras layer`` (for its configuration).
        group: The `hope_keras.graph.walker.NeuronGroup`.
        rows: Neuron indices.
        dtype: Of ``w_eff`` and ``u``.
        columns: ``columns(layer_name, attr, rows)``: the producer kernel's columns
            `rows` as rows (`hope_keras.edit.editor.ModelEditor.columns`, which caches
            them); None: gathered from `array`.

    Returns:
        ``(w_eff, b_eff, u)`` rows, as `hope_keras.scoring.neurons.extract_group` computes
        them (``b_eff`` in float64).
    """
    rows = np.asarray(rows, dtype=np.intp)
    producer, bn = get(group.producer), get(group.bn)
    axis = layer_rules.output_axis(producer)
    kernel = np.moveaxis(array(group.producer, "kernel"), axis, -1)
    columns = columns if axis == -1 else None  # a column cache holds last-axis columns
    n = kernel.shape[-1]
    contiguous = rows.size and rows[-1] - rows[0] == rows.size - 1 and np.all(np.diff(rows) == 1)
    flat = kernel.reshape(-1, n)
    if columns is not None:
        w_raw = columns(group.producer, "kernel", rows).astype(dtype, copy=False)
    else:  # np.take, not flat[:, rows]: the same columns, about 3× faster on a wide kernel
        w_raw = (flat[:, int(rows[0]):int(rows[-1]) + 1] if contiguous
                 else np.take(flat, rows, axis=1)).T.astype(dtype)
    has_bias = getattr(producer, "use_bias", False) and getattr(producer, "bias", None) is not None
    bias = array(group.producer, "bias")[rows].astype(np.float64) if has_bias else 0.0
    gamma = array(group.bn, "gamma")[rows].astype(np.float64) if bn.scale else 1.0
    beta = array(group.bn, "beta")[rows].astype(np.float64) if bn.center else 0.0
    mean = array(group.bn, "moving_mean")[rows].astype(np.float64)
    var = array(group.bn, "moving_variance")[rows].astype(np.float64)
    scale = np.broadcast_to(gamma / np.sqrt(var + float(bn.epsilon)), rows.shape)
    w_eff = scale.astype(dtype)[:, None] * w_raw
    b_eff = beta - scale * (mean - bias)
    positions = {c.layer: c.positions for c in group.readers}
    parts = []
    for c in group.consumers:
        layer = get(c.layer)
        pos = positions[c.layer][rows]
        for w in layer_rules.get(layer).in_weights(layer):
            if getattr(layer, w.attr, None) is None:
                continue
            idx = pos if w.expand == 1 else (
                pos[..., None] * w.expand + np.arange(w.expand)).reshape(rows.size, -1)
            taken = np.take(array(c.layer, w.attr), idx.reshape(-1), axis=w.axis)
            parts.append(np.moveaxis(taken, w.axis, 0).reshape(rows.size, -1)
                         .astype(dtype, copy=False))
    u = (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)) if parts \
        else np.zeros((rows.size, 0), dtype)
    return w_eff, np.asarray(b_eff, dtype=np.float64), u


def group_dims(get, group):
    """``(n, d, m)``: a ``"neurons"`` group's width, input and output vector lengths,
    from the layers' shapes."""
    n = group.size
    d = int(np.prod(get(group.producer).kernel.shape)) // max(n, 1)
    m = 0
    positions = {c.layer: c.positions for c in group.readers}
    for c in group.consumers:
        layer = get(c.layer)
        k = positions[c.layer].shape[1] if c.layer in positions else 1
        for w in layer_rules.get(layer).in_weights(layer):
            var = getattr(layer, w.attr, None)
            if var is not None:
                shape = tuple(var.shape)
                m += k * w.expand * int(np.prod(shape)) // max(shape[w.axis], 1)
    return n, d, m


def use_sketch(n: int, d: int, m: int) -> bool:
    """Whether a group of width n with vectors of lengths d, m gets a `SketchCache`."""
    return n >= cache_lib.SKETCH_WIDTH or float(n) * n * (d + m) >= cache_lib.SKETCH_WORK


def build_sketch_cache(get, group, kernel: str = "approx", chunk_rows: int = 512,
                       seed: Optional[int] = None):
    """Builds a `SketchCache` from the model's layers, streaming row chunks (never
    the group's full float64 vectors), projected on Gaussian columns drawn with
    ``seed`` (None: `SKETCH_SEED`).

    Returns:
        ``(cache, extras)``: the cache and a dict with ``p_init``, ``gamma``,
        ``beta``, ``mean``, ``var``, ``eps``, ``bias`` (the group's BN and producer
        arrays) and ``u_split``.

    Raises:
        ValueError: on NaN/Inf weights (naming the layer).
    """
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact'. Received: kernel={kernel!r}")

    memo = {}

    def array(layer, attr):
        key = (layer, attr)
        if key not in memo:
            v = getattr(get(layer), attr)
            # No copy where TensorFlow allows (read-only; the rows read are copied).
            arr = read_values(v) if hasattr(v, "numpy") else np.asarray(v)
            check_finite(layer, attr, arr)
            memo[key] = arr
        return memo[key]

    n = group.size
    gamma, beta, mean, var, eps = bn_arrays(get(group.bn))
    rng = np.random.default_rng(cache_lib.SKETCH_SEED if seed is None else seed)
    r = cache_lib.SKETCH_DIM
    # The projections multiply where the Gram products do (`cache.GRAM_BACKEND`): on
    # a CPU, NumPy's sgemm is 2–6× faster than TensorFlow's matmul for these (512 ×
    # 8192) @ (8192 × 256) chunks, and needs no copy of each chunk into a tensor.
    if cache_lib.multiplies_on_tensorflow():
        import tensorflow as tf

        def project(x, om):
            return tf.matmul(tf.constant(x), om).numpy()

        def omega(d):
            return tf.constant(rng.normal(0, 1 / np.sqrt(r), (d, r)), tf.float32)
    else:
        def project(x, om):
            return x @ om

        def omega(d):
            return rng.normal(0, 1 / np.sqrt(r), (d, r)).astype(np.float32)
    sk_w = sk_u = None
    dw, du, b_eff = np.empty(n), np.empty(n), np.empty(n)
    nnz = np.zeros(n)
    omega_w = omega_u = None
    first = True
    split = None
    for start in range(0, n, chunk_rows):
        rows = np.arange(start, min(n, start + chunk_rows))
        w, b, u = extract_rows(array, get, group, rows, dtype=np.float32)
        if first:  # vectors no longer than r are kept as they are (exact)
            first = False
            omega_w, omega_u = (None if x.shape[1] <= r else omega(x.shape[1])
                                for x in (w, u))
            sk_w = np.zeros((n, r if omega_w is not None else w.shape[1]), np.float32)
            sk_u = np.zeros((n, r if omega_u is not None else u.shape[1]), np.float32)
        for sk, x, om in ((sk_w, w, omega_w), (sk_u, u, omega_u)):
            sk[rows] = x if om is None else project(x, om)
        # Exact diagonals: float64 sums (of float32 weights' squares, exact in float64).
        dw[rows] = np.einsum("ij,ij->i", w, w, dtype=np.float64)
        du[rows] = np.einsum("ij,ij->i", u, u, dtype=np.float64)
        b_eff[rows] = b
        nnz[rows] = np.count_nonzero(u, axis=1)
        if split is None:
            split = _u_split(get, group, rows[:1])
    producer = get(group.producer)
    nnz += np.count_nonzero(np.moveaxis(array(group.producer, "kernel"), layer_rules.output_axis(
        producer), -1).reshape(-1, n), axis=0)
    has_bias = 1 if getattr(producer, "use_bias", False) else 0
    bias = (array(group.producer, "bias").astype(np.float64) if has_bias else np.zeros(n))
    g = np.abs(gamma).astype(np.float64)
    k_self = kernels.self_kernel(g, beta)
    cache = cache_lib.SketchCache(
        gamma=g, beta=beta.astype(np.float64).copy(), wnorm=np.sqrt(np.maximum(dw, 0.0)),
        k_self=k_self, capacity=np.sqrt(np.maximum(du, 0.0)) * np.sqrt(k_self),
        gram_v=None, gram_w=None, gram_u=None, kernel=kernel,
        sk_w=sk_w, sk_u=sk_u, dw=dw, du=du, bias=b_eff)
    extras = dict(p_init=(nnz + has_bias + 4).astype(np.float64), gamma=gamma, beta=beta,
                  mean=mean, var=var, eps=eps, bias=bias, u_split=split)
    return cache, extras


def _u_split(get, group, rows):
    split = [0]
    positions = {c.layer: c.positions for c in group.readers}
    for c in group.consumers:
        layer = get(c.layer)
        pos = positions[c.layer][rows]
        width = 0
        for w in layer_rules.get(layer).in_weights(layer):
            var = getattr(layer, w.attr, None)
            if var is None:
                continue
            shape = tuple(var.shape)
            width += pos.shape[1] * w.expand * int(np.prod(shape)) // max(shape[w.axis], 1)
        split.append(split[-1] + width)
    return split


class OnDemandState(LayerState):
    """The `LayerState` of a group too wide to keep its vectors (a `SketchCache`
    group): ``w_raw`` and ``u`` (and what derives from them) are re-read from the
    model's current weights when accessed, not kept in memory."""

    def __init__(self, graph, group, extras):  # noqa: D107 - not a dataclass init
        self._graph = graph
        self.group = group
        self.bias, self.gamma, self.beta = extras["bias"], extras["gamma"], extras["beta"]
        self.mean, self.var, self.eps = extras["mean"], extras["var"], extras["eps"]
        self.u_split, self.p_init = extras["u_split"], extras["p_init"]

    def _full(self):

        return extract_group(None, self.group, graph=self._graph)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def w_raw(self) -> np.ndarray:
        return self._full().w_raw

    @property
    def u(self) -> np.ndarray:
        return self._full().u

    def __repr__(self) -> str:
        return f"OnDemandState(group={self.group.name!r}, size={self.size})"


def _scaled_rows(scale: np.ndarray, w: np.ndarray, dtype) -> np.ndarray:
    """``(scale[:, None] * w).astype(dtype)`` (products in float64, then rounded)
    in the memory order of `w`, a block of its last axis at a time."""
    out = np.empty_like(w, dtype=dtype)  # keeps w's layout: the Gram product reads the same
    step = max(1, (cache_lib.CHUNK_ROWS * 1024) // max(w.shape[0], 1))
    for s in range(0, w.shape[1], step):
        out[:, s:s + step] = scale[:, None] * w[:, s:s + step]
    return out


def build_group_cache(state: LayerState, kernel: str = "approx") -> cache_lib.GroupCache:
    """Builds the cache of one group from its extracted neurons.

    Args:
        state: The group's `LayerState` (BN-folded neurons and output vectors).
        kernel: ``"approx"`` (the engine's zero-bias cross-kernel) or ``"exact"``.

    Returns:
        A `GroupCache`.

    Example:

    >>> import keras
    >>> from hope_keras.graph.walker import walk
    >>> from hope_keras.scoring.neurons import extract_group
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2)(x))
    >>> group = next(iter(walk(model).groups.values()))
    >>> cache = build_group_cache(extract_group(model, group))
    >>> cache.gram_u.shape, cache.capacity.shape
    ((16, 16), (16,))
    """
    if kernel not in ("approx", "exact"):
        raise ValueError(f"kernel must be 'approx' or 'exact'. Received: kernel={kernel!r}")
    n = state.size
    dtype = np.float32 if n >= cache_lib.FLOAT32_WIDTH else np.float64
    # No float64 temporaries of n × d or n × n besides the tables (the same values,
    # rounded a chunk at a time; 128 MB each for a 4096 × 4096 array): on a virtual
    # machine a cold `analyze` spends most of its time in the kernel's page faults on
    # fresh memory (measured with `benchmarks/scale.py vgg16`).
    w_eff = _scaled_rows(state.scale, state.w_raw, dtype)
    b = state.b_eff
    gram_w = cache_lib.gram(w_eff, dtype=dtype)
    del w_eff
    gram_v = np.empty_like(gram_w)  # gram_w + b bᵀ
    for s in range(0, n, cache_lib.CHUNK_ROWS):
        end = s + cache_lib.CHUNK_ROWS
        np.add(gram_w[s:end], np.outer(b[s:end], b).astype(dtype), out=gram_v[s:end])
    gram_u = cache_lib.gram(state.u, dtype=dtype)
    gamma = np.abs(state.gamma).astype(np.float64)
    beta = state.beta.astype(np.float64).copy()
    wnorm = np.sqrt(np.maximum(np.diag(gram_w).astype(np.float64), 0.0))
    k_self = kernels.self_kernel(gamma, beta)
    capacity = np.sqrt(np.maximum(np.diag(gram_u).astype(np.float64), 0.0)) * np.sqrt(k_self)
    return cache_lib.GroupCache(
        gamma=gamma, beta=beta, wnorm=wnorm, k_self=k_self, capacity=capacity,
        gram_v=gram_v, gram_w=gram_w, gram_u=gram_u, kernel=kernel,
    )
