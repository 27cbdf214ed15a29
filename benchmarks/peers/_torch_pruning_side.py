"""The Torch-Pruning half of `benchmarks/peers/resnet50.py` (run by it in its own
interpreter, the one with torch, torchvision and torch-pruning installed).

L1 filter pruning of torchvision's ResNet-50 (``weights=None``) to a FLOPs ratio, the
recipe of Torch-Pruning's ImageNet script (``reproduce/main_imagenet.py --model
resnet50 --prune --method l1``): `tp.importance.MagnitudeImportance(p=1)`,
`tp.pruner.MagnitudePruner` with ``pruning_ratio=1.0`` over ``iterative_steps=100``
(each `step` prunes one more percent of every layer's channels: the same ratio in
every layer unless ``--global-pruning``), the 1000-way classifier left whole, and
`step` repeated until the FLOPs are at or below the target. The FLOPs are counted as
hope_keras counts them (2 × the multiply-accumulates of the Conv/Linear layers, one
example), so both sides meet the same budget; Torch-Pruning's own count (which adds
BN, ReLU and pooling) is reported beside it.

Writes one JSON object to ``--out``.
"""

import argparse
import copy
import json
import time

import numpy as np
import torch
import torch_pruning as tp
import torchvision


def kernel_flops(model, x):
    """2 × multiply-accumulates of the Conv2d/Linear layers for one example of `x`."""
    total = [0]

    def conv(m, inputs, out):
        k = m.weight.shape[1] * m.weight.shape[2] * m.weight.shape[3]  # in/groups × kh × kw
        total[0] += 2 * k * out[0].numel()

    def linear(m, inputs, out):
        total[0] += 2 * m.in_features * m.out_features

    hooks = []
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            hooks.append(m.register_forward_hook(conv))
        elif isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_hook(linear))
    with torch.inference_mode():
        model(x[:1])
    for h in hooks:
        h.remove()
    return total[0]


def params(model):
    return sum(p.numel() for p in model.parameters())


def forward_time(model, x, repeats=5):
    """Median seconds of one forward pass of `x` after one warm-up."""
    times = []
    with torch.inference_mode():
        model(x)
        for _ in range(repeats):
            t = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def interleaved_latency(models, x, repeats, warmup=1):
    """Seconds of every timed batch of each model, runs interleaved (the order
    alternates each round, as `hope_keras.profile`), so machine noise hits every model
    alike."""
    times = [[] for _ in models]
    with torch.inference_mode():
        for _ in range(warmup):
            for m in models:
                m(x)
        for r in range(repeats):
            order = list(range(len(models)))
            for i in (order if r % 2 == 0 else order[::-1]):
                t = time.perf_counter()
                models[i](x)
                times[i].append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flops", type=float, default=0.5)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--global-pruning", action="store_true")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    original = copy.deepcopy(model)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.uniform(0, 1, (args.batch, 3, args.size, args.size))
                         .astype("float32"))
    example = x[:1]
    T = forward_time(model, x)
    flops0, params0 = kernel_flops(model, x), params(model)
    tp_ops0, _ = tp.utils.count_ops_and_params(model, example_inputs=example)
    print(f"torch T (batch-{args.batch} forward, {args.size}x{args.size}): {T:.3f} s; "
          f"{flops0 / 1e9:.2f} GFLOPs, {params0} params", flush=True)

    t0 = time.perf_counter()
    ignored = [m for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.out_features == 1000]
    pruner = tp.pruner.MagnitudePruner(
        model, example, importance=tp.importance.MagnitudeImportance(p=1),
        global_pruning=args.global_pruning, pruning_ratio=1.0, iterative_steps=100,
        ignored_layers=ignored)
    t_init = time.perf_counter() - t0
    flops, steps = flops0, 0
    while flops > args.flops * flops0 and steps < 100:
        pruner.step()
        steps += 1
        flops = kernel_flops(model, x)
    seconds = time.perf_counter() - t0
    tp_ops, _ = tp.utils.count_ops_and_params(model, example_inputs=example)
    print(f"Torch-Pruning L1 ({'global' if args.global_pruning else 'uniform'}): "
          f"{seconds:.2f} s ({t_init:.2f} s building the pruner), {steps} steps, "
          f"FLOPs {flops / flops0:.3f}, params {params(model) / params0:.3f}", flush=True)

    runs_pruned, runs_original = interleaved_latency([model, original], x, args.repeats)
    lat_pruned, lat_original = float(np.median(runs_pruned)), float(np.median(runs_original))
    out = {
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "torch_pruning": getattr(tp, "__version__", "?"),
        "threads": torch.get_num_threads(), "size": args.size, "batch": args.batch,
        "T_s": T, "recipe": {
            "importance": "MagnitudeImportance(p=1)", "pruner": "MagnitudePruner",
            "pruning_ratio": 1.0, "iterative_steps": 100,
            "scope": "global" if args.global_pruning else "uniform (per layer)",
            "ignored": "the 1000-way Linear"},
        "flops0": flops0, "params0": params0, "prune_s": seconds,
        "pruner_init_s": t_init, "steps": steps, "flops_ratio": flops / flops0,
        "params_ratio": params(model) / params0, "tp_ops_ratio": tp_ops / tp_ops0,
        "latency_s": {"original": lat_original, "pruned": lat_pruned},
        "latency_ratio": lat_pruned / lat_original, "repeats": args.repeats,
        "latency_ratio_of_minima": min(runs_pruned) / min(runs_original),
        "latency_runs_s": {"original": runs_original, "pruned": runs_pruned},
    }
    print(f"latency (batch {args.batch}, interleaved medians of {args.repeats}): "
          f"{1e3 * lat_pruned:.0f} / {1e3 * lat_original:.0f} ms = "
          f"{out['latency_ratio']:.3f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
