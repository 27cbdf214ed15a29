"""Where correct_statistics' prediction goes wrong: predicted vs measured (calibration
data) change of each BN input's per-channel mean and variance, and selection-split
accuracy with: no correction / correct_statistics / mean shift only / variance ratio only /
data re-estimation (oracle, 512 calibration images). An ad-hoc diagnostic of the _sc
methods of benchmarks/quality.py (HOPE points here are direct compress() runs; the
``resnet_bench`` case converts to quality.py's ResNet-50 densities 0.6 / 0.5).

Usage (repository root)::

    nice -n 10 .venv/bin/python benchmarks/bn_correction_diagnostic.py demo|resnet50|resnet_bench
    .venv/bin/python benchmarks/bn_correction_diagnostic.py --quick   # demo, one case, 200 images
"""
import sys, numpy as np, keras
sys.path.insert(0, "benchmarks")
import quality, hope_keras
from _common import compress, quick_requested
from hope_keras import moments as M, baselines
from hope_keras.bn_stats import reestimate_batchnorm_statistics as reest

def bns(model):
    return [l for l in model._flatten_layers() if isinstance(l, keras.layers.BatchNormalization)]

def run(model_name, cases, n_sel=None):
    n_sel = n_sel or (1000 if model_name == "resnet50" else 2000)
    model, splits, xc = quality.load_splits(model_name, n_sel, 10)
    x, y = splits["sel"]
    a = hope_keras.analyze(model)
    orig = [w.numpy().copy() for w in model.weights]
    def reset():
        for w, v in zip(model.weights, orig): w.assign(v)
    def acc():
        p = np.concatenate([np.asarray(model(x[i:i+250], training=False)) for i in range(0, len(x), 250)])
        return 100 * np.mean(np.argmax(p, 1) == y)
    def measured():
        keep = [w.numpy().copy() for w in model.weights]
        reest(model, xc)
        out = {b.name: (b.moving_mean.numpy().astype(float), b.moving_variance.numpy().astype(float)) for b in bns(model)}
        for w, v in zip(model.weights, keep): w.assign(v)
        return out
    S0 = measured()
    flat = a.graph.flat
    for label, edit in cases:
        reset(); edit(model, a)
        after = M.propagate(flat)
        S1 = measured()
        errs, tail = [], []
        for node in flat.nodes:
            b = node.op
            if not isinstance(b, keras.layers.BatchNormalization) or b.name not in S1: continue
            t = node.inputs[0]
            (m0, v0), (m1, v1) = a.moments[t], after[t]
            (s0m, s0v), (s1m, s1v) = S0[b.name], S1[b.name]
            ok = (s0v > 1e-8) & (v0 > 0) & (s1v > 1e-12) & (v1 > 0)
            sd = np.sqrt(s0v[ok])
            dm_meas, dm_pred = (s1m - s0m)[ok] / sd, (m1 - m0)[ok] / sd
            lr_meas, lr_pred = np.log(s1v[ok] / s0v[ok]), np.log(v1[ok] / v0[ok])
            errs.append((b.name, np.percentile(np.abs(dm_meas), 95), np.percentile(np.abs(dm_meas - dm_pred), 95),
                         np.percentile(np.abs(lr_meas), 95), np.percentile(np.abs(lr_meas - lr_pred), 95)))
            k = int(np.argmax(np.abs(lr_meas - lr_pred)))
            tail.append((b.name, float(lr_pred[k]), float(lr_meas[k]), float(np.mean(lr_pred)), float(np.mean(lr_meas))))
        e = np.array([r[1:] for r in errs])
        changed = e[:, 0] + e[:, 2] > 1e-6
        print(f"{model_name} {label}: {changed.sum()}/{len(e)} BN inputs changed; medians over those BNs of per-channel 95th percentiles:"
              f" |Δmean|/sd measured {np.median(e[changed,0]):.3f}, error after correction {np.median(e[changed,1]):.3f};"
              f" |log var ratio| measured {np.median(e[changed,2]):.3f}, error after correction {np.median(e[changed,3]):.3f}")
        worst = sorted(tail, key=lambda r: -abs(r[1] - r[2]))[:4]
        print("   worst channel log var ratio (BN, predicted, measured; BN mean predicted, measured):", [(r[0], *[round(v, 2) for v in r[1:]]) for r in worst])
        base = [w.numpy().copy() for w in model.weights]
        res = {"none": acc()}
        new = hope_keras.correct_statistics(model, a); res["sc"] = acc()
        for w, v in zip(model.weights, base): w.assign(v)
        for mode in ("mean_only", "var_only"):
            for node in flat.nodes:
                b = node.op
                if not isinstance(b, keras.layers.BatchNormalization) or b.name not in new: continue
                t = node.inputs[0]; (m0, v0), (m1, v1) = a.moments[t], after[t]
                if mode == "mean_only": b.moving_mean.assign((b.moving_mean.numpy() + (m1 - m0)).astype("float32"))
                else: b.moving_variance.assign((b.moving_variance.numpy() * np.where(v0 > 0, v1 / np.where(v0 > 0, v0, 1), 1)).astype("float32"))
            res[mode] = acc()
            for w, v in zip(model.weights, base): w.assign(v)
        reest(model, xc); res["reestimate(512 calib)"] = acc()
        print("   sel acc:", {k: round(v, 1) for k, v in res.items()}, flush=True)
    reset()

def hope(**kw):
    # The default when this diagnostic was written: residual streams whole.
    kw.setdefault("cost", hope_keras.costs.HopeCost(groups="no_streams"))
    return lambda m, a: compress(m, analysis=a, **kw)
def bl(d, method="bn_scale", scope="layer"):
    return lambda m, a: baselines.prune(m, d, method=method, scope=scope, analysis=a)

which = "quick" if quick_requested() else sys.argv[1]
if which == "quick":
    run("demo", [("hope density=0.9", hope(density=0.9))], n_sel=200)
elif which == "demo":
    run("demo", [("hope flops=0.9", hope(flops=0.9)), ("hope density=0.6", hope(density=0.6)),
                 ("bn_scale_layer density=0.6", bl(0.6))])
elif which == "vgg8":
    run("vgg8", [("hope density=0.7", hope(density=0.7)), ("bn_scale_layer density=0.6", bl(0.6))])
elif which == "resnet_bench":  # the benchmark's densities 0.6 / 0.5 of N=11456 (7616 priced)
    import math
    own = lambda d: (math.floor(d * 11456 + 1e-9) - (11456 - 7616)) / 7616
    run("resnet50", [(f"hope bench density={d} (own {own(d):.4f})", hope(density=own(d))) for d in (0.6, 0.5)])
else:
    run("resnet50", [("hope density=0.9", hope(density=0.9)), ("hope density=0.6", hope(density=0.6)),
                     ("hope density=0.5", hope(density=0.5)), ("bn_scale_layer flops~0.9 (density 0.9)", bl(0.9))])
