"""Mutation study: do the tests notice small, plausible bugs?

Each mutant below is a one-place source patch of ``src/hope_keras`` of the kind a
change could slip in (a merge that reads one neuron twice, a cost without a term,
a FLOPs count without its spatial factor, a mapping off by one, a sign flipped, …).
For each, the package is copied to a temporary folder, the patch applied there
(the working tree is never touched), and the test files meant to catch it are run
with the copy first on ``PYTHONPATH`` (``pytest -x``: the first failure kills the
mutant). ``--full`` runs the whole fast suite (``make test``'s selection) on the
mutants that survive their files. The outcome of every mutant, the test that
killed it and the time it took are written to a JSON file.

Usage::

    python scripts/mutants.py                      # every mutant, its test files
    python scripts/mutants.py --only hope_prune_n  # some of them
    python scripts/mutants.py --full               # survivors: the whole fast suite
    python scripts/mutants.py --list               # the mutants, no run

Run it with the project's interpreter (``.venv/bin/python``); the tests run under
the same one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "mutants.json")


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A one-place patch: ``old`` (found exactly once in ``path``) becomes ``new``.

    Attributes:
        name: Identifier.
        what: The bug it plants, in words.
        path: File under ``src/hope_keras``.
        old, new: The text replaced and its replacement.
        tests: The test files meant to catch it (run in this order).
    """

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: Tuple[str, ...]


COST_TABLES = ("tests/test_default_cost_table.py",)
M = Mutant
MUTANTS: List[Mutant] = [
    # ---------------------------------------------------------------- edits
    M("merge_reads_one_neuron_twice", "a merge folds neuron i twice instead of i and j",
      "edit/editor.py", "(wi, bi), (wj, bj) = folded(i), folded(j)",
      "(wi, bi), (wj, bj) = folded(i), folded(i)",
      COST_TABLES + ("tests/test_exactness.py",)),
    M("prune_leaves_the_readers", "a prune zeroes writers and BN but not the readers' slices",
      "edit/editor.py", "        for c in g.couplings:\n            self._zero_coupling(c, i)\n",
      "        for c in g.couplings:\n            if c.role != \"in\":\n"
      "                self._zero_coupling(c, i)\n",
      COST_TABLES + ("tests/test_layer_patterns.py",)),
    M("evict_leaves_beta", "an eviction zeroes the branch end's γ but not its β",
      "edit/editor.py", '                self._write(b.final_bn, "beta", slice(None), 0.0)\n',
      "", COST_TABLES + ("tests/test_exactness.py",)),
    M("merge_scale_always_alpha_star", "the default merge writes the α* parent, not the sum's",
      "search/merge_search.py", 'scale = sol.B if merge_scale == "sum" else costs.alpha_star(A, sol.B, c_rem)',
      "scale = costs.alpha_star(A, sol.B, c_rem)",
      COST_TABLES + ("tests/test_exactness.py",)),
    M("merge_forgets_parent_capacity", "C after a merge is C_rem (the parent's B forgotten)",
      "search/merge_search.py", "c_after = max(c_rem + (0.0 if dead_parent else float(scale)), costs.FLOOR)",
      "c_after = max(c_rem, costs.FLOOR)", COST_TABLES),
    M("prune_keeps_C", "C is not lowered by the pruned neuron's capacity",
      "search/encoder.py", "c_after = max(gs.C - gs.cache.capacity[i], costs.FLOOR)",
      "c_after = max(gs.C, costs.FLOOR)", COST_TABLES),
    M("parent_wnorm_from_gram_v", "replace_with_parent sets ‖w_k‖ from the augmented Gram",
      "scoring/cache.py", "self.wnorm[i] = np.sqrt(max(float(self.gram_w[i, i]), 0.0))",
      "self.wnorm[i] = np.sqrt(max(float(self.gram_v[i, i]), 0.0))", COST_TABLES),
    M("parent_gram_w_swapped", "replace_with_parent's gram_w row uses (a2, a1)",
      "scoring/cache.py", "(self.gram_w, (a1, a2))", "(self.gram_w, (a2, a1))", COST_TABLES),
    # ---------------------------------------------------------------- costs
    M("prune_cost_without_fi", "J_prune's denominator C − ‖f_i‖ loses ‖f_i‖",
      "scoring/cost_formulas.py", "np.maximum(_f64(layer_capacity) - cap, FLOOR)",
      "np.maximum(_f64(layer_capacity), FLOOR)",
      ("tests/test_costs.py",) + COST_TABLES),
    M("merge_residual_without_square", "J_merge subtracts B, not B², from ‖f_i + f_j‖²",
      "scoring/cost_formulas.py", "np.maximum(_f64(norm_sum_sq) - B * B, 0.0)",
      "np.maximum(_f64(norm_sum_sq) - B, 0.0)", ("tests/test_costs.py",) + COST_TABLES),
    M("hope_prune_width", "the default prune cost keeps the paper's width factor n",
      "scoring/costs.py", "return j_prune(c.capacity, c.C, 1.0)", "return j_prune(c.capacity, c.C, c.n)",
      COST_TABLES),
    M("hope_merge_paper", "the default merge is priced with the paper's α* cost",
      "scoring/costs.py", "return j_merge_residual(c.norm_sum_sq, c.B, c.c_rem, 1.0)",
      "return j_merge(c.A, c.B, c.c_rem, 1.0)", COST_TABLES),
    M("hope_evict_identity", "the default eviction divides by C_identity, not C_stream",
      "scoring/costs.py", "stream = float(c.c_stream)", "stream = float(c.c_identity)",
      COST_TABLES + ("tests/test_engine.py",)),
    M("hope_rank_no_readers", "the default rank forgets the number of readers R",
      "scoring/costs.py", "        J = J * info.readers\n", "", COST_TABLES),
    M("hope_rank_per_flop", "under a FLOPs budget the rank is J / S, not J / sqrt(k·S)",
      "scoring/costs.py", "return J / np.sqrt(k * np.maximum(info.flops, 1.0))",
      "return J / np.maximum(info.flops, 1.0)",
      ("tests/test_live_size_formulas.py", "tests/test_engine.py")),
    M("flops_rank_stale", "a FLOPs-budget rank keeps the savings of when it was pushed",
      "scoring/costs.py", '        return budget == "flops"\n', "        return False\n",
      ("tests/test_live_size_formulas.py",)),
    M("neighbors_by_producer_only", "refresh='neighbors' finds no neighbour through readers",
      "search/merge_search.py", "nb = set().union(*(written_by.get(c.layer, ()) for c in g.readers))",
      "nb = set()", COST_TABLES),
    # ---------------------------------------------------------- surrogate math
    M("bn_fold_bias_sign", "BN folding adds the producer bias with the wrong sign",
      "scoring/neurons.py", "return self.beta - self.scale * (self.mean - self.bias)",
      "return self.beta - self.scale * (self.mean + self.bias)",
      ("tests/test_neurons.py",) + COST_TABLES),
    M("self_kernel_sign", "E[relu(y)²] with −β|γ|φ(t)", "activations/kernels.py",
      "k = (g * g + b * b) * ndtr(t) + b * g * _phi(t)",
      "k = (g * g + b * b) * ndtr(t) - b * g * _phi(t)",
      ("tests/test_kernels.py",) + COST_TABLES),
    M("warped_correlation_halved", "ρ̃ = 2κ/(2 + sqrt(1 + 4κ²))", "activations/kernels.py",
      "rt = x / (1.0 + np.hypot(1.0, x))", "rt = x / (2.0 + np.hypot(1.0, x))",
      ("tests/test_kernels.py",) + COST_TABLES),
    M("arccos_kernel_term", "I(ρ) with arccos ρ for π − arccos ρ", "activations/kernels.py",
      "(np.pi - np.arccos(r)) * r", "np.arccos(r) * r", ("tests/test_kernels.py",) + COST_TABLES),
    M("pair_kernel_warped_halved", "the compiled pair values' ρ̃ = 2κ/(2 + sqrt(1 + 4κ²))",
      "scoring/pair_kernels.py", "return _clip(x / (1.0 + math.hypot(1.0, x)), -1.0, 1.0)",
      "return _clip(x / (2.0 + math.hypot(1.0, x)), -1.0, 1.0)",
      ("tests/test_pair_kernels.py",) + COST_TABLES),
    M("pair_kernel_arccos_term", "the compiled I(ρ) with arccos ρ for π − arccos ρ",
      "scoring/pair_kernels.py", "(math.pi - math.acos(r)) * r", "math.acos(r) * r",
      ("tests/test_pair_kernels.py",) + COST_TABLES),
    M("pair_kernel_parent_sign", "the compiled merge keeps +v even where −v has the larger B",
      "scoring/pair_kernels.py", "if side == 0 or b > best[0]:", "if side == 0:",
      ("tests/test_pair_kernels.py",) + COST_TABLES),
    M("pair_kernel_h12_sign", "the compiled merge's rotated G_u has its off-diagonal's sign flipped",
      "scoring/pair_kernels.py", "h12 = c * s * (gu_jj - gu_ii) + (c * c - s * s) * gu_ij",
      "h12 = c * s * (gu_jj - gu_ii) - (c * c - s * s) * gu_ij",
      ("tests/test_pair_kernels.py",) + COST_TABLES),
    M("relu_max_sign", "a ReLU with max_value: its saturating term's slope sign flipped",
      "activations/registry.py", "terms.append(Term(1, m, (m, -1.0)))",
      "terms.append(Term(1, m, (m, 1.0)))",
      ("tests/test_activation_capacity_monte_carlo.py", "tests/test_activations.py")),
    M("elu_offset_sign", "ELU's constant term −α written +α", "activations/registry.py",
      "Term(0, 0.0, (-scale * alpha,)),", "Term(0, 0.0, (scale * alpha,)),",
      ("tests/test_activation_capacity_monte_carlo.py", "tests/test_activations.py")),
    M("transposed_taps_ignored", "a transposed convolution's output counts every tap",
      "graph/layers.py", "        return 1.0 / float(np.prod(layer.strides))\n",
      "        return 1.0\n", ("tests/test_moments.py",)),
    M("transposed_filters_last_axis", "a transposed convolution's filters read on the last axis",
      "scoring/neurons.py", "kernel = np.moveaxis(kernel, layer_rules.output_axis(layer), -1)",
      "kernel = np.moveaxis(kernel, -1, -1)",
      ("tests/test_exactness.py", "tests/test_layer_patterns.py")),
    M("transposed_merge_writes_last_axis", "a merge writes a transposed filter on the last axis",
      "edit/editor.py", "return (Ellipsis, c) if axis == -1 else _axis_index(ndim, axis, c)",
      "return (Ellipsis, c)", ("tests/test_exactness.py", "tests/test_layer_patterns.py")),
    M("merge_scales_ignored", "a scaled sum's moments ignore its scales",
      "scoring/moments.py", "            ms = [s * m for s, m in zip(scales, ms)]\n",
      "            ms = list(ms)\n", ("tests/test_moments.py",)),
    M("split_writer_by_index", "a writer of part of its outputs is edited at the group's index",
      "edit/editor.py",
      "by_pos = not c.in_order",
      "by_pos = False", ("tests/test_graph.py", "tests/test_layer_patterns.py")),
    M("misaligned_add_not_split", "an Add of misaligned channels pins instead of splitting",
      "graph/walker.py", "        if self.final or not all(", "        if True or not all(",
      ("tests/test_graph.py", "tests/test_layer_patterns.py")),
    M("moments_add_first_variance", "an Add's variance is its first input's",
      "scoring/moments.py", "            return sum(ms), sum(vs)\n", "            return sum(ms), vs[0]\n",
      ("tests/test_moments.py",) + COST_TABLES),
    M("coupled_capacity_variance_only", "a coupled channel's E[x²] forgets the mean²",
      "scoring/neurons.py", "s2 = (var + mean * mean)[c.positions]", "s2 = var[c.positions]",
      ("tests/test_moments.py",) + COST_TABLES),
    # -------------------------------------------------------- graph, slim, sizes
    M("flatten_map_off_by_one", "Flatten maps position f to channel c + 1 (mod C)",
      "graph/layers.py", "grid = np.broadcast_to(np.arange(dims[-1]), dims)",
      "grid = np.broadcast_to(np.roll(np.arange(dims[-1]), 1), dims)",
      ("tests/test_neurons.py",) + COST_TABLES + ("tests/test_layer_patterns.py",)),
    M("concat_offsets_swapped", "Concatenate places its inputs in reverse order",
      "graph/walker.py", "parts = [self.pos[t] for t in node.inputs]",
      "parts = [self.pos[t] for t in node.inputs[::-1]]",
      ("tests/test_layer_patterns.py", "tests/test_graph.py")),
    M("slim_depth_multiplier_tile", "slim keeps a depth multiplier's columns tiled, "
      "not repeated", "edit/slim.py", "keep = np.repeat(keep, expand)", "keep = np.tile(keep, expand)",
      ("tests/test_layer_patterns.py",)),
    M("flops_without_positions", "a convolution's FLOPs lose the output positions",
      "graph/layers.py", "return 2 * positions * k * (in_live // groups) * out_live",
      "return 2 * k * (in_live // groups) * out_live",
      ("tests/test_profile_formulas.py", "tests/test_live_size_formulas.py")),
    M("separable_flops_without_depthwise", "a separable convolution's FLOPs lose the "
      "depthwise part", "graph/layers.py",
      "return 2 * positions * (k * in_live * m + in_live * m * out_live)",
      "return 2 * positions * (in_live * m * out_live)",
      ("tests/test_profile_formulas.py", "tests/test_live_size_formulas.py")),
    M("live_width_ignores_positions", "a removed channel lowers a Flatten's width by one, "
      "not by its positions", "search/sizes.py", "self.tensor_live[t] -= k * removed",
      "self.tensor_live[t] -= removed",
      ("tests/test_live_size_formulas.py", "tests/test_engine.py")),
    # ------------------------------------------------------------ trajectories
    M("replay_one_step_short", "replay applies one step fewer than asked",
      "search/trajectory.py", "for s in self.steps[:n_steps]:", "for s in self.steps[:max(n_steps - 1, 0)]:",
      ("tests/test_slim_trajectory.py", "tests/test_budgets_replay_and_cli_options.py")),
    M("step_for_off_by_one", "step_for answers one step early", "search/trajectory.py",
      "return int(hit[0]) + 1", "return int(hit[0])",
      ("tests/test_budgets_replay_and_cli_options.py", "tests/test_slim_trajectory.py")),
    M("step_for_flops_reads_params", "step_for(flops=) reads the parameter ratios",
      "search/trajectory.py", '"flops": lambda: self.field("flops_after")',
      '"flops": lambda: self.field("params_after")',
      ("tests/test_budgets_replay_and_cli_options.py",)),
    M("fingerprint_trainable_only", "the weight fingerprint skips non-trainable weights "
      "(BN moving statistics)", "graph/fingerprint.py", "for w in get(name).weights:",
      "for w in get(name).trainable_weights:",
      ("tests/test_slim_trajectory.py", "tests/test_bad_input.py")),
    M("correction_shift_sign", "the data-free correction moves μ against the shift",
      "stats/bn_stats.py", "mean = np.where(live, mean + (m1 - m0), mean)",
      "mean = np.where(live, mean - (m1 - m0), mean)", ("tests/test_correct_statistics.py",)),
    # ------------------------------------------------------------------- DEFT
    M("l2_penalty_abs", "L2Penalty sums the absolute values of W, not W²", "deft/baselines.py",
      "tf.reduce_sum(tf.square(v))", "tf.reduce_sum(tf.abs(v))",
      ("tests/test_deft_trainer_options.py",)),
    M("restore_best_ignored", "fit(restore_best=True) keeps the last epoch",
      "deft/trainer.py", "if restore_best and best_weights is not None:", "if False:",
      ("tests/test_deft_trainer_options.py",)),
    M("deft_separable_unmasked", "a separable convolution's pointwise rows are not cut",
      "deft/application.py",
      "            layer.pointwise_kernel.assign(layer.pointwise_kernel.numpy() * m)",
      "            pass", ("tests/test_deft_training.py",)),
    M("deft_depthwise_shared_max", "a separable depthwise kernel moves with any elastic output",
      "deft/application.py", "                out[name] = float(vec.min())\n            elif",
      "                out[name] = float(vec.max())\n            elif",
      ("tests/test_deft_training.py",)),
    M("deft_transposed_taps_ignored", "DEFT's compensation counts every tap of a transposed convolution",
      "deft/application.py", "        taps = layer_rules.taps_per_output(layer)",
      "        taps = 1.0", ("tests/test_deft_plan.py",)),
    M("deft_transposed_mask_last_axis", "a transposed convolution's mask reads its outputs on the last axis",
      "deft/application.py", "                              out_axis=layer_rules.output_axis(layer))",
      "                              out_axis=-1)", ("tests/test_deft_training.py",)),
    M("deft_layer_norm_per_channel", "drift passes a LayerNormalization channel by channel",
      "deft/application.py",
      "                d_in = conservative  # its statistics mix every channel",
      "                pass  # its statistics mix every channel",
      ("tests/test_deft_training.py",)),
]


def apply(mutant: Mutant, dest: str) -> str:
    """Copies ``src`` to `dest` and applies `mutant` there; returns its src folder."""
    src = os.path.join(dest, "src")
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    path = os.path.join(src, "hope_keras", mutant.path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"Mutant {mutant.name!r}: its text occurs {count} times in "
                         f"{mutant.path} (expected once): {mutant.old!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mutant.old, mutant.new))
    py_compile.compile(path, doraise=True)
    return src


def _env(src: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
               HOPE_KERAS_CACHE="off")
    others = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
              if p and os.path.abspath(p) != SRC]
    env["PYTHONPATH"] = os.pathsep.join([src] + others)
    return env


def run_tests(src: str, tests, timeout: float, workers: int) -> dict:
    """Runs pytest on `tests` with `src` first on the path: the outcome."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", *tests]
    if workers > 1 and len(tests) > 1:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    if not tests:  # the whole fast suite (`make test`)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers),
               "--dist", "loadfile"]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(src), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "killed", "how": f"timeout after {timeout:.0f} s",
                "seconds": round(time.time() - start, 1)}
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode == 0:
        result = {"outcome": "survived", "how": ""}
    elif failed:  # exit status 1, or 2 when -x stops pytest-xdist's workers
        result = {"outcome": "killed", "how": failed[0]}
    else:
        result = {"outcome": "killed", "how": f"pytest exit status {proc.returncode}: "
                  + (failed[0] if failed else out.strip().splitlines()[-1][:200])}
    result["seconds"] = round(time.time() - start, 1)
    return result


def check_copy_is_imported(timeout: float) -> None:
    """The tests import the copy, not the working tree (an editable install)."""
    with tempfile.TemporaryDirectory(prefix="hope_mutant_") as tmp:
        src = os.path.join(tmp, "src")
        shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
        proc = subprocess.run([sys.executable, "-c", "import hope_keras; "
                               "print(hope_keras.__file__)"], env=_env(src),
                              capture_output=True, text=True, timeout=timeout)
        if not proc.stdout.strip().startswith(src):
            raise RuntimeError(f"hope_keras is imported from {proc.stdout.strip()!r}, not "
                               f"from the mutated copy under {src}: {proc.stderr[-500:]}")


def markdown_table(path: str) -> str:
    """The results file `path` as a Markdown table (docs/testing.md)."""
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    what = {m.name: m.what for m in MUTANTS}
    lines = ["| mutant | the bug planted | outcome | killed by |", "| --- | --- | --- | --- |"]
    for r in report["mutants"]:
        bug = what.get(r["name"], r["what"]).replace("|", "\\|")
        lines.append(f"| `{r['name']}` (`{r['file']}`) | {bug} | "
                     f"{r['outcome']} | {('`' + r['how'] + '`') if r['how'] else '—'} |")
    loads = [r["load_average_before"][0] for r in report["mutants"]
             if r.get("load_average_before")]
    minutes = sum(r["seconds"] for r in report["mutants"]) / 60
    lines.append("")
    lines.append(f"{report['killed']} of {report['total']} killed "
                 f"({100 * report['kill_rate']:.1f} %): `{'`, then `'.join(report['commands'])}`; "
                 f"{minutes:.0f} minutes of test runs on {report['cpus']} cores shared with "
                 f"other jobs (load average {min(loads):.1f}–{max(loads):.1f}).")
    return "\n".join(lines)


def _load_avg() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", help="run these mutants only")
    p.add_argument("--full", action="store_true",
                   help="run the whole fast suite on the survivors of their test files")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist processes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per test run")
    p.add_argument("--out", default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--tests", nargs="+",
                   help="run these test files for every mutant instead of its own")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--check", action="store_true",
                   help="only check that every mutant applies and compiles")
    p.add_argument("--table", action="store_true",
                   help="print the results in --out as a Markdown table and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(args.out))
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutants: {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:<36} {m.path:<24} {m.what}")
        return 0
    if args.check:
        for m in chosen:
            with tempfile.TemporaryDirectory(prefix="hope_mutant_") as tmp:
                apply(m, tmp)
        print(f"{len(chosen)} mutants apply and compile")
        return 0
    check_copy_is_imported(args.timeout)
    previous, commands = {}, []
    if os.path.exists(args.out) and args.only:  # a partial run updates the others' file
        with open(args.out, encoding="utf-8") as f:
            old = json.load(f)
        previous = {r["name"]: r for r in old.get("mutants", [])}
        commands = old.get("commands", [])
    command = "python scripts/mutants.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    results, started = dict(previous), time.time()
    for m in chosen:
        load = _load_avg()
        with tempfile.TemporaryDirectory(prefix="hope_mutant_") as tmp:
            src = apply(m, tmp)
            ran = list(args.tests or m.tests)
            r = run_tests(src, ran, args.timeout, args.workers)
            if args.full and r["outcome"] == "survived":
                full = run_tests(src, (), args.timeout, args.workers)
                ran.append("the whole fast suite")
                r = dict(full, seconds=round(r["seconds"] + full["seconds"], 1))
        results[m.name] = {"name": m.name, "what": m.what, "file": m.path, "tests": ran,
                           **r, "load_average_before": load, "command": command.strip()}
        print(f"{m.name:<36} {r['outcome']:<9} {r['seconds']:>7.1f} s  {r['how']}",
              flush=True)
    ordered = [results[m.name] for m in MUTANTS if m.name in results]
    killed = sum(r["outcome"] == "killed" for r in ordered)
    report = {
        "commands": commands + [command.strip()],
        "cpus": os.cpu_count(),
        "seconds_last_command": round(time.time() - started, 1),
        "killed": killed, "total": len(ordered),
        "kill_rate": round(killed / max(len(ordered), 1), 4),
        "mutants": ordered,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"killed {killed} of {len(ordered)} ({100 * report['kill_rate']:.1f} %); "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
