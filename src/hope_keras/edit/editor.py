"""Apply HOPE actions to a Keras model's weights (docs/theory.md §4, §5).

`ModelEditor` keeps a numpy mirror of the weights it touches, so a step costs a few
slice assignments, and writes them back into the model's variables on `commit()`.
Each action runs inside `step()`: if anything (an exception, KeyboardInterrupt)
interrupts it, the mirror is restored to the last completed step. `commit()` is all
or nothing: Ctrl-C waits until every variable is written, an error while writing
puts back the ones already written.

On the CPU the mirror is the variables themselves (`VIEW_MIN_BYTES`): the editor
writes into views of the variables' own buffers, not copies, so the model holds
each completed step as soon as it completes (an interrupted step is undone there
too) and `commit()` has nothing to write or put back for them. Variables in GPU
memory, and other backends', take the copying path above.

Edits go through the group's couplings (`hope_keras.graph.walker.Coupling`) and the layer
registry (`hope_keras.layers`): removing channel ``c`` zeroes every writer's output
slice, every channelwise layer's per-channel weights and every reader's input
slice, whatever the layer types.

The editor decides nothing: the engine (or a replay, or a baseline) tells it what
to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Dict, List, Optional, Tuple

import keras
import numpy as np

from hope_keras.graph import layers as layer_rules
from hope_keras._host_buffers import buffer_view, still_aliased
from hope_keras.graph.walker import Coupling, ModelGraph, NeuronGroup
from hope_keras.activations.kernels import relu_mean
from hope_keras.scoring.neurons import reader_means
from hope_keras.scoring import moments as moments_lib
from hope_keras.scoring.cache import sorted_unique


@contextlib.contextmanager
def defer_keyboard_interrupt():
    """Holds Ctrl-C (SIGINT) back until the block ends, then raises it.

    Yields a function that raises a held-back Ctrl-C at once (and nothing when none
    came): a loop can check between its iterations under one handler. In the main
    thread only (Python runs signal handlers there); elsewhere the block runs
    unguarded.

    Example:

    >>> with defer_keyboard_interrupt() as deliver_pending:
    ...     deliver_pending()  # no Ctrl-C came: nothing happens
    """
    def nothing():
        return None

    if threading.current_thread() is not threading.main_thread():
        yield nothing
        return
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    except (ValueError, OSError):  # not the main interpreter
        yield nothing
        return

    def deliver_pending():
        if received:
            frame = received[0]
            received.clear()
            if callable(previous):  # default_int_handler raises KeyboardInterrupt
                previous(signal.SIGINT, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

    try:
        yield deliver_pending
    finally:
        signal.signal(signal.SIGINT, previous)
        deliver_pending()


#: Variables of at least this many bytes are written back slice by slice (`commit`).
SWAP_MIN_BYTES = 64 << 20
#: The size of one slice of that write-back.
SWAP_SLICE_BYTES = 32 << 20


def _sliceable(var, arr):
    """The TensorFlow variable under Keras variable `var` when `commit` writes it in
    slices (`SWAP_MIN_BYTES`, TensorFlow backend, not autocast), else None."""
    if arr.ndim == 0 or arr.nbytes < SWAP_MIN_BYTES or keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    target = getattr(var, "value", None)
    if not isinstance(target, tf.Variable) or tuple(target.shape) != arr.shape \
            or target.dtype.as_numpy_dtype != arr.dtype:
        return None
    return target


#: Variables of at least this many bytes (all: 0) are edited in place when they live
#: in host memory: the editor writes into a NumPy view of the variable's own buffer
#: instead of a copy (`hope_keras._host_buffers.buffer_view`). No copy to make, none
#: to write back: a wide layer costs half the memory during a run, and a step on
#: ResNet-50 about a tenth less time (measured with benchmarks/scale.py).
VIEW_MIN_BYTES = 0


def _assign_slice(target, start: int, stop: int, values) -> None:
    """``target[start:stop] = values`` in place (one slice of `commit`).

    A scatter of rows, not ``target[start:stop].assign``: that reads the variable to
    slice it, and the read's reference makes TensorFlow copy the whole buffer before
    writing, once per slice (measured with benchmarks/scale.py)."""
    import tensorflow as tf

    target.scatter_update(tf.IndexedSlices(values, tf.range(start, stop)))


def _swap_in_slices(target, arr, uninterrupted) -> None:
    """Writes `arr` into `target` slice by slice along the first axis, leaving the
    previous values in `arr`. On an error the slices already swapped are swapped
    back (`target` and `arr` as they were) and the error propagates."""
    rows = arr.shape[0]
    step = max(1, SWAP_SLICE_BYTES // max(arr.nbytes // max(rows, 1), 1))
    done = []
    try:
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            old = target[start:stop].numpy()
            uninterrupted(lambda: _assign_slice(target, start, stop, arr[start:stop]))
            arr[start:stop] = old
            done.append((start, stop))
    except BaseException:
        for start, stop in reversed(done):
            new = target[start:stop].numpy()
            target[start:stop].assign(arr[start:stop])
            arr[start:stop] = new
        raise


def _finishing_writes(interrupted: list):
    """``uninterrupted(write)``: runs ``write()``; a first KeyboardInterrupt during it
    is appended to ``interrupted`` and the write runs again to its end (a second one
    is raised)."""
    def uninterrupted(write):
        while True:
            try:
                return write()
            except KeyboardInterrupt as e:
                if interrupted:
                    raise
                interrupted.append(e)
    return uninterrupted


@dataclasses.dataclass(frozen=True)
class ParentCoefficients:
    """How a merged parent is built from its children (docs/theory.md §4).

    ``v_k = a1·v_i + a2·v_j`` (augmented folded inputs), ``u_k = m1·u_i + m2·u_j``,
    and the parent's BN scale and shift are ``gamma``, ``beta``.
    """

    a1: float
    a2: float
    m1: float
    m2: float
    gamma: float
    beta: float


class _MirrorLayer:
    """Read-only view of one layer whose weights come from the editor's mirror."""

    _ATTRS = ("kernel", "bias", "gamma", "beta", "moving_mean", "moving_variance",
              "depthwise_kernel", "pointwise_kernel", "alpha")

    def __init__(self, editor: "ModelEditor", name: str):
        self._editor = editor
        self._layer = editor.layer(name)
        self.wrapped_layer = self._layer
        self.name = name

    def __getattr__(self, attr):
        if attr in self._ATTRS:
            if getattr(self._layer, attr, None) is None:
                return None
            return self._editor.array(self.name, attr)
        return getattr(self._layer, attr)


class _MirrorModel:
    """Duck-typed model for `hope_keras.scoring.neurons.extract_group` over the mirror."""

    def __init__(self, editor: "ModelEditor"):
        self._editor = editor

    def get_layer(self, name):
        return _MirrorLayer(self._editor, name)


def _axis_index(ndim: int, axis: int, idx) -> tuple:
    index = [slice(None)] * ndim
    index[axis] = idx
    return tuple(index)


def _filter_index(ndim: int, axis: int, c) -> tuple:
    """Filter `c` of a kernel whose filters lie on `axis`: ``(..., c)`` on the last
    one (the form the column cache recognises), else a full index."""
    return (Ellipsis, c) if axis == -1 else _axis_index(ndim, axis, c)


class _ColumnCache:
    """Recently read columns (last axis) of one mirror array, transposed: a
    neuron's input weights are a strided column of its producer's kernel, and a
    wide group's exact re-pricing reads the same few columns step after step
    (an 8192 × 8192 kernel: about 20 columns a step, each 8192 strided reads). The
    editor keeps the copies equal to the mirror through its writes (`written`): a
    column written whole is kept as written, a column zeroed is dropped, rows
    written are copied in again, anything else clears the cache; so does an undone
    step (`ModelEditor.step`).

    Args:
        shape: The array's shape.
        slots: How many columns are kept (least recently read ones go first).
    """

    def __init__(self, shape, slots: int):
        self.shape = tuple(shape)
        self.n = int(self.shape[-1])
        self.rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        self.slots = int(slots)
        self.data = None  # (slots, rows), allocated at first use
        self.owner = np.full(self.slots, -1, dtype=np.int64)
        self.slot_of = np.full(self.n, -1, dtype=np.int64)
        self.used = np.zeros(self.slots, dtype=np.int64)
        self.clock = 0
        self.hits = self.misses = 0

    def clear(self) -> None:
        self.owner[:] = -1
        self.slot_of[:] = -1
        self.used[:] = 0

    def get(self, arr: np.ndarray, cols) -> np.ndarray:
        """``arr.reshape(-1, n)[:, cols].T`` (a new array, the array's dtype)."""
        cols = np.asarray(cols, dtype=np.intp).ravel()
        keys = sorted_unique(cols)
        at = self.slot_of[keys]
        hit = at >= 0
        self.clock += 1
        self.used[at[hit]] = self.clock
        out = np.empty((keys.size, self.rows), dtype=arr.dtype)
        out[hit] = self.data[at[hit]] if hit.any() else 0
        miss = keys[~hit]
        self.hits += int(hit.sum())
        self.misses += int(miss.size)
        if miss.size:
            # np.take, not flat[:, miss]: the same columns, about 3× faster.
            fresh = np.take(arr.reshape(self.rows, self.n), miss, axis=1).T
            out[~hit] = fresh
            self._insert(miss, fresh, self.slots - int(hit.sum()))
        if keys.size == cols.size and np.array_equal(keys, cols):
            return out  # sorted distinct columns (a re-pricing's rows): no reorder copy
        return out[np.searchsorted(keys, cols)]

    def _insert(self, cols, vectors, room: int) -> None:
        """Keeps columns `cols` (distinct, not cached), at most `room` of them, in
        the least recently read slots."""
        k = min(cols.size, room, self.slots)
        if k <= 0:
            return
        if self.data is None:
            self.data = np.empty((self.slots, self.rows), dtype=vectors.dtype)
        # The k least recently read slots (the current read's hits are the latest).
        victims = np.argpartition(self.used, k - 1)[:k]
        old = self.owner[victims]
        self.slot_of[old[old >= 0]] = -1
        self.owner[victims] = cols[:k]
        self.slot_of[cols[:k]] = victims
        self.data[victims] = vectors[:k]
        self.used[victims] = self.clock

    def _normalized(self, index):
        """`index` as a tuple of one entry per axis where it is ``(..., c)``."""
        if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis:
            return (slice(None),) * (len(self.shape) - 1) + (index[1],)
        return index

    def _whole_columns(self, index) -> bool:
        """Whether `index` selects whole columns (every row of some columns)."""
        return (isinstance(index, tuple) and len(index) == len(self.shape)
                and all(isinstance(x, slice) and x == slice(None) for x in index[:-1]))

    def _column_index(self, index):
        """The one column `index` writes whole (an int), else None."""
        index = self._normalized(index)
        if self._whole_columns(index) and isinstance(index[-1], (int, np.integer)):
            return int(index[-1])
        return None

    def peek(self, index) -> Optional[np.ndarray]:
        """A copy of ``arr[index]`` when `index` is a whole column that is cached
        (an undo record without a strided read), else None."""
        col = self._column_index(index)
        if col is None or self.slot_of[col] < 0:
            return None
        return self.data[self.slot_of[col]].reshape(self.shape[:-1]).copy()

    def written(self, arr: np.ndarray, index, values) -> None:
        """`arr[index] = values` was just done: keep the copies equal to `arr`."""
        col = self._column_index(index)
        if col is not None and np.size(values) == self.rows:
            # One column written whole (a merged parent's filter): kept as written,
            # for its next reads (the array's dtype, as the assignment cast it).
            self._drop(col)
            self.clock += 1
            self._insert(np.array([col]),
                         np.asarray(values, dtype=arr.dtype).reshape(1, self.rows), 1)
            return
        if self.data is None or not (self.owner >= 0).any():
            return
        index = self._normalized(index)
        full = slice(None)
        if not (isinstance(index, tuple) and len(index) == len(self.shape)):
            self.clear()
        elif self._whole_columns(index):
            if isinstance(index[-1], slice):
                self.clear()
            else:
                self._drop(index[-1])  # whole columns
        elif isinstance(index[-1], slice) and index[-1] == full:  # whole rows
            rows = np.arange(self.rows).reshape(self.shape[:-1])[index[:-1]].ravel()
            live = np.flatnonzero(self.owner >= 0)
            flat = arr.reshape(self.rows, self.n)
            self.data[live[:, None], rows[None, :]] = flat[rows[:, None],
                                                           self.owner[live][None, :]].T
        else:
            self.clear()

    def _drop(self, cols) -> None:
        at = self.slot_of[np.asarray(cols, dtype=np.intp)]
        at = np.atleast_1d(at)
        at = at[at >= 0]
        self.slot_of[self.owner[at]] = -1
        self.owner[at] = -1
        self.used[at] = 0


class ModelEditor:
    """Edits a model's weights in place: prune, merge and evict.

    Args:
        model: The Keras model to edit.
        graph: Its `ModelGraph` (from `hope_keras.graph.walker.walk` or `analyze`).
        mean_compensation: Default of `prune`'s ``compensate``.
        moments: The `hope_keras.scoring.moments.propagate` table of the *unedited* model
            (``Analysis.moments``): the means used to compensate ``"coupled"``
            groups (computed on demand when needed and not given).

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.graph.walker import walk
    >>> inputs = keras.Input((4,))
    >>> x = keras.layers.Dense(3, name="hidden")(inputs)
    >>> x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    >>> editor = ModelEditor(model, walk(model))
    >>> editor.cache_columns("hidden", "kernel", slots=2)
    >>> before = editor.columns("hidden", "kernel", [1, 2])
    >>> with editor.step():
    ...     editor.prune("hidden", 1)
    >>> after = editor.columns("hidden", "kernel", [1, 2])  # the cache follows the edit
    >>> bool(np.all(after[0] == 0)), bool(np.array_equal(after[1], before[1]))
    (True, True)
    >>> editor.commit()
    >>> float(np.abs(model.get_layer("head").kernel.numpy()[1]).sum())
    0.0
    """

    def __init__(self, model, graph: ModelGraph, mean_compensation: bool = False,
                 moments=None):
        self.model = model
        self.graph = graph
        self.mean_compensation = bool(mean_compensation)
        self._moments = moments
        self._arrays: Dict[Tuple[str, str], np.ndarray] = {}
        self._held: Dict[Tuple[str, str], object] = {}  # tensors behind in-place views
        self._dirty: set = set()
        self._undo: List = None
        self._blocks = {b.name: b for b in graph.blocks}
        self._plans: Dict[Coupling, list] = {}
        self._columns: Dict[Tuple[str, str], _ColumnCache] = {}
        # Cached lookups (a step must not cost O(number of layers)); nested layers too.
        if graph.flat is not None:
            self._layers = dict(graph.flat.layers)
        else:
            self._layers = {layer.name: layer for layer in model.layers}

    def layer(self, name: str):
        """The model's layer with key `name` (cached lookup)."""
        return self._layers[name]

    # ------------------------------------------------------------------ mirror
    def array(self, layer: str, attr: str) -> np.ndarray:
        """The current (possibly edited) value of ``layer.attr`` as numpy."""
        key = (layer, attr)
        if key not in self._arrays:
            var = getattr(self.layer(layer), attr)
            found = buffer_view(var, VIEW_MIN_BYTES)
            if found is not None:  # in host memory: edited in place (`VIEW_MIN_BYTES`)
                self._arrays[key], self._held[key] = found
                return found[0]
            arr = var.numpy()
            # Keras returns a fresh array: a second copy would only double the peak
            # memory of a wide layer (256 MB for an 8192 × 8192 kernel).
            if not (arr.flags.writeable and arr.flags.owndata):
                arr = np.array(arr)
            self._arrays[key] = arr
        return self._arrays[key]

    def cache_columns(self, layer: str, attr: str, slots: int) -> None:
        """Keeps up to `slots` recently read columns of ``layer.attr`` (`columns`)."""
        key = (layer, attr)
        if key not in self._columns:
            shape = getattr(self.layer(layer), attr).shape
            self._columns[key] = _ColumnCache(shape, slots)

    def columns(self, layer: str, attr: str, cols) -> np.ndarray:
        """``array(layer, attr).reshape(-1, n)[:, cols].T``: the current values of
        the columns (last axis) `cols`, one row each, from the column cache where
        `cache_columns` set one up (the class example shows both)."""
        arr = self.array(layer, attr)
        cache = self._columns.get((layer, attr))
        if cache is None:
            flat = arr.reshape(-1, arr.shape[-1])
            return np.take(flat, np.asarray(cols, dtype=np.intp).ravel(), axis=1).T
        return cache.get(arr, cols)

    def _write(self, layer: str, attr: str, index, values) -> None:
        arr = self.array(layer, attr)
        cache = self._columns.get((layer, attr))
        if self._undo is not None:
            old = cache.peek(index) if cache is not None else None
            if old is None:
                # A gather or a scalar is already a copy; only a view needs one.
                old = arr[index]
                if isinstance(old, np.ndarray) and np.may_share_memory(old, arr):
                    old = old.copy()
            self._undo.append((arr, index, old))
        arr[index] = values
        self._dirty.add((layer, attr))
        if cache is not None:
            cache.written(arr, index, values)

    def mirror_model(self) -> _MirrorModel:
        """A read-only model view over the current mirror (for re-extraction)."""
        return _MirrorModel(self)

    @contextlib.contextmanager
    def step(self):
        """Makes the edits inside atomic: on any exception they are undone."""
        self._undo = []
        try:
            yield
        except BaseException:
            for arr, index, old in reversed(self._undo):
                arr[index] = old
            for cache in self._columns.values():  # they may hold undone values
                cache.clear()
            raise
        finally:
            self._undo = None

    def commit(self) -> None:
        """Writes every edited array back into the model's variables, all or nothing.

        A KeyboardInterrupt (Ctrl-C) during the write-back is raised once every
        variable is written; any other error puts back the variables already written
        (the model then holds the previous commit; the editor keeps its edits) and
        propagates. Written arrays leave the mirror (`array` reads them again).
        Variables edited in place (`VIEW_MIN_BYTES`: on the CPU) hold every
        completed step's edits already: they have nothing to write and nothing to
        put back (unless an assignment from elsewhere replaced their buffer since:
        then the editor's values are written, as for a copy).

        A variable of `SWAP_MIN_BYTES` or more is written in slices along its first
        axis, each slice swapped with the mirror's (the mirror then holds the
        previous values, for a rollback): no whole-variable copy of the previous
        values and no whole-variable temporary besides the mirror itself.
        """
        keys = sorted(self._dirty)
        interrupted = []
        uninterrupted = _finishing_writes(interrupted)
        with defer_keyboard_interrupt():
            written = []
            try:
                for key in keys:
                    var = getattr(self.layer(key[0]), key[1])
                    arr = self._arrays[key]
                    if key in self._held:
                        # Edited in place: nothing to write unless an assignment
                        # from elsewhere gave the variable a new buffer. No rollback
                        # copy either: the variable keeps the edits (module docstring).
                        if not still_aliased(var, arr):
                            uninterrupted(lambda: var.assign(arr))
                        del self._arrays[key], self._held[key]
                        if key in self._columns:
                            self._columns[key].clear()
                        continue
                    target = _sliceable(var, arr)
                    if target is None:
                        before = var.numpy()
                        uninterrupted(lambda: var.assign(arr))
                    else:
                        _swap_in_slices(target, arr, uninterrupted)
                        before = arr  # the previous values now
                    written.append((var, before, key))
                    # The variable holds the edits now: the mirror is read again on
                    # demand, so the previous values kept for a rollback take the
                    # mirror's place instead of adding to it (an 8192-wide MLP: 1 GB).
                    del self._arrays[key]
                    if key in self._columns:
                        self._columns[key].clear()
            except BaseException:
                for var, before, key in reversed(written):
                    if key not in self._arrays:  # the editor keeps its edits
                        self._arrays[key] = np.array(var.numpy())
                    var.assign(before)
                raise
            # Inside the block: a Ctrl-C it held back is raised when the block ends,
            # and the written arrays have left the mirror.
            self._dirty.clear()
            # Views only read go too (taken again for free): held, they would make
            # TensorFlow copy those buffers when the model is trained afterwards.
            for key in list(self._held):
                del self._arrays[key], self._held[key]
                if key in self._columns:
                    self._columns[key].clear()
        if interrupted:
            raise interrupted[0]

    # ------------------------------------------------------------ channel edits
    def _group(self, name: str) -> NeuronGroup:
        try:
            return self.graph.groups[name]
        except KeyError:
            raise ValueError(
                f"No neuron group named '{name}'. Known groups: {list(self.graph.groups)}"
            ) from None

    def _plan(self, c: Coupling) -> list:
        """``(attr, axis, ndim, expand, by_position)`` of each weight coupling `c`
        gives a channel, built once per coupling (a prune of a residual stream's
        channel zeroes a dozen couplings: their lookups must not cost every step)."""
        plan = self._plans.get(c)
        if plan is None:
            layer = self.layer(c.layer)
            rule = layer_rules.get(layer)
            if c.role == "out":  # by position when it writes a part of its outputs
                ws = rule.out_weights(layer)
                by_pos = not c.in_order
            elif c.role == "channel":
                ws = [w for w in rule.channel_weights(layer) if w.attr != "moving_variance"]
                by_pos = True
            else:
                ws = [w for w in rule.in_weights(layer)
                      if getattr(layer, w.attr, None) is not None]
                by_pos = True
            plan = [(w.attr, w.axis, self.array(c.layer, w.attr).ndim,
                     w.expand if c.role == "in" else 1, by_pos) for w in ws]
            self._plans[c] = plan
        return plan

    def _slices(self, c: Coupling, i: int) -> list:
        """(attr, index) of every weight slice of `c.layer` that channel i owns."""
        out = []
        for attr, axis, ndim, expand, by_pos in self._plan(c):
            pos = c.positions[i] if by_pos else i
            if expand != 1:
                pos = (pos[:, None] * expand + np.arange(expand)).reshape(-1)
            out.append((attr, _axis_index(ndim, axis, pos)))
        return out

    def _zero_coupling(self, c: Coupling, i: int) -> None:
        for attr, index in self._slices(c, i):
            self._write(c.layer, attr, index, 0.0)

    def prune(self, group: str, i: int, compensate: Optional[bool] = None) -> None:
        """Channel `i` of `group` is removed: every coupled slice is zeroed.

        With mean compensation (``compensate``, default: the editor's
        ``mean_compensation``) the channel is replaced by its mean: each reader's
        bias gains ``Σ w · E[x_i]`` (or, for a bias-free reader followed only by a
        BatchNormalization, that BN's moving mean loses it). For a ``"neurons"``
        group ``E[x_i] = E[ReLU(N(β_i, γ_i²))]`` from the current BN; for other
        groups the means of the data-free moment propagation of the unedited model.
        Readers with neither bias nor BN are left uncompensated.
        """
        g = self._group(group)
        compensate = self.mean_compensation if compensate is None else compensate
        shifts = self._mean_shifts(g, i) if compensate else ()
        for c in g.couplings:
            self._zero_coupling(c, i)
        for layer, attr, value in shifts:
            self._write(layer, attr, slice(None), value)

    def _channel_means(self, g: NeuronGroup, i: int) -> Dict[str, np.ndarray]:
        """Per reader, ``(out,)``: what channel i adds on average to its outputs."""
        if g.kind == "neurons":
            bn = self.layer(g.bn)
            gamma = float(self.array(g.bn, "gamma")[i]) if bn.scale else 1.0
            beta = float(self.array(g.bn, "beta")[i]) if bn.center else 0.0
            m = float(relu_mean(gamma, beta))
            out = {}
            if m == 0.0:
                return out
            for c in g.readers:
                rows = [self.array(c.layer, attr)[index].astype(np.float64)
                        for attr, index in self._slices(c, i)]
                kernel = rows[0]
                out[c.layer] = m * kernel.reshape(-1, kernel.shape[-1]).sum(axis=0)
            return out
        if self._moments is None:
            self._moments = moments_lib.propagate(self.graph.flat)
        get = self.mirror_model().get_layer
        return {c.layer: reader_means(get, c, self._moments)[i] for c in g.readers}

    def _mean_shifts(self, g: NeuronGroup, i: int):
        """``(layer, attr, new value)`` writes that move channel i's mean into biases."""
        out = []
        for reader, shift in self._channel_means(g, i).items():
            if not np.any(shift):
                continue
            target = self._bias_target(reader)
            if target is None:
                continue
            layer, attr, sign = target
            cur = self.array(layer, attr)
            out.append((layer, attr, (cur.astype(np.float64) + sign * shift).astype(cur.dtype)))
        return out

    def _bias_target(self, reader: str):
        """Where a constant added to `reader`'s output can go: its bias, or the
        moving mean of the BatchNormalization that alone follows it (sign −1)."""
        layer = self.layer(reader)
        if getattr(layer, "use_bias", False) and getattr(layer, "bias", None) is not None:
            return reader, "bias", 1.0
        bn = self.graph.bn_after.get(reader)
        if bn is not None:
            return bn, "moving_mean", -1.0
        return None

    def merge(self, group: str, i: int, j: int, coef: ParentCoefficients) -> None:
        """Writes the parent of `i` and `j` into slot `i` and zeroes slot `j`.

        The parent's pre-activation is exactly ``a1·y_i + a2·y_j`` (BN folded), its
        output slices are ``m1·u_i + m2·u_j``; both are computed from the current
        weights, so channels pruned elsewhere stay zero. ``"neurons"`` groups only.
        """
        g = self._group(group)
        if g.kind != "neurons":
            raise ValueError(f"Group '{group}' is a {g.kind!r} group: only 'neurons' "
                             "groups (producer → BN → ReLU → consumers) can merge.")
        producer = self.layer(g.producer)
        bn = self.layer(g.bn)
        dtype = self.array(g.producer, "kernel").dtype
        gamma_k2 = float(coef.gamma) ** 2
        if gamma_k2 < bn.epsilon or not np.isfinite(gamma_k2):
            # Inactive parent (appendix B.5.1): both slots go.
            self.prune(group, i, compensate=False)
            self.prune(group, j, compensate=False)
            return
        # Filters i, j are read in float64; a transposed convolution's lie on axis -2.
        kernel, axis = self.array(g.producer, "kernel"), layer_rules.output_axis(producer)
        has_bias = getattr(producer, "use_bias", False) and producer.bias is not None
        # The two channels' entries only, read as float64 (no whole-vector copies).
        bias = self.array(g.producer, "bias") if has_bias else None
        gam = self.array(g.bn, "gamma") if bn.scale else None
        bet = self.array(g.bn, "beta") if bn.center else None
        mean = self.array(g.bn, "moving_mean")
        var = self.array(g.bn, "moving_variance")

        def folded(c):
            s = ((float(gam[c]) if gam is not None else 1.0)
                 / np.sqrt(float(var[c]) + bn.epsilon))
            w = (self.columns(g.producer, "kernel", c).reshape(kernel.shape[:-1]) if axis == -1
                 else kernel[_filter_index(kernel.ndim, axis, c)])  # (column cache: last axis)
            w = s * w.astype(np.float64)
            b = (float(bet[c]) if bet is not None else 0.0) - s * (
                float(mean[c]) - (float(bias[c]) if bias is not None else 0.0)
            )
            return w, b

        (wi, bi), (wj, bj) = folded(i), folded(j)
        w_v = coef.a1 * wi + coef.a2 * wj
        b_v = coef.a1 * bi + coef.a2 * bj
        s_k = float(np.sqrt(gamma_k2))  # moving variance γ_k² − ε gives s = γ_k
        gamma_w = s_k if bn.scale else 1.0
        beta_w = float(coef.beta) if bn.center else 0.0
        new_filter = w_v * (s_k / gamma_w)
        new_mean = (beta_w - b_v) * s_k / gamma_w
        rows = []
        for c in g.readers:
            for (attr, idx_i), (_, idx_j) in zip(self._slices(c, i), self._slices(c, j)):
                k = self.array(c.layer, attr)
                rows.append((c.layer, attr, idx_i, coef.m1 * k[idx_i].astype(np.float64)
                             + coef.m2 * k[idx_j].astype(np.float64)))
        # All values are computed; now write (atomic under step()).
        self._write(g.producer, "kernel", _filter_index(kernel.ndim, axis, i),
                    new_filter.astype(dtype))
        if has_bias:
            self._write(g.producer, "bias", i, 0.0)
        if bn.scale:
            self._write(g.bn, "gamma", i, gamma_w)
        if bn.center:
            self._write(g.bn, "beta", i, beta_w)
        self._write(g.bn, "moving_mean", i, new_mean)
        self._write(g.bn, "moving_variance", i, max(gamma_k2 - bn.epsilon, 0.0))
        for layer, attr, idx, value in rows:
            self._write(layer, attr, idx, value)
        self.prune(group, j, compensate=False)

    def evict(self, block: str) -> None:
        """The block's branch outputs exactly zero (its final BN γ = β = 0, or its
        final convolution's weights when the branch ends without a BN)."""
        try:
            b = self._blocks[block]
        except KeyError:
            raise ValueError(
                f"No residual block named '{block}'. Known blocks: {list(self._blocks)}"
            ) from None
        if not b.evictable:
            raise ValueError(f"Block '{block}' has a projection shortcut: it cannot be evicted.")
        producer = self.layer(b.final_producer)
        if b.final_bn is not None:
            bn = self.layer(b.final_bn)
            if bn.scale and bn.center:
                self._write(b.final_bn, "gamma", slice(None), 0.0)
                self._write(b.final_bn, "beta", slice(None), 0.0)
                return
            for attr in ("gamma", "beta", "moving_mean"):
                if getattr(bn, attr, None) is not None:
                    self._write(b.final_bn, attr, slice(None), 0.0)
        for w in layer_rules.get(producer).out_weights(producer):
            self._write(b.final_producer, w.attr, slice(None), 0.0)
