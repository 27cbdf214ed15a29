"""The HOPE greedy encoder (docs/theory.md §3–§5).

Every step executes the admissible action with the lowest ranking key ``DR`` among
all prunes, merges and evictions (``DR = cost.rank(J, ...)``: ``J`` per neuron
removed for the default cost, ``J / P_init`` for the paper's), edits the model
(through `hope_keras.edit`), records the step (`hope_keras.trajectory`), then
refreshes only what changed: the touched group's best action and the eviction cost
of the block that holds it. A group's best merge comes from its bounded candidate
table (`hope_keras.candidates.MergeTable`: each neuron's ``k`` best partners, lazy
per-row bounds, exact for the built-in costs), so a step touches O(n) bounds and a
few rows rather than the n²/2 pairs; a merge recomputes the parent's row in O(n)
kernel work. Each group's and block's best action sits in a heap, so a step does not
grow with the number of layers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import functools
import heapq
import math
import numbers
import os
import threading
from typing import Dict, Iterable, Optional

import keras
import numpy as np

from hope_keras import _keras_graph as kg
from hope_keras import bn_stats, costs
from hope_keras import layers as layer_rules
from hope_keras.analysis import Analysis, analyze
from hope_keras.cache import (SketchCache, _background, build_group_cache, build_sketch_cache,
                              extract_rows, wait_background)
from hope_keras.candidates import MergeTable
from hope_keras.edit import ModelEditor, ParentCoefficients, defer_keyboard_interrupt
from hope_keras.neurons import extract_group
from hope_keras.progress import WorkBar, resolve_verbose
from hope_keras.trajectory import Step, Trajectory, fingerprint

ACTIONS = ("prune", "merge", "evict")

#: Merge candidates kept per neuron by default (`Encoder`'s ``merge_candidates``).
DEFAULT_MERGE_CANDIDATES = 16

#: With ``merge_candidates="auto"`` and the certified search, groups up to this width
#: keep every pair (a dense table, each pair priced once); wider ones keep
#: `DEFAULT_MERGE_CANDIDATES` partners per neuron. Four n × n float64 tables of 1024
#: neurons are 32 MB; wider tables are compact (`candidates.DENSE_FLOAT64_MAX`):
#: 144 MB for 4096 neurons.
DENSE_PAIRS_MAX = 4096

#: Sketched groups (`hope_keras.cache.SketchCache`): pairs re-priced from exact Gram
#: entries per selection (the selected one and the next cheapest rows' pairs).
REFINE_BATCH = 8
#: ... and in groups of `REFINE_WIDE` neurons or more, `REFINE_BATCH_WIDE` pairs: a
#: round costs mostly its fixed work, so fewer, larger rounds pay where many are
#: needed (the 4 × 8192 MLP: 1.4 rounds a step against 2.3, its run 20–24 % shorter,
#: the sum of J lower; on the trained models sketched whole, whose groups are narrow,
#: 16 pairs gave no better accuracy than 8: measured with benchmarks/sketch_search.py).
REFINE_WIDE = 6144
REFINE_BATCH_WIDE = 16
#: ``merge_search="auto"`` (the default) certifies the merge search in groups
#: narrower than this, and selects the best of each neuron's top-k partners
#: (``"top_k"``) in groups at least this wide (those sketched by width alone,
#: `cache.SKETCH_WIDTH`): there the certified search's rescans take tenths of a
#: second a step, and more as the run goes (the 4 × 8192 MLP: 181 ms a step over its
#: first 300 steps) where the top-k search takes about 6 ms. No model of the quality
#: benchmark has a group this wide: on all of them "auto" is the certified search.
AUTO_TOP_K_WIDTH = 6144
# Bytes of a sketched group's producer-kernel columns the editor keeps (`ModelEditor.
# cache_columns`): exact re-pricing reads the same neurons' weights step after step.
# 16 MB: 512 columns of an 8192 × 8192 float32 kernel, 4096 of a 1024 × 8192 one.
COLUMN_CACHE_BYTES = 16 << 20

# Merge tables built at once (`Encoder._set_tables`) fill in threads from this many
# pairs (sum of n² over their groups): below it a thread costs more than it saves.
PARALLEL_FILL_PAIRS = 1 << 22

#: Capacity, relative to the layer's initial capacity, below which a neuron only
#: prunes (`_GroupState.pair_ok`).
NEGLIGIBLE = 1e-9


@dataclasses.dataclass
class CompressionResult:
    """What `compress` returns.

    Attributes:
        trajectory: The executed steps (`hope_keras.Trajectory`).
        density: Reached neuron density (active / initial compressible neurons).
        params_ratio: Live parameters of the slimmed model / original parameters.
        flops_ratio: FLOPs per example of the slimmed model / original FLOPs.
        stopped: Why the run stopped: ``"budget"``, ``"no_action"`` or ``"steps"``.
        analysis: The `Analysis` of the model before compression.
        model: The compressed model (edited in place).
        corrected: Names of the BatchNormalization layers whose statistics the run
            corrected after its steps.
        data: The ``data=`` given to `compress` (`recover` reuses it).
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

    def __repr__(self) -> str:  # one line: the analysis' caches are not printed
        return (f"CompressionResult(model={self.trajectory.meta.get('model_name')!r}, "
                f"steps={len(self.trajectory)}, density={self.density:.4f}, "
                f"params_ratio={self.params_ratio:.4f}, flops_ratio={self.flops_ratio:.4f}, "
                f"stopped={self.stopped!r})")

    def recover(self, teacher=None, **kwargs):
        """`hope_keras.recover` of the compressed model on the ``data`` given to
        `compress`: distillation from ``teacher``, without the BatchNormalization
        re-estimation before it (`compress` has just made it on the same data).

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
        from hope_keras.recover import recover

        if self.model is None or self.data is None:
            raise ValueError("CompressionResult.recover needs the data= given to compress; "
                             "this run had none: call hope_keras.recover(model, data, "
                             "teacher=...) instead.")
        kwargs.setdefault("reestimate", "after")
        return recover(self.model, self.data, teacher=teacher, **kwargs)

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
        if isinstance(layer, keras.layers.BatchNormalization):
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


class _SizeCounter:
    """Live parameters and FLOPs of the slimmed model, updated per touched layer.

    Every tensor has a live channel count; removing a channel of a group lowers it
    on every tensor the group flows through, and each layer's size is recounted
    from its input and output live counts by its layer rule (`hope_keras.layers`).
    A step recounts only the layers of the group it touched. FLOPs are 2 × the
    multiply-adds of the layers with kernels (Dense, ConvND, depthwise and
    separable convolutions) for one example; BN, activations and pooling count 0.
    """

    def __init__(self, model, analysis: Analysis):
        g = analysis.graph
        fg = g.flat
        self.fg = fg
        self.params0 = int(model.count_params())
        self.live = {name: grp.size for name, grp in g.groups.items()}
        self.tensor_live = {t: (int(s[-1]) if len(s) > 1 and s[-1] else 0)
                            for t, s in fg.shapes.items()}
        self.group_tensors = {name: {t: pos.shape[1] for t, pos in grp.tensors.items()}
                              for name, grp in g.groups.items()}
        self.layers_of: Dict[str, set] = {}
        touched = set()
        for name, grp in g.groups.items():
            keys = set()
            for t in grp.tensors:
                p = fg.producer_node(t)
                if p is not None:
                    keys.add(p.key)
                keys |= {fg.nodes[k].key for k in fg.consumers.get(t, ())}
            keys = {k for k in keys if _sized(fg.layers[k])}
            self.layers_of[name] = keys
            touched |= keys
        for b in g.blocks:
            touched |= {k for k in b.branch_layers if _sized(fg.layers[k])}
        self.evicted: set = set()
        self._formulas: Dict[str, tuple] = {}
        self.flops0 = sum(self._node_flops(n) for n in fg.nodes)
        self.params_now, self.flops_now = {}, {}
        for key in touched:
            self.params_now[key], self.flops_now[key] = self._count(key)
        self.params = self.params0
        self.flops = self.flops0

    def _node_flops(self, node, tensor_live=None) -> int:
        layer = node.op
        if not isinstance(layer, keras.layers.Layer) or not node.inputs or not node.outputs:
            return 0
        live = self.tensor_live if tensor_live is None else tensor_live
        rule = layer_rules.get(layer)
        return int(rule.flops(layer, node, live[node.inputs[0]], live[node.outputs[0]],
                              self.fg.shapes[node.inputs[0]], self.fg.shapes[node.outputs[0]]))

    def _size_at(self, key: str, n_in, n_out):
        """(params, flops) of layer `key` at input/output widths (rule formulas)."""
        node = self.fg.node_of(key)
        layer = node.op
        rule = layer_rules.get(layer)
        role = layer_rules.role_of(layer, node)
        if role == "source":
            params = layer_rules.weight_param_count(layer, rule, n_in, n_out, None)
        elif role == "channelwise":
            params = layer_rules.weight_param_count(layer, rule, None, None, n_in)
        else:
            params = int(layer.count_params())
        flops = 0
        if node.inputs and node.outputs:
            flops = int(rule.flops(layer, node, n_in, n_out, self.fg.shapes[node.inputs[0]],
                                   self.fg.shapes[node.outputs[0]]))
        return params, flops

    def _formula(self, key: str):
        """Bilinear coefficients of (params, flops) in (live in, live out): every
        layer rule's sizes are affine in each width, so four probes fix them."""
        f = self._formulas.get(key)
        if f is None:
            (p11, f11), (p21, f21), (p12, f12), (p22, f22) = (
                self._size_at(key, a, b) for a, b in ((1, 1), (2, 1), (1, 2), (2, 2)))
            pc = p22 - p21 - p12 + p11
            fc = f22 - f21 - f12 + f11
            pa, fa = p21 - p11 - pc, f21 - f11 - fc
            pb, fb = p12 - p11 - pc, f12 - f11 - fc
            f = (p11 - pa - pb - pc, pa, pb, pc, f11 - fa - fb - fc, fa, fb, fc)
            node = self.fg.node_of(key)
            f = f + (node.inputs[0] if node.inputs else None,
                     node.outputs[0] if node.outputs else None)
            self._formulas[key] = f
        return f

    def _count(self, key: str, tensor_live=None):
        """(params, flops) of layer `key` at the given live tensor widths."""
        if key in self.evicted:
            return 0, 0
        live = self.tensor_live if tensor_live is None else tensor_live
        p0, pa, pb, pc, f0, fa, fb, fc, t_in, t_out = self._formula(key)
        a = live[t_in] if t_in is not None else 0
        b = live[t_out] if t_out is not None else 0
        return p0 + pa * a + pb * b + pc * a * b, f0 + fa * a + fb * b + fc * a * b

    def _lives_after(self, group: str, removed: int):
        live = dict(self.tensor_live)
        for t, k in self.group_tensors[group].items():
            live[t] -= k * removed
        return live

    def remove(self, group: str, removed: int) -> None:
        """Records that `group` lost `removed` channels (recount with `update`)."""
        self.live[group] -= removed
        for t, k in self.group_tensors[group].items():
            self.tensor_live[t] -= k * removed

    def update(self, names: Iterable[str]) -> None:
        for name in names:
            p, f = self._count(name)
            self.params += p - self.params_now[name]
            self.flops += f - self.flops_now[name]
            self.params_now[name], self.flops_now[name] = p, f

    def marginal(self, group: str, removed: int = 1):
        """(params, flops) the slimmed model loses if `group` loses `removed` channels."""
        live = {t: self.tensor_live[t] - k * removed
                for t, k in self.group_tensors[group].items()}
        full = _Overlay(self.tensor_live, live)
        dp = df = 0
        for name in self.layers_of[group]:
            p, f = self._count(name, full)
            dp += self.params_now[name] - p
            df += self.flops_now[name] - f
        return dp, df

    def copy(self) -> "_SizeCounter":
        """An independent counter in the same state (formulas shared)."""
        new = copy.copy(self)
        for attr in ("live", "tensor_live", "params_now", "flops_now"):
            setattr(new, attr, dict(getattr(self, attr)))
        new.evicted = set(self.evicted)
        return new

    @property
    def params_ratio(self) -> float:
        return self.params / self.params0

    @property
    def flops_ratio(self) -> float:
        return self.flops / max(self.flops0, 1)


class _Overlay(dict):
    """A read-only view of `base` with a few keys replaced (no copy)."""

    def __init__(self, base, changes):
        super().__init__(changes)
        self._base = base

    def __missing__(self, key):
        return self._base[key]


def _sized(layer) -> bool:
    """Whether a layer's size (parameters or FLOPs) depends on its channel counts."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    return bool(layer.weights) or layer_rules.get(layer).role == "source"


def _cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_ONE_THREAD_LOCK = threading.Lock()
_one_thread_holders = [0, None]  # how many hold the limit, and its threadpoolctl limiter


@contextlib.contextmanager
def _one_blas_thread():
    """BLAS (NumPy's OpenBLAS/MKL) limited to one thread (`threadpoolctl`) while any
    holder is inside: the first in sets the limit, the last out restores what was
    there before. Two encoders in two threads can overlap; limits nested per holder
    would be restored out of order and leave the process at one thread."""
    import threadpoolctl

    with _ONE_THREAD_LOCK:
        if _one_thread_holders[0] == 0:
            _one_thread_holders[1] = threadpoolctl.threadpool_limits(1, user_api="blas")
        _one_thread_holders[0] += 1
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _one_thread_holders[0] -= 1
            if _one_thread_holders[0] == 0:
                limiter, _one_thread_holders[1] = _one_thread_holders[1], None
                limiter.restore_original_limits()


@contextlib.contextmanager
def _run_threads(sketched: bool):
    """The run loop's BLAS threads: one where sketched groups merge. Their merged
    parents' Gram rows are products on a background thread
    (`SketchCache.prefetch_parent_rows`) while the main thread edits the model;
    with OpenBLAS's own threads on every core that product takes the main
    thread's core (the 4 × 8192 MLP's first 3000 steps: 28.73–30.09 s, 26.60–28.81
    s with one thread, CPU time halved; `benchmarks/scale.py`'s MLP). Products still running
    are waited for before the limit is lifted."""
    if not sketched:
        yield
        return
    with _one_blas_thread():
        try:
            yield
        finally:
            wait_background()


def _release_free_memory() -> None:
    """Returns the C allocator's free memory to the system (glibc's ``malloc_trim``;
    nothing elsewhere): the fill threads' temporaries stay in their own arenas, which
    the run's later allocations do not reuse (the 4 × 8192 MLP's first 1500 steps
    peaked at 3.23 GB without the trim, 3.14 with it, 3.12 filling one table after
    another)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class _GroupState:
    """A group's live state during a run: active set, n, C, merge table."""

    def __init__(self, name, cache, p_init):
        self.name = name
        self.cache = cache
        self.p_init = p_init
        n = cache.size
        self.size0 = n
        self.active = np.ones(n, dtype=bool)
        self.n = n
        self.C = max(cache.layer_capacity(), costs.FLOOR)
        self.C_init = self.C
        self.frozen = False
        self.mergeable = bool(getattr(cache, "mergeable", False))
        self._table: Optional[MergeTable] = None  # set by the Encoder when merges run
        self._make_table = None  # or built at first use (`defer_table`)
        self.free_prunes = True  # False when prunes are off: negligible neurons merge
        self.version = 0

    @property
    def table(self) -> Optional[MergeTable]:
        """The group's merge table (None: the group does not merge)."""
        if self._make_table is not None:
            self._table, self._make_table = self._make_table(), None
        return self._table

    @table.setter
    def table(self, table: Optional[MergeTable]) -> None:
        self._table, self._make_table = table, None

    @property
    def merges(self) -> bool:
        return self._table is not None or self._make_table is not None

    def defer_table(self, make) -> None:
        """The table is built by ``make()`` when first read: a dense table (n × n,
        up to 144 MB) is not built for a group whose neurons are all pruned for free
        first, or never reach a merge. Only for tables whose selection does not
        depend on when they were built: the dense ones, which price every pair
        from the cache as it is, and of which nothing is re-priced before their
        first selection."""
        self._table, self._make_table = None, make

    def pair_ok(self) -> np.ndarray:
        """Which neurons can merge now: active, non-zero input vector, and capacity
        above `NEGLIGIBLE` of the layer's. A neuron below that is pruned at a cost of
        at most `NEGLIGIBLE`; merging it would only risk a parent whose self-kernel
        underflows (a dead neuron's, exp(-(beta/gamma)^2 / 2)) and whose scale
        `capacity / sqrt(K_vv)` overflows float32 (seen on calibrated VGG16)."""
        ok = self.active & (self.cache.wnorm > 0)
        if self.free_prunes:
            ok &= self.cache.capacity > NEGLIGIBLE * self.C_init
        return ok

    def remove(self, j: int) -> None:
        self.active[j] = False
        self.n -= 1


@dataclasses.dataclass(frozen=True)
class Action:
    """One candidate action, as the engine ranks and executes it.

    Attributes:
        kind: ``"prune"``, ``"merge"`` or ``"evict"``.
        unit: The group (prune, merge) or residual block (evict) it acts on.
        i: The pruned neuron, or the merge's vessel slot (−1 for an eviction).
        j: The merge's removed slot (−1 otherwise).
        J: Its distortion under the run's cost.
        DR: The ranking key the engine minimises (``cost.rank(J, ...)``).
        P_init: The static parameter footprint of the action (docs/theory.md §3).
        neurons: Compressible neurons it removes.
    """

    kind: str
    unit: str
    i: int
    j: int
    J: float
    DR: float
    P_init: float
    neurons: int


BUDGETS = ("density", "params", "flops")
MERGE_SEARCHES = ("auto", "certified", "top_k")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How the `Encoder` searches for the cheapest merge; the defaults select what
    the exhaustive scan selects wherever that is practical.

    Attributes:
        merge_candidates: Merge partners kept per neuron (an int ``k``), or None to
            price every pair at every step (the exhaustive scan, for checking).
            ``"auto"`` (default): for the built-in costs, whose bounds make the
            bounded scan select exactly the exhaustive scan's pair
            (`hope_keras.candidates`), every pair in groups of up to
            `DENSE_PAIRS_MAX` neurons (priced once, when its bound first matters)
            and `DEFAULT_MERGE_CANDIDATES` in wider ones; None for other costs
            (with an int they get the best pair among the candidates).
        merge_search: ``"certified"``: pairs (dense tables) or rows (k-partner
            tables) the bounds cannot rule out are priced exactly, so the merge
            selected is the exhaustive scan's. ``"top_k"``: each neuron keeps the k
            partners of smallest merge residual among the neurons of larger
            capacity, found when its row was filled (refilled once three quarters
            of them are gone), and the cheapest of those is selected.
            ``"auto"`` (default): ``"certified"`` in groups narrower than
            `AUTO_TOP_K_WIDTH` (6144) neurons, ``"top_k"`` in wider ones, where the
            certified search takes tenths of a second a step.
        refresh: ``"local"`` (default: after an action only the touched group's
            cache is updated, the paper's decoupled cache) or ``"neighbors"`` (also
            rebuild the caches of the producer- and consumer-side groups: 2–6×
            slower, with no consistent gain, docs/hope.md).

    Example:

    >>> from hope_keras import SearchOptions
    >>> SearchOptions(merge_search="top_k").merge_search
    'top_k'
    """

    merge_candidates: object = "auto"
    merge_search: str = "auto"
    refresh: str = "local"

    def __post_init__(self):
        k = self.merge_candidates
        if k != "auto" and k is not None and (
                isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
            raise ValueError("merge_candidates must be 'auto', None or an integer ≥ 1. "
                             f"Received: merge_candidates={k!r}")
        if self.merge_search not in MERGE_SEARCHES:
            raise ValueError(f"merge_search must be one of {MERGE_SEARCHES}. "
                             f"Received: merge_search={self.merge_search!r}")
        if self.refresh not in ("local", "neighbors"):
            raise ValueError(f"refresh must be 'local' or 'neighbors'. "
                             f"Received: refresh={self.refresh!r}")

    @classmethod
    def get(cls, identifier) -> "SearchOptions":
        """None (the defaults), a dict of its fields or a `SearchOptions`."""
        if identifier is None:
            return cls()
        if isinstance(identifier, cls):
            return identifier
        if isinstance(identifier, dict):
            try:
                return cls(**identifier)
            except TypeError as e:
                raise ValueError(f"search: {e}. Received: search={identifier!r}") from None
        raise ValueError(f"search must be None, a dict or a hope_keras.SearchOptions. "
                         f"Received: search={identifier!r}")


class Encoder:
    """The receding-horizon greedy HOPE encoder over one model.

    Most users call `hope_keras.compress` (which is ``Encoder(...).run(...)`` with
    its arguments checked first); the encoder is exposed for custom loops:
    `next_action` returns the cheapest `Action`, `execute` applies it, and `run`
    executes actions until a budget is met, then corrects the BatchNormalization
    statistics the run left stale (`hope_keras.correction.StatisticsCorrection`).
    A custom loop calls `correct_statistics` itself when it is done.

    Args:
        model: The Keras model to compress in place.
        cost: A `hope_keras.costs.Cost`, its name (``"hope"``, the default: the
            width-free cost of docs/theory.md; ``"paper"``: the paper's
            ``J / P_init``) or its config dict. The cost also carries the merge
            scale, the cross-kernel and mean compensation (`hope_keras.costs.HopeCost`).
        actions: Subset of ``("prune", "merge", "evict")``.
        analysis: Its `Analysis` (computed if omitted), made with the cost's kernel.
        search: `SearchOptions` (or a dict of its fields): how merges are searched.
        data: Unlabeled inputs (array, ``tf.data.Dataset`` or iterable of batches;
            labels are ignored): the BatchNormalization statistics the run leaves
            stale are re-estimated on them, and nothing synthetic is made.
        correction: Without ``data``, how the statistics are corrected data-free:
            ``"auto"`` (default), ``"surrogate"``, True or False
            (`hope_keras.correction`), or a `StatisticsCorrection`.
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
    """

    def __init__(self, model, *, cost="hope", actions=ACTIONS,
                 analysis: Optional[Analysis] = None, search=None, data=None,
                 correction="auto", verbose="auto"):
        from hope_keras.correction import StatisticsCorrection

        actions = tuple(actions) if not isinstance(actions, str) else (actions,)
        bad = [a for a in actions if a not in ACTIONS]
        if bad or not actions:
            raise ValueError(f"actions must be a non-empty subset of {ACTIONS}. "
                             f"Received: actions={actions}")
        search = SearchOptions.get(search)
        if isinstance(correction, StatisticsCorrection):
            if data is not None:
                raise ValueError("Give data= or a StatisticsCorrection, not both.")
            self.correction = correction
        else:
            self.correction = StatisticsCorrection(correction, data=data, verbose=verbose)
        self.search = search
        resolve_verbose(verbose)
        self.verbose = verbose
        merge_candidates, merge_search, refresh = (
            search.merge_candidates, search.merge_search, search.refresh)
        budget = "density"
        self.cost = costs.get(cost)
        builtin = type(self.cost) in (costs.PaperCost, costs.HopeCost)
        self._dense_pairs = merge_candidates == "auto" and builtin
        if merge_candidates == "auto":
            merge_candidates = DEFAULT_MERGE_CANDIDATES if builtin else None
        self.merge_candidates = None if merge_candidates is None else int(merge_candidates)
        self.merge_search = merge_search
        self._bound = self.cost.name if builtin else None
        self.model = model
        merge_scale, kernel = self.cost.merge_scale, self.cost.kernel
        mean_compensation = self.cost.mean_compensation
        if analysis is None:
            analysis = analyze(model, kernel=kernel, verbose=verbose)
        else:  # the run mutates the caches: keep the caller's analysis intact
            _check_analysis(analysis)
            analysis.check(model)  # of this model, and not stale
            if analysis.kernel != kernel:
                raise ValueError(
                    f"The analysis was made with kernel={analysis.kernel!r} and the cost "
                    f"{self.cost!r} uses kernel={kernel!r}: pass "
                    f"hope_keras.analyze(model, kernel={kernel!r}) or no analysis.")
            analysis = dataclasses.replace(
                analysis, caches={k: v.copy() for k, v in analysis.caches.items()})
        self.analysis = analysis
        _check_finite_weights(model, analysis.graph.flat)
        # The trajectory's fingerprint is hashed on a thread while the tables fill
        # (hashlib releases the GIL; nothing edits the model before __init__ ends).
        hashed = _background().submit(fingerprint, model, analysis.graph)
        self.actions = set(actions)
        self.merge_scale = merge_scale
        self.refresh = refresh
        self.kernel = kernel
        self.budget = budget
        a = self.analysis
        self.graph = a.graph
        if budget == "flops":
            self._check_flops_countable()
        # The cost says which groups it can price (the paper's: its neuron layers).
        scope = getattr(self.cost, "groups", "all")
        self.groups = {name: _GroupState(name, a.caches[name], a.states[name].p_init)
                       for name in a.caches
                       if costs.in_scope(scope, self.graph.groups[name])}
        self.blocks = {b.name: b for b in self.graph.blocks
                       if all(g in self.groups for g in b.groups)}
        self.block_reports = {b.name: b for b in a.blocks if b.name in self.blocks}
        if "merge" in self.actions:
            for gs in self.groups.values():
                gs.free_prunes = "prune" in self.actions
            self._set_tables([gs for gs in self.groups.values() if gs.mergeable])
        self.block_of = {g: b for g, b in self.graph.block_of_group().items()
                         if b in self.blocks}
        self.evicted: set = set()
        self.num_neurons = int(sum(gs.size0 for gs in self.groups.values()))
        # Layers reading each group: its actions' J counts once per reader (costs).
        self._readers = {name: float(self.graph.groups[name].num_readers)
                         for name in self.groups}
        if self.num_neurons == 0:
            what = ("no compressible neuron group" if not a.groups else
                    f"no neuron group the cost {self.cost.name!r} can price")
            raise ValueError(
                f"Model '{model.name}' has {what}. Pinned layers: "
                f"{a.pinned_summary() or 'none (no Dense/Conv layers)'}. "
                "See hope_keras.analyze(model).summary() for every reason.")
        self.active = self.num_neurons
        self.sizes = _SizeCounter(model, a)
        self.mean_compensation = bool(mean_compensation)
        self.editor = ModelEditor(model, self.graph, mean_compensation=mean_compensation,
                                  moments=a.moments)
        for name, gs in self.groups.items():
            if isinstance(gs.cache, SketchCache):  # exact entries for executed merges
                gs.cache.source = self._exact_source(name)
        self._neighbors = self._neighbor_map() if refresh == "neighbors" else {}
        self._heap: list = []
        self._seq = 0
        self._block_version: Dict[str, int] = {}
        self._stale = False  # interrupted inside a step's bookkeeping: cannot continue
        self._start_from_live_channels(model)
        self._push_all()
        self.trajectory = Trajectory({
            "model_name": model.name,
            "fingerprint": hashed.result(),
            "groups": [[n, g.size] for n, g in self.graph.groups.items()],
            "blocks": [b.name for b in self.graph.blocks],
            "block_groups": {b.name: list(b.groups) for b in self.graph.blocks},
            "num_neurons": self.num_neurons,
            "num_params": self.sizes.params0,
            "num_flops": self.sizes.flops0,
            "capacities": {n: g.C_init for n, g in self.groups.items()},
            "options": {"cost": self.cost.get_config(), "actions": sorted(self.actions),
                        "merge_scale": merge_scale, "refresh": refresh, "kernel": kernel,
                        "mean_compensation": self.mean_compensation,
                        "merge_candidates": self.merge_candidates,
                        "merge_search": self.merge_search,
                        # the correction applied after the steps (set when applied)
                        "correct_statistics": False},
        })

    @property
    def params(self):
        """The live size counter (``.params_ratio``, ``.flops_ratio``)."""
        return self.sizes

    def set_budget(self, budget: str) -> None:
        """Re-ranks every action for another budget kind."""
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}. Received: budget={budget!r}")
        if budget == "flops":
            self._check_flops_countable()
        if budget != self.budget:
            self.budget = budget
            self._push_all()

    def _check_flops_countable(self) -> None:
        """A FLOPs budget needs every layer's FLOPs: refused (before any edit) when a
        layer has an unknown spatial dimension, as `hope_keras.profile` refuses."""
        if not getattr(self, "_flops_countable", False):
            from hope_keras.profile import _node_flops

            fg = self.graph.flat
            for node in fg.nodes:
                _node_flops(node, fg)
            self._flops_countable = True

    def _push_all(self) -> None:
        self._heap = []
        for name in self.groups:
            self._push_group(name)
        for name in self.blocks:
            self._push_block(name)

    # ----------------------------------------------------------- best actions
    def _neighbor_map(self):
        producer_of = {g.producer: name for name, g in self.graph.groups.items()}
        out = {}
        for name, g in self.graph.groups.items():
            nb = {producer_of[c.layer] for c in g.consumers if c.layer in producer_of}
            nb |= {other for other, h in self.graph.groups.items()
                   if any(c.layer == g.producer for c in h.consumers)}
            out[name] = nb - {name}
        # Only the groups the run prices have caches to rebuild (a cost may leave
        # some out: "paper" all but its neuron layers, "no_streams" the streams).
        priced = set(self.groups)
        return {name: nb & priced for name, nb in out.items() if name in priced}

    def _rank_info(self, kind, unit, neurons, p_init, group=None, sizes=None):
        if sizes is not None:
            dp, df = sizes
        elif group is not None:
            dp, df = self.sizes.marginal(group, 1)
        else:
            dp, df = self._eviction_savings(unit)
        readers = 1.0 if kind == "evict" else self._readers[unit]
        return costs.RankInfo(kind, np.asarray(neurons, dtype=np.float64),
                              np.asarray(p_init, dtype=np.float64),
                              np.asarray(float(dp)), np.asarray(float(df)), self.budget,
                              readers)

    def _certified(self, gs: "_GroupState") -> bool:
        """Whether the group's merge search is certified (`merge_search`)."""
        if self.merge_search == "auto":
            return gs.cache.size < AUTO_TOP_K_WIDTH
        return self.merge_search == "certified"

    def _dense(self, gs: "_GroupState") -> bool:
        return (self._dense_pairs and self._certified(gs)
                and gs.cache.size <= DENSE_PAIRS_MAX)

    def _merge_table(self, gs: "_GroupState") -> MergeTable:
        k = self.merge_candidates
        return MergeTable(gs.cache, k, self._bound, gs.p_init, gs.pair_ok(),
                          preselect=32 if k is None else max(2 * k, 32),
                          certify=self._certified(gs), dense=self._dense(gs))

    def _set_table(self, gs: "_GroupState") -> None:
        """A new merge table for `gs`: dense ones (the same selection whenever they
        are built) at first use, others now."""
        if self._dense(gs):
            gs.defer_table(functools.partial(self._merge_table, gs))
        else:
            gs.table = self._merge_table(gs)

    def _set_tables(self, states) -> None:
        """`_set_table` for each of `states`; the tables built now (not deferred) are
        built in threads when there is enough work: each reads only its own group's
        cache, and NumPy releases the GIL in its loops (four 8192-wide top-k fills:
        13.7–14.8 s in one thread, 8.5–8.7 s in two)."""
        now = [gs for gs in states if not self._dense(gs)]
        for gs in states:
            if self._dense(gs):
                self._set_table(gs)
        workers = min(len(now), _cpu_count())
        if workers < 2 or sum(gs.size0 ** 2 for gs in now) < PARALLEL_FILL_PAIRS:
            for gs in now:
                gs.table = self._merge_table(gs)
            return
        # One BLAS thread per worker: OpenBLAS's own threads would spin on the cores
        # the workers use (15.1 s instead of 8.7 s for the MLP's four fills).
        with _one_blas_thread(), concurrent.futures.ThreadPoolExecutor(workers) as pool:
            tables = list(pool.map(self._merge_table, now))
        for gs, table in zip(now, tables):
            gs.table = table
        _release_free_memory()

    def best_group_action(self, name: str) -> Optional[Action]:
        """The group's cheapest prune or merge under the run's cost, or None."""
        gs = self.groups[name]
        if gs.frozen or gs.n <= 1:
            return None
        cache, best = gs.cache, None
        cap = cache.capacity
        sizes = self.sizes.marginal(name, 1)
        if "prune" in self.actions:
            idx = np.flatnonzero(gs.active)
            u_norm = cache.u_norm[idx]
            J = self.cost.prune(costs.PruneCandidates(cap[idx], gs.C, gs.n, gs.size0,
                                                      cache.k_self[idx], u_norm,
                                                      cache.gamma[idx]))
            dr = self.cost.rank(J, self._rank_info("prune", name, 1, gs.p_init[idx],
                                                   sizes=sizes))
            k = int(np.argmin(dr))
            best = Action("prune", name, int(idx[k]), -1, float(J[k]), float(dr[k]),
                          float(gs.p_init[idx[k]]), 1)
        if best is not None and cap[best.i] <= NEGLIGIBLE * gs.C_init:
            # A free prune (see `_GroupState.pair_ok`): no merge saves a neuron for less
            # that matters, and the bounds could not certify one below it.
            return best
        if "merge" in self.actions and gs.table is not None:
            def price(A, B, c_rem, norm_sum_sq, P):
                J = self.cost.merge(costs.MergeCandidates(A, B, c_rem, norm_sum_sq, gs.n,
                                                          gs.size0))
                return J, self.cost.rank(J, self._rank_info("merge", name, 1, P,
                                                            sizes=sizes))

            cutoff = np.inf if best is None else best.DR
            scale = 1.0
            if gs.table.bound is not None:  # built-in costs: DR linear in J (bounds)
                scale = float(np.ravel(self.cost.rank(np.ones(1), self._rank_info(
                    "merge", name, 1, np.ones(1), sizes=sizes)))[0])
            found = gs.table.select(gs.C, gs.n, gs.pair_ok(), price, cutoff=cutoff,
                                    scale=scale)
            if isinstance(cache, SketchCache):
                # Sketched pair values: the pair selected, and the next cheapest rows'
                # pairs with it, are re-priced from exact Gram entries until the
                # selection is stable.
                batch = REFINE_BATCH_WIDE if cache.size >= REFINE_WIDE else REFINE_BATCH
                for _ in range(64):
                    if found is None or gs.table.is_exact(found[2], found[3]):
                        break
                    ii, jj = gs.table.leading_pairs(batch)
                    ii, jj = np.append(found[2], ii), np.append(found[3], jj)
                    keep = np.ones(ii.size, dtype=bool)
                    keep[1:] = (ii[1:] != found[2]) | (jj[1:] != found[3])
                    ii, jj = ii[keep][:batch], jj[keep][:batch]
                    gs.table.refine_pairs(ii, jj, cache.exact_pairs(ii, jj))
                    found = gs.table.select(gs.C, gs.n, gs.pair_ok(), price, cutoff=cutoff,
                                            scale=scale)
            if found is not None:
                dr, J, i, j = found
                if best is None or dr < best.DR:
                    best = Action("merge", name, i, j, J, dr, float(gs.p_init[j]), 1)
        return best

    def _eviction_savings(self, name: str):
        b = self.blocks[name]
        sizes = self.sizes
        dp = sum(sizes.params_now[layer] for layer in b.branch_layers if layer in sizes.params_now)
        df = sum(sizes.flops_now[layer] for layer in b.branch_layers if layer in sizes.flops_now)
        return dp, df

    def eviction_action(self, name: str) -> Action:
        """The eviction of block `name` as an `Action` (J and DR under the run's cost)."""
        b, rep = self.blocks[name], self.block_reports[name]
        J = float(self.cost.evict(costs.EvictCandidate(
            np.array([self.groups[g].n for g in b.groups], dtype=np.float64),
            np.array([self.groups[g].C for g in b.groups]), rep.c_identity, rep.c_branch,
            rep.c_stream)))
        removed = sum(self.groups[g].n for g in b.groups)
        dr = float(np.asarray(self.cost.rank(
            np.asarray(J), self._rank_info("evict", name, removed, rep.p_init))))
        return Action("evict", name, -1, -1, J, dr, float(rep.p_init), int(removed))

    def _push_group(self, name: str) -> None:
        gs = self.groups[name]
        gs.version += 1
        best = self.best_group_action(name)
        if best is not None:
            self._seq += 1
            heapq.heappush(self._heap, (best.DR, self._seq, "g", name, gs.version, best))

    def _push_block(self, name: str) -> None:
        if "evict" not in self.actions or not self.blocks[name].evictable:
            return
        if name in self.evicted:
            return
        action = self.eviction_action(name)
        self._seq += 1
        v = self._block_version.get(name, 0) + 1
        self._block_version[name] = v
        heapq.heappush(self._heap, (action.DR, self._seq, "b", name, v, action))

    def _valid(self, entry) -> bool:
        _, _, kind, name, version, _ = entry
        if kind == "g":
            return self.groups[name].version == version and not self.groups[name].frozen
        return name not in self.evicted and self._block_version.get(name) == version

    def next_action(self, max_removed: Optional[int] = None) -> Optional[Action]:
        """The cheapest valid `Action` (evictions removing more than `max_removed`
        neurons are skipped), or None."""
        self._check_not_stale()
        skipped = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            action = entry[5]
            if action.kind == "evict" and max_removed is not None \
                    and action.neurons > max_removed:
                skipped.append(entry)
                continue
            found = entry
            break
        for e in skipped:
            heapq.heappush(self._heap, e)
        if found is not None:
            heapq.heappush(self._heap, found)  # stays until executed
        return None if found is None else found[5]

    # --------------------------------------------------------------- execute
    def _check_not_stale(self) -> None:
        if self._stale:
            raise RuntimeError(
                "This encoder was interrupted while updating its tables after step "
                f"{len(self.trajectory)}: it cannot continue. The model and its "
                "trajectory agree: save the trajectory, or replay it on the original "
                "model and start a new run.")

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
        recorded = len(self.trajectory)
        try:
            return self._execute(action)
        except BaseException:
            # Recorded, then interrupted: the tables may be half updated.
            self._stale = len(self.trajectory) > recorded
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
            gs.remove(i)
            gs.cache.clear(i)
        else:
            cache = gs.cache
            sol = cache.solve_pair(i, j)
            cap = cache.capacity
            A = cap[i] ** 2 + cap[j] ** 2
            c_rem = gs.C - cap[i] - cap[j]
            scale = sol.B if self.merge_scale == "sum" else costs.alpha_star(A, sol.B, c_rem)
            gv_ii, gv_jj, _, _, gu_ii, gu_jj, gu_ij = cache.merge_terms(i, j)
            pc = costs.parent_coefficients(sol, scale, gv_ii, gv_jj, gu_ii, gu_jj, gu_ij)
            coef = tuple(float(x) for x in pc)
            if not all(np.isfinite(c) and abs(c) < 1e30 for c in coef):
                raise FloatingPointError(
                    f"Merging neurons {i} and {j} of group {unit!r} would write "
                    f"non-finite or float32-overflowing weights (parent coefficients "
                    f"{coef}); this merge was not applied (the model holds the steps "
                    f"before it). Allow prunes (actions=...) so that neurons of "
                    f"negligible capacity are pruned instead.")
            eps = float(self.editor.layer(self.graph.groups[unit].bn).epsilon)
            dead_parent = coef[4] ** 2 < eps
            if isinstance(cache, SketchCache) and not dead_parent and gs.table is not None:
                cache.prefetch_parent_rows(i, j, *coef[:4])  # while the model is edited
            active_after = self.active - (2 if dead_parent else 1)
            c_after = max(c_rem + (0.0 if dead_parent else float(scale)), costs.FLOOR)
            with self.editor.step():
                self.editor.merge(unit, i, j, ParentCoefficients(*coef))
                step = self._record(action, c_before, c_after, active_after, coef, [unit])
            gs.remove(j)
            if dead_parent:
                gs.remove(i)
                cache.clear(i)
                cache.clear(j)
            else:
                cache.replace_with_parent(i, j, *coef)
                gs.table.on_merge(i, gs.pair_ok())
        gs.C = step.c_after
        self._after_group_change(unit)
        return step

    def _record(self, action: Action, c_before, c_after, active_after, coef,
                changed_groups, evict=False):
        """Updates the live size counts and appends the step (O(touched layers))."""
        counter = self.sizes
        unit = action.unit
        touched = set()
        for g in changed_groups:
            touched |= counter.layers_of[g]
        if evict:
            touched |= set(self.blocks[unit].branch_layers)
        touched &= set(counter.params_now)
        lives = {unit} if not evict else set(self.blocks[unit].groups)
        saved = ({k: (counter.params_now[k], counter.flops_now[k]) for k in touched},
                 counter.params, counter.flops, {g: counter.live[g] for g in lives},
                 {t: counter.tensor_live[t] for g in lives for t in counter.group_tensors[g]},
                 set(counter.evicted) if evict else None)
        try:
            if evict:
                self._count_eviction(unit)
            else:
                counter.remove(unit, self.active - active_after)
            counter.update(touched)
            step = Step(action.kind, unit, int(action.i), int(action.j), float(action.J),
                        float(action.P_init), float(action.DR), float(c_before),
                        float(c_after), int(active_after), float(counter.params_ratio),
                        tuple(coef), float(counter.flops_ratio))
            self.trajectory.append(step)
            self.active = active_after
        except BaseException:
            for k, (p, f) in saved[0].items():
                counter.params_now[k], counter.flops_now[k] = p, f
            counter.params, counter.flops = saved[1], saved[2]
            counter.live.update(saved[3])
            counter.tensor_live.update(saved[4])
            if evict:
                counter.evicted = saved[5]
            raise
        return step

    def _evict(self, action: Action) -> Step:
        unit = action.unit
        b = self.blocks[unit]
        removed = sum(self.groups[g].n for g in b.groups)
        c_before = float(sum(self.groups[g].C for g in b.groups))
        with self.editor.step():
            self.editor.evict(unit)
            step = self._record(action, c_before, 0.0, self.active - removed,
                                (np.nan,) * 6, list(b.groups), evict=True)
        self._freeze_evicted(unit)
        # Other blocks' eviction savings may share layers: not in practice.
        return step

    def _count_eviction(self, name: str) -> None:
        """The size counter's side of evicting block `name`: its branch layers and
        every live channel of its groups go."""
        counter = self.sizes
        counter.evicted |= set(self.blocks[name].branch_layers)
        for g in self.blocks[name].groups:
            counter.remove(g, counter.live[g])

    def _freeze_evicted(self, name: str) -> None:
        """The engine's side: block `name` is evicted, its groups frozen and empty."""
        self.evicted.add(name)
        for g in self.blocks[name].groups:
            gs = self.groups[g]
            gs.frozen, gs.n = True, 0
            gs.version += 1

    def _start_from_live_channels(self, model) -> None:
        """What an earlier compression removed (the channels and evicted blocks that
        `slim` drops) starts removed: the densities, ratios and budgets of this run
        count from the model as given, not from its dense shapes. Only groups with a
        channel of zero capacity are read again (none in an uncompressed model)."""
        from hope_keras.slim import live_channels

        counter = self.sizes
        touched = set()
        for name, b in self.blocks.items():
            rep = self.block_reports[name]
            if b.evictable and rep.c_branch == 0.0 and name not in self.evicted:
                touched |= set(b.branch_layers).union(*(counter.layers_of[g] for g in b.groups))
                self.active -= sum(self.groups[g].n for g in b.groups)
                self._count_eviction(name)
                self._freeze_evicted(name)
        for name, gs in self.groups.items():
            if gs.frozen or not np.any(np.asarray(gs.cache.capacity)[gs.active] == 0.0):
                continue
            dead = gs.active & ~live_channels(model, self.graph.groups[name], self.graph)
            if dead.all():  # a group the model does not use at all: left as it is
                continue
            for i in np.flatnonzero(dead):
                gs.remove(int(i))
                gs.cache.clear(int(i))
            gs.C = max(gs.cache.layer_capacity(gs.active), costs.FLOOR)
            counter.remove(name, int(dead.sum()))
            touched |= counter.layers_of[name]
            self.active -= int(dead.sum())
        if touched:
            counter.update(touched & set(counter.params_now))

    def _after_group_change(self, name: str) -> None:
        self._push_group(name)
        if name in self.block_of:
            self._push_block(self.block_of[name])
        for nb in self._neighbors.get(name, ()):
            self._rebuild(nb)

    def _exact_source(self, name: str):
        """A sketched group's reader of exact rows (`SketchCache.source`): the
        producer kernel's columns through the editor's column cache."""
        group = self.graph.groups[name]
        kernel = self.editor.layer(group.producer).kernel
        column = int(np.prod(kernel.shape[:-1])) * np.dtype(kernel.dtype).itemsize
        self.editor.cache_columns(group.producer, "kernel",
                                  max(16, min(COLUMN_CACHE_BYTES // column, group.size)))
        return functools.partial(extract_rows, self.editor.array, self.editor.layer, group,
                                 columns=self.editor.columns)

    def _rebuild(self, name: str) -> None:
        """refresh="neighbors": re-extract a group from the edited weights."""
        gs = self.groups[name]
        if gs.frozen:
            return
        group = self.graph.groups[name]
        if isinstance(gs.cache, SketchCache):
            gs.cache = build_sketch_cache(self.editor.mirror_model().get_layer, group,
                                          kernel=self.kernel)[0]
            gs.cache.source = self._exact_source(name)
        else:
            state = extract_group(self.editor.mirror_model(), group)
            gs.cache = build_group_cache(state, kernel=self.kernel)
        for j in np.flatnonzero(~gs.active):
            gs.cache.clear(int(j))
        if gs.merges:
            self._set_table(gs)
        gs.C = max(gs.cache.layer_capacity(gs.active), costs.FLOOR)
        self._push_group(name)
        if name in self.block_of:
            self._push_block(self.block_of[name])

    # ------------------------------------------------------------------- run
    def compress(self, density=None, params=None, flops=None, steps=None) -> CompressionResult:
        """`run` to the first budget given, as `hope_keras.compress` does: budgets
        already met or out of reach are refused first (nothing changed), Ctrl-C raises
        `CompressionInterrupted`, and the result is a `CompressionResult`.

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
        density, params, flops = (_fraction(name, value) for name, value in (
            ("density", density), ("params", params), ("flops", flops)))
        _check_steps(steps)
        self.check_budget(density=density, params=params, flops=flops)
        try:
            stopped = self.run(density=density, params=params, flops=flops, steps=steps)
        except KeyboardInterrupt as e:
            raise CompressionInterrupted(self.trajectory, self) from e
        return CompressionResult(
            trajectory=self.trajectory,
            density=self.active / self.num_neurons,
            params_ratio=self.sizes.params_ratio,
            flops_ratio=self.sizes.flops_ratio,
            stopped=stopped,
            analysis=self.analysis,
            model=self.model,
            corrected=sorted(self.correction.last),
            data=self.correction.data,
        )

    def check_budget(self, density=None, params=None, flops=None) -> None:
        """Raises ValueError (nothing changed) when a budget is already met or out of
        reach of this encoder's actions and the pinned layers."""
        if density is not None and self.active <= math.floor(
                density * self.num_neurons + 1e-9):
            raise ValueError(
                f"The budget density={density} is already met: the model has "
                f"{self.active} live compressible neurons of {self.num_neurons} (density "
                f"{self.active / self.num_neurons:.4f}). Nothing was changed.")
        if params is not None and self.sizes.params_ratio <= params:
            raise ValueError(f"The budget params={params} is already met (parameter ratio "
                             f"{self.sizes.params_ratio:.4f}). Nothing was changed.")
        if flops is not None and self.sizes.flops_ratio <= flops:
            raise ValueError(f"The budget flops={flops} is already met (FLOPs ratio "
                             f"{self.sizes.flops_ratio:.4f}). Nothing was changed.")
        min_active, min_params, min_flops = self.min_reachable()
        if density is not None and min_active > density * self.num_neurons + 1e-9:
            raise ValueError(
                f"density={density} is out of reach with actions={sorted(self.actions)}: "
                f"at least {min_active} of {self.num_neurons} neurons remain (density "
                f"{min_active / self.num_neurons:.4f}). Nothing was changed.")
        if params is not None and min_params > params + 1e-12:
            raise ValueError(f"params={params} is out of reach: pinned layers keep at least "
                             f"{min_params:.4f} of the parameters. Nothing was changed.")
        if flops is not None and min_flops > flops + 1e-12:
            raise ValueError(f"flops={flops} is out of reach: pinned layers keep at least "
                             f"{min_flops:.4f} of the FLOPs. Nothing was changed.")

    def min_reachable(self):
        """(min active neurons, min parameter ratio, min FLOPs ratio) reachable."""
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
        counter = self.sizes.copy()
        for n, v in per_group.items():
            counter.remove(n, counter.live[n] - max(v, 0))
        for b in evictable:
            counter.evicted |= set(self.blocks[b].branch_layers)
        counter.update(list(counter.params_now))
        return sum(per_group.values()), counter.params_ratio, counter.flops_ratio

    def correct_statistics(self) -> dict:
        """Corrects the BatchNormalization statistics after the steps so far (the
        encoder's `correction`); `run` calls it at its end. A later step or `run`
        first puts back what it wrote. Returns ``{BN name: (mean, variance)}``."""
        self._start_correction()
        return self._finish_correction()

    def _start_correction(self) -> None:
        """Before an edit: what the correction needs of the model as it is (taken
        once), and the statistics an earlier correction wrote put back."""
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
        density, params, flops = (_fraction(name, value) for name, value in (
            ("density", density), ("params", params), ("flops", flops)))
        _check_steps(steps)
        target_active = (math.floor(density * self.num_neurons + 1e-9)
                         if density is not None else None)
        kind = ("density" if density is not None else "params" if params is not None
                else "flops" if flops is not None else self.budget)
        self.set_budget(kind)

        def done():
            if target_active is not None and self.active <= target_active:
                return "budget"
            if params is not None and self.sizes.params_ratio <= params + 1e-12:
                return "budget"
            if flops is not None and self.sizes.flops_ratio <= flops + 1e-12:
                return "budget"
            if steps is not None and len(self.trajectory) >= steps:
                return "steps"
            return None

        self._check_not_stale()
        self._start_correction()
        if resolve_verbose(verbose):
            goal = ", ".join(f"{k}={v}" for k, v in (("density", density), ("params", params),
                                                     ("flops", flops), ("steps", steps))
                             if v is not None) or "no admissible action left"
            print(f"Compressing '{self.model.name}' ({goal}): the cheapest of "
                  f"{'/'.join(sorted(self.actions))} at each step.")
        bar, work_done = self._progress_bar(target_active, params, flops, steps, verbose)

        def show():
            bar.update(work_done(), density=self.active / self.num_neurons,
                       params=self.sizes.params_ratio)

        reason = None
        try:
            # Ctrl-C takes effect between steps: held back for the whole loop (one
            # signal handler, not two per step) and raised before the next step.
            sketched = any(isinstance(gs.cache, SketchCache) and gs.merges
                           for gs in self.groups.values())
            with defer_keyboard_interrupt() as deliver_pending, _run_threads(sketched):
                while True:
                    deliver_pending()
                    reason = done()
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

    def _progress_bar(self, target_active, params, flops, steps, verbose):
        """A bar over the planned work and a function giving the work done: neurons
        to remove under a density budget (or with no budget), parameters / FLOPs to
        remove, or steps."""
        if target_active is not None or (params is None and flops is None and steps is None):
            goal = target_active if target_active is not None else self.min_reachable()[0]
            start = self.active
            total, unit, now = start - goal, "neuron", lambda: start - self.active
        elif params is not None:
            start = self.sizes.params
            total = math.ceil(start - params * self.sizes.params0)
            unit, now = "param", lambda: start - self.sizes.params
        elif flops is not None:
            start = self.sizes.flops
            total = math.ceil(start - flops * self.sizes.flops0)
            unit, now = "flop", lambda: start - self.sizes.flops
        else:
            start = len(self.trajectory)
            total, unit, now = steps - start, "step", lambda: len(self.trajectory) - start
        return WorkBar(max(int(total), 0), unit, verbose), now


def compress(model, *, density: Optional[float] = None, params: Optional[float] = None,
             flops: Optional[float] = None, steps: Optional[int] = None, cost="hope",
             actions=ACTIONS, data=None, verbose="auto") -> CompressionResult:
    """Compresses a Keras model in place with HOPE.

    The greedy encoder executes, one step at a time, the prune, merge or block
    eviction with the lowest distortion for what it saves, until the first budget
    given is met (or no action is admissible when none is given). Every step is
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
        data: Unlabeled inputs of the model (a numpy array, a ``tf.data.Dataset``
            or an iterable of batches; ``(x, y)`` elements: labels are ignored). The
            BatchNormalization layers downstream of the edits are re-estimated on
            enough of them that each sees 1024 values per channel (a 7 × 7 map: 21
            inputs; at least 16; `hope_keras.correction.DATA_VALUES_PER_CHANNEL`);
            nothing synthetic is made. None (default): the data-free
            correction, which makes synthetic inputs only when the run moved a
            residual stream (`hope_keras.correction`).
        verbose: ``"auto"`` (default: progress bars and one line per long stage
            when standard output is a terminal or a notebook), True or False.

    Returns:
        A `CompressionResult` (``trajectory``, ``density``, ``params_ratio``,
        ``flops_ratio``, ``stopped``, ``corrected``).

    Raises:
        ValueError: on a budget already met or out of reach, or a model with no
            compressible group; the model is then left unchanged.
        CompressionInterrupted: on Ctrl-C (a `KeyboardInterrupt`): the model holds
            exactly the steps of the exception's ``trajectory``.

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
    density, params, flops = (_fraction(name, value) for name, value in (
        ("density", density), ("params", params), ("flops", flops)))
    _check_steps(steps)
    return Encoder(model, cost=cost, actions=actions, data=data, verbose=verbose).compress(
        density=density, params=params, flops=flops, steps=steps)


def _check_analysis(analysis) -> None:
    if not isinstance(analysis, Analysis):
        raise TypeError(f"analysis must be a hope_keras.Analysis (hope_keras.analyze(model)). "
                        f"Received: {analysis!r} of type {type(analysis).__name__}")


def _check_steps(steps) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral)
                              or steps < 0):
        raise ValueError(f"steps must be an integer ≥ 0. Received: steps={steps!r}")


def _fraction(name, value):
    """A budget in (0, 1] as a float (None stays None); a clear error otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in (0, 1]. Received: {name}={value!r} "
                         f"of type {type(value).__name__}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1]. Received: {name}={value}")
    return float(value)
