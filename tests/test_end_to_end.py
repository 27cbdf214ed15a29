"""End to end on keras.applications.ResNet50 at 224 × 224 (random networks:
test_fuzz.py; every family at small sizes: test_applications.py).

Marked slow (about a minute each): `make test-slow` and `make test-all` run them.
"""

import keras
import numpy as np
import pytest

import hope_keras
from conftest import L

pytestmark = pytest.mark.slow


def test_resnet50_compress_half_density_then_slim():
    model = keras.applications.ResNet50(weights=None)
    rng = np.random.default_rng(0)
    # Non-trivial BN statistics: a calibration pass on random images, random γ/β.
    hope_keras.reestimate_batchnorm_statistics(
        model, rng.uniform(0, 255, (4, 224, 224, 3)).astype("float32"), batch_size=4)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.gamma.assign(rng.uniform(0.3, 1.5, n).astype("float32"))
            layer.beta.assign(rng.normal(0, 0.5, n).astype("float32"))
    x = keras.applications.resnet50.preprocess_input(
        rng.uniform(0, 255, (2, 224, 224, 3)).astype("float32"))
    # "surrogate": the synthetic inputs of the default's stream-reader correction take
    # ~110 s at 224×224 (benchmarks/scale.py --correct-statistics auto); they are
    # tested on small networks (test_synthetic.py) and every family (make test-apps).
    result = hope_keras.Encoder(model, correction="surrogate", verbose=False).compress(density=0.5)
    assert result.density == pytest.approx(0.5, abs=1 / 7616)
    small = hope_keras.slim(model)
    assert small.count_params() < 0.8 * model.count_params()
    assert small.count_params() == round(result.params_ratio * model.count_params())
    ya, yb = model.predict(x, verbose=0), small.predict(x, verbose=0)
    np.testing.assert_allclose(yb, ya, rtol=1e-4, atol=1e-6)


def test_paper_cost_first_action_on_resnet50_equals_an_independent_computation():
    """keras.applications.ResNet50 with a known BN setting (seeded γ, β, moving
    statistics): the paper's DR = J / P_init of every prune and every eviction,
    computed here from the raw weights with the spec's formulas, against the engine's
    first step under cost="paper"."""
    from scipy.stats import norm

    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    rng = np.random.default_rng(7)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            for w, v in ((layer.gamma, rng.uniform(0.3, 1.5, n)),
                         (layer.beta, rng.normal(0, 0.5, n)),
                         (layer.moving_mean, rng.normal(0, 0.3, n)),
                         (layer.moving_variance, rng.uniform(0.5, 2.0, n))):
                w.assign(v.astype("float32"))

    def arr(layer, attr):
        return getattr(model.get_layer(layer), attr).numpy().astype(np.float64)

    groups = {"conv1_conv": ["conv2_block1_0_conv", "conv2_block1_1_conv"]}
    blocks = []
    for stage, count in ((2, 3), (3, 4), (4, 6), (5, 3)):
        for k in range(1, count + 1):
            p = f"conv{stage}_block{k}"
            groups[f"{p}_1_conv"] = [f"{p}_2_conv"]
            groups[f"{p}_2_conv"] = [f"{p}_3_conv"]
            if k > 1:
                blocks.append((f"{p}_add", p, f"conv{stage}_block{k - 1}_3_bn"))
    best, stats = None, {}
    for g, consumers in groups.items():
        W = arr(g, "kernel").reshape(-1, arr(g, "kernel").shape[-1]).T
        bn = g.replace("_conv", "_bn")
        gam, bet = arr(bn, "gamma"), arr(bn, "beta")
        t = bet / np.abs(gam)
        K = (gam ** 2 + bet ** 2) * norm.cdf(t) + bet * np.abs(gam) * norm.pdf(t)
        U = np.hstack([np.moveaxis(arr(c, "kernel"), -2, 0).reshape(len(gam), -1)
                       for c in consumers])
        cap = np.linalg.norm(U, axis=1) * np.sqrt(K)
        n, C = len(cap), cap.sum()
        J = n * cap / (C - cap)
        P = np.count_nonzero(W, axis=1) + 1 + np.count_nonzero(U, axis=1) + 4
        stats[g] = (n, C)
        i = int(np.argmin(J / P))
        if best is None or (J / P)[i] < best[0]:
            best = ((J / P)[i], "prune", g, i, J[i])
    for add, p, cond in blocks:
        internal = [f"{p}_1_conv", f"{p}_2_conv"]
        c_id = np.sqrt(arr(cond, "gamma") ** 2 + arr(cond, "beta") ** 2).sum()
        J = sum(stats[g][0] * stats[g][1] for g in internal) / c_id
        P = sum(np.count_nonzero(arr(g, "kernel")) + np.count_nonzero(arr(g, "bias"))
                for g in internal)
        P += 4 * sum(len(arr(f"{p}_{k}_bn", "gamma")) for k in (1, 2, 3))
        if J / P < best[0]:
            best = (J / P, "evict", add, -1, J)
    result = hope_keras.compress(model, steps=1, cost="paper", actions=("prune", "evict"),
                                 verbose=False)
    (step,) = result.trajectory.steps
    assert (step.kind, step.unit, step.i) == best[1:4]
    assert step.J == pytest.approx(best[4], rel=1e-9)
    assert step.DR == pytest.approx(best[0], rel=1e-9)
