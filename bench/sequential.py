"""The group-sequential sweep design (``aepo_core/sequential.py``, issue 52 item 4) validated by simulation.

**Model** (``bench/power.py``'s, with the powered sweep's components, ``bench/results/power_claims_powered.json``):
one run's Pass@1 over n_q questions is μ_arm + w + ē, w the run-level shift (σ²_seed = 0.00356, σ_seed = 0.060)
and ē the mean of its questions' run × question noise (σ²_q = 0.2412 per question's paired difference at 2
samples, so σ²_q/2 per arm and question), σ²_aq = 0, n_q = 112. The per-seed arm means are simulated directly:
X_{s,a} ~ N(μ_a, σ²_run), σ²_run = σ²_seed + σ²_q/(2·n_q), so a seed's paired difference has
Var(D_s) = 2σ²_seed + σ²_q/n_q (σ_D = 0.0963: the fixed 5-seed design's SE 0.0431, power.py's). Arms are
independent (the conservative case of power.py's assumption 2); the design's t statistics do not depend on σ
under H0, so the error rates hold at any σ, the power figures at this one.

**What is reported**, per scenario (global null; AEPO better than both others by Δ, ARPO = GRPO; a ladder GRPO <
ARPO < AEPO by Δ each): the family-wise error (a *differ* on a comparison whose arms are equal, any of them) with
its Monte-Carlo standard error √(p(1−p)/R), the power on each false null (a *differ* with the right sign), the
false *equivalent* rate on comparisons whose |Δ| ≥ margin, the expected seeds per arm and cells (arm × seed runs)
in all, and the fixed design for comparison: its power at 5 seeds per arm and the fewest seeds per arm that reach the
target power at the same family-wise α (Bonferroni, t-test: the sequential design's one-look case). Cost: a cell
(one training run of the powered sweep's plan) takes ``--cell-minutes`` (15: run_wall_s 879 s in
``power_claims_powered.json``) of the 2-core machine, one cell at a time.

A few hundred simulated sweeps are also decided by :func:`aepo_core.sequential.run_looks` itself, and must agree
with the vectorized decisions here: the figures are about the code the sweep runs.

Run: ``.venv/bin/python -m bench.sequential [--waves 2 2 2 2 2] [--delta 0.121] [--margin 0.15] [--reps 20000]``;
prints the tables and writes ``bench/results/sequential.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aepo_core.sequential import Decision, Design, normal_cdf, normal_quantile, run_looks, seeds_for_power, t_boundary
from bench.harness import print_table, write_result

SIGMA2_SEED = 0.003556681681681681  # power_claims_powered.json components (two-way ANOVA, 5 seeds × 3 arms)
SIGMA2_Q = 0.2411753271128271
N_QUESTIONS = 112
SIGMA_RUN = math.sqrt(SIGMA2_SEED + SIGMA2_Q / (2 * N_QUESTIONS))
ARMS = ("aepo", "arpo", "grpo")
COMPARISONS = (("aepo", "arpo"), ("aepo", "grpo"), ("arpo", "grpo"))
CODES = {Decision.CONTINUE: 0, Decision.DIFFER: 1, Decision.EQUIVALENT: 2, Decision.UNDECIDED: 3, Decision.FUTILE: 4}
EFFECTS = (0.1, 0.121, 0.15, 0.2, 0.25, 0.3)  # the effect table's Δ (AEPO over ARPO = GRPO)
OUT = Path(__file__).resolve().parent / "results" / "sequential.json"


@dataclass(frozen=True)
class Simulated:
    """R simulated sweeps of one design and scenario: each comparison's final decision code (``CODES``) and the
    sign of its last estimate, and the seeds each arm ran."""

    decisions: np.ndarray  # (R, C) int
    signs: np.ndarray  # (R, C) ±1
    seeds: np.ndarray  # (R, arms) int


def _boundary(z: float, df: int | None, cache: dict[tuple[float, int | None], float]) -> float:
    key = (z, df)
    if key not in cache:
        cache[key] = t_boundary(z, df)
    return cache[key]


def _variances(design: Design, data: np.ndarray, active: np.ndarray, ia: int, ib: int,
               cache: dict[tuple[float, int | None], float], z: float, zf: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(SE², efficacy boundary, futility boundary) per replicate of comparison (ia, ib) on ``data`` (R, n, arms),
    as ``_compare`` does."""
    n, reps = data.shape[1], len(data)
    if design.variance == "pilot":
        return (np.full(reps, (design.sigma or 0.0) ** 2 / n), np.full(reps, z),
                np.full(reps, min(_boundary(zf, None, cache), z)))
    if design.variance == "paired":
        diff = data[:, :, ia] - data[:, :, ib]
        c = _boundary(z, n - 1, cache)
        return diff.var(axis=1, ddof=1) / n, np.full(reps, c), np.full(reps, min(_boundary(zf, n - 1, cache), c))
    var, bound, fut = np.empty(reps), np.empty(reps), np.empty(reps)
    patterns, index = np.unique(active, axis=0, return_inverse=True)
    for p, pattern in enumerate(patterns):
        rows, cols = np.flatnonzero(index.ravel() == p), np.flatnonzero(pattern)
        if len(cols) < 2:  # stopped sweeps: nothing is looked at
            var[rows], bound[rows], fut[rows] = 1.0, math.inf, 0.0
            continue
        sub = data[rows][:, :, cols]
        resid = sub - sub.mean(axis=1, keepdims=True) - sub.mean(axis=2, keepdims=True) \
            + sub.mean(axis=(1, 2), keepdims=True)
        df = (n - 1) * (len(cols) - 1)
        var[rows] = 2.0 * (resid ** 2).sum(axis=(1, 2)) / df / n
        bound[rows] = _boundary(z, df, cache)
        fut[rows] = min(_boundary(zf, df, cache), bound[rows][0])
    return var, bound, fut


def simulate(design: Design, means: Mapping[str, float], reps: int, rng: np.random.Generator,
             x: np.ndarray | None = None, sigma_run: float = SIGMA_RUN) -> Simulated:
    """``reps`` sweeps under ``design`` with arm means ``means`` and per-seed SD ``sigma_run`` (or the given
    per-seed values ``x``, (R, N, arms))."""
    arms = design.arms
    if x is None:
        mu = np.array([means[a] for a in arms])
        x = mu + sigma_run * rng.standard_normal((reps, design.max_seeds, len(arms)))
    bounds, futile, cache = design.z_boundaries(), design.futility_z_boundaries(), {}
    pairs = [(arms.index(a), arms.index(b)) for a, b in design.comparisons]
    decisions = np.zeros((len(x), len(pairs)), dtype=int)
    signs = np.zeros((len(x), len(pairs)))
    seeds = np.zeros((len(x), len(arms)), dtype=int)
    n = 0
    for k, wave in enumerate(design.waves):
        open_ = decisions == 0
        active = np.zeros((len(x), len(arms)), dtype=bool)
        for c, (ia, ib) in enumerate(pairs):
            active[:, ia] |= open_[:, c]
            active[:, ib] |= open_[:, c]
        n += wave
        seeds += active * wave
        data = x[:, :n, :]
        for c, (ia, ib) in enumerate(pairs):
            var, bound, fut = _variances(design, data, active, ia, ib, cache, bounds[k], futile[k])
            est = data[:, :, ia].mean(axis=1) - data[:, :, ib].mean(axis=1)
            se = np.sqrt(var)
            differ = np.abs(est) >= bound * se
            equivalent = ~differ & (design.margin is not None) & (np.abs(est) + bound * se < (design.margin or 0))
            futility = ~differ & ~equivalent & (np.abs(est) < fut * se)
            new = np.where(differ, 1, np.where(equivalent, 2, np.where(futility, 4,
                                                                        3 if k == len(design.waves) - 1 else 0)))
            decisions[:, c] = np.where(open_[:, c], new, decisions[:, c])
            signs[:, c] = np.where(open_[:, c], np.sign(est), signs[:, c])
    return Simulated(decisions, signs, seeds)


def check_against_core(design: Design, reps: int, rng: np.random.Generator) -> int:
    """Decide ``reps`` simulated sweeps with :func:`run_looks` and with :func:`simulate`; raises on a mismatch.
    Half the sweeps under the null, half with every arm apart by 0.12, so that all decisions occur."""
    mu = np.array([0.0, 0.06, 0.12])
    x = mu * (np.arange(reps) % 2)[:, None, None] + SIGMA_RUN * rng.standard_normal((reps, design.max_seeds, 3))
    fast = simulate(design, {}, reps, rng, x)
    seeds = list(range(design.max_seeds))
    for r in range(reps):
        per_q = {arm: {s: {"q": float(x[r, s, i])} for s in seeds} for i, arm in enumerate(design.arms)}
        out = run_looks(design, per_q, seeds)
        got = [CODES[c.decision] for c in out.decisions().values() if c is not None]
        ran = [sum(len(look.seeds) - (len(out.looks[i - 1].seeds) if i else 0) for i, look in enumerate(out.looks)
                   if arm in look.arms) for arm in design.arms]
        if got != list(fast.decisions[r]) or ran != list(fast.seeds[r]):
            raise AssertionError(f"replicate {r}: run_looks {got} {ran} vs vectorized {fast.decisions[r]} "
                                 f"{fast.seeds[r]}")
    return reps


def summarize(design: Design, means: Mapping[str, float], sim: Simulated) -> dict[str, object]:
    """The scenario's error rates, power and expected seeds (see the module docstring)."""
    reps = len(sim.decisions)
    deltas = [means[a] - means[b] for a, b in design.comparisons]
    null = [abs(d) < 1e-12 for d in deltas]
    false_differ = (sim.decisions[:, null] == 1).any(axis=1) if any(null) else np.zeros(reps, dtype=bool)
    fwer = float(false_differ.mean())
    out: dict[str, object] = {"means": dict(means), "fwer": fwer, "fwer_mc_se": math.sqrt(fwer * (1 - fwer) / reps)}
    per = {}
    for c, ((a, b), d) in enumerate(zip(design.comparisons, deltas, strict=True)):
        dec = sim.decisions[:, c]
        row = {"delta": d, **{name: float((dec == code).mean()) for name, code in
                              (("differ", 1), ("equivalent", 2), ("futile", 4), ("undecided", 3))}}
        if d != 0:
            row["power"] = float(((dec == 1) & (sim.signs[:, c] == np.sign(d))).mean())
        per[f"{a} - {b}"] = row
    out["comparisons"] = per
    alts = [c for c, d in enumerate(deltas) if d != 0]
    if alts:
        out["all_false_nulls_rejected"] = float((sim.decisions[:, alts] == 1).all(axis=1).mean())
    if design.margin is not None:
        wide = [c for c, d in enumerate(deltas) if abs(d) >= design.margin]
        out["false_equivalent"] = float((sim.decisions[:, wide] == 2).any(axis=1).mean()) if wide else 0.0
    out["seeds_per_arm"] = {a: float(sim.seeds[:, i].mean()) for i, a in enumerate(design.arms)}
    out["cells"] = float(sim.seeds.sum(axis=1).mean())
    out["cells_p90"] = float(np.quantile(sim.seeds.sum(axis=1), 0.9))
    return out


def fixed_power(design: Design, means: Mapping[str, float], seeds: int, reps: int, rng: np.random.Generator
                ) -> float:
    """The smallest power over the false nulls of a fixed design: ``seeds`` per arm, one look, Bonferroni α. With a
    pilot σ the z test's exact power Φ(Δ√n/σ − z) + Φ(−Δ√n/σ − z), z = z_{1−α/(2C)}; otherwise the same t-test and
    variance estimate, simulated."""
    deltas = [abs(means[a] - means[b]) for a, b in design.comparisons if means[a] != means[b]]
    if design.variance == "pilot":
        z, sd = normal_quantile(1.0 - design.alpha_per_comparison / 2.0), (design.sigma or 1.0) / math.sqrt(seeds)
        return min(normal_cdf(d / sd - z) + normal_cdf(-d / sd - z) for d in deltas)
    fixed = Design((seeds,), design.comparisons, design.alpha, None, design.variance)
    res = summarize(fixed, means, simulate(fixed, means, reps, rng))
    comps = res["comparisons"]
    assert isinstance(comps, dict)
    return min(float(v["power"]) for v in comps.values() if "power" in v)


def scenarios(delta: float) -> dict[str, dict[str, float]]:
    return {"global null": dict.fromkeys(ARMS, 0.5),
            f"aepo +{delta:g} over arpo = grpo": {"aepo": 0.5 + delta, "arpo": 0.5, "grpo": 0.5},
            f"ladder grpo < arpo < aepo by {delta:g}": {"aepo": 0.5 + 2 * delta, "arpo": 0.5 + delta, "grpo": 0.5}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", type=int, nargs="+", help="seeds per wave (default: 5 waves of --wave; with "
                                                         "--variance pilot the fewest that reach --power)")
    p.add_argument("--wave", type=int, default=2, help="seeds per wave when --waves is not given")
    p.add_argument("--alpha", type=float, default=0.05, help="family-wise two-sided α")
    p.add_argument("--delta", type=float, default=0.121, help="effect the design is built for (Pass@1)")
    p.add_argument("--margin", type=float, default=0.15, help="equivalence margin")
    p.add_argument("--variance", choices=["paired", "pooled", "pilot"], default="paired")
    p.add_argument("--futility", choices=["none", "obf", "pocock"], default="none", help="β-spending futility")
    p.add_argument("--sigma", type=float, default=SIGMA_RUN * math.sqrt(2), help="pilot σ of a seed's paired "
                                                                                 "difference (the design's)")
    p.add_argument("--robust", type=float, nargs="*", default=[1.5], help="true σ / pilot σ ratios at which the "
                                                                          "global null is also simulated")
    p.add_argument("--power", type=float, default=0.8, help="target power (futility, pilot N_max, fixed design)")
    p.add_argument("--reps", type=int, default=20000, help="simulated sweeps per scenario")
    p.add_argument("--check", type=int, default=300, help="sweeps decided by aepo_core.sequential.run_looks too")
    p.add_argument("--cell-minutes", type=float, default=15.0, help="minutes of the 2-core machine per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def build_design(args: argparse.Namespace) -> Design:
    """The design the arguments describe (pilot without --waves: :func:`seeds_for_power`'s waves)."""
    waves = tuple(args.waves) if args.waves else (
        seeds_for_power(args.wave, args.sigma, args.delta, args.alpha / len(COMPARISONS), 1 - args.power,
                        args.futility) if args.variance == "pilot" else (args.wave,) * 5)
    planned = args.variance == "pilot" or args.futility != "none"
    return Design(waves, COMPARISONS, args.alpha, args.margin, args.variance, args.futility,
                  args.delta if planned else None, args.sigma if planned else None, args.power)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    design = build_design(args)
    checked = check_against_core(design, args.check, rng)
    results = {name: summarize(design, means, simulate(design, means, args.reps, rng))
               for name, means in scenarios(args.delta).items()}
    null = scenarios(args.delta)["global null"]
    robust = {f"{r:g}": summarize(design, null, simulate(design, null, args.reps, rng, sigma_run=SIGMA_RUN * r))
              for r in args.robust}
    alternative = scenarios(args.delta)[f"aepo +{args.delta:g} over arpo = grpo"]
    fixed = {n: fixed_power(design, alternative, n, args.reps // 2, rng) for n in range(2, 21)}
    needed = next((n for n, p in fixed.items() if p >= args.power), None)
    effects = {d: summarize(design, m, simulate(design, m, args.reps // 4, rng)) for d in EFFECTS
               for m in [{"aepo": 0.5 + d, "arpo": 0.5, "grpo": 0.5}]}
    hours = args.cell_minutes / 60.0
    fixed5_cells = 5 * len(ARMS)
    equal_cells = (needed or math.nan) * len(ARMS)
    print(design.describe())
    print_table(f"Simulated sweeps ({args.reps} per scenario; σ_run {SIGMA_RUN:.4f}, σ_D {SIGMA_RUN * 2 ** .5:.4f})",
                ["scenario", "FWER ± MC se", "power (per false null)", "all rejected", "E seeds/arm", "E cells",
                 "E hours", "vs fixed 5-seed", "vs fixed equal-power"],
                [[name, f"{r['fwer']:.4f} ± {r['fwer_mc_se']:.4f}",
                  ", ".join(f"{k} {v['power']:.3f}" for k, v in r["comparisons"].items() if "power" in v) or "–",
                  r.get("all_false_nulls_rejected", "–"),
                  ", ".join(f"{v:.2f}" for v in r["seeds_per_arm"].values()), r["cells"], r["cells"] * hours,
                  f"{r['cells'] / fixed5_cells:.2f}×", f"{r['cells'] / equal_cells:.2f}×"]
                 for name, r in results.items()])
    print_table("Global null when the true σ is a multiple of the design's", ["true σ / pilot σ", "FWER ± MC se",
                                                                               "E cells"],
                [[k, f"{r['fwer']:.4f} ± {r['fwer_mc_se']:.4f}", r["cells"]] for k, r in robust.items()])
    print_table(f"Fixed design at the same α (Bonferroni, {args.variance}), power at Δ = {args.delta:g} "
                "(the worse false null)", ["seeds/arm", "power", "cells", "hours"],
                [[n, p, n * len(ARMS), n * len(ARMS) * hours] for n, p in fixed.items() if n <= (needed or 20) + 1])
    print_table(f"AEPO better than both by Δ ({args.reps // 4} sweeps each): when the design stops early",
                ["Δ", "power (worse false null)", "E seeds aepo / arpo / grpo", "E cells", "vs fixed 5-seed"],
                [[d, min(v["power"] for v in r["comparisons"].values() if "power" in v),
                  " / ".join(f"{v:.2f}" for v in r["seeds_per_arm"].values()), r["cells"],
                  f"{r['cells'] / fixed5_cells:.2f}×"] for d, r in effects.items()])
    print(f"fixed design reaching {args.power:.0%} power: {needed} seeds/arm "
          f"({needed * len(ARMS) * hours if needed else math.nan:.2f} h); fixed 5 seeds/arm: power {fixed[5]:.3f}, "
          f"{fixed5_cells * hours:.2f} h; {checked} sweeps agreed with aepo_core.sequential.run_looks; "
          f"{time.perf_counter() - t0:.0f} s")
    write_result(args.out, {
        "benchmark": "sequential", "design": {**design.__dict__, "description": design.describe(),
                                              "z_boundaries": design.z_boundaries(),
                                              "futility_z_boundaries": design.futility_z_boundaries(),
                                              "planned_power": design.planned_power()},
        "model": {"sigma2_seed": SIGMA2_SEED, "sigma2_q": SIGMA2_Q, "n_questions": N_QUESTIONS,
                  "sigma_run": SIGMA_RUN, "sigma_d": SIGMA_RUN * math.sqrt(2)},
        "delta": args.delta, "reps": args.reps, "seed": args.seed, "cell_minutes": args.cell_minutes,
        "scenarios": results, "null_at_true_sigma_ratio": robust,
        "by_effect": {f"{d:g}": r for d, r in effects.items()}, "fixed_power": fixed,
        "fixed_seeds_for_power": needed, "fixed5_cells": fixed5_cells,
        "checked_against_core": checked, "seconds": time.perf_counter() - t0})
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
