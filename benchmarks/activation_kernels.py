"""Speed and accuracy of the Gaussian activation moments (hope_keras.activations).

For every registered activation: the wall time of one ``cross`` call on an n × n pair
table (a layer's worth of cross kernels), the largest error of ``cross`` on a few
pairs against nested adaptive quadrature (scipy), of ``mean`` / ``second_moment``
against adaptive quadrature, and the time of ``invert_moments`` for n channels.

The pair table: means ~ N(0, 1), standard deviations ~ U(0.2, 2), correlations the
cosines of random weight vectors (dimension 64) of which 5% are near-duplicates of
another (correlations ~0.997), the situation merges are made for. The accuracy check
also uses a fixed set of hard pairs: sigma up to 5, |rho| from 0.9 to 0.995.

Usage:
    .venv/bin/python benchmarks/activation_kernels.py [--n 2048] [--pairs 12]
        [--only relu,tanh] [--quick]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
from scipy import integrate
from scipy.stats import norm

from hope_keras import activations as A
from _common import add_quick

ACTIVATIONS = ["relu", "leaky_relu", "linear", "relu6", "hard_sigmoid", "hard_silu", "elu",
               "selu", "sigmoid", "tanh", "softplus", "silu", "gelu", "gelu_approximate", "mish"]


# (mu_i, sigma_i, mu_j, sigma_j, rho): steep activations, strong correlations
HARD = [(0.0, 3.0, 0.5, 3.0, 0.97), (1.0, 5.0, -1.0, 5.0, 0.9), (1.0, 5.0, -1.0, 5.0, -0.97),
        (0.2, 5.0, 0.1, 4.0, 0.995), (-2.0, 4.0, 1.5, 2.0, 0.95)]


def pair_table(n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, 64))
    dup = rng.choice(n, n // 20, replace=False)
    w[dup] = w[rng.choice(n, dup.size)] + 0.01 * rng.standard_normal((dup.size, 64))
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    rho = np.clip(w @ w.T, -1.0, 1.0)
    return rng.normal(0, 1, n), rng.uniform(0.2, 2.0, n), rho


def quad(f, pts):
    pts = [p for p in pts if abs(p) < 12] or None
    return integrate.quad(f, -13, 13, points=pts, epsabs=1e-14, epsrel=1e-12, limit=400)[0]


def ref_cross(act, mi, si, mj, sj, r):
    """E[psi(x_i) psi(x_j)] = E_X[psi(mu_i + s_i X) E[psi(x_j) | X]], both adaptive."""
    s = np.sqrt(max(1.0 - r * r, 0.0))
    bp = sorted(set(act.breakpoints) | {0.0})

    def inner(x):
        c, b = mj + sj * r * x, sj * s
        if b == 0.0:
            return float(act(c))
        return quad(lambda w: act(c + b * w) * norm.pdf(w), [(p - c) / b for p in bp])

    return quad(lambda x: act(mi + si * x) * inner(x) * norm.pdf(x), [(p - mi) / si for p in bp])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--only", default="")
    add_quick(parser)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else ACTIVATIONS
    hard = HARD
    if args.quick:  # a small table, one hard pair; one activation of each method
        args.n, args.pairs, hard = 64, 1, HARD[:1]
        names = ["relu", next(n for n in ACTIVATIONS[1:] if A.get(n).terms is not None),
                 next(n for n in ACTIVATIONS if A.get(n).terms is None)]
    mu, sigma, rho = pair_table(args.n)
    off = rho[~np.eye(args.n, dtype=bool)]
    print(f"n = {args.n}: {args.n ** 2} pairs; |rho| > 0.99 for {np.mean(np.abs(off) > 0.99):.2%}"
          f" of the off-diagonal pairs, median |rho| {np.median(np.abs(off)):.3f}")
    rng = np.random.default_rng(1)
    # accuracy pairs: random ones and near-duplicates
    ii = rng.choice(args.n, args.pairs)
    jj = np.where(np.arange(args.pairs) % 2 == 0, rng.choice(args.n, args.pairs),
                  np.argsort(-(rho - 2 * np.eye(args.n))[ii], axis=1)[:, 0])
    print()
    print("| activation | method | cross, n×n (s) | ns / pair | max cross error (table) | "
          "max cross error (hard) | max mean / 2nd-moment error | "
          "invert_moments, n channels (s) | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        act = A.get(name)
        method = ("kernels.py" if name == "relu" else "closed form" if act.terms is not None
                  else "Mehler + quadrature")
        t0 = time.perf_counter()
        k = act.cross(mu[:, None], sigma[:, None], mu[None], sigma[None], rho)
        t_cross = time.perf_counter() - t0
        assert np.all(np.isfinite(k))
        err = 0.0
        for i, j in zip(ii, jj):
            ref = ref_cross(act, mu[i], sigma[i], mu[j], sigma[j], rho[i, j])
            scale = np.sqrt(k[i, i] * k[j, j])
            err = max(err, abs(k[i, j] - ref) / scale)
        err_hard = 0.0
        for c in hard:
            scale = np.sqrt(act.second_moment(c[0], c[1]) * act.second_moment(c[2], c[3]))
            err_hard = max(err_hard, abs(float(act.cross(*c)) - ref_cross(act, *c)) / scale)
        err1 = 0.0
        for i in ii[:6]:
            bp = [(p - mu[i]) / sigma[i] for p in set(act.breakpoints) | {0.0}]
            m1 = quad(lambda z: act(mu[i] + sigma[i] * z) * norm.pdf(z), bp)
            m2 = quad(lambda z: act(mu[i] + sigma[i] * z) ** 2 * norm.pdf(z), bp)
            err1 = max(err1, abs(float(act.mean(mu[i], sigma[i])) - m1) / np.sqrt(m2),
                       abs(float(act.second_moment(mu[i], sigma[i])) - m2) / m2)
        m, v = act.mean(mu, sigma), act.variance(mu, sigma)
        t0 = time.perf_counter()
        res = A.invert_moments(act, m, v)
        t_inv = time.perf_counter() - t0
        print(f"| {name} | {method} | {t_cross:.2f} | {1e9 * t_cross / args.n ** 2:.0f} | "
              f"{err:.1e} | {err_hard:.1e} | {err1:.1e} | {t_inv:.2f} | {int(res.failed.sum())} |",
              flush=True)
    print()
    print("Errors are relative to sqrt(K_ii K_jj) (cross), sqrt(E[psi^2]) (mean) and E[psi^2];"
          f" table: {args.pairs} pairs of the table, half of them near-duplicates; hard: the"
          f" {len(hard)} fixed pairs; mean / 2nd moment: 6 neurons of the table.")


if __name__ == "__main__":
    main()
