"""Does modelling channel correlations fix the data-free BN variance prediction?

For every "neurons" group (producer → BN → ReLU → consumer conv → BN) of the
ResNet-50 fixture, this predicts the per-channel variance of the *first-hop* BN input
(the consumer's output) before and after ``hope_keras.compress(density=d,
correct_statistics=False)`` and compares the predicted log-variance ratio
``log(after / before)`` with the measured one (BN moving statistics re-estimated on
the 512 calibration images, as ``bn_correction_diagnostic.py`` does). Predictions:

* ``indep``     — ``hope_keras.moments.propagate`` (what ``correct_statistics`` uses).
* ``corr``      — ``Var(y_c) = Σ_ij G^c_ij Cov_ij``, ``G^c_ij = Σ_t W[t,i,c] W[t,j,c]``,
  ``Cov_ij = K(i,j) − m_i m_j``: the exact bivariate-Gaussian cross-kernel with the
  cache's warped correlation ρ̃ (``cache.pair_grid``; after compression from
  ``analyze`` of the compressed model) and each ReLU input's mean / variance from
  ``moments.propagate`` (same marginals as ``indep``: only the correlations differ).
* ``corrK``     — the same with the cache's own ``K(i,j)`` (``pair_grid``, zero-bias
  approximation), ``K(i,i) = k_self`` and ``m_i = relu_mean(gamma, beta)`` of the cache.
* ``corr_pad``  — ``corr`` with the consumer's zero padding counted: per output
  position only the taps that fall inside the input, pooled variance =
  mean over positions of the per-position variance + variance over positions of the
  per-position mean (conv5 is 1×1 spatially at 32×32: a 3×3 "same" conv only sees
  its centre tap there).
* ``data_pad`` / ``data`` — the ``corr_pad`` / ``corr`` formula with the *measured*
  channel covariance and means of the group's ReLU outputs (calibration images, in the
  model with all BNs re-estimated, like the measured target): what is left is the
  spatial-independence assumption (taps treated as uncorrelated).

``indep_mine`` (the ``corr`` formula with the covariance's diagonal only) must equal
``indep``: a check of the formula. Also prints, for *all* BN inputs grouped by kind
(first hop ``_2_bn``/``_3_bn``, residual-stream readers ``_1_bn``, shortcuts
``_0_bn``), the error of the independence prediction; how well ρ̃ matches the
measured correlation of the ReLU inputs; and (``--acc``) selection-split accuracy with only the first-hop BNs corrected (variance
times a predicted ratio, mean shift from ``indep``) against no correction, the data
re-estimation of the first-hop BNs only, and the data re-estimation of all BNs.

Densities are converted like ``bn_correction_diagnostic.py``'s ``resnet_bench`` case
(quality.py's ResNet-50 densities 0.6 / 0.5 of N=11456 channels, 7616 priced).

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/bn_correlated_diagnostic.py [--acc] [0.6 0.5]
    .venv/bin/python benchmarks/bn_correlated_diagnostic.py --quick   # demo CNN, density 0.7, --acc
"""
import math
import sys
import time

import keras
import numpy as np

sys.path.insert(0, "benchmarks")
import quality  # noqa: E402
from _common import compress  # noqa: E402

import hope_keras  # noqa: E402
from hope_keras import kernels as K  # noqa: E402
from hope_keras import moments as M  # noqa: E402
from hope_keras.bn_stats import reestimate_batchnorm_statistics as reest  # noqa: E402

PASS = (keras.layers.ZeroPadding2D,)


def bns(model):
    return [l for l in model._flatten_layers() if isinstance(l, keras.layers.BatchNormalization)]


def hops(analysis):
    """[(group, relu node, consumer node, first-hop BN node)] for direct links."""
    flat, out = analysis.graph.flat, []
    for name, g in analysis.graph.groups.items():
        if getattr(g, "kind", None) != "neurons" or not isinstance(analysis.caches.get(name), hope_keras.cache.GroupCache):
            continue
        for c in g.consumers:
            cn = flat.node_of(c.layer)
            if not isinstance(cn.op, keras.layers.Conv2D) or type(cn.op) is not keras.layers.Conv2D:
                continue
            p = flat.producer_node(cn.inputs[0])
            while p is not None and isinstance(p.op, PASS):
                p = flat.producer_node(p.inputs[0])
            if p is None or not isinstance(p.op, (keras.layers.ReLU, keras.layers.Activation)):
                continue  # e.g. max pooling in between: not a linear first hop
            kids = flat.children(cn)
            if len(kids) != 1 or not isinstance(kids[0].op, keras.layers.BatchNormalization):
                continue
            if cn.op.kernel.shape[2] != g.size:
                continue
            out.append((name, p, cn, kids[0]))
    return out


def tap_mask(conv, hw):
    """(positions, taps) 0/1 mask of the taps inside the (unpadded) input."""
    kh, kw = conv.kernel_size
    sh, sw = conv.strides
    H, W = hw
    if conv.padding == "same":
        oh, ow = -(-H // sh), -(-W // sw)
        ph = max((oh - 1) * sh + kh - H, 0) // 2
        pw = max((ow - 1) * sw + kw - W, 0) // 2
    else:
        oh, ow, ph, pw = (H - kh) // sh + 1, (W - kw) // sw + 1, 0, 0
    r = np.arange(oh)[:, None] * sh - ph + np.arange(kh)[None]  # (oh, kh) input rows
    q = np.arange(ow)[:, None] * sw - pw + np.arange(kw)[None]
    vr, vq = (r >= 0) & (r < H), (q >= 0) & (q < W)
    return (vr[:, None, :, None] & vq[None, :, None, :]).reshape(oh * ow, kh * kw).astype(float)


def pred_var(W, cov, m, mask=None):
    """Pooled variance of each output channel of a conv with input channel
    covariance `cov` and means `m`, taps independent. W: (taps, cin, cout)."""
    q = np.einsum("tic,ij,tjc->tc", W, cov, W)  # per-tap variance contribution
    if mask is None:
        return q.sum(0)
    mu_t = np.einsum("tic,i->tc", W, m)
    within = mask.mean(0) @ q
    mu_p = mask @ mu_t  # (positions, cout), bias omitted (a constant shift)
    return within + mu_p.var(0)


def gauss_cov(mz, vz, rho):
    s = np.sqrt(np.maximum(vz, 0))
    m = K.relu_mean(s, mz)
    kx = K.cross_kernel_exact(s[:, None], mz[:, None], s[None], mz[None], rho)
    np.fill_diagonal(kx, K.self_kernel(s, mz))
    return kx - np.outer(m, m), m


def cache_cov(cache):
    n = cache.size
    rho, kc, _ = cache.pair_grid(np.arange(n))
    kc = np.array(kc, dtype=float)
    np.fill_diagonal(kc, cache.k_self)
    m = K.relu_mean(cache.gamma, cache.beta)
    return kc - np.outer(m, m), m, np.array(rho, dtype=float)


def act_stats(model, layers, x):
    """Measured per-group (mean, covariance) of ReLU outputs and correlation of
    ReLU inputs, pooled over images and positions."""
    outs = []
    for l in layers:
        outs += [l.input, l.output]
    probe = keras.Model(model.inputs, outs)
    acc = [None] * len(outs)
    for i in range(0, len(x), 128):
        ys = probe(x[i:i + 128], training=False)
        for k, y in enumerate(ys):
            y = np.asarray(y, dtype=np.float64).reshape(-1, y.shape[-1])
            s = (len(y), y.sum(0), y.T @ y)
            acc[k] = s if acc[k] is None else tuple(a + b for a, b in zip(acc[k], s))
    res = []
    for k in range(0, len(outs), 2):
        st = []
        for n, s1, s2 in (acc[k], acc[k + 1]):
            mu = s1 / n
            st.append((mu, s2 / n - np.outer(mu, mu)))
        (mz, cz), (ma, ca) = st
        d = np.sqrt(np.maximum(np.diag(cz), 1e-30))
        res.append((ma, ca, cz / np.outer(d, d)))
    return res


def main(argv):
    quick = "--quick" in argv  # the demo CNN (one first hop), 200 images, one density
    do_acc = "--acc" in argv or quick
    dens = [float(a) for a in argv if not a.startswith("--")] or ([0.7] if quick else [0.6, 0.5])
    t_start = time.time()
    model, splits, xc = quality.load_splits("demo" if quick else "resnet50",
                                            200 if quick else 1000, 10)
    x, y = splits["sel"]
    a0 = hope_keras.analyze(model)
    H = hops(a0)
    flat0 = a0.graph.flat
    orig = [w.numpy().copy() for w in model.weights]

    def reset():
        for w, v in zip(model.weights, orig):
            w.assign(v)

    def measured():
        keep = [w.numpy().copy() for w in model.weights]
        reest(model, xc)
        out = {b.name: (b.moving_mean.numpy().astype(float), b.moving_variance.numpy().astype(float)) for b in bns(model)}
        for w, v in zip(model.weights, keep):
            w.assign(v)
        return out

    def acc():
        p = np.concatenate([np.asarray(model(x[i:i + 250], training=False)) for i in range(0, len(x), 250)])
        return 100 * np.mean(np.argmax(p, 1) == y)

    def predict(analysis, mom):
        """{bn name: {method: per-channel variance}} and ρ̃ vs measured ρ stats."""
        relus = [h[1].op for h in H]
        # measured in the re-estimated model: the "measured" BN-input variances are
        # those of the model whose upstream BNs are re-estimated too
        keep = [w.numpy().copy() for w in model.weights]
        reest(model, xc)
        data = act_stats(model, relus, xc)
        for w, v in zip(model.weights, keep):
            w.assign(v)
        out, rho_err = {}, []
        for (gname, rn, cn, bn), (ma, ca, rz) in zip(H, data):
            cache = analysis.caches[gname]
            conv = cn.op
            Wt = conv.kernel.numpy().astype(np.float64)
            Wt = Wt.reshape(-1, Wt.shape[2], Wt.shape[3])
            mz, vz = (np.asarray(v, dtype=np.float64) for v in mom[rn.inputs[0]])
            n = cache.size
            rho, _, _ = cache.pair_grid(np.arange(n))
            rho = np.array(rho, dtype=float)
            np.fill_diagonal(rho, 1.0)
            cov, m = gauss_cov(mz, vz, rho)
            covk, mk, _ = cache_cov(cache)
            mask = tap_mask(conv, flat0.shapes[cn.inputs[0]][1:3])
            act = cache.wnorm > 0
            iu = np.triu_indices(n, 1)
            sel = act[iu[0]] & act[iu[1]]
            rho_err.append((gname, rho[iu][sel], rz[iu][sel]))
            out[bn.op.name] = {
                "indep": np.asarray(mom[bn.inputs[0]][1], dtype=np.float64),
                "indep_mine": pred_var(Wt, np.diag(np.diag(cov)), m),
                "corr": pred_var(Wt, cov, m),
                "corrK": pred_var(Wt, covk, mk),
                "corr_pad": pred_var(Wt, cov, m, mask),
                "data": pred_var(Wt, ca, ma),
                "data_pad": pred_var(Wt, ca, ma, mask),
            }
        return out, rho_err

    S0 = measured()
    P0, rho0 = predict(a0, a0.moments)
    print(f"{len(H)} first hops (group → consumer conv → BN); setup {time.time() - t_start:.0f} s", flush=True)
    stage = lambda b: b.split("_")[0]
    rr = np.concatenate([r[1] for r in rho0]), np.concatenate([r[2] for r in rho0])
    print(f"before compression: ρ̃ (cache) vs measured ReLU-input correlation over all active pairs: "
          f"pearson {np.corrcoef(*rr)[0, 1]:.3f}, median |ρ̃| {np.median(np.abs(rr[0])):.3f}, "
          f"median |ρ measured| {np.median(np.abs(rr[1])):.3f}, median |error| {np.median(np.abs(rr[0] - rr[1])):.3f}")
    for b in sorted({stage(h[3].op.name) for h in H}):
        sel = [r for r, h in zip(rho0, H) if stage(h[3].op.name) == b]
        p, q = np.concatenate([r[1] for r in sel]), np.concatenate([r[2] for r in sel])
        print(f"   {b}: pearson {np.corrcoef(p, q)[0, 1]:.3f}, median |ρ̃| {np.median(np.abs(p)):.3f}, median |ρ| {np.median(np.abs(q)):.3f}")
    # sanity: the level of the before predictions (log pred / measured)
    methods = list(next(iter(P0.values())).keys())
    lev = {k: np.median(np.concatenate([np.log(P0[b][k] / S0[b][1]) for b in P0 if (S0[b][1] > 1e-8).all()])) for k in methods}
    print("before compression, median log(predicted / measured) BN-input variance:", {k: round(float(v), 2) for k, v in lev.items()})

    for d in dens:
        own = d if quick else (math.floor(d * 11456 + 1e-9) - (11456 - 7616)) / 7616
        reset()
        t0 = time.time()
        # The default when this diagnostic was written: the 3840 stream channels whole.
        compress(model, density=own, analysis=a0, correct_statistics=False,
                            cost=hope_keras.costs.HopeCost(groups="no_streams"))
        t_c = time.time() - t0
        mom1 = M.propagate(flat0)
        a1 = hope_keras.analyze(model)
        S1 = measured()
        P1, _ = predict(a1, mom1)
        print(f"\n=== bench density {d} (own {own:.4f}); compress {t_c:.0f} s ===")
        rows = {}
        for b in P1:
            ok = (S0[b][1] > 1e-8) & (S1[b][1] > 1e-12)
            for k in methods:
                ok &= (P0[b][k] > 0) & (P1[b][k] > 0)
            meas = np.log(S1[b][1][ok] / S0[b][1][ok])
            rows[b] = (meas, {k: np.log(P1[b][k][ok] / P0[b][k][ok]) for k in methods})
        changed = [b for b in rows if np.abs(rows[b][0]).max() > 1e-3]
        print(f"{len(changed)}/{len(rows)} first-hop BNs changed. Per-channel log var ratio (after/before):"
              " median |pred − meas| / 95th pct |pred − meas| / pearson r with measured; 'meas' = median measured log ratio")
        hdr = "stage        n_ch   meas " + " ".join(f"{k:>20}" for k in methods)
        print(hdr)
        groups = {}
        for b in changed:
            groups.setdefault(stage(b), []).append(b)
        groups["all"] = changed
        for sname, bl in sorted(groups.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            meas = np.concatenate([rows[b][0] for b in bl])
            cells = []
            for k in methods:
                p = np.concatenate([rows[b][1][k] for b in bl])
                r = np.corrcoef(p, meas)[0, 1] if p.std() > 0 and meas.std() > 0 else float("nan")
                e = np.abs(p - meas)
                cells.append(f"{np.median(e):.2f}/{np.percentile(e, 95):.2f}/{r:5.2f}")
            print(f"{sname:10s} {meas.size:6d} {np.median(meas):6.2f} " + " ".join(f"{c:>20}" for c in cells))
        print("all BN inputs, by kind (independence prediction, moments.propagate): n BNs changed, per-channel"
              " median |meas log ratio|, 95th pct |meas|, median |indep − meas|, 95th pct |indep − meas|, worst channel (meas, pred)")
        first = {h[3].op.name for h in H}
        kinds = {}
        for node in flat0.nodes:
            b = node.op
            if not isinstance(b, keras.layers.BatchNormalization):
                continue
            t = node.inputs[0]
            s0v, s1v = S0[b.name][1], S1[b.name][1]
            v0, v1 = np.asarray(a0.moments[t][1], float), np.asarray(mom1[t][1], float)
            ok = (s0v > 1e-8) & (s1v > 1e-12) & (v0 > 0) & (v1 > 0)
            meas, pred = np.log(s1v[ok] / s0v[ok]), np.log(v1[ok] / v0[ok])
            if np.abs(meas).max() < 1e-3:
                continue
            parts = b.name.rsplit("_", 2)
            kind = (("first hop " if b.name in first else "other ")
                    + (parts[-2] if len(parts) > 1 else b.name) + "_bn")
            kinds.setdefault(kind, []).append((b.name, meas, pred))
        for kind, lst in sorted(kinds.items()):
            meas = np.concatenate([r[1] for r in lst]); pred = np.concatenate([r[2] for r in lst])
            e = np.abs(pred - meas); k = int(np.argmax(e))
            print(f"   {kind:18s} {len(lst):3d} {np.median(np.abs(meas)):6.2f} {np.percentile(np.abs(meas), 95):6.2f}"
                  f" {np.median(e):6.2f} {np.percentile(e, 95):6.2f}   ({meas[k]:.2f}, {pred[k]:.2f})")
        worst = sorted(changed, key=lambda b: -abs(np.median(rows[b][0])))[:6]
        print("most changed BNs (median per-channel log ratio): measured | " + " | ".join(methods))
        for b in worst:
            print(f"   {b:28s} {np.median(rows[b][0]):6.2f} | " + " | ".join(f"{np.median(rows[b][1][k]):6.2f}" for k in methods))
        if do_acc:
            base = [w.numpy().copy() for w in model.weights]
            res = {"none": acc()}
            for label, k in (("first-hop corr_pad", "corr_pad"), ("first-hop corr", "corr"), ("first-hop indep", "indep"),
                             ("first-hop data_pad", "data_pad")):
                for h in H:
                    bn = h[3].op
                    t = h[3].inputs[0]
                    m0, m1 = a0.moments[t][0], mom1[t][0]
                    r = np.where(P0[bn.name][k] > 0, P1[bn.name][k] / np.where(P0[bn.name][k] > 0, P0[bn.name][k], 1), 1)
                    bn.moving_mean.assign((bn.moving_mean.numpy() + (m1 - m0)).astype("float32"))
                    bn.moving_variance.assign((bn.moving_variance.numpy() * r).astype("float32"))
                res[label] = acc()
                for w, v in zip(model.weights, base):
                    w.assign(v)
            for h in H:
                bn = h[3].op
                bn.moving_mean.assign(S1[bn.name][0].astype("float32"))
                bn.moving_variance.assign(S1[bn.name][1].astype("float32"))
            res["first-hop reestimate"] = acc()
            for w, v in zip(model.weights, base):
                w.assign(v)
            reest(model, xc)
            res["all reestimate"] = acc()
            for w, v in zip(model.weights, base):
                w.assign(v)
            print("sel acc (%):", {k: round(float(v), 1) for k, v in res.items()}, flush=True)
    reset()
    print(f"\nwall time {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
