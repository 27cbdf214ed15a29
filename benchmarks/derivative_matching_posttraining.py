"""Post-training derivative matching on a smooth 2-D regression task, five seeds.

Task: x uniform on the unit disk, y = sin(2 x1) cos(1.5 x2) + 0.5 x1 x2 + noise
(σ = 0.1). Teacher: four hidden GELU layers of width 512, one output, trained with
Adam (MSE). For k = 0, 1, … every hidden layer is compressed with order k
(backward, center 0, radius 1); the first k whose test MSE is ≤ 1.05 × the
teacher's test MSE gives the "first sufficient width" (the largest kept width
over the four layers) and the parameter reduction.

Usage:
    .venv/bin/python benchmarks/derivative_matching_posttraining.py [--seeds 0,1,2,3,4]
        [--width 512] [--epochs 40]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import keras
from _common import add_quick
from hope_keras import derivative_matching as dm


def target(x):
    return np.sin(2 * x[:, 0]) * np.cos(1.5 * x[:, 1]) + 0.5 * x[:, 0] * x[:, 1]


def data(n, rng, noise=0.1):
    x = dm.sample_ball(n, 2, 1.0, seed=int(rng.integers(1 << 31)))
    y = target(x) + noise * rng.normal(size=n)
    return x.astype("float32"), y[:, None].astype("float32")


def mse(model, x, y):
    pred = np.concatenate([np.asarray(model(x[i : i + 4096])) for i in range(0, len(x), 4096)]).astype(np.float64)
    return float(np.mean((pred - y) ** 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--kmax", type=int, default=10)
    ap.add_argument("--act", default="gelu")
    add_quick(ap)  # one seed, a 4 × 32 teacher trained 1 epoch, k ≤ 1
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.width, args.epochs, args.kmax = "0", 32, 1, 1

    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        t0 = time.perf_counter()
        keras.utils.set_random_seed(seed)
        rng = np.random.default_rng(seed)
        xtr, ytr = data(4096, rng)
        xva, yva = data(1024, rng)
        xte, yte = data(4096, rng)
        teacher = keras.Sequential(
            [keras.Input((2,))]
            + [keras.layers.Dense(args.width, activation=args.act) for _ in range(4)]
            + [keras.layers.Dense(1)]
        )
        teacher.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        teacher.fit(xtr, ytr, validation_data=(xva, yva), epochs=args.epochs, batch_size=128,
                    verbose=0)
        t_train = time.perf_counter() - t0
        m_tr, m_te = mse(teacher, xtr, ytr), mse(teacher, xte, yte)
        found = None
        for k in range(args.kmax + 1):
            student, rep = dm.compress_mlp(teacher, order=k, radius=1.0)
            s_te = mse(student, xte, yte)
            widths = [l.units for l in student.layers[:4]]
            print(f"seed {seed} k={k:2d} widths={widths} test MSE {s_te:.5f} "
                  f"(teacher {m_te:.5f}, ratio {s_te / m_te:.4f})", flush=True)
            if s_te <= 1.05 * m_te:
                found = dict(seed=seed, k=k, width=max(widths), widths=widths,
                             reduction=rep.reduction, teacher_test=m_te, teacher_train=m_tr,
                             student_test=s_te, student_train=mse(student, xtr, ytr),
                             student_val=mse(student, xva, yva),
                             params=(rep.params_before, rep.params_after),
                             train_s=t_train, total_s=time.perf_counter() - t0)
                break
        if found is None:
            print(f"seed {seed}: no k <= {args.kmax} met the criterion")
            continue
        rows.append(found)

    print("\n| seed | first k | kept widths | params teacher -> student | reduction | "
          "teacher test MSE | student test MSE | student test/train | teacher test/train |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['k']} | {r['widths']} | {r['params'][0]} -> {r['params'][1]} | "
              f"{r['reduction']:.0f}x | {r['teacher_test']:.5f} | {r['student_test']:.5f} | "
              f"{r['student_test'] / r['student_train']:.4f} | "
              f"{r['teacher_test'] / r['teacher_train']:.4f} |")
    if rows:
        print(f"\nmedian first sufficient width {np.median([r['width'] for r in rows]):.0f}, "
              f"median reduction {np.median([r['reduction'] for r in rows]):.0f}x "
              f"over {len(rows)} seeds")


if __name__ == "__main__":
    main()
