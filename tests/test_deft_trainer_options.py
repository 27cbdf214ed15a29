"""`deft.Trainer`'s penalties, monitor and best-epoch restore, and `deft.L2Penalty`.

The penalty is checked against its formula and against what it must do to a plain
SGD step (``W ← W − lr·(∂loss/∂W + 2·l2·W)``: the difference from the same step
without it is ``−2·lr·l2·W`` on the kernels and nothing on the biases); the kept
epoch against the history's best score and against a re-run stopped at that epoch.
"""

import keras
import numpy as np
import pytest

from conftest import copy_model
from hope_keras import deft

L = keras.layers


def _net(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = L.Dense(8, activation="relu", name="feat")(inputs)
    return keras.Model(inputs, L.Dense(3, name="head")(h))


def _data(seed, n=48):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def test_l2_penalty_is_its_formula_and_adds_its_gradient_to_an_sgd_step():
    model = _net(0)
    l2, lr = 0.05, 0.1
    penalty = deft.L2Penalty(l2)
    kernels = [v.numpy().astype(np.float64) for v in model.trainable_variables
               if len(v.shape) > 1]
    assert len(kernels) == 2
    assert float(penalty(model)) == pytest.approx(l2 * sum((k ** 2).sum() for k in kernels),
                                                  rel=1e-6)
    x, y = _data(0)
    plain, penalised = copy_model(model), copy_model(model)
    for m, penalties in ((plain, ()), (penalised, (penalty,))):
        deft.Trainer(m, keras.optimizers.SGD(lr), penalties=penalties).fit(
            (x, y), epochs=1, batch_size=len(x), shuffle=False, restore_best=False)
    for v0, a, b in zip(model.trainable_variables, plain.trainable_variables,
                        penalised.trainable_variables):
        w0 = v0.numpy().astype(np.float64)
        expected = -2 * lr * l2 * w0 if len(v0.shape) > 1 else np.zeros_like(w0)
        np.testing.assert_allclose(b.numpy() - a.numpy(), expected, atol=2e-6,
                                   err_msg=v0.path)


def test_restore_best_keeps_the_starting_weights_when_no_epoch_beats_them():
    """Validation labels are the starting model's own predictions (accuracy 1.0 at
    epoch 0): training on other labels cannot beat it, so ``restore_best`` puts the
    starting weights back; without it the trained weights stay."""
    model = _net(1)
    x, y = _data(1)
    x_val = _data(2, 32)[0]
    y_val = np.asarray(model(x_val)).argmax(-1)
    start = [w.copy() for w in model.get_weights()]
    kept = copy_model(model)
    history = deft.Trainer(model, keras.optimizers.SGD(0.5), monitor="target_acc").fit(
        (x, y), epochs=3, batch_size=16, target_val=(x_val, y_val), evaluate_start=True)
    assert history.best_epoch == 0 and history.best["target_acc"] == 1.0
    for a, b in zip(model.get_weights(), start):
        np.testing.assert_array_equal(a, b)
    deft.Trainer(kept, keras.optimizers.SGD(0.5), monitor="target_acc").fit(
        (x, y), epochs=3, batch_size=16, target_val=(x_val, y_val), evaluate_start=True,
        restore_best=False)
    assert any(not np.array_equal(a, b) for a, b in zip(kept.get_weights(), start))


@pytest.mark.parametrize("monitor", ["h_score", "target_acc"])
def test_the_kept_epoch_is_the_first_best_of_the_monitored_score(monitor):
    """With a source retention, ``monitor`` picks the epoch (the first of the best
    scores) whose weights ``fit`` restores: a re-run stopped there has them."""
    source = _net(2)
    retention = deft.SourceRetention(source)
    x, y = _data(3, 64)
    xs = _data(4, 64)[0]
    ys = np.asarray(source(xs)).argmax(-1)
    rerun = copy_model(source)

    def fit(model, epochs, restore_best):
        trainer = deft.Trainer(model, keras.optimizers.SGD(0.3), retention=retention,
                               monitor=monitor)
        return trainer.fit((x, y), epochs=epochs, batch_size=16, target_val=(x, y),
                           source_val=(xs, ys), shuffle=False, restore_best=restore_best)

    history = fit(source, 6, True)
    scores = [e[monitor] for e in history.epochs]
    assert history.best_epoch == 1 + int(np.argmax(scores))
    assert history.best[monitor] == max(scores)
    other = [e["target_acc" if monitor == "h_score" else "h_score"] for e in history.epochs]
    assert np.argmax(other) != np.argmax(scores)  # the monitor decides which epoch
    fit(rerun, history.best_epoch, False)
    for a, b in zip(source.get_weights(), rerun.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
