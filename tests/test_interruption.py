"""Interrupting compress anywhere leaves the model at the replay of a trajectory.

KeyboardInterrupt is raised from monkeypatched functions in the step loop, inside a
prune, a merge and an eviction, inside the bookkeeping after a step, and inside the
write-back into the model's variables (as a raised exception and as a real SIGINT);
each time the model must equal the replay of the steps the exception hands back, and
where the run can go on, going on must give the uninterrupted run. Both ways the
editor holds weights: views of the variables' own buffers (the CPU default) and
copies written back by `commit` (GPU variables, distributed ones).
"""

import os
import signal
import textwrap

import numpy as np
import pytest

import hope_keras
from conftest import plant_duplicate, run_on_two_logical_cpus, small_resnet
from hope_keras.edit import editor as edit
from hope_keras.search.encoder import Encoder

DENSITY = 0.35
COPIES = 1 << 62  # edit.VIEW_MIN_BYTES that no variable reaches: the copying editor


def _editor_holding(how):
    """A fixture body: the editor holds views of the variables ("in place", the CPU
    default) or copies written back by `commit` (a GPU's variables, other backends).
    Set and restored by hand: the tests call `monkeypatch.undo()` midway."""
    saved = edit.VIEW_MIN_BYTES
    if how == "copies":
        edit.VIEW_MIN_BYTES = COPIES
    yield how
    edit.VIEW_MIN_BYTES = saved


@pytest.fixture(params=["in place", "copies"])
def editor_path(request):
    yield from _editor_holding(request.param)


@pytest.fixture
def copies():
    yield from _editor_holding("copies")


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal (a background
    job may have inherited it as ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _model():
    """Its run to density 0.35 prunes, merges (twins in "fc") and evicts "b1_add"."""
    model = small_resnet(seed=11)
    for src, dst in ((0, 5), (1, 7), (2, 8)):
        plant_duplicate(model, "fc", "head", src, dst, seed=dst)
    for name in ("b1a_bn", "b1b_bn"):
        bn = model.get_layer(name)
        for v in (bn.gamma, bn.beta):
            v.assign(0.3 * v.numpy())
    return model


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run: its steps and final weights, statistics corrected (an
    interrupted run continued with `Encoder.run` is corrected at its end the same way)."""
    model = _model()
    result = hope_keras.compress(model, density=DENSITY, verbose=False)
    kinds = [s.kind for s in result.trajectory.steps]
    assert {"prune", "merge", "evict"} <= set(kinds)
    return result.trajectory, [w.copy() for w in model.get_weights()]


def _assert_model_is_replay(model, trajectory):
    replayed = trajectory.replay(_model(), step=len(trajectory))
    for a, b in zip(replayed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _assert_same_run(trajectory, model, reference):
    ref_traj, ref_weights = reference
    assert [(s.kind, s.unit, s.i, s.j) for s in trajectory.steps] == [
        (s.kind, s.unit, s.i, s.j) for s in ref_traj.steps]
    for a, b in zip(model.get_weights(), ref_weights):
        np.testing.assert_array_equal(a, b)


def _interrupt_on_call(monkeypatch, owner, name, k, before=False, exc=KeyboardInterrupt):
    """Makes owner.name raise `exc` on its k-th call (after doing its work unless
    `before`)."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if before and calls["n"] == k:
            raise exc("interrupted")
        out = real(*args, **kwargs)
        if not before and calls["n"] == k:
            raise exc("interrupted")
        return out

    monkeypatch.setattr(owner, name, flaky)
    return calls


@pytest.mark.parametrize("where, k", [
    ("loop", 4),      # between steps: Encoder.next_action
    ("prune", 2),     # inside a prune, after its edits reached the mirror
    ("merge", 2),     # inside a merge
    ("evict", 1),     # inside the eviction
])
def test_interrupted_compress_hands_back_a_trajectory_the_model_equals(where, k, reference,
                                                                       monkeypatch,
                                                                       editor_path):
    owner, name = {"loop": (Encoder, "next_action"), "prune": (edit.ModelEditor, "prune"),
                   "merge": (edit.ModelEditor, "merge"),
                   "evict": (edit.ModelEditor, "evict")}[where]
    calls = _interrupt_on_call(monkeypatch, owner, name, k)
    model = _model()
    with pytest.raises(hope_keras.CompressionInterrupted) as e:
        hope_keras.compress(model, density=DENSITY, verbose=False)
    assert isinstance(e.value, KeyboardInterrupt) and calls["n"] == k
    monkeypatch.undo()
    trajectory = e.value.trajectory
    done = len(trajectory)
    assert 0 < done < len(reference[0])
    _assert_model_is_replay(model, trajectory)
    # The interrupted step left no trace: the run continues where it stopped.
    assert e.value.encoder.run(density=DENSITY, verbose=False) == "budget"
    assert len(trajectory) > done
    _assert_same_run(trajectory, model, reference)


def test_sigint_during_a_step_takes_effect_after_the_step(reference, monkeypatch, ctrl_c,
                                                         editor_path):
    real = edit.ModelEditor.evict

    def evict_then_ctrl_c(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, mid-step
        real(self, *args, **kwargs)

    monkeypatch.setattr(edit.ModelEditor, "evict", evict_then_ctrl_c)
    model = _model()
    with pytest.raises(hope_keras.CompressionInterrupted) as e:
        hope_keras.compress(model, density=DENSITY, verbose=False)
    monkeypatch.undo()
    trajectory = e.value.trajectory
    assert trajectory.steps[-1].kind == "evict"  # the step finished, then it stopped
    _assert_model_is_replay(model, trajectory)
    e.value.encoder.run(density=DENSITY, verbose=False)
    _assert_same_run(trajectory, model, reference)


def test_interrupted_bookkeeping_keeps_model_and_trajectory_but_refuses_to_continue(
        monkeypatch, editor_path):
    from hope_keras.scoring import cache

    _interrupt_on_call(monkeypatch, cache.GroupCache, "replace_with_parent", 1, before=True)
    model = _model()
    with pytest.raises(hope_keras.CompressionInterrupted) as e:
        hope_keras.compress(model, density=DENSITY, verbose=False)
    monkeypatch.undo()
    assert e.value.trajectory.steps[-1].kind == "merge"  # recorded and written
    _assert_model_is_replay(model, e.value.trajectory)
    with pytest.raises(RuntimeError, match="cannot continue"):
        e.value.encoder.run(density=DENSITY, verbose=False)


def test_a_custom_loop_interrupted_in_the_bookkeeping_refuses_to_continue(monkeypatch):
    """`next_action` / `execute` by hand (the class docstring's custom loop): a step
    recorded, then interrupted in the table updates, leaves an encoder that raises
    at its next call instead of going on from half-updated tables."""
    from hope_keras.scoring import cache

    model = _model()
    enc = Encoder(model, analysis=hope_keras.analyze(model))
    while (action := enc.next_action()).kind != "merge":
        enc.execute(action)
    _interrupt_on_call(monkeypatch, cache.GroupCache, "replace_with_parent", 1, before=True)
    with pytest.raises(KeyboardInterrupt):
        enc.execute(action)
    monkeypatch.undo()
    assert enc.trajectory.steps[-1].kind == "merge"  # recorded and written
    _assert_model_is_replay(model, enc.trajectory)
    for call in (enc.next_action, lambda: enc.execute(action),
                 lambda: enc.run(density=DENSITY, verbose=False)):
        with pytest.raises(RuntimeError, match="cannot continue"):
            call()


def test_a_custom_loop_failing_before_the_record_goes_on(monkeypatch, reference):
    """A step that fails before it is recorded (here inside the merge's edits, which
    the editor undoes) leaves nothing behind: the loop goes on to the same run."""
    model = _model()
    enc = Encoder(model, analysis=hope_keras.analyze(model))
    calls = _interrupt_on_call(monkeypatch, edit.ModelEditor, "merge", 1)
    while calls["n"] == 0:
        action = enc.next_action()
        try:
            enc.execute(action)
        except KeyboardInterrupt:
            pass
    monkeypatch.undo()
    enc.run(density=DENSITY, verbose=False)
    _assert_same_run(enc.trajectory, model, reference)


def _variable_class(model):
    return type(model.weights[0])


@pytest.fixture(params=["whole", "slices"])
def write_back(request, monkeypatch, copies):
    """How `commit` writes a variable of the copying editor: whole (`assign`), or
    slice by slice swapped with the mirror (every variable here, as an 8192-wide
    kernel is), one row at a time. Returns the owner and name of the function that
    writes one piece."""
    if request.param == "whole":
        return lambda model: (model and _variable_class(model), "assign")
    monkeypatch.setattr(edit, "SWAP_MIN_BYTES", 1)
    monkeypatch.setattr(edit, "SWAP_SLICE_BYTES", 1)
    return lambda model: (edit, "_assign_slice")


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_interrupting_the_write_back_still_writes_every_step(how, reference, monkeypatch,
                                                           ctrl_c, write_back):
    model = _model()
    owner, name = write_back(model)
    real = getattr(owner, name)
    calls = {"n": 0}

    def assign(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            if how == "raise":
                raise KeyboardInterrupt("interrupted")
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    enc = Encoder(model)  # built before the patch: only the write-back assigns
    monkeypatch.setattr(owner, name, assign)
    with pytest.raises(KeyboardInterrupt):
        enc.run(density=DENSITY, verbose=False)
    monkeypatch.setattr(owner, name, real)
    assert calls["n"] > 5  # the assignments went on after the interrupt
    assert len(enc.trajectory) == len(reference[0])
    _assert_model_is_replay(model, enc.trajectory)  # every step, not corrected
    enc.correct_statistics()  # what the interrupted run did not reach
    _assert_same_run(enc.trajectory, model, reference)


def test_an_error_in_the_write_back_restores_the_variables_already_written(monkeypatch,
                                                                         reference,
                                                                         write_back):
    # The 6th write (whole: the 6th variable), and for slices also one deep into a
    # variable of many slices.
    for k in (6,) if write_back(None)[1] == "assign" else (6, 40):
        model = _model()
        before = [w.copy() for w in model.get_weights()]
        owner, name = write_back(model)
        real = getattr(owner, name)
        enc = Encoder(model)
        calls = _interrupt_on_call(monkeypatch, owner, name, k, before=True, exc=RuntimeError)
        with pytest.raises(RuntimeError):
            enc.run(density=DENSITY, verbose=False)
        assert calls["n"] >= k  # (the rollback's writes count too)
        monkeypatch.setattr(owner, name, real)
        # All or nothing: the model is still the original (the replay of zero steps).
        for a, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(a, b)
        # The editor kept its edits (also those of the variables it had written and
        # put back): committing again gives the uninterrupted run.
        enc.editor.commit()
        enc.correct_statistics()
        _assert_same_run(enc.trajectory, model, reference)


def test_the_copying_editor_edits_its_own_copy_until_commit(copies):
    """The copying editor's arrays are its own (Keras hands back a fresh array, kept
    without a second copy): an edit leaves the model's variables as they were until
    `commit`."""
    from hope_keras.graph.walker import walk

    model = small_resnet(seed=1)
    graph = walk(model)
    name = next(n for n, g in graph.groups.items() if g.kind == "neurons")
    producer = graph.groups[name].producer
    layer = model.get_layer(producer)
    before = [np.array(w) for w in model.get_weights()]
    editor = edit.ModelEditor(model, graph)
    with editor.step():
        editor.prune(name, 0)
    assert not np.shares_memory(editor.array(producer, "kernel"), layer.kernel.numpy())
    assert np.all(editor.array(producer, "kernel")[..., 0] == 0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    editor.commit()
    assert np.all(layer.kernel.numpy()[..., 0] == 0)
    assert np.any(layer.kernel.numpy()[..., 1] != 0)


def test_a_large_variable_is_written_in_slices_without_a_whole_copy(monkeypatch, copies):
    """A variable of `SWAP_MIN_BYTES` or more is written slice by slice, never read
    whole during the write-back (no copy of its previous values beside the mirror),
    and ends with the editor's edits; smaller variables are written whole."""
    import keras
    from hope_keras.graph.walker import walk

    inputs = keras.Input((48,))
    x = keras.layers.Dense(64, name="wide")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="wide_bn")(x))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    graph = walk(model)
    editor = edit.ModelEditor(model, graph)
    with editor.step():
        editor.prune("wide", 5)
        editor.prune("wide", 9)
    kernel = model.get_layer("wide").kernel
    want = np.array(editor.array("wide", "kernel"))
    head_want = np.array(editor.array("head", "kernel"))
    monkeypatch.setattr(edit, "SWAP_MIN_BYTES", kernel.numpy().nbytes)  # "wide" only
    monkeypatch.setattr(edit, "SWAP_SLICE_BYTES", 10 * 64 * 4)  # 10 rows a slice
    slices = []
    real_slice = edit._assign_slice

    def record(target, start, stop, values):
        slices.append((target.name, stop - start))
        return real_slice(target, start, stop, values)

    var_class = type(kernel)
    real_numpy = var_class.numpy

    def numpy(self):
        assert self is not kernel, "the large variable was read whole"
        return real_numpy(self)

    monkeypatch.setattr(edit, "_assign_slice", record)
    monkeypatch.setattr(var_class, "numpy", numpy)
    editor.commit()
    monkeypatch.undo()
    assert [n for _, n in slices] == [10, 10, 10, 10, 8]  # 48 rows
    np.testing.assert_array_equal(kernel.numpy(), want)
    assert np.all(kernel.numpy()[:, [5, 9]] == 0)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), head_want)
    assert ("wide", "kernel") not in editor._arrays  # read again on demand


def _one_group_model():
    import keras

    inputs = keras.Input((6,))
    x = keras.layers.Dense(5, name="hidden")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="hidden_bn")(x))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def test_on_the_cpu_the_editor_edits_the_variables_in_place(monkeypatch):
    """The default editor writes into the variables' own buffers: the model holds an
    edit as soon as its step completes, an interrupted step is undone in the model,
    and `commit` assigns nothing."""
    from hope_keras.graph.walker import walk

    model = _one_group_model()
    editor = edit.ModelEditor(model, walk(model))
    kernel = model.get_layer("hidden").kernel
    before = kernel.numpy()
    with editor.step():
        editor.prune("hidden", 1)
    assert np.all(kernel.numpy()[:, 1] == 0)  # before any commit
    np.testing.assert_array_equal(np.delete(kernel.numpy(), 1, axis=1),
                                  np.delete(before, 1, axis=1))
    with pytest.raises(RuntimeError, match="midway"):
        with editor.step():
            editor.prune("hidden", 3)
            raise RuntimeError("midway")
    np.testing.assert_array_equal(kernel.numpy()[:, 3], before[:, 3])  # undone in place
    editor.array("hidden_bn", "moving_variance")  # a view only read
    assigned = []
    var_class = type(kernel)
    real = var_class.assign
    monkeypatch.setattr(var_class, "assign",
                        lambda self, *a, **k: assigned.append(self.path) or real(self, *a, **k))
    editor.commit()
    assert assigned == []
    assert np.all(model.get_layer("head").kernel.numpy()[1] == 0)
    # No view outlives the commit (held, it would make TensorFlow copy the buffer
    # when the model is trained): read again, it is a new one.
    assert not editor._held
    assert np.all(editor.array("hidden", "kernel")[:, 1] == 0)


@pytest.mark.parametrize("how", ["in place", "copies"])
def test_commit_writes_the_edits_over_an_assignment_from_elsewhere(how):
    """Between an edit and `commit` the variable is assigned from outside the editor
    (which gives it a new buffer): commit writes the editor's values, with views as
    with copies."""
    from hope_keras.graph.walker import walk

    gen = _editor_holding(how)
    next(gen)
    try:
        model = _one_group_model()
        editor = edit.ModelEditor(model, walk(model))
        with editor.step():
            editor.prune("hidden", 2)
        want = np.array(editor.array("hidden", "kernel"))
        kernel = model.get_layer("hidden").kernel
        kernel.assign(np.full(kernel.shape, 7.0, dtype="float32"))
        editor.commit()
        np.testing.assert_array_equal(kernel.numpy(), want)
        assert np.all(kernel.numpy()[:, 2] == 0)
    finally:
        next(gen, None)


def test_a_held_back_ctrl_c_is_raised_at_the_next_check(ctrl_c):
    """`Encoder.run` holds Ctrl-C back for its whole loop and checks between steps:
    a Ctrl-C mid-iteration lets the iteration finish and is raised by the next
    check, once."""
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with edit.defer_keyboard_interrupt() as deliver_pending:
            for k in range(4):
                deliver_pending()
                seen.append(k)
                if k == 1:
                    os.kill(os.getpid(), signal.SIGINT)
                    seen.append("went on")
    assert seen == [0, 1, "went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_MIRRORED = textwrap.dedent("""
    import tensorflow as tf
    import numpy as np
    from conftest import copy_model, small_resnet
    import hope_keras
    from hope_keras._host_buffers import buffer_view

    model = small_resnet(seed=4)
    single = copy_model(model)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        mirrored = copy_model(model)
    assert buffer_view(mirrored.weights[0]) is None  # one replica's buffer
    for m in (single, mirrored):
        hope_keras.Encoder(m, correction=False, verbose=False).compress(density=0.5)
    for a, w in zip(single.get_weights(), mirrored.weights):
        for replica in w.value.values:
            np.testing.assert_array_equal(replica.numpy(), a, err_msg=w.path)
    print("MIRRORED_OK")
""")


def test_a_mirrored_model_is_edited_through_copies_on_every_replica():
    """A variable created under `tf.distribute.MirroredStrategy` (two logical CPUs,
    in a subprocess) is no plain resource variable: the editor copies it and
    `commit` assigns every replica, which end equal to the same compression on one
    device (edited in place, only one replica's buffer would change)."""
    run_on_two_logical_cpus(_MIRRORED)


def _arrays_in(obj, path="analysis", seen=None, depth=0):
    """Every NumPy array reachable from `obj` through hope_keras objects, dicts,
    lists and tuples: ``{path: array}``."""
    seen = set() if seen is None else seen
    out = {}
    if id(obj) in seen or depth > 6:
        return out
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_arrays_in(v, f"{path}[{k!r}]", seen, depth + 1))
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            out.update(_arrays_in(v, f"{path}[{k}]", seen, depth + 1))
    elif type(obj).__module__.startswith("hope_keras") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            out.update(_arrays_in(v, f"{path}.{k}", seen, depth + 1))
    return out


def test_the_analysis_keeps_no_view_of_the_weights(monkeypatch):
    """`analyze` reads the weights through views of the variables' buffers
    (`hope_keras._host_buffers.read_values`) where it copies them at once: nothing it
    keeps may be such a view, or the editor's in-place writes would change it. Every
    array of an analysis (dense and sketched groups) is the same after every group
    of the model was edited in place."""
    from hope_keras.scoring import cache as cache_lib
    from hope_keras.graph.walker import walk

    monkeypatch.setattr(cache_lib, "SKETCH_WIDTH", 8)  # "fc" (9 wide) sketched
    model = small_resnet(seed=3)
    rng = np.random.default_rng(3)
    for w in model.weights:  # no zero biases: their edits must show
        if w.path.endswith("bias"):
            w.assign(rng.normal(0, 0.1, w.shape).astype("float32"))
    analysis = hope_keras.analyze(model)
    assert any(isinstance(c, cache_lib.SketchCache) for c in analysis.caches.values())
    before = {k: np.array(v) for k, v in _arrays_in(analysis).items()}
    assert len(before) > 50
    editor = edit.ModelEditor(model, walk(model))
    for name, group in analysis.graph.groups.items():
        with editor.step():
            editor.prune(name, 0)
            if group.kind == "neurons":
                editor.merge(name, 1, 2, edit.ParentCoefficients(
                    0.6, 0.4, 1.1, 0.9, 1.3, 0.2))
    editor.commit()
    changed = [k for k, v in _arrays_in(analysis).items()
               if k in before and not np.array_equal(v, before[k], equal_nan=True)]
    assert not changed, changed[:5]
