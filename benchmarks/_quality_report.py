"""The quality benchmark's report: its tables, the choices they support, its plots.

Reads the results `benchmarks/quality.py` writes (``benchmarks/results/quality_<model>.json``)
and prints the tables of docs/benchmarks.md and docs/quality.md, the default against
the best baseline at every point, and writes ``docs/img/quality_<model>.png``. Run it
through the benchmark's command line::

    .venv/bin/python benchmarks/quality.py --report        # every table, the PNGs
    .venv/bin/python benchmarks/quality.py --compare hope hope_round8
    .venv/bin/python benchmarks/quality.py --kept hope      # stream channels kept
"""

from __future__ import annotations

import json

import numpy as np

import quality
from quality import (ALL_METHODS, AXES, BASELINES, BASELINES_SC, MODELS, PLAIN_BASELINES,
                     RATIOS, SPLITS, model_path, stream_groups)

#: Where the results are read and the PNGs written (`quality.py --results` sets both).
RESULTS = quality.RESULTS
IMG = quality.IMG


LABELS = {
    "hope": "**HOPE default** (`cost=\"hope\"`)",
    "hope_topk": "HOPE `merge_search=\"top_k\"` (uncertified merge search)",
    "hope_round8": "HOPE `round_to=8` (every touched layer a multiple of 8 channels)",
    "hope_topk_auto": "HOPE `merge_search=\"top_k\"`, the default's correction",
    "hope_sc": "HOPE + `correct_statistics`",
    "hope_sc_moved": "HOPE + `correct_statistics` without the trajectory (parents moved)",
    "hope_trust_merges": "exp: the default's correction, the surrogate trusted behind merges",
    "hope_re": "HOPE + BN re-estimated (uses data)",
    "hope_auto": "HOPE `compress(correct_statistics=\"auto\")`",
    "hope_prune_auto": "HOPE prune-only, `correct_statistics=\"auto\"`",
    "hope_nocorr": "HOPE default without the statistics correction (`correct_statistics=False`, as the variants)",
    "hope_nostreams_nocorr": "HOPE `HopeCost(groups=\"no_streams\")` without the statistics correction (the α rows' scope)",
    "hope_nostreams": "HOPE `HopeCost(groups=\"no_streams\")` (streams whole; the previous default)",
    "hope_one_reader": "exp: HOPE, streams priced as one reader's channel (no factor R)",
    "hope_noevict": "exp: HOPE without evictions (`actions=(\"prune\", \"merge\")`)",
    "hope_alpha_merge": "HOPE, merges priced by α* (the previous merge cost)",
    "hope_prev": "HOPE with the α* merge cost, ranked per neuron under every budget",
    "hope_paper": "HOPE `cost=\"paper\"`",
    "hope_neurons": "exp: default cost on the paper's neuron layers only (streams whole)",
    "hope_mc": "HOPE + mean compensation",
    "hope_neighbors": "HOPE `refresh=\"neighbors\"`",
    "hope_prune": "HOPE prune-only",
    "hope_prune_sc": "HOPE prune-only + `correct_statistics`",
    "hope_prune_mc": "HOPE prune-only + mean comp.",
    "hope_merge_paper": "HOPE `merge_scale=\"paper\"` (α* merge cost)",
    "rank_k": "exp: rank by sqrt(K_ii)",
    "rank_gamma": "exp: rank by abs(γ)",
    "rank_u": "exp: rank by ‖u_i‖",
    "rank_k_prune": "exp: rank by sqrt(K_ii), prune-only",
    "rank_gamma_prune": "exp: rank by abs(γ), prune-only",
    "rank_u_prune": "exp: rank by ‖u_i‖, prune-only",
    "hope_width_b50": "exp: layer weight (n0/mean n0)^0.5",
    "order_a0": "exp: order per neuron (α = 0)",
    "order_a25": "exp: order α = 0.25",
    "order_a50": "exp: order α = 0.5",
    "order_a75": "exp: order α = 0.75",
    "order_param": "exp: order per parameter / FLOP (α = 1)",
    "nm_global": "Neuron Merging global",
    "nm_layer": "Neuron Merging per layer",
}
for _b in BASELINES:
    if _b not in LABELS:
        _m, _s, _mc = _b.replace("_mc", "").rsplit("_", 1)[0], _b.replace("_mc", "").rsplit(
            "_", 1)[1], _b.endswith("_mc")
        LABELS[_b] = ({"l1_input": "L1 input", "l1_joint": "L1 joint",
                       "bn_scale": "BN scale"}[_m] + (" global" if _s == "global"
                                                      else " per layer")
                      + (" + mean comp." if _mc else ""))
for _b in BASELINES:
    LABELS[_b + "_sc"] = LABELS[_b] + " + `correct_statistics`"
    LABELS[_b + "_re"] = LABELS[_b] + " + BN re-estimated (uses data)"
    LABELS[_b + "_syn"] = LABELS[_b] + " + stream readers corrected (synthetic inputs)"
SHORT = {"l1_input": "L1in", "l1_joint": "L1j", "bn_scale": "BN", "nm": "NM"}


def short(name):
    m, s = name.replace("_mc", "").rsplit("_", 1)
    return f"{SHORT[m]}/{'g' if s == 'global' else 'l'}" + ("+mc" if name.endswith("_mc")
                                                            else "")


def load_results(model):
    path = RESULTS / f"quality_{model}.json"
    return json.loads(path.read_text()) if path.exists() else None


def acc_at(r, method, axis, target, split="heldout"):
    for p in r["results"].get(method, {}).get(axis, []):
        if abs(p["target"] - target) < 1e-9:
            return 100 * p["acc"][split]
    return None


def best_baseline(r, axis, target, split="heldout", pool=PLAIN_BASELINES):
    best = (None, None)
    for b in pool:
        a = acc_at(r, b, axis, target, split)
        if a is not None and (best[0] is None or a > best[0]):
            best = (a, b)
    return best


def fmt(a):
    return "—" if a is None else f"{a:.1f}"


def table(r, methods, axis, split, mark_reached=False):
    targets = sorted({p["target"] for m in methods
                      for p in r["results"].get(m, {}).get(axis, [])}, reverse=True)
    lines = ["| method | " + " | ".join(f"{t:g}" for t in targets) + " |",
             "|---" * (len(targets) + 1) + "|"]
    for m in methods:
        pts = {p["target"]: p for p in r["results"].get(m, {}).get(axis, [])}
        if not pts:
            continue
        cells = []
        for t in targets:
            p = pts.get(t)
            if p is None:
                cells.append("—")
                continue
            c = f"{100 * p['acc'][split]:.1f}"
            if mark_reached and p[axis] < t - 0.01:
                c += f" @{p[axis]:.2f}"
            cells.append(c)
        lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    return lines


def targets_check(r, model):
    """The quality targets on the held-out split, against the plain and the
    mean-compensated best baseline."""
    lines = []
    ds = [0.9, 0.8, 0.7, 0.6, 0.5] if model != "lenet300" else [0.8, 0.7, 0.6, 0.5,
                                                                0.4, 0.3, 0.2]
    rows = [("density", d) for d in ds] + [("flops", f) for f in (0.8, 0.6, 0.5)]
    lines.append("| point | default | best baseline | margin | best incl. mean comp. | margin |")
    lines.append("|---|---|---|---|---|---|")
    misses = []
    for axis, t in rows:
        a = acc_at(r, "hope", axis, t)
        b, bn = best_baseline(r, axis, t)
        c, cn = best_baseline(r, axis, t, pool=BASELINES)
        m1 = None if a is None or b is None else a - b
        m2 = None if a is None or c is None else a - c
        if m1 is not None and m1 < -1:
            misses.append(f"{axis} {t:g}: {m1:+.1f}")
        lines.append(f"| {axis} {t:g} | {fmt(a)} | {fmt(b)} {short(bn) if bn else ''} | "
                     f"{'—' if m1 is None else f'{m1:+.1f}'} | {fmt(c)} "
                     f"{short(cn) if cn else ''} | {'—' if m2 is None else f'{m2:+.1f}'} |")
    return lines, misses


def cliffs(r, axis="density", method="hope"):
    """Neighbouring points where `method` drops > 20 points while the best plain
    baseline drops < 5 (held-out)."""
    pts = sorted(r["results"].get(method, {}).get(axis, []), key=lambda p: -p["target"])
    out = []
    prev_t, prev_a = 1.0, 100 * r["info"]["accuracy"]["heldout"]
    prev_b = prev_a
    for p in pts:
        t, a = p["target"], 100 * p["acc"]["heldout"]
        b, _ = best_baseline(r, axis, t)
        if b is not None and prev_a - a > 20 and prev_b - b < 5:
            out.append(f"{axis} {prev_t:g}→{t:g}: {prev_a:.1f}→{a:.1f} "
                       f"(best baseline {prev_b:.1f}→{b:.1f})")
        prev_t, prev_a, prev_b = t, a, (b if b is not None else prev_b)
    return out


def mean_over(r, method, axis, split, targets):
    vals = [acc_at(r, method, axis, t, split) for t in targets]
    return None if any(v is None for v in vals) else float(np.mean(vals))


def decisions(results):
    """Summary tables for the decisions: mean accuracy over the grid per split."""
    lines = []

    def grid(model, axis):
        if axis == "density":
            return [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2] if model == "lenet300" else \
                [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
        return list(RATIOS)

    def ran(meth, axis):
        return any(r and r["results"].get(meth, {}).get(axis) for r in results.values())

    def block(title, methods, axis, note="", needs=()):
        if needs and not any(ran(x, axis) for x in needs):
            return  # none of the variants this block compares was run
        methods = [x for x in methods if ran(x, axis)]
        lines.append(f"\n#### {title}\n")
        if note:
            lines.append(note + "\n")
        models = [m for m in MODELS if results.get(m)]
        lines.append("| method | " + " | ".join(f"{m} sel | {m} held-out" for m in models)
                     + " |")
        lines.append("|---" * (2 * len(models) + 1) + "|")
        for meth in methods:
            if not any(results[m]["results"].get(meth, {}).get(axis) for m in models):
                continue  # not run on any model
            cells = []
            for m in models:
                for s in SPLITS:
                    # Only the targets every compared method reached on this model.
                    ts = [t for t in grid(m, axis)
                          if all(acc_at(results[m], x, axis, t, s) is not None
                                 for x in methods
                                 if results[m]["results"].get(x, {}).get(axis))]
                    v = mean_over(results[m], meth, axis, s, ts) if ts else None
                    cells.append(fmt(v))
            lines.append(f"| {LABELS.get(meth, meth)} | " + " | ".join(cells) + " |")

    dens = ("Mean accuracy % over the densities 0.9…0.3 (LeNet 0.8…0.2) that every "
            "listed method reached on that model.")
    block("Merge cost, merges, allocation (density axis)",
          ["hope", "hope_nocorr", "hope_alpha_merge", "hope_prev", "hope_merge_paper", "hope_prune",
           "hope_noevict", "hope_width_b50",
           "hope_neighbors", "hope_paper"], "density", dens)
    for axis in ("density", "flops"):
        block(f"Residual streams priced or whole ({axis} axis)",
              ["hope", "hope_neurons", "hope_paper"], axis,
              dens if axis == "density" else "Mean accuracy % over the FLOPs ratios "
              "0.9…0.3 every listed method reached on that model.",
              needs=["hope_neurons"])
    for axis in AXES:
        block(f"Residual streams: every reader counted, one reader, or streams whole ({axis} axis)",
              ["hope", "hope_one_reader", "hope_nostreams", "hope_paper"], axis,
              dens if axis == "density" else f"Mean accuracy % over the {axis} ratios "
              "0.9…0.3 every listed method reached.", needs=["hope_nostreams"])
    ranks = ["rank_k", "rank_gamma", "rank_u", "rank_k_prune", "rank_gamma_prune",
             "rank_u_prune"]
    block("Within-layer ranking (density axis)",
          ["hope", "hope_nocorr", "rank_k", "rank_gamma", "rank_u", "hope_prune", "rank_k_prune",
           "rank_gamma_prune", "rank_u_prune"], "density", dens, needs=ranks)
    for axis in ("density", "flops"):
        # Only the baselines run both ways (`name` and `name_mc`).
        mc_pairs = [x for b in BASELINES if b.endswith("_mc") and ran(b, axis)
                    for x in (b[:-3], b)]
        block(f"Mean compensation ({axis} axis)",
              ["hope", "hope_nocorr", "hope_mc", "hope_prune", "hope_prune_mc"] + mc_pairs, axis,
              dens if axis == "density" else "Mean accuracy % over the FLOPs ratios "
              "0.9…0.3 every listed method reached.", needs=["hope_mc", "hope_prune_mc"])
    for axis in ("density", "flops"):
        sc_pairs = [x for b in BASELINES_SC if ran(b, axis) for x in (b[:-3], b)]
        block(f"BN statistics correction, `correct_statistics` ({axis} axis)",
              ["hope", "hope_sc", "hope_sc_moved"] + sc_pairs, axis,
              dens if axis == "density" else "Mean accuracy % over the FLOPs ratios "
              "0.9…0.3 every listed method reached.", needs=["hope_sc"] + sc_pairs[1::2])
    for axis in AXES:
        block(f"`compress(correct_statistics=\"auto\")`, the default's correction ({axis} axis)",
              ["hope", "hope_auto", "hope_prune", "hope_prune_sc", "hope_prune_auto"], axis,
              dens if axis == "density" else f"Mean accuracy % over the {axis} ratios "
              "0.9…0.3 every listed method reached.", needs=["hope_auto"])
        diffs = []
        for m in MODELS:
            r = results.get(m)
            if not r or not r["results"].get("hope_auto", {}).get(axis):
                continue
            d = [abs(acc_at(r, "hope_auto", axis, p["target"], s)
                     - acc_at(r, "hope", axis, p["target"], s))
                 for p in r["results"]["hope_auto"][axis] for s in SPLITS
                 if acc_at(r, "hope", axis, p["target"], s) is not None]
            if d:
                diffs.append(f"{m} {max(d):.2f} ({len(d)} points)")
        if diffs:
            lines.append(f"\n`hope_auto` against `hope` ({axis} axis), largest absolute "
                         "difference at any point and split: " + ", ".join(diffs) + ".")
    for axis in ("params", "flops"):
        block(f"Ordering under a {axis}= budget",
              ["hope", "hope_nocorr", "hope_nostreams_nocorr", "order_a0", "order_a25",
               "order_a50", "order_a75", "order_param",
               "hope_prev", "hope_paper"] + list(PLAIN_BASELINES), axis,
              f"Mean accuracy % over the {axis} ratios 0.9…0.3 every listed method "
              "reached on that model.")
    return lines


def summary(results):
    """The default against the best plain baseline, held-out split, at the target
    points: one table for the CNNs, one for LeNet."""
    lines = []
    cnn = [m for m in ("demo", "vgg8", "resnet50") if results.get(m)]
    head = [("density", d) for d in (0.9, 0.8, 0.7, 0.6, 0.5)]
    flops = [("flops", f) for f in (0.8, 0.6, 0.5)]

    def rows(model, points):
        r = results[model]
        a = [acc_at(r, "hope", ax, t) for ax, t in points]
        b = [best_baseline(r, ax, t) for ax, t in points]
        bold = [x is not None and y[0] is not None and x >= y[0] for x, y in zip(a, b)]
        da = " | ".join(f"**{fmt(x)}**" if k else fmt(x) for x, k in zip(a, bold))
        db = " | ".join(f"{fmt(v)} {short(n) if n else ''}".strip() for v, n in b)
        return [f"| {model}, default | {da} |", f"| {model}, best baseline | {db} |"]

    if cnn:
        lines.append("| model | " + " | ".join(f"{t:g}" for _, t in head)
                     + " | " + " | ".join(f"FLOPs {t:g}" for _, t in flops) + " |")
        lines.append("|---" * (len(head) + len(flops) + 1) + "|")
        for m in cnn:
            lines += rows(m, head + flops)
    if results.get("lenet300"):
        pts = [("density", d) for d in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)] + flops
        lines.append("\n| LeNet-300-100 | " + " | ".join(
            f"{t:g}" if ax == "density" else f"FLOPs {t:g}" for ax, t in pts) + " |")
        lines.append("|---" * (len(pts) + 1) + "|")
        lines += [x.replace("lenet300, ", "") for x in rows("lenet300", pts)]
    return lines




def kept(model, methods, axis="density"):
    """Prints, per stored point of each method, the residual stream channels and the
    other neurons kept, and the accuracy (selection / held-out): where a cost spends
    its budget. The stream groups are read from the results, or (results stored
    before they were recorded) from an analysis of the saved model."""
    r = load_results(model)
    if r is None:
        raise SystemExit(f"no stored results for {model!r} in {RESULTS}")
    streams = r["info"].get("streams")
    if streams is None:
        import keras

        if model == "demo":
            from hope_keras.data import load_demo_model

            m = load_demo_model()
        else:
            m = keras.models.load_model(model_path(model), compile=False)
        import hope_keras

        streams = stream_groups(hope_keras.analyze(m))
    sizes = r["info"]["groups"]
    s0 = sum(sizes[g] for g in streams)
    o0 = sum(sizes.values()) - s0
    print(f"| method | {axis} | stream channels kept (of {s0}) | other neurons kept "
          f"(of {o0}) | accuracy sel / held-out |")
    print("|---|---|---|---|---|")
    for method in methods:
        for p in r["results"].get(method, {}).get(axis, []):
            s = sum(p["alive"][g] for g in streams)
            o = sum(p["alive"].values()) - s
            print(f"| {method} | {p['target']} | {s} | {o} | "
                  f"{100 * p['acc']['sel']:.1f} / {100 * p['acc']['heldout']:.1f} |")


def compare(first, second, models=MODELS):
    """Prints, per model (every axis pooled), how method `second` scores against
    `first` at the same targets: points scored the same on both splits, and the
    held-out and selection differences (second − first, points of accuracy); then
    each one's sum of J per axis."""
    print(f"| model | points the same | held-out: mean / min / max | selection: "
          f"mean / min / max | sum of J per axis, {first} / {second} |")
    print("|---|---|---|---|---|")
    for model in models:
        r = load_results(model)
        if r is None or first not in r["results"] or second not in r["results"]:
            continue
        pairs, sums = [], []
        for axis, points in r["results"][first].items():
            other = {p["target"]: p for p in r["results"][second].get(axis, [])}
            pairs += [(p, other[p["target"]]) for p in points if p["target"] in other]
            notes = [r["notes"].get(m, {}).get(axis, {}) for m in (first, second)]
            if all("sum_J" in n for n in notes):
                sums.append(f"{axis} " + " / ".join(f"{n['sum_J']:.6g}" for n in notes))
        if not pairs:
            continue
        diff = {k: np.array([100 * (b["acc"][k] - a["acc"][k]) for a, b in pairs])
                for k in SPLITS}
        same = int(np.sum((np.abs(diff["sel"]) < 1e-9) & (np.abs(diff["heldout"]) < 1e-9)))
        print(f"| {model} | {same} of {len(pairs)} | " + " | ".join(
            f"{d.mean():+.2f} / {d.min():+.1f} / {d.max():+.1f}"
            for d in (diff["heldout"], diff["sel"])) + f" | {'; '.join(sums)} |")


def report(models=MODELS, plots=True):
    results = {m: load_results(m) for m in models}
    lines = ["\n### Summary: default against the best baseline (held-out split)\n"]
    lines += summary(results)
    for model in models:
        r = results.get(model)
        if r is None:
            continue
        info = r["info"]
        lines.append(f"\n### Quality: {model}\n")
        lines.append(
            f"{info['neurons']} compressible neurons in {len(info['groups'])} groups, "
            f"{info['blocks']} evictable blocks, {info['params']} parameters, "
            f"{info['flops'] / 1e6:.2f} MFLOPs per example. Uncompressed accuracy: "
            f"{100 * info['accuracy']['sel']:.2f} % on the selection split "
            f"({info['n']['sel']} images), {100 * info['accuracy']['heldout']:.2f} % on "
            f"the held-out split ({info['n']['heldout']} images). HOPE densities: "
            f"{info['hope_densities']}.\n")
        present = [m for m in ALL_METHODS if m in r["results"]]
        for axis in AXES:
            ms = [m for m in present if axis in r["results"][m]]
            if not ms:
                continue
            lines.append(f"\nAccuracy % against the {axis} "
                         f"{'' if axis == 'density' else 'ratio '}target, "
                         f"held-out split (`@x`: the {axis} actually reached when a step "
                         f"overshot):\n")
            lines += table(r, ms, axis, "heldout", mark_reached=True)
        lines.append("\nTargets: the default against the best baseline (held-out split):\n")
        tl, misses = targets_check(r, model)
        lines += tl
        cl = cliffs(r) + cliffs(r, "flops")
        lines.append(f"\nMisses (> 1 point below the plain best baseline): "
                     f"{', '.join(misses) or 'none'}. Cliffs: {', '.join(cl) or 'none'}.")
        if plots:
            plot(model, r)
            lines.append(f"\n![{model}](img/quality_{model}.png)\n")
    lines.append("\n### Decisions: selection split against held-out split\n")
    lines += decisions(results)
    text = "\n".join(lines)
    print(text)
    return text


def plot(model, r):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    fig, axs = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    show = ["hope", "hope_alpha_merge", "hope_paper", "hope_neurons", "hope_prune", "order_a0",
            "order_param"] + \
        list(PLAIN_BASELINES) + ["bn_scale_layer_mc", "bn_scale_global_mc"]
    colors = plt.get_cmap("tab20").colors
    for k, m in enumerate(show):
        for ax, axis in zip(axs, AXES):
            pts = sorted(r["results"].get(m, {}).get(axis, []), key=lambda p: -p["target"])
            if not pts:
                continue
            x = [1.0] + [p[axis] for p in pts]
            y = [100 * r["info"]["accuracy"]["heldout"]] + [100 * p["acc"]["heldout"]
                                                           for p in pts]
            hope = m.startswith(("hope", "order"))
            ax.plot(x, y, "-" if hope else "--", marker="o", ms=3,
                    lw=2.8 if m == "hope" else 1.2,
                    color="black" if m == "hope" else colors[k % 20],
                    label=LABELS.get(m, m).replace("**", "").replace("`", ""))
    for ax, axis in zip(axs, AXES):
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.set_xlabel({"density": "neuron density", "params": "live parameter ratio",
                       "flops": "FLOPs ratio"}[axis])
    axs[0].set_ylabel("held-out accuracy (%)")
    axs[0].set_title(f"{model}: accuracy vs neuron density (no fine-tuning)", fontsize=10)
    axs[1].set_title("vs parameter ratio (budget params=)", fontsize=10)
    axs[2].set_title("vs FLOPs ratio (budget flops=)", fontsize=10)
    handles, labels = axs[0].get_legend_handles_labels()
    h2, l2 = axs[2].get_legend_handles_labels()
    for h, lab in zip(h2, l2):
        if lab not in labels:
            handles.append(h)
            labels.append(lab)
    fig.legend(handles, labels, fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(IMG / f"quality_{model}.png", dpi=100)
    plt.close(fig)
