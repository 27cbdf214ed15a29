"""The engine's whole step-0 cost table against a float64 brute force.

Every prune (each neuron), merge (each pair i < j) and eviction DR the engine computes
before its first step is recomputed here from the raw Keras weights with the spec's
formulas (HOPE_SPEC sections 1-5: BN folding, surrogate kernels, the parent direction
as the top singular vector of ``u_i v_iᵀ + u_j v_jᵀ``, eq. 6, 19-20, 40, ``DR = J /
P_init``), written independently of the library. The seeds include models where the
first step is a merge and where it is an eviction.
"""

import itertools

import keras
import numpy as np
import pytest
from scipy.stats import norm

import hope_keras
from conftest import L, randomize_bn
from hope_keras.search.encoder import Encoder
from test_exactness import _channel_rows

# The engine options that select the spec's (the paper's) cost.
ENGINE_OPTIONS = {"cost": "paper"}


# ----------------------------------------------------------- the spec's cost formulas
def paper_costs(n, cap, C, pairs_A_B, P_neuron, blocks):
    """The spec's J and DR for every action, from capacities and merge objectives.

    Args:
        n: active neurons of the group; cap: ‖f_i‖ per neuron; C: Σ cap.
        pairs_A_B: {(i, j): (A, B)} for i < j.
        P_neuron: P_init per neuron.
        blocks: ignored here (evictions: `paper_eviction`).

    Returns:
        ({i: (J, DR)}, {(i, j): (J, DR)}).
    """
    prunes = {}
    for i in range(n):
        J = n * cap[i] / (C - cap[i])
        prunes[i] = (J, J / P_neuron[i])
    merges = {}
    for (i, j), (A, B) in pairs_A_B.items():
        c_rem = C - cap[i] - cap[j]
        alpha = (A + B * c_rem) / (2 * c_rem + B)                       # eq. 40
        J = n * np.sqrt(2 * alpha ** 2 - 2 * alpha * B + A) / (c_rem + alpha)  # eq. 6
        merges[(i, j)] = (J, J / P_neuron[j])  # the removed child's footprint
    return prunes, merges


def paper_eviction(ns, Cs, c_identity, P):
    J = sum(n * c for n, c in zip(ns, Cs)) / c_identity                 # eqs. 19, 20
    return J, J / P


# ------------------------------------------------------------ surrogate, by hand
def _self_k(g, b):
    g = abs(g)
    if g == 0:
        return max(b, 0.0) ** 2
    t = b / g
    return (g * g + b * b) * norm.cdf(t) + b * g * norm.pdf(t)


def _cross_k(rho, kii, kjj):
    rho = float(np.clip(rho, -1, 1))
    return (np.sqrt(1 - rho * rho) + (np.pi - np.arccos(rho)) * rho) / np.pi * np.sqrt(kii * kjj)


def _weights(layer, attr, default):
    v = getattr(layer, attr, None)
    return default if v is None else v.numpy().astype(np.float64)


def _group_arrays(model, producer, bn_name, activation, consumers):
    """Folded inputs V, outputs U, γ, β, P_init of one group, read off the raw weights."""
    p, bn = model.get_layer(producer), model.get_layer(bn_name)
    kernel = p.kernel.numpy().astype(np.float64)
    n = kernel.shape[-1]
    W = kernel.reshape(-1, n).T
    c = _weights(p, "bias", np.zeros(n)) if p.use_bias else np.zeros(n)
    g = _weights(bn, "gamma", np.ones(n)) if bn.scale else np.ones(n)
    b = _weights(bn, "beta", np.zeros(n)) if bn.center else np.zeros(n)
    mu, var = bn.moving_mean.numpy().astype(float), bn.moving_variance.numpy().astype(float)
    s = np.sqrt(var + bn.epsilon)
    Weff = (g / s)[:, None] * W
    beff = b - g * (mu - c) / s
    V = np.hstack([Weff, beff[:, None]])
    U = []
    for cname in consumers:
        k = model.get_layer(cname).kernel.numpy().astype(np.float64)
        rows = [_channel_rows(model, activation, cname, ch) for ch in range(n)]
        U.append(np.stack([(k[..., r, :] if k.ndim > 2 else k[r]).ravel() for r in rows]))
    U = np.hstack(U)
    P = np.count_nonzero(W, axis=1) + int(p.use_bias) + np.count_nonzero(U, axis=1) + 4
    return Weff, V, U, g, b, P


def _merge_objective(i, j, Weff, V, U, g, b, K):
    wi, wj = np.linalg.norm(Weff[i]), np.linalg.norm(Weff[j])
    re = np.clip(Weff[i] @ Weff[j] / wi / wj, -1 + 1e-12, 1 - 1e-12)
    kap = re / (1 - re * re) * abs(g[i]) / wi * abs(g[j]) / wj
    rt = 2 * kap / (1 + np.sqrt(1 + 4 * kap * kap))
    M = np.outer(U[i], V[i]) + np.outer(U[j], V[j])
    direction = np.linalg.svd(M)[2][0]
    lam = np.linalg.lstsq(V[[i, j]].T, direction, rcond=None)[0]
    best = -np.inf
    for sign in (1.0, -1.0):
        l1, l2 = sign * lam
        mean = l1 * b[i] + l2 * b[j]
        cij = abs(g[i] * g[j]) * rt
        sd = np.sqrt(l1 * l1 * g[i] ** 2 + l2 * l2 * g[j] ** 2 + 2 * l1 * l2 * cij)
        kvv = _self_k(sd, mean)
        kvi = _cross_k((l1 * g[i] ** 2 + l2 * cij) / (sd * abs(g[i])), kvv, K[i])
        kvj = _cross_k((l1 * cij + l2 * g[j] ** 2) / (sd * abs(g[j])), kvv, K[j])
        best = max(best, np.linalg.norm(kvi * U[i] + kvj * U[j]) / np.sqrt(kvv))
    return best


def brute_force_table(model, groups, block):
    """{("prune", g, i, -1) | ("merge", g, i, j) | ("evict", blk, -1, -1): (J, DR)}."""
    table, width = {}, {}
    for name, (bn, act, consumers) in groups.items():
        Weff, V, U, g, b, P = _group_arrays(model, name, bn, act, consumers)
        n = len(g)
        K = np.array([_self_k(g[i], b[i]) for i in range(n)])
        cap = np.linalg.norm(U, axis=1) * np.sqrt(K)
        C = cap.sum()
        width[name] = (n, C)
        pairs = {(i, j): (cap[i] ** 2 + cap[j] ** 2, _merge_objective(i, j, Weff, V, U, g, b, K))
                 for i, j in itertools.combinations(range(n), 2)}
        prunes, merges = paper_costs(n, cap, C, pairs, P, None)
        table.update({("prune", name, i, -1): v for i, v in prunes.items()})
        table.update({("merge", name, i, j): v for (i, j), v in merges.items()})
    blk, internal, input_bn, block_bns = block
    bn = model.get_layer(input_bn)
    c_id = np.sqrt(bn.gamma.numpy().astype(float) ** 2 + bn.beta.numpy().astype(float) ** 2).sum()
    P = sum(np.count_nonzero(model.get_layer(gname).kernel.numpy())
            + np.count_nonzero(model.get_layer(gname).bias.numpy()) for gname in internal)
    P += sum(4 * model.get_layer(x).moving_mean.shape[0] for x in block_bns)
    table[("evict", blk, -1, -1)] = paper_eviction(
        [width[x][0] for x in internal], [width[x][1] for x in internal], c_id, P)
    return table


# ------------------------------------------------------------------ the model
def _model(seed, weak_branch=1.0, twins=0.0):
    """conv → Flatten → Dense stem, a Dense identity block, a Dense head group.

    Groups: "cv" (Flatten → Dense consumer), "b_in" (inside block "blk"), "h".
    `weak_branch` scales the block's internal BN γ, β (its capacity); `twins` > 0 makes h's neuron 3 a noisy
    copy of neuron 0 (a cheap merge).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 5, 2))
    x = L.Conv2D(3, 3, name="cv")(inputs)
    x = L.ReLU(name="cv_relu")(L.BatchNormalization(scale=seed % 3 != 1, name="cv_bn")(x))
    x = L.Flatten(name="flat")(x)
    x = L.Dense(6, name="stem")(x)
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(x))
    y = L.Dense(4, name="b_in")(x)
    y = L.ReLU(name="b_in_relu")(L.BatchNormalization(center=seed % 3 != 2, name="b_in_bn")(y))
    y = L.BatchNormalization(name="b_out_bn")(L.Dense(6, name="b_out")(y))
    x = L.ReLU(name="blk_relu")(L.Add(name="blk")([x, y]))
    x = L.Dense(5, name="h")(x)
    x = L.ReLU(name="h_relu")(L.BatchNormalization(name="h_bn")(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    randomize_bn(model, seed, gamma=(0.2, 1.5))
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.2, layer.bias.shape).astype("float32"))
    in_bn = model.get_layer("b_in_bn")  # a weak branch: little internal capacity
    for w in in_bn.weights[:2]:
        w.assign(w.numpy() * weak_branch)
    if twins:
        h, hbn, head = (model.get_layer(n) for n in ("h", "h_bn", "head"))
        k = h.kernel.numpy()
        k[:, 3] = k[:, 0] * (1 + twins * rng.normal(size=k.shape[0]))
        h.kernel.assign(k)
        for w in hbn.weights:
            a = w.numpy()
            a[3] = a[0]
            w.assign(a)
        u = head.kernel.numpy()
        u[3] = u[0] * (1 + twins * rng.normal(size=u.shape[1]))
        head.kernel.assign(u)
    return model


GROUPS = {"cv": ("cv_bn", "cv_relu", ["stem"]), "b_in": ("b_in_bn", "b_in_relu", ["b_out"]),
          "h": ("h_bn", "h_relu", ["head"])}
BLOCK = ("blk", ["b_in"], "stem_bn", ["b_in_bn", "b_out_bn"])


def engine_table(enc):
    """The engine's step-0 J and DR of every action (the one place that reads the
    encoder's tables: update it with the engine's API)."""
    from hope_keras.scoring import costs

    table = {}
    for name, gs in enc.groups.items():
        cache, n, C = gs.cache, gs.n, gs.C
        cap = cache.capacity
        idx = np.arange(n)
        u_norm = np.sqrt(np.diag(cache.gram_u))
        J = enc.cost.prune(costs.PruneCandidates(cap, C, n, n, cache.k_self, u_norm,
                                                 cache.gamma))
        dr = enc.cost.rank(J, enc._rank_info("prune", name, 1, gs.p_init[idx], name))
        table.update({("prune", name, i, -1): (J[i], dr[i]) for i in idx})
        ii, jj = np.triu_indices(n, k=1)
        A = cap[ii] ** 2 + cap[jj] ** 2
        J = enc.cost.merge(costs.MergeCandidates(
            A, cache.B[ii, jj], C - cap[ii] - cap[jj],
            A + 2 * cache.k_cross[ii, jj] * cache.gram_u[ii, jj], n, n))
        dr = enc.cost.rank(J, enc._rank_info("merge", name, 1, gs.p_init[jj], name))
        table.update({("merge", name, i, j): (J[k], dr[k])
                      for k, (i, j) in enumerate(zip(ii, jj))})
    for name in enc.blocks:
        a = enc.eviction_action(name)
        table[("evict", name, -1, -1)] = (a.J, a.DR)
    return table


# (seed, weak_branch, twins, the action the brute force puts first); seed % 3 switches
# BN scale / center off in two groups.
CASES = [(0, 1.0, 0.0, "prune"), (2, 1.0, 0.05, "prune"), (1, 1.0, 0.05, "merge"),
         (5, 0.05, 0.0, "evict")]


@pytest.mark.parametrize("seed,weak_branch,twins,first", CASES)
def test_step0_cost_table_and_first_action_equal_the_brute_force(seed, weak_branch, twins,
                                                                 first):
    model = _model(seed, weak_branch, twins)
    expected = brute_force_table(model, GROUPS, BLOCK)
    enc = Encoder(model, **ENGINE_OPTIONS)
    got = engine_table(enc)
    assert set(got) == set(expected)
    assert sum(k[0] == "merge" for k in expected) == 3 + 6 + 10  # every pair i < j of widths 3, 4, 5
    for key, (J, dr) in expected.items():
        assert got[key][0] == pytest.approx(J, rel=1e-6, abs=1e-12), key
        assert got[key][1] == pytest.approx(dr, rel=1e-6, abs=1e-12), key
    # The engine's own choice (through compress) is the table's argmin.
    best = min(expected, key=lambda k: expected[k][1])
    assert best[0] == first
    step = hope_keras.compress(model, steps=1, verbose=False,
                               **ENGINE_OPTIONS).trajectory.steps[0]
    assert (step.kind, step.unit, step.i, step.j) == best
    assert step.J == pytest.approx(expected[best][0], rel=1e-6)
    assert step.DR == pytest.approx(expected[best][1], rel=1e-6)
