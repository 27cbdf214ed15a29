"""The default cost's (``cost="hope"``) whole action table against a float64 brute force,
at step 0 and at every step of a run.

The brute force is written here from docs/theory.md alone (no hope_keras formula is
called): BN folding and the surrogate N(β, γ²) (§1), the ReLU self-kernel in closed
form and the arc-cosine cross-kernel (§1), the capacity of a coupled channel from the
moments carried through ReLU, swish and a residual Add (§2, the swish moment by a
160-node Gauss–Hermite rule), the parent direction as the top right singular vector
of ``u_i v_iᵀ + u_j v_jᵀ`` with its sign check (§4), the default's
``J_prune = ‖f_i‖/(C − ‖f_i‖)``, ``J_merge = sqrt(max(‖f_i + f_j‖² − B², 0))/(C_rem + B)``,
``J_evict = C_branch / C_stream`` and its ranking ``DR = R·J/k`` (§3), and the parent
the engine writes (capacity ``B``, the children's input/output Frobenius ratio kept,
§4).

Along the run it simulates the documented state of the greedy encoder (§3: the
touched group is updated; the other groups keep the geometry computed at the start;
``C`` is tracked as ``C − ‖f_i‖`` after a prune and ``C_rem + B`` after a merge; the
eviction's price is the initial model's, ranked per live neuron of the block) and
checks, at every step, every price of the engine's table, that the action the engine
executes is the brute force's argmin, and that the executed edit is the one priced:
the merged parent read back from the edited weights is ``a1·(w_i, b_i) + a2·(w_j, b_j)``
with output ``m1·u_i + m2·u_j`` and capacity ``B``. Groups none of whose neighbours was
edited are also priced from scratch on the edited model.
"""

import itertools
import math

import keras
import numpy as np
import pytest
from numpy.polynomial.hermite_e import hermegauss
from scipy.stats import norm

from conftest import L, randomize_bn
from hope_keras.scoring import costs
from hope_keras.search.encoder import Encoder

FLOOR = 1e-12  # docs/theory.md §3: C_rem tracked with a floor of 1e-12
_NODES, _WEIGHTS = hermegauss(160)
_WEIGHTS = _WEIGHTS / math.sqrt(2 * math.pi)


# ------------------------------------------------------------------ surrogate (§1, §2)
def relu_second(sd, mean):
    """E[relu(z)²], z ~ N(mean, sd²) (eq. 3)."""
    sd = abs(sd)
    if sd == 0:
        return max(mean, 0.0) ** 2
    t = mean / sd
    return (sd * sd + mean * mean) * norm.cdf(t) + mean * sd * norm.pdf(t)


def relu_first(sd, mean):
    """E[relu(z)], z ~ N(mean, sd²)."""
    sd = abs(sd)
    if sd == 0:
        return max(mean, 0.0)
    t = mean / sd
    return mean * norm.cdf(t) + sd * norm.pdf(t)


def swish_second(sd, mean):
    """E[swish(z)²] by Gauss–Hermite quadrature (swish(x) = x·sigmoid(x))."""
    z = mean + abs(sd) * _NODES
    return float(np.sum(_WEIGHTS * (z / (1 + np.exp(-z))) ** 2))


def arccos_cross(rho, kii, kjj):
    """The engine's zero-bias cross-kernel I(ρ)·sqrt(K_ii K_jj) (eqs. 5, 85)."""
    rho = float(np.clip(rho, -1.0, 1.0))
    return ((math.sqrt(1 - rho * rho) + (math.pi - math.acos(rho)) * rho) / math.pi
            * math.sqrt(kii * kjj))


def warped(w_i, w_j, g_i, g_j):
    """ρ̃ of two neurons from their effective input weights (eqs. 4, 80, 81)."""
    ni, nj = np.linalg.norm(w_i), np.linalg.norm(w_j)
    r = float(np.clip(w_i @ w_j / (ni * nj), -1 + 1e-12, 1 - 1e-12))
    kappa = r / (1 - r * r) * abs(g_i) / ni * abs(g_j) / nj
    return 2 * kappa / (1 + math.sqrt(1 + 4 * kappa * kappa))


def _f64(v):
    return np.asarray(v.numpy() if hasattr(v, "numpy") else v, dtype=np.float64)


def bn_params(bn):
    n = bn.moving_mean.shape[0]
    gamma = _f64(bn.gamma) if bn.scale else np.ones(n)
    beta = _f64(bn.beta) if bn.center else np.zeros(n)
    return gamma, beta, _f64(bn.moving_mean), _f64(bn.moving_variance), float(bn.epsilon)


# ----------------------------------------------------------------------- the model
def build_model(seed, branch=1.0, twins=0.0):
    """conv → Flatten → stem, an identity block around a Dense pair, a swish layer, a
    ReLU layer, a head.

    Groups: "cv" (neurons, read through Flatten), "stem" (the residual stream,
    written by stem and b_out, read by b_in and sw: coupled, 2 readers), "b_in"
    (neurons, inside block "blk"), "sw" (coupled: swish), "h" (neurons). `branch`
    scales the branch end's BN γ, β (a weak branch is cheap to evict); `twins` > 0
    makes h's neuron 3 a noisy copy of its neuron 0 (a cheap merge).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 5, 2))
    x = L.Conv2D(3, 3, name="cv")(inputs)
    x = L.ReLU(name="cv_relu")(L.BatchNormalization(name="cv_bn")(x))
    x = L.Dense(6, name="stem")(L.Flatten(name="flat")(x))
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(x))
    y = L.Dense(4, name="b_in")(x)
    y = L.ReLU(name="b_in_relu")(L.BatchNormalization(center=seed % 2 == 0,
                                                      name="b_in_bn")(y))
    y = L.BatchNormalization(name="b_out_bn")(L.Dense(6, name="b_out")(y))
    x = L.ReLU(name="blk_relu")(L.Add(name="blk")([x, y]))
    x = L.Dense(4, name="sw")(x)
    x = L.Activation("swish", name="sw_act")(L.BatchNormalization(name="sw_bn")(x))
    x = L.Dense(5, name="h", use_bias=seed % 3 != 0)(x)
    x = L.ReLU(name="h_relu")(L.BatchNormalization(name="h_bn")(x))
    model = keras.Model(inputs, L.Dense(3, name="head")(x))
    randomize_bn(model, seed, gamma=(0.2, 1.5))
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.normal(0, 0.2, layer.bias.shape).astype("float32"))
    for w in model.get_layer("b_out_bn").weights[:2]:  # γ, β
        w.assign(w.numpy() * branch)
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


# name: (producer, BN, output vectors u_c of its channels read off the consumer kernel)
NEURON_GROUPS = {
    "cv": ("cv", "cv_bn", lambda m: _f64(m.get_layer("stem").kernel).reshape(9, 3, 6)
           .transpose(1, 0, 2).reshape(3, -1)),  # Flatten of 3×3×3: rows c, c+3, …
    "b_in": ("b_in", "b_in_bn", lambda m: _f64(m.get_layer("b_out").kernel)),
    "h": ("h", "h_bn", lambda m: _f64(m.get_layer("head").kernel)),
}
READERS = {"cv": 1, "stem": 2, "b_in": 1, "sw": 1, "h": 1}  # counted off the model
BLOCK_GROUPS = {"blk": ("b_in",)}
# The groups whose from-scratch price an edit of the key group changes.
NEIGHBOURS = {"cv": {"stem"}, "stem": {"cv", "b_in", "sw"}, "b_in": {"stem"},
              "sw": {"stem", "h"}, "h": {"sw"}}


def neuron_arrays(model, producer, bn_name, u_of):
    """Folded inputs W, biases b, surrogate γ, β and outputs U of a neuron group."""
    p = model.get_layer(producer)
    kernel = _f64(p.kernel)
    n = kernel.shape[-1]
    W = kernel.reshape(-1, n).T
    c = _f64(p.bias) if p.use_bias else np.zeros(n)
    gamma, beta, mu, var, eps = bn_params(model.get_layer(bn_name))
    s = np.sqrt(var + eps)
    return {"W": (gamma / s)[:, None] * W, "b": beta - gamma * (mu - c) / s,
            "gamma": np.abs(gamma), "beta": beta, "U": u_of(model)}


def stream_moments(model):
    """Mean and variance of the block input (ReLU of stem_bn) and of the sum read by sw."""
    gs, bs, *_ = bn_params(model.get_layer("stem_bn"))
    go, bo, *_ = bn_params(model.get_layer("b_out_bn"))
    m1 = np.array([relu_first(g, b) for g, b in zip(gs, bs)])
    v1 = np.array([relu_second(g, b) for g, b in zip(gs, bs)]) - m1 ** 2
    return (m1, v1), (m1 + bo, v1 + go ** 2), (go, bo)


def from_scratch(model):
    """Every group's state as the engine builds it at its start, and the block's
    eviction price, from the raw weights in float64."""
    groups = {}
    for name, (producer, bn, u_of) in NEURON_GROUPS.items():
        a = neuron_arrays(model, producer, bn, u_of)
        a["K"] = np.array([relu_second(g, b) for g, b in zip(a["gamma"], a["beta"])])
        a["cap"] = np.linalg.norm(a["U"], axis=1) * np.sqrt(a["K"])
        groups[name] = a
    (m1, v1), (m2, v2), (go, bo) = stream_moments(model)
    # The stream: b_in reads relu(stem_bn), sw reads relu(relu(stem_bn) + b_out_bn).
    second_b_in = m1 ** 2 + v1
    second_sw = np.array([relu_second(math.sqrt(v), m) for m, v in zip(m2, v2)])
    u_b_in, u_sw = _f64(model.get_layer("b_in").kernel), _f64(model.get_layer("sw").kernel)
    groups["stem"] = {"cap": np.sqrt((u_b_in ** 2).sum(1) * second_b_in
                                     + (u_sw ** 2).sum(1) * second_sw)}
    gsw, bsw, *_ = bn_params(model.get_layer("sw_bn"))
    second = np.array([swish_second(g, b) for g, b in zip(gsw, bsw)])
    groups["sw"] = {"cap": np.linalg.norm(_f64(model.get_layer("h").kernel), axis=1)
                    * np.sqrt(second)}
    for a in groups.values():
        a["active"] = np.ones(a["cap"].size, dtype=bool)
        a["C"] = a["cap"].sum()
    c_branch = np.sqrt(go ** 2 + bo ** 2).sum()
    c_stream = np.sqrt(m1 ** 2 + v1).sum()
    return groups, {"blk": c_branch / c_stream}


def merge_parent(a, i, j):
    """The sum-scale parent of i and j (§4): ``(B, a, (λ1, λ2), c, û, sd, mean)``, its
    input vector ``a·(λ1 v_i + λ2 v_j)`` (``‖λ1 v_i + λ2 v_j‖ = 1``), its output ``c·û``,
    and the mean and sd of ``λ1 y_i + λ2 y_j``."""
    V = np.hstack([a["W"], a["b"][:, None]])
    U, g, b, K = a["U"], a["gamma"], a["beta"], a["K"]
    rt = warped(a["W"][i], a["W"][j], g[i], g[j])
    M = np.outer(U[i], V[i]) + np.outer(U[j], V[j])
    direction = np.linalg.svd(M)[2][0]
    lam = np.linalg.lstsq(V[[i, j]].T, direction, rcond=None)[0]
    best = None
    for sign in (1.0, -1.0):
        l1, l2 = sign * lam
        mean = l1 * b[i] + l2 * b[j]
        cij = g[i] * g[j] * rt
        sd = math.sqrt(max(l1 * l1 * g[i] ** 2 + l2 * l2 * g[j] ** 2 + 2 * l1 * l2 * cij, 0))
        kvv = relu_second(sd, mean)
        kvi = arccos_cross((l1 * g[i] ** 2 + l2 * cij) / (sd * g[i]), kvv, K[i])
        kvj = arccos_cross((l1 * cij + l2 * g[j] ** 2) / (sd * g[j]), kvv, K[j])
        out = kvi * U[i] + kvj * U[j]
        B = np.linalg.norm(out) / math.sqrt(kvv)
        if best is None or B > best[0]:
            best = (B, l1, l2, sd, mean, kvv, out / np.linalg.norm(out))
    B, l1, l2, sd, mean, kvv, u_hat = best
    # Physical scale: capacity B, the children's ‖[v_i v_j]‖_F / ‖[u_i u_j]‖_F kept.
    r = np.linalg.norm(V[[i, j]]) / np.linalg.norm(U[[i, j]])
    c = math.sqrt(B / (r * math.sqrt(kvv)))
    scale_in = r * c
    return B, scale_in, (l1, l2), c, u_hat, sd, mean


class Oracle:
    """The brute-force action table and the documented state of the greedy run."""

    def __init__(self, model):
        self.groups, self.evict_J = from_scratch(model)
        self.evicted = set()
        for a in self.groups.values():
            a["C_init"] = a["C"]

    def live(self, name):
        return int(self.groups[name]["active"].sum())

    def table(self):
        """{(kind, unit, i, j): (J, DR)} of every admissible action."""
        out = {}
        frozen = {g for b in self.evicted for g in BLOCK_GROUPS[b]}
        for name, a in self.groups.items():
            if name in frozen or self.live(name) <= 1:
                continue  # a layer's last neuron is never pruned
            idx = np.flatnonzero(a["active"])
            for i in idx:
                J = a["cap"][i] / max(a["C"] - a["cap"][i], FLOOR)
                out[("prune", name, int(i), -1)] = (J, READERS[name] * J)
            if name not in NEURON_GROUPS:
                continue  # coupled groups are pruned only
            ok = [i for i in idx if np.linalg.norm(a["W"][i]) > 0
                  and a["cap"][i] > 1e-9 * a["C_init"]]
            for i, j in itertools.combinations(ok, 2):
                B = merge_parent(a, i, j)[0]
                rt = warped(a["W"][i], a["W"][j], a["gamma"][i], a["gamma"][j])
                f_ij = arccos_cross(rt, a["K"][i], a["K"][j]) * (a["U"][i] @ a["U"][j])
                norm_sum_sq = a["cap"][i] ** 2 + a["cap"][j] ** 2 + 2 * f_ij
                c_rem = max(a["C"] - a["cap"][i] - a["cap"][j], FLOOR)
                J = math.sqrt(max(norm_sum_sq - B * B, 0.0)) / (c_rem + B)
                out[("merge", name, int(i), int(j))] = (J, READERS[name] * J)
        for blk, J in self.evict_J.items():
            if blk not in self.evicted:
                k = sum(self.live(g) for g in BLOCK_GROUPS[blk])
                out[("evict", blk, -1, -1)] = (J, J / k)
        return out

    def execute(self, kind, unit, i, j):
        """Applies a step to the state; a merge returns its parent's coefficients."""
        if kind == "evict":
            self.evicted.add(unit)
            return None
        a = self.groups[unit]
        if kind == "prune":
            a["C"] = max(a["C"] - a["cap"][i], FLOOR)
            a["active"][i] = False
            a["cap"][i] = 0.0
            return None
        B, scale_in, (l1, l2), c, u_hat, sd, mean = merge_parent(a, i, j)
        c_rem = a["C"] - a["cap"][i] - a["cap"][j]
        a1, a2 = scale_in * l1, scale_in * l2
        u_k = c * u_hat
        # u_hat lies in span(u_i, u_j): its coefficients.
        m1, m2 = np.linalg.lstsq(a["U"][[i, j]].T, u_k, rcond=None)[0]
        a["W"][i] = a1 * a["W"][i] + a2 * a["W"][j]
        a["b"][i] = a1 * a["b"][i] + a2 * a["b"][j]
        a["U"][i] = u_k
        a["gamma"][i], a["beta"][i] = scale_in * sd, scale_in * mean
        a["K"][i] = relu_second(a["gamma"][i], a["beta"][i])
        a["cap"][i] = np.linalg.norm(u_k) * math.sqrt(a["K"][i])
        a["active"][j] = False
        a["cap"][j] = 0.0
        a["C"] = max(c_rem + B, FLOOR)
        self.last_B = B
        return a1, a2, m1, m2, scale_in * sd, scale_in * mean


# --------------------------------------------------------------- the engine's table
def engine_table(enc):
    """The engine's J and DR of every admissible action now (the one place that reads
    the encoder's state: update it with the engine's internals)."""
    table = {}
    for name, gs in enc.groups.items():
        if gs.frozen or gs.n <= 1:
            continue
        cache, idx = gs.cache, np.flatnonzero(gs.active)
        cap = cache.capacity
        J = enc.cost.prune(costs.PruneCandidates(cap[idx], gs.C, gs.n, gs.size0,
                                                 cache.k_self[idx], cache.u_norm[idx],
                                                 cache.gamma[idx]))
        dr = enc.cost.rank(J, enc._rank_info("prune", name, 1, gs.p_init[idx], name))
        table.update({("prune", name, int(i), -1): (J[k], dr[k]) for k, i in enumerate(idx)})
        if not gs.mergeable:
            continue
        ok = np.flatnonzero(gs.pair_ok())
        ii, jj = (np.array(x, dtype=int) for x in zip(*itertools.combinations(ok, 2)))
        pv = cache.pair_values(ii, jj)
        A = cap[ii] ** 2 + cap[jj] ** 2
        J = enc.cost.merge(costs.MergeCandidates(A, pv.B, gs.C - cap[ii] - cap[jj],
                                                 A + 2 * pv.k_cross * pv.gram_u, gs.n,
                                                 gs.size0))
        dr = enc.cost.rank(J, enc._rank_info("merge", name, 1, gs.p_init[jj], name))
        table.update({("merge", name, int(i), int(j)): (J[k], dr[k])
                      for k, (i, j) in enumerate(zip(ii, jj))})
    for name in enc.blocks:
        if enc.evictions.open(name):
            a = enc.eviction_action(name)
            table[("evict", name, -1, -1)] = (a.J, a.DR)
    return table


def _key(kind, unit, i, j):
    return (kind, unit, min(i, j), max(i, j)) if kind == "merge" else (kind, unit, i, j)


def assert_tables_equal(got, expected, where, units=None):
    if units is not None:
        got = {k: v for k, v in got.items() if k[1] in units}
        expected = {k: v for k, v in expected.items() if k[1] in units}
    assert set(got) == set(expected), (where, set(got) ^ set(expected))
    for key, (J, dr) in expected.items():
        assert got[key][0] == pytest.approx(J, rel=1e-6, abs=1e-12), (where, key)
        assert got[key][1] == pytest.approx(dr, rel=1e-6, abs=1e-12), (where, key)


def folded_channel(model, producer, bn_name, c):
    """(w_eff, b) of channel c, read from the weights."""
    p = model.get_layer(producer)
    kernel = _f64(p.kernel)
    w = kernel.reshape(-1, kernel.shape[-1])[:, c]
    bias = _f64(p.bias)[c] if p.use_bias else 0.0
    gamma, beta, mu, var, eps = bn_params(model.get_layer(bn_name))
    s = math.sqrt(var[c] + eps)
    return gamma[c] / s * w, beta[c] - gamma[c] * (mu[c] - bias) / s


def check_edit(model, before, step, coef, B=None, clean=True):
    """The executed step, read back from the edited weights."""
    if step.kind == "evict":
        go, bo, *_ = bn_params(model.get_layer("b_out_bn"))
        assert not go.any() and not bo.any()
        return
    if step.unit not in NEURON_GROUPS:
        return
    producer, bn, u_of = NEURON_GROUPS[step.unit]
    U = u_of(model)
    if step.kind == "prune":
        w, b = folded_channel(model, producer, bn, step.i)
        assert not w.any() and b == 0 and not U[step.i].any()
        return
    i, j = step.i, step.j
    (wi, bi), (wj, bj) = (folded_channel(before, producer, bn, c) for c in (i, j))
    a1, a2, m1, m2, gamma_k, beta_k = coef
    w, b = folded_channel(model, producer, bn, i)
    scale = np.abs(a1 * wi + a2 * wj).max()
    np.testing.assert_allclose(w, a1 * wi + a2 * wj, rtol=1e-5, atol=1e-6 * scale)
    assert b == pytest.approx(a1 * bi + a2 * bj, rel=1e-5, abs=1e-6 * scale)
    U0 = u_of(before)
    np.testing.assert_allclose(U[i], m1 * U0[i] + m2 * U0[j], rtol=1e-5,
                               atol=1e-6 * np.abs(U[i]).max())
    assert not U[j].any()
    gamma, beta, *_ = bn_params(model.get_layer(bn))
    assert abs(gamma[i]) == pytest.approx(gamma_k, rel=1e-5)
    assert beta[i] == pytest.approx(beta_k if model.get_layer(bn).center else 0.0,
                                    rel=1e-5, abs=1e-7)
    # Its capacity from the edited weights is B (merge_scale="sum"), where the group's
    # neighbours are as they were at the start (else its readers' weights moved since).
    if clean:
        cap = np.linalg.norm(U[i]) * math.sqrt(relu_second(gamma[i], beta[i]))
        assert cap == pytest.approx(B, rel=1e-5)


class Snapshot:
    """The weights of a model's layers as numpy copies, read like the model's layers
    (``snapshot.get_layer(name).kernel``)."""

    ATTRS = ("kernel", "bias", "gamma", "beta", "moving_mean", "moving_variance")

    def __init__(self, model):
        self.layers = {}
        for layer in model.layers:
            values = {a: np.array(getattr(layer, a).numpy()) for a in self.ATTRS
                      if getattr(layer, a, None) is not None}
            for a in ("use_bias", "scale", "center", "epsilon"):
                if hasattr(layer, a):
                    values[a] = getattr(layer, a)
            self.layers[layer.name] = type("LayerWeights", (), values)

    def get_layer(self, name):
        return self.layers[name]


# (seed, branch scale, twins, steps, kinds the run must include)
RUNS = [(1, 0.4, 0.0, 12, {"prune", "merge", "evict"}),   # merges in h, b_in, cv first
        (4, 0.5, 0.05, 12, {"prune", "merge", "evict"}),  # a twin pair merges first
        (3, 0.3, 0.05, 12, {"prune", "merge", "evict"}),  # h without bias, early eviction
        (2, 1.0, 0.0, 10, {"prune", "merge"})]            # three merges in b_in


@pytest.mark.parametrize("seed,branch,twins,steps,kinds", RUNS)
def test_every_price_and_every_choice_of_a_run_equal_the_brute_force(seed, branch, twins,
                                                                     steps, kinds):
    model = build_model(seed, branch, twins)
    oracle = Oracle(model)
    enc = Encoder(model, verbose=False)
    assert {n: gs.readers for n, gs in enc.groups.items()} == READERS
    executed, stale = [], set()
    for k in range(steps):
        expected = oracle.table()
        assert_tables_equal(engine_table(enc), expected, f"step {k}")
        # The groups none of whose neighbours has been edited are priced from scratch
        # on the edited weights too (the others keep their start geometry).
        enc.editor.commit()
        frozen = {g for b in oracle.evicted for g in BLOCK_GROUPS[b]}
        clean = set(READERS) - stale - frozen
        fresh = Oracle(model)
        for g in clean:
            a = fresh.groups[g]
            a["active"] = oracle.groups[g]["active"].copy()
            a["C"], a["C_init"] = a["cap"][a["active"]].sum(), oracle.groups[g]["C_init"]
        fresh.evicted = set(oracle.evicted)
        assert_tables_equal(engine_table(enc), fresh.table(), f"step {k}, from scratch",
                            units=clean)
        action = enc.next_action()
        best = min(expected, key=lambda a: expected[a][1])
        got = _key(action.kind, action.unit, action.i, action.j)
        if got != best:  # a tie: the two cheapest within round-off
            assert expected[got][1] == pytest.approx(expected[best][1], rel=1e-9), (k, got,
                                                                                     best)
        before = Snapshot(model)
        step = enc.execute(action)
        assert step.J == pytest.approx(expected[got][0], rel=1e-6)
        assert step.DR == pytest.approx(expected[got][1], rel=1e-6)
        coef = oracle.execute(step.kind, step.unit, step.i, step.j)
        enc.editor.commit()
        if coef is not None:
            np.testing.assert_allclose(step.coef, coef, rtol=1e-6, atol=1e-9)
        check_edit(model, before, step, coef, getattr(oracle, "last_B", None),
                   clean=step.unit in clean)
        executed.append(step.kind)
        if step.kind == "evict":  # its branch end (in the stream) is zeroed
            stale |= {"stem"} | NEIGHBOURS["stem"]
        else:
            stale |= NEIGHBOURS[step.unit]
    assert kinds <= set(executed), executed


def test_step0_table_counts_every_pair_and_readers_count():
    """The table holds every prune (22 channels), every pair of the three neuron
    groups (3 + 6 + 10) and the eviction; the stream's prune ranks twice its J."""
    model = build_model(3)
    expected = Oracle(model).table()
    assert sum(k[0] == "prune" for k in expected) == 3 + 6 + 4 + 4 + 5
    assert sum(k[0] == "merge" for k in expected) == 3 + 6 + 10
    assert ("evict", "blk", -1, -1) in expected
    for key, (J, dr) in expected.items():
        if key[1] == "stem":
            assert dr == 2 * J
    assert_tables_equal(engine_table(Encoder(model, verbose=False)), expected, "step 0")


@pytest.mark.parametrize("seed,twins", [(1, 0.0), (4, 0.05)])
def test_refresh_neighbors_prices_every_step_from_the_edited_weights(seed, twins):
    """``refresh="neighbors"`` rebuilds the groups on both sides of an edited one from
    the edited weights, so every price equals the brute force of the edited model
    from scratch at every step (prunes and merges: an eviction moves the propagated
    moments, which stay those of the start). The stream's neighbours are found
    through all its writers and readers, and it is rebuilt as a coupled group."""
    model = build_model(seed, 1.0, twins)
    enc = Encoder(model, actions=("prune", "merge"), search={"refresh": "neighbors"},
                  verbose=False)
    active = {g: np.ones(n, dtype=bool) for g, n in
              (("cv", 3), ("stem", 6), ("b_in", 4), ("sw", 4), ("h", 5))}
    touched = set()
    for k in range(12):
        enc.editor.commit()
        fresh = Oracle(model)
        fresh.evict_J = {}
        for g, a in fresh.groups.items():
            a["active"] = active[g].copy()
            a["C"] = a["cap"][a["active"]].sum()
        expected = fresh.table()
        assert_tables_equal(engine_table(enc), expected, f"step {k}")
        action = enc.next_action()
        best = min(expected, key=lambda a: expected[a][1])
        got = _key(action.kind, action.unit, action.i, action.j)
        assert got == best or expected[got][1] == pytest.approx(expected[best][1], rel=1e-9)
        step = enc.execute(action)
        active[step.unit][step.j if step.kind == "merge" else step.i] = False
        touched.add(step.unit)
    assert {"stem", "sw"} & touched and {"cv", "b_in", "h"} & touched, touched
