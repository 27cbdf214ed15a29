"""A distributed custom training loop for DEFT and the baselines (algorithm 3, phase 3).

`Trainer` trains on the target task under a `tf.distribute.Strategy`, evaluates
target accuracy and source retention after every epoch, and keeps the weights of the
epoch with the best H-score (or best target accuracy).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Sequence

import keras
import numpy as np

from hope_keras.deft.plan import find_head
from hope_keras.deft.retention import accuracy, h_score

__all__ = ["Trainer", "TrainHistory"]


@dataclasses.dataclass
class TrainHistory:
    """What `Trainer.fit` returns.

    Attributes:
        epochs: One dict per epoch: ``epoch``, ``loss``, ``target_acc``,
            ``source_acc`` (NaN without retention), ``h_score``, ``seconds``.
        best_epoch: 1-based index of the kept epoch (0: the starting weights).
        best: The kept epoch's dict.
    """

    epochs: List[dict]
    best_epoch: int
    best: dict


class Trainer:
    """Trains a model on the target task under a `tf.distribute.Strategy`.

    Create the model and the optimizer inside ``strategy.scope()``; a single-device
    run needs no strategy (the default one is used). Each step computes the
    per-example loss, averages it over the global batch, adds the penalties
    (``model.losses`` and ``penalties``, each counted once across replicas), and
    calls ``optimizer.apply_gradients`` (an `ElasticOptimizer` scales the gradients).

    Args:
        model: The target model (built in ``strategy.scope()``).
        optimizer: Any Keras optimizer, usually an `ElasticOptimizer`.
        loss: Per-example loss (default sparse categorical cross-entropy; logits
            unless the head has a softmax).
        strategy: A `tf.distribute.Strategy` (default: the current one).
        retention: A `SourceRetention`, to measure the source task each epoch.
        penalties: Callables ``penalty(model) -> scalar`` added to the loss (e.g.
            `EWCPenalty`, `L2Penalty`).
        monitor: ``"h_score"`` (default) or ``"target_acc"``: which epoch to keep.

    Example:

    >>> import keras, numpy as np
    >>> from hope_keras.deft import Trainer
    >>> inputs = keras.Input((4,))
    >>> model = keras.Model(inputs, keras.layers.Dense(3, name="head")(inputs))
    >>> trainer = Trainer(model, keras.optimizers.SGD(0.1))
    >>> x, y = np.random.rand(32, 4).astype("float32"), np.arange(32) % 3
    >>> history = trainer.fit((x, y), epochs=2, batch_size=8, target_val=(x, y))
    >>> len(history.epochs)
    2
    """

    def __init__(self, model, optimizer, loss=None, strategy=None, retention=None,
                 penalties: Sequence[Callable] = (), monitor: str = "h_score"):
        import tensorflow as tf

        if monitor not in ("h_score", "target_acc"):
            raise ValueError(f"monitor must be 'h_score' or 'target_acc'. Received: "
                             f"monitor={monitor!r}")
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy or tf.distribute.get_strategy()
        if loss is None:
            act = getattr(model.get_layer(find_head(model)), "activation", None)
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=getattr(act, "__name__", "") != "softmax", reduction=None)
        self.loss = loss
        self.retention = retention
        self.penalties = list(penalties)
        self.monitor = monitor
        self._step = None

    # ------------------------------------------------------------------ steps
    def _make_step(self):
        import tensorflow as tf

        model, opt, strategy = self.model, self.optimizer, self.strategy
        if not opt.built:  # create the optimizer state outside tf.function, in scope
            with strategy.scope():
                opt.build(model.trainable_variables)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                per_example = tf.reshape(self.loss(y, out), [-1])
                loss = tf.nn.compute_average_loss(per_example)
                extra = [tf.cast(l, loss.dtype) for l in model.losses]
                extra += [tf.cast(p(model), loss.dtype) for p in self.penalties]
                if extra:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(extra))
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))
            return loss

        @tf.function(reduce_retracing=True)
        def step(x, y):
            per_replica = strategy.run(replica_step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        return step

    def train_epoch(self, dataset) -> float:
        """One pass over a distributed dataset; returns the mean loss."""
        if self._step is None:
            self._step = self._make_step()
        total, batches = 0.0, 0
        for x, y in dataset:
            total += float(self._step(x, y))
            batches += 1
        return total / max(batches, 1)

    def distribute(self, data, batch_size: int, shuffle: bool = True, seed: int = 0):
        """A distributed dataset from ``(x, y)`` arrays or a batched `tf.data.Dataset`."""
        import tensorflow as tf

        if isinstance(data, tf.data.Dataset):
            ds = data
        else:
            if not (isinstance(data, (tuple, list)) and len(data) == 2):
                raise ValueError("Training data must be a pair (x, y) of arrays or a "
                                 f"batched tf.data.Dataset. Received: {type(data).__name__}"
                                 + (f" of {len(data)}" if isinstance(data, (tuple, list))
                                    else ""))
            # x: one array, or one per model input (a list, tuple or dict of them).
            x = _as_structure(data[0])
            y = np.asarray(data[1])
            sizes = [len(a) for a in keras.tree.flatten(x)]
            if set(sizes) != {len(y)}:
                raise ValueError(
                    f"Training data holds {', '.join(map(str, sizes))} examples (per "
                    f"input array) and {len(y)} labels; give every input array and the "
                    "labels the same number of examples.")
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            if shuffle:
                ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
            ds = ds.batch(batch_size)
        return self.strategy.experimental_distribute_dataset(ds)

    # -------------------------------------------------------------------- fit
    def evaluate(self, target_val=None, source_val=None) -> dict:
        """Target accuracy, source retention and H-score of the current weights."""
        self._check_source_val(source_val)
        t = accuracy(self.model, *target_val) if target_val is not None else float("nan")
        s = float("nan")
        if self.retention is not None:
            if source_val is not None:
                s = self.retention.evaluate(self.model, *source_val)
            elif self.retention.data[0] is not None:
                s = self.retention.evaluate(self.model)
        h = h_score(t, s) if np.isfinite(s) and np.isfinite(t) else float("nan")
        return {"target_acc": t, "source_acc": s, "h_score": h}

    def _check_source_val(self, source_val) -> None:
        if source_val is not None and self.retention is None:
            raise ValueError(
                "source_val is scored through the trainer's retention (the source "
                "head and BN statistics), and this Trainer has none: pass "
                "retention=deft.SourceRetention(model) when building it, or drop "
                "source_val. Received: source_val given, retention=None.")

    def fit(self, train, epochs: int, batch_size: int = 16, target_val=None,
            source_val=None, shuffle: bool = True, seed: int = 0,
            restore_best: bool = True, evaluate_start: bool = False,
            verbose: bool = False) -> TrainHistory:
        """Trains for `epochs`, evaluating after each; keeps the best epoch.

        Args:
            train: ``(x, y)`` arrays (``x`` one array, or a list of arrays for a
                model of several inputs) or a batched `tf.data.Dataset` (global
                batches).
            epochs: Number of epochs.
            batch_size: Global batch size for array data.
            target_val: ``(x, y)`` target validation data.
            source_val: ``(x, y)`` source validation data (needs ``retention``).
            shuffle, seed: Shuffling of array data.
            restore_best: Load the best epoch's weights at the end.
            evaluate_start: Also score the starting weights as epoch 0 (a candidate
                for the best epoch).
            verbose: Print one line per epoch.

        Returns:
            A `TrainHistory`.
        """
        if epochs < 1:
            raise ValueError(f"epochs must be ≥ 1. Received: epochs={epochs}")
        self._check_source_val(source_val)
        ds = self.distribute(train, batch_size, shuffle=shuffle, seed=seed)
        key = self.monitor if (self.monitor == "target_acc" or self.retention) \
            else "target_acc"
        history, best, best_epoch, best_weights = [], None, 0, None

        def score(rec):
            v = rec[key]
            return -np.inf if not np.isfinite(v) else v

        if evaluate_start:
            rec = {"epoch": 0, "loss": float("nan"), "seconds": 0.0,
                   **self.evaluate(target_val, source_val)}
            best, best_weights = rec, self.model.get_weights()
        for epoch in range(1, epochs + 1):
            t0 = time.time()
            loss = self.train_epoch(ds)
            rec = {"epoch": epoch, "loss": loss, "seconds": 0.0,
                   **self.evaluate(target_val, source_val)}
            rec["seconds"] = time.time() - t0
            history.append(rec)
            if verbose:
                print(f"epoch {epoch}: loss {loss:.4f} target {rec['target_acc']:.4f} "
                      f"source {rec['source_acc']:.4f} H {rec['h_score']:.4f} "
                      f"({rec['seconds']:.1f} s)")
            if best is None or score(rec) > score(best):
                best, best_epoch = rec, epoch
                if restore_best:
                    best_weights = self.model.get_weights()
        if restore_best and best_weights is not None:
            self.model.set_weights(best_weights)
        return TrainHistory(history, best_epoch, best)


def _as_structure(x):
    """Inputs as tf.data slices them: an array, or a tuple (or dict) of arrays, one
    per model input (a list would be read as one stacked tensor)."""
    if isinstance(x, dict):
        return {k: np.asarray(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return tuple(np.asarray(v) for v in x)
    return np.asarray(x)
