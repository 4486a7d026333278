"""Power of the training comparison (issue 16, item 2), from the first comparison's variance.

How many test questions × seeds (training runs per arm) a comparison of two arms needs to detect a Pass@1
difference Δ at a given power, and what this machine can afford, from ``bench/results/compare_algorithms.json``
(7 arms × 3 seeds × 3 RL steps, 24 questions × 2 samples).

**Model.** Arm a trained with seed s answers question q correctly with probability
p_{a,s,q} = μ_a + u_q + w_{a,s} + e_{a,s,q}: u_q the question's difficulty (the same for every arm: it cancels in
a paired difference), w_{a,s} the run-level shift of that training run (variance σ²_seed: what more questions
cannot average away), e_{a,s,q} the run × question deviation; each question is scored on m samples, which adds
Bernoulli noise. Let σ²_w be the variance of one run's per-question Pass@1 around μ_a + u_q + w_{a,s}
(e plus sampling noise at m samples). The comparison's statistic is
D = mean_{s,q} Pass@1_{A,s,q} − mean_{s,q} Pass@1_{B,s,q} over n_q questions and n_s seeds per arm, with the two
arms trained independently, so

    Var(D) = σ²_q / (n_q·n_s) + 2·σ²_seed / n_s,        σ²_q = 2·σ²_w

(σ²_q: the variance of one question's paired difference between one run of each arm).

**Estimates.** σ²_q from the per-question Pass@1 (already averaged over S_A and S_B seeds): for a pair of arms,
the across-question variance of d_q = P̄_{A,q} − P̄_{B,q} is σ²_w·(1/S_A + 1/S_B) (u_q cancels, the seed shifts are
the same for every question and leave the variance), so σ̂²_q = 2·Var_q(d_q) / (1/S_A + 1/S_B), averaged over the
pairs of the arms compared. σ²_seed from each arm's Pass@1 by seed: their pooled within-arm variance s²_seed
(Σ_a (S_a − 1)·s²_a / Σ_a (S_a − 1)) estimates σ²_seed + σ²_w/n_q (each run's Pass@1 still carries its questions'
noise), so σ̂²_seed = max(0, s²_seed − σ̂²_q / (2·n_q)). With 11 degrees of freedom and 3 RL steps that correction
can eat it all: the uncorrected s²_seed is reported beside it as the pessimistic case.

**Per-seed results** (``per_question_pass@1_by_seed``, written by ``bench.compare_algorithms`` since issue 16)
allow more: a two-way analysis of variance of the seed-matched differences d_{s,q} = P_{A,s,q} − P_{B,s,q}
(seeds × questions, one value per cell) separates three components of the difference: the run × question noise
σ²_q (residual mean square), a persistent arm × question effect σ²_aq (it does not average over seeds) and the
seed effect on the difference, which takes the place of 2σ²_seed (and is smaller for seed-matched arms that
share randomness):

    MS_res = ΣΣ(d − d̄_s· − d̄_·q + d̄)² / ((S−1)(Q−1))   estimates σ²_q
    MS_q   = S·Σ_q(d̄_·q − d̄)² / (Q−1)                  estimates σ²_q + S·σ²_aq
    MS_s   = Q·Σ_s(d̄_s· − d̄)² / (S−1)                  estimates σ²_q + 2Q·σ²_seed

so Var(D) = σ²_q/(n_q·n_s) + σ²_aq/n_q + 2σ²_seed/n_s; the raw (pessimistic) σ²_seed is MS_s/(2Q).

**Assumptions, said plainly.** (1) Without per-seed results, the question-level variation of a difference is
taken as run × question noise, which averages over seeds (σ²_aq = 0); a persistent arm × question effect would
not, so the seed counts are then optimistic. (2) Arms are independent trainings; the sweep's
arms share the SFT start and, per seed, the data order and sampling seeds, which correlates them (AEPO's ablations
differ from AEPO far less per question than AEPO from GRPO) and makes the formula conservative for seed-matched
pairs. (3) The number of RL steps changes the effect itself (and σ²_seed: runs diverge as they train), which a
3-step run cannot estimate: every table holds for a fixed training budget.

**Power** of the two-sided z-test at level α: Φ(|Δ|/SE − z_{1−α/2}) + Φ(−|Δ|/SE − z_{1−α/2}), SE = √Var(D).

**Cost** (one one-thread worker): a run costs steps·B·k·c_traj + n_q·m·c_eval seconds, c_traj the measured RL
seconds per trajectory (``rl_wall_s_per_run`` / (steps·B·k)) and c_eval the rest of a run's wall time per evaluation
question-sample (it carries the run's start-up too: an over-estimate). A run's wall time is the sweep's per run and
worker when the input timed a sweep, else the mean over arms of the runs' logged phases (``arms.*.phases_s``: a
``--analyse-only`` result), else the first comparison's 480 s; a design of n_arms × n_s runs on W workers
takes n_arms·n_s·run / W.

Run: ``.venv/bin/python -m bench.power [--input bench/results/compare_algorithms.json] [--delta 0.05]
[--power 0.8] [--hours 12] [--steps 10]``; prints the components, the tables and the affordable design and writes
``bench/results/power.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from bench.harness import RESULTS_DIR, print_table, write_result
from bench.phases import PhaseSeconds

DEFAULT_INPUT = RESULTS_DIR / "compare_algorithms.json"
CLAIMS_ARMS = ("aepo", "arpo", "grpo")
# The first comparison's wall time: 1 h 20 min for 20 runs on 2 one-thread workers (bench/README.md), i.e.
# 2 · 4800 s / 20 = 480 worker-seconds per run (3 RL steps, evaluation, start-up). Its JSON was re-analysed
# (--analyse-only), so it carries no sweep wall time of its own.
MEASURED_RUN_WALL_S = 480.0
QUESTION_GRID = (24, 56, 112, 280, 560)  # 56: the demo world's whole test split (8 held-out companies × 7 relations)
SEED_GRID = (3, 5, 10, 20)
MAX_SEEDS = 1000


class InputError(ValueError):
    """The first comparison's JSON lacks what the estimate needs (the message names the field)."""


# ------------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class FirstComparison:
    """What the estimate reads from ``compare_algorithms.json``."""

    per_question: dict[str, dict[str, float]]  # arm → question id → Pass@1 averaged over the arm's seeds
    by_seed: dict[str, list[float]]  # arm → Pass@1 of each seed's run
    rl_wall_s: dict[str, float]  # arm → RL seconds per run (sum of step/wall_s)
    rl_steps: int
    questions_per_step: int
    k: int
    eval_samples: int
    run_wall_s: float  # worker-seconds per run, evaluation and start-up included
    # arm → seed → question id → Pass@1 of that run; empty in results from before issue 16 recorded it
    per_seed_question: dict[str, dict[str, dict[str, float]]]


def _field(data: Mapping[str, object], path: str, prefix: str = "") -> object:
    """``data[a][b]…`` for the path ``a.b…``; :class:`InputError` names the field as ``prefix`` + ``path``."""
    node: object = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise InputError(f"missing field {prefix}{path}")
        node = node[part]
    return node


def read_first_comparison(data: Mapping[str, object], run_wall_s: float | None = None) -> FirstComparison:
    """The fields of a ``compare_algorithms`` result; :class:`InputError` names the first one missing."""
    arms = _field(data, "arms")
    if not isinstance(arms, Mapping) or not arms:
        raise InputError("field arms has no arm")
    per_question = _field(data, "per_question_pass@1")
    for arm in arms:
        _field(per_question, arm, "per_question_pass@1.")  # type: ignore[arg-type]
    wall = _field(data, "wall_s")
    per_run = wall.get("per_run") if isinstance(wall, Mapping) else None
    workers = int(data.get("workers") or 1)
    phases = [PhaseSeconds(**a["phases_s"]).total for a in arms.values()  # type: ignore[union-attr]
              if isinstance(a, Mapping) and isinstance(a.get("phases_s"), Mapping)]
    if per_run:  # the sweep ran in the invocation that wrote the result: its wall per run and worker
        measured = float(per_run) * workers
    elif phases and all(math.isfinite(t) for t in phases):  # re-analysed stored runs: their own phases
        measured = sum(phases) / len(phases)
    else:  # results from before the phases were logged
        measured = MEASURED_RUN_WALL_S
    by_seed_question = data.get("per_question_pass@1_by_seed") or {}
    return FirstComparison(
        per_question={a: {q: float(v) for q, v in per_question[a].items()} for a in arms},  # type: ignore[index]
        by_seed={a: [float(v) for v in _field(arms, f"{a}.pass@1_by_seed", "arms.").values()] for a in arms},
        rl_wall_s={a: float(_field(arms, f"{a}.rl_wall_s_per_run", "arms.")) for a in arms},
        rl_steps=int(_field(data, "budget.rl_steps")),
        questions_per_step=int(_field(data, "budget.questions_per_step")),
        k=int(_field(data, "budget.k")),
        eval_samples=int(_field(data, "budget.eval_samples")),
        run_wall_s=run_wall_s if run_wall_s is not None else measured,
        per_seed_question={a: {str(s): {q: float(v) for q, v in qs.items()} for s, qs in seeds.items()}
                           for a, seeds in by_seed_question.items()},  # type: ignore[union-attr]
    )


# ------------------------------------------------------------------------------------------------ variance
@dataclass(frozen=True)
class VarianceComponents:
    """σ²_q (one question's paired difference between one run of each arm, at ``eval_samples`` samples),
    σ²_aq (a persistent arm × question effect in it) and σ²_seed (an arm's run-level Pass@1 shift), with what
    they came from."""

    sigma2_q: float
    sigma2_seed: float  # corrected for the questions' noise in each run's Pass@1, clipped at 0
    sigma2_seed_raw: float  # the same uncorrected (the pessimistic case)
    seed_df: int  # degrees of freedom of the seed variance
    n_questions: int  # questions of the first comparison
    eval_samples: int
    pairs: tuple[tuple[str, str], ...]  # the arm pairs σ²_q is averaged over
    sigma2_aq: float = 0.0  # 0: not separable (seed-averaged results)
    method: str = "seed-averaged"  # or "two-way" (per-seed results)


def _variance(values: Sequence[float]) -> float:
    """Unbiased sample variance Σ(x − x̄)² / (n − 1)."""
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def paired_question_variance(a: Mapping[str, float], b: Mapping[str, float], seeds_a: int, seeds_b: int) -> float:
    """σ̂²_q of one pair: 2·Var_q(P̄_{A,q} − P̄_{B,q}) / (1/S_A + 1/S_B) over the questions both arms answered."""
    questions = sorted(set(a) & set(b))
    if len(questions) < 2:
        raise InputError(f"fewer than 2 common questions in a pair of arms ({len(questions)})")
    return 2.0 * _variance([a[q] - b[q] for q in questions]) / (1.0 / seeds_a + 1.0 / seeds_b)


def pooled_seed_variance(by_seed: Mapping[str, Sequence[float]]) -> tuple[float, int]:
    """(Σ_a (S_a − 1)·s²_a / Σ_a (S_a − 1), Σ_a (S_a − 1)) over the arms with at least 2 seeds."""
    arms = [v for v in by_seed.values() if len(v) >= 2]
    df = sum(len(v) - 1 for v in arms)
    if df == 0:
        raise InputError("no arm has 2 or more seeds in arms.*.pass@1_by_seed")
    return sum((len(v) - 1) * _variance(v) for v in arms) / df, df


@dataclass(frozen=True)
class PairAnova:
    """Variance components of one pair's seed-matched differences (module docstring), each clipped at 0."""

    sigma2_q: float  # MS_res
    sigma2_aq: float  # (MS_q − MS_res) / S
    seed_effect: float  # (MS_s − MS_res) / Q: 2σ²_seed
    seed_effect_raw: float  # MS_s / Q = Var_s(d̄_s·)
    seed_df: int  # S − 1


def paired_two_way(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]]) -> PairAnova | None:
    """Two-way ANOVA of d_{s,q} = P_{A,s,q} − P_{B,s,q} over the seeds and questions both arms have (seed →
    question → Pass@1); None with fewer than 2 of either."""
    seeds = sorted(set(a) & set(b))
    questions = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds))) if seeds else []
    if len(seeds) < 2 or len(questions) < 2:
        return None
    d = np.array([[a[s][q] - b[s][q] for q in questions] for s in seeds])
    n_s, n_q = d.shape
    by_seed, by_question, grand = d.mean(axis=1), d.mean(axis=0), d.mean()
    ms_res = float(((d - by_seed[:, None] - by_question[None, :] + grand) ** 2).sum() / ((n_s - 1) * (n_q - 1)))
    ms_q = float(n_s * ((by_question - grand) ** 2).sum() / (n_q - 1))
    ms_s = float(n_q * ((by_seed - grand) ** 2).sum() / (n_s - 1))
    return PairAnova(ms_res, max(0.0, (ms_q - ms_res) / n_s), max(0.0, (ms_s - ms_res) / n_q), ms_s / n_q, n_s - 1)


def distinct_arms(first: FirstComparison, arms: Sequence[str]) -> list[str]:
    """``arms`` less those whose per-question and per-seed Pass@1 repeat an earlier arm's exactly: the same
    training run twice (``aepo-no-clip-balance`` was ``aepo`` run for run), not two draws of the noise."""
    seen: list[tuple[object, ...]] = []
    out = []
    for arm in arms:
        key = (tuple(sorted(first.per_question[arm].items())), tuple(sorted(first.by_seed[arm])))
        if key not in seen:
            seen.append(key)
            out.append(arm)
    return out


def estimate_components(first: FirstComparison, arms: Sequence[str]) -> VarianceComponents:
    """Over the distinct pairs of ``arms``: the two-way components when every pair has per-seed results for ≥ 2
    common seeds, else σ̂²_q from the seed-averaged per-question values and σ̂²_seed pooled over every distinct
    arm (module docstring)."""
    unknown = [a for a in arms if a not in first.per_question]
    if unknown:
        raise InputError(f"missing field arms.{unknown[0]}")
    chosen = distinct_arms(first, arms)
    pairs = tuple(itertools.combinations(chosen, 2))
    if not pairs:
        raise InputError(f"fewer than 2 distinct arms among {list(arms)}")
    anovas = [paired_two_way(first.per_seed_question.get(a, {}), first.per_seed_question.get(b, {}))
              for a, b in pairs]
    if all(anovas):
        return _two_way_components(first, pairs, anovas)  # type: ignore[arg-type]
    sigma2_q = sum(paired_question_variance(first.per_question[a], first.per_question[b], len(first.by_seed[a]),
                                            len(first.by_seed[b])) for a, b in pairs) / len(pairs)
    every = distinct_arms(first, list(first.per_question))
    raw, df = pooled_seed_variance({a: first.by_seed[a] for a in every})
    n_q = round(sum(len(first.per_question[a]) for a in every) / len(every))
    return VarianceComponents(sigma2_q=sigma2_q, sigma2_seed=max(0.0, raw - sigma2_q / (2 * n_q)),
                              sigma2_seed_raw=raw, seed_df=df, n_questions=n_q, eval_samples=first.eval_samples,
                              pairs=pairs)


def _two_way_components(first: FirstComparison, pairs: tuple[tuple[str, str], ...],
                        anovas: Sequence[PairAnova]) -> VarianceComponents:
    """The pairs' two-way components averaged; σ²_seed is half the seed effect on a difference."""
    n = len(anovas)
    n_q = round(sum(len(first.per_question[a]) for pair in pairs for a in pair) / (2 * n))
    return VarianceComponents(sigma2_q=sum(x.sigma2_q for x in anovas) / n,
                              sigma2_seed=sum(x.seed_effect for x in anovas) / (2 * n),
                              sigma2_seed_raw=sum(x.seed_effect_raw for x in anovas) / (2 * n),
                              seed_df=sum(x.seed_df for x in anovas), n_questions=n_q,
                              eval_samples=first.eval_samples, pairs=pairs,
                              sigma2_aq=sum(x.sigma2_aq for x in anovas) / n, method="two-way")


# ------------------------------------------------------------------------------------------------ power
def se_of_difference(sigma2_q: float, sigma2_seed: float, n_questions: int, n_seeds: int,
                     sigma2_aq: float = 0.0) -> float:
    """SE(D) = √(σ²_q/(n_q·n_s) + σ²_aq/n_q + 2σ²_seed/n_s) of the mean paired Pass@1 difference of two arms."""
    if n_questions < 1 or n_seeds < 1:
        raise ValueError(f"a design needs ≥ 1 question and seed; got {n_questions} × {n_seeds}")
    return math.sqrt(sigma2_q / (n_questions * n_seeds) + sigma2_aq / n_questions + 2.0 * sigma2_seed / n_seeds)


def z_power(delta: float, se: float, alpha: float = 0.05) -> float:
    """Power of the two-sided z-test at level α: Φ(|Δ|/SE − z_{1−α/2}) + Φ(−|Δ|/SE − z_{1−α/2})."""
    if se <= 0:
        return 1.0 if delta else alpha
    norm = NormalDist()
    z = norm.inv_cdf(1.0 - alpha / 2.0)
    shift = abs(delta) / se
    return norm.cdf(shift - z) + norm.cdf(-shift - z)


def detectable_effect(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest |Δ| the two-sided z-test detects with ``power``: (z_{1−α/2} + z_power)·SE (the other tail
    neglected)."""
    norm = NormalDist()
    return (norm.inv_cdf(1.0 - alpha / 2.0) + norm.inv_cdf(power)) * se


def design_power(comp: VarianceComponents, delta: float, n_questions: int, n_seeds: int, alpha: float = 0.05,
                 pessimistic: bool = False) -> float:
    """Power of an n_q × n_s design under ``comp`` (σ²_seed raw when ``pessimistic``)."""
    seed = comp.sigma2_seed_raw if pessimistic else comp.sigma2_seed
    return z_power(delta, se_of_difference(comp.sigma2_q, seed, n_questions, n_seeds, comp.sigma2_aq), alpha)


def min_seeds(comp: VarianceComponents, delta: float, target: float, n_questions: int, alpha: float = 0.05,
              pessimistic: bool = False) -> int | None:
    """The fewest seeds per arm reaching ``target`` power with ``n_questions`` (None beyond :data:`MAX_SEEDS`)."""
    return next((s for s in range(2, MAX_SEEDS + 1)
                 if design_power(comp, delta, n_questions, s, alpha, pessimistic) >= target), None)


# ------------------------------------------------------------------------------------------------ cost
@dataclass(frozen=True)
class CostModel:
    """Seconds of one one-thread worker: per RL trajectory (its rollout and share of the update) and per
    evaluation question-sample (with the run's start-up folded in)."""

    trajectory_s: float
    eval_sample_s: float

    def run_s(self, steps: int, questions_per_step: int, k: int, n_questions: int, samples: int) -> float:
        """steps·B·k·c_traj + n_q·m·c_eval."""
        return steps * questions_per_step * k * self.trajectory_s + n_questions * samples * self.eval_sample_s


def cost_model(first: FirstComparison, arms: Sequence[str], eval_questions: int) -> CostModel:
    """c_traj = mean RL seconds per run of ``arms`` / (steps·B·k); c_eval = (run wall − that) / (n_q·m)."""
    rl = sum(first.rl_wall_s[a] for a in arms) / len(arms)
    trajectories = first.rl_steps * first.questions_per_step * first.k
    return CostModel(trajectory_s=rl / trajectories,
                     eval_sample_s=max(0.0, first.run_wall_s - rl) / (eval_questions * first.eval_samples))


@dataclass(frozen=True)
class Plan:
    """The training comparison to cost: arms, RL budget per run, evaluation, and the machine's workers."""

    arms: int
    steps: int
    questions_per_step: int
    k: int
    samples: int
    workers: int

    def hours(self, cost: CostModel, n_questions: int, n_seeds: int) -> float:
        """n_arms·n_s·run_s / W, in hours."""
        run = cost.run_s(self.steps, self.questions_per_step, self.k, n_questions, self.samples)
        return self.arms * n_seeds * run / self.workers / 3600.0


@dataclass(frozen=True)
class Design:
    n_questions: int
    n_seeds: int
    hours: float
    power: float
    power_pessimistic: float


def best_affordable(comp: VarianceComponents, cost: CostModel, plan: Plan, hours: float, delta: float,
                    max_questions: int, alpha: float = 0.05) -> Design | None:
    """The most powerful n_q × n_s design (n_q ≤ ``max_questions``, ≥ 2 seeds) within ``hours``; for each seed
    count the most questions that fit, since a question costs far less than a run.

    Ranked by the power under the raw σ²_seed first: the point estimate (0 after 3 steps) saturates the power at a
    few seeds, while the run-level variance that longer training adds is what only more seeds average away."""
    best: Design | None = None
    for seeds in range(2, MAX_SEEDS + 1):
        per_run_s = hours * 3600.0 * plan.workers / (plan.arms * seeds)
        train_s = cost.run_s(plan.steps, plan.questions_per_step, plan.k, 0, plan.samples)
        room = per_run_s - train_s
        n_q = min(max_questions, math.floor(room / (plan.samples * cost.eval_sample_s))) if cost.eval_sample_s \
            else max_questions
        if room <= 0 or n_q < 1:
            break
        cand = Design(n_q, seeds, plan.hours(cost, n_q, seeds), design_power(comp, delta, n_q, seeds, alpha),
                      design_power(comp, delta, n_q, seeds, alpha, pessimistic=True))
        if best is None or (cand.power_pessimistic, cand.power) > (best.power_pessimistic, best.power):
            best = cand
    return best


# ------------------------------------------------------------------------------------------------ CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="first comparison's JSON (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "power.json")
    p.add_argument("--delta", type=float, default=0.05, help="Pass@1 difference to detect (default: %(default)s)")
    p.add_argument("--power", type=float, default=0.8, help="target power (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.05, help="two-sided test level (default: %(default)s)")
    p.add_argument("--arms", nargs="+", default=list(CLAIMS_ARMS),
                   help="the arms compared: σ²_q from their pairs; the cost counts them (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="RL steps per run of the planned comparison")
    p.add_argument("--questions-per-step", type=int, default=None, help="default: the first comparison's")
    p.add_argument("--k", type=int, default=None, help="rollouts per question; default: the first comparison's")
    p.add_argument("--hours", type=float, default=12.0, help="wall-clock budget of the comparison")
    p.add_argument("--workers", type=int, default=2, help="one-thread workers (this machine: 2 cores)")
    p.add_argument("--max-questions", type=int, default=280,
                   help="test questions available (the demo world's split has 56; data.synthetic.entities=200 "
                   "gives 280)")
    p.add_argument("--run-wall-s", type=float, default=None,
                   help=f"worker-seconds per first-comparison run (default: its JSON's, else {MEASURED_RUN_WALL_S:g})")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = json.loads(args.input.read_text())
        first = read_first_comparison(data, args.run_wall_s)
        comp = estimate_components(first, args.arms)
    except (OSError, json.JSONDecodeError, InputError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        print(f"bench.power: {args.input}: {reason}", file=sys.stderr)
        return 2
    return report(args, first, comp)


def report(args: argparse.Namespace, first: FirstComparison, comp: VarianceComponents) -> int:
    """Print the components, the power table, the minimal seeds and the affordable designs; write the JSON."""
    n0, s0 = comp.n_questions, min(len(first.by_seed[a]) for a in args.arms)
    plan = Plan(arms=len(args.arms), steps=args.steps,
                questions_per_step=args.questions_per_step or first.questions_per_step, k=args.k or first.k,
                samples=first.eval_samples, workers=args.workers)
    cost = cost_model(first, args.arms, n0)
    first_se = se_of_difference(comp.sigma2_q, comp.sigma2_seed, n0, s0, comp.sigma2_aq)
    seed_from = (f"seed-matched differences over seeds ({comp.seed_df} df) / 2" if comp.method == "two-way"
                 else f"pooled over arms ({comp.seed_df} df)") + f", less σ²_q/(2·{n0})"
    print_table(f"Variance components (first comparison, {comp.method})", ["component", "variance", "SD", "from"], [
        ["σ²_q (question, paired, per seed)", comp.sigma2_q, math.sqrt(comp.sigma2_q),
         f"{len(comp.pairs)} pairs of {', '.join(args.arms)}; {n0} questions × {first.eval_samples} samples"],
        ["σ²_aq (arm × question)", comp.sigma2_aq, math.sqrt(comp.sigma2_aq),
         "two-way ANOVA" if comp.method == "two-way" else "not separable without per-seed results: 0"],
        ["σ²_seed (run level)", comp.sigma2_seed, math.sqrt(comp.sigma2_seed), seed_from],
        ["σ²_seed raw (pessimistic)", comp.sigma2_seed_raw, math.sqrt(comp.sigma2_seed_raw), "uncorrected"],
        ["SE(D) of the first comparison", "", first_se, f"{n0} questions × {s0} seeds: detects "
         f"|Δ| ≥ {detectable_effect(first_se, args.alpha, args.power):.3f} at {args.power:.0%} power"],
    ])
    table = [{"n_questions": n_q, "n_seeds": s,
              "power": design_power(comp, args.delta, n_q, s, args.alpha),
              "power_pessimistic": design_power(comp, args.delta, n_q, s, args.alpha, pessimistic=True),
              "hours": plan.hours(cost, n_q, s)} for n_q in QUESTION_GRID for s in SEED_GRID]
    print_table(f"Power to detect ΔPass@1 = {args.delta} (two-sided α = {args.alpha}); σ²_seed point / raw; "
                f"hours for {plan.arms} arms × {plan.steps} steps on {plan.workers} workers",
                ["questions", *(f"{s} seeds" for s in SEED_GRID)],
                [[n_q, *(f"{r['power']:.2f} / {r['power_pessimistic']:.2f} ({r['hours']:.1f} h)"
                         for r in table if r["n_questions"] == n_q)] for n_q in QUESTION_GRID])
    minimal = [{"n_questions": n_q, "min_seeds": min_seeds(comp, args.delta, args.power, n_q, args.alpha),
                "min_seeds_pessimistic": min_seeds(comp, args.delta, args.power, n_q, args.alpha, pessimistic=True)}
               for n_q in QUESTION_GRID]
    for row in minimal:
        row["hours"] = plan.hours(cost, row["n_questions"], row["min_seeds"]) if row["min_seeds"] else None
    print_table(f"Fewest seeds per arm for {args.power:.0%} power",
                ["questions", "seeds", "hours", "seeds (raw σ_seed)"],
                [[r["n_questions"], r["min_seeds"], r["hours"], r["min_seeds_pessimistic"]] for r in minimal])
    budgets = sorted({args.hours, 4.0, 8.0, 24.0, 48.0})
    affordable = {h: best_affordable(comp, cost, plan, h, args.delta, args.max_questions, args.alpha)
                  for h in budgets}
    print_table(f"Affordable: {plan.arms} arms × {plan.steps} RL steps × {plan.questions_per_step} questions × "
                f"k = {plan.k}, ≤ {args.max_questions} test questions × {plan.samples} samples, {plan.workers} "
                f"workers (c_traj {cost.trajectory_s:.1f} s, c_eval {cost.eval_sample_s:.2f} s)",
                ["hours", "questions", "seeds", "power", "power (raw σ_seed)"],
                [[h, d.n_questions, d.n_seeds, d.power, d.power_pessimistic] if d else [h, "–", "–", "–", "–"]
                 for h, d in affordable.items()])
    write_result(args.out, {
        "benchmark": "power",
        "input": str(args.input),
        "delta": args.delta, "target_power": args.power, "alpha": args.alpha, "arms": list(args.arms),
        "components": {**asdict(comp), "sigma_q": math.sqrt(comp.sigma2_q), "sigma_seed": math.sqrt(comp.sigma2_seed),
                       "sigma_seed_raw": math.sqrt(comp.sigma2_seed_raw)},
        "first_comparison": {"n_questions": n0, "n_seeds": s0, "se": first_se,
                             "detectable_effect": detectable_effect(first_se, args.alpha, args.power)},
        "cost": {**asdict(cost), "run_wall_s": first.run_wall_s, "plan": asdict(plan)},
        "table": table,
        "min_seeds": minimal,
        "affordable": {f"{h:g}h": asdict(d) if d else None for h, d in affordable.items()},
    })
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
