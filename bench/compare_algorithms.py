"""AEPO vs ARPO vs GRPO, and AEPO's ablations, on the synthetic deep-search task (issue 6, item 5).

1. **One shared start.** Cold-start SFT on oracle transcripts is run once for the sweep's base config and the
   result saved as a plain HF model directory in the model cache (``compare-sft-<hash>``, reused by later runs
   with the same model / SFT / data / tools / protocol settings). Every arm starts from these weights.
2. **The sweep** ``configs/sweeps/algorithms.yaml`` (AEPO, ARPO, GRPO + four AEPO ablations, 3 seeds) runs
   through the real sweep flow (Prefect child flow runs, nested MLflow runs), with the same rollout budget
   (k, questions per step, steps, token caps) and the same learning rate for every arm; only the keys the sweep
   file names differ. ``--set`` adds overrides for every arm (e.g. a smaller CPU budget).
3. **Analysis** from MLflow, per arm: per-question Pass@1 and Pass@k averaged over seeds, with bootstrap 95%
   CIs over questions; the paired difference to GRPO on the same questions (bootstrap CI); tool calls per
   question at evaluation; rollout diversity during training (distinct tool-call sequences per question group,
   mean and largest number of branches on one path); the final training reward.
4. **Training curves** per arm and RL step (issue 16), from each run's metric histories: the mean over seeds and
   the lowest / highest seed of the policy entropy of the update's tokens, the training reward, tool calls per
   trajectory, branches per question and on one path, the share of a question's branches on its top-1 / top-3
   paths, the informative groups; the seed-mean entropy's slope per arm. Figures ``entropy_over_training.png``,
   ``training_curves.png`` and ``curves_by_tokens.png`` (against the cumulative generated tokens) go to
   ``bench/results/<out stem>/`` and, when the sweep ran here, to its parent MLflow run (``training_curves/``); the
   per-step numbers into the JSON.
5. **Over seeds** (issue 27 §5): per arm each run's Pass@1, generated tokens, clipped share of update tokens (mean
   over steps: how much a clipping loss had to act on) and entropy slope with a Student-t
   interval over seeds (rising / falling only where the slopes' interval excludes 0); every pair of arms
   seed-matched: ΔPass@1 over seeds (t interval, t-test, Holm over the pairs), given the seeds (bootstrap over
   questions), by question family (exploratory), and Δ entropy slope.

Run: ``.venv/bin/python -m bench.compare_algorithms [--seeds 0 1 2] [--set train.steps=4 ...] [--quick]
[--workers 2]``. ``--workers N`` (N >= 1) fans the sweep out through a Prefect process work pool on this
machine (``bench/pool.py``: ``aepo ui``, the ``train`` deployment, N one-flow-run workers with cores/N torch
threads each), every child logging to the pool's ``mlflow server`` over HTTP: the README's "Scaling out" set-up,
timed. Small-model decoding on CPU is bound by per-op overhead, so two one-thread workers on two cores get more
done than one two-thread process. ``--workers 0`` (default) runs the sweep in this process. Either way the runs
land in the runs dir's SQLite store, which ``--analyse-only`` and ``aepo ui --runs-dir`` read.
Prints the table and writes ``bench/results/compare_algorithms.json`` (``compare_algorithms-quick.json`` with
``--quick``; ``--out`` elsewhere). Runs go to ``--runs-dir`` (default ``runs/bench-compare``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from aepo_core.evaluation import OverSeeds
from bench.harness import RESULTS_DIR, cli_logging, environment, print_table, write_result
from bench.phases import PHASE_COLUMNS, PhaseSeconds, mean_phases, phase_row, phase_seconds
from flows.cli.render import interval
from infra.atomic import atomic_dir
from infra.data.loaders import dataset_key
from infra.plots import Band

log = logging.getLogger("bench.compare_algorithms")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SWEEP = REPO / "configs" / "sweeps" / "algorithms.yaml"
BASELINE = "grpo"
# What the shared SFT checkpoint depends on (every other key may differ between arms without invalidating it).
SFT_KEYS = ("model", "data", "tools", "train.sft", "optim.micro_batch_tokens", "seed")
# Issue 16's training curves: the paper claims AEPO keeps the policy entropy stable where ARPO/GRPO collapse or explode
# it, and concentrates fewer branches on one path. Metrics a run never logged (runs from before the branch shares
# were added) are left out of that run's curves, not drawn as zeros.
ENTROPY = "train/entropy_mean"
TOKENS = "cost/total_generated_tokens"
CURVE_METRICS = {  # metric → panel title
    ENTROPY: "policy entropy of the update's tokens (nats)",
    "rollout/reward_mean": "training reward",
    "rollout/tool_calls_mean": "tool calls per trajectory",
    "rollout/branches_per_question": "branches per question",
    "rollout/max_branches_per_path": "most branches on one path",
    "rollout/branch_top1_share": "share of branches on the top-1 path",
    "rollout/branch_top3_share": "share of branches on the top-3 paths",
    "rollout/informative_groups": "informative groups in the update",
    TOKENS: "generated tokens, cumulative",
}
# Against the common budget (issue 27 §4): these curves are drawn once more over the cumulative generated tokens (the
# seed mean at each step), since an arm that branches spends more per step.
BY_TOKENS = (ENTROPY, "rollout/reward_mean", "rollout/tool_calls_mean")
# The share of update tokens whose ratio the loss clipped: the clipping losses (AEPO's stop-gradient balance, PPO's,
# GPPO's) differ only there, so a comparison of them means little where it is small (0.2 % in the powered sweep).
CLIP = "train/clip_frac"
RUN_METRICS = ("rollout/distinct_tool_sequences", "rollout/max_branches_per_path", "rollout/branch_samples",
               "rollout/reward_mean", "step/wall_s", CLIP)
CURVES_ARTIFACT_DIR = "training_curves"
# Per-arm tables that go to the JSON's top level (keyed by arm) rather than into its arm summaries.
PER_ARM_TABLES = ("per_question_pass@1", "per_question_pass@1_by_seed", "question_family", "curves")
# An arm's entropy trend, in words, from the sign of its runs' slopes over seeds (OverSeeds.sign).
TREND_WORDS = {"> 0": "rising", "< 0": "falling", "0 in CI": "none shown (0 in CI)", "one seed": "one seed"}
# Two steps: the second rollout already samples from weights the arms' losses moved differently.
# With 8 SFT transcripts every reward was −1 (zero advantages, zero gradient: every arm identical); the demo's 48
# give rewards that differ within groups, so the arms' losses move the weights differently.
QUICK_SETS = ["train.steps=2", "train.batch_size=4", "eval.max_questions=4", "eval.n_samples=2",
              "eval.pass_k=2", "train.sft.max_examples=48", "tracking.log_model=false"]


# ------------------------------------------------------------------------------------------------ SFT start
def _sft_key(cfg: Any) -> str:
    from aepo_core.protocol import SYSTEM_PROMPT

    data = cfg.model_dump(mode="json")
    parts = {}
    for key in SFT_KEYS:
        node = data
        for part in key.split("."):
            node = node[part]
        parts[key] = node
    parts["system_prompt"] = SYSTEM_PROMPT
    if not parts["train.sft"]["warmup_steps"]:
        # train.sft.warmup_steps came after the cached SFT starts of the rollout study (issue 26); at its default
        # it trains the same weights, so it is left out and those caches keep their key.
        del parts["train.sft"]["warmup_steps"]
    # model.sampler_dtype (issue 52) picks the training rollouts' engine: SFT never samples, so it is left out.
    del parts["model"]["sampler_dtype"]
    # train.sft.seed (later still) orders SFT's batches in place of the run's seed: the key holds the seed that does.
    parts["seed"] = cfg.train.sft.order_seed(cfg.seed)
    del parts["train.sft"]["seed"]
    if cfg.optim.share_prefix != "off":  # another float rounding of the same SFT (as another micro-batch size): its
        # own start; "common" keeps the key it had as the boolean true
        parts["optim.share_prefix"] = True if cfg.optim.share_prefix == "common" else cfg.optim.share_prefix
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def shared_sft_checkpoint(base: Any, runs: Path, refresh: bool = False) -> tuple[Path, dict[str, float]]:
    """The base config's cold-start SFT, run once and cached as an HF model directory (atomic rename)."""
    from infra.models import cache_root
    from infra.run.runtime import build_runtime
    from infra.run.sft import run_sft

    cfg = base.model_copy(update={"train": base.train.model_copy(
        update={"sft": base.train.sft.model_copy(update={"enabled": True})})})
    root = cache_root(cfg.model)
    final = root / f"compare-sft-{_sft_key(cfg)}"
    marker = final / "aepo_sft.json"
    if marker.is_file() and not refresh:
        log.info("shared SFT start: %s (cached)", final)
        return final, json.loads(marker.read_text())
    t0 = time.perf_counter()
    runtime = build_runtime(cfg, runs / "sft-start", run_name="compare-sft")
    rows = runtime.load_rows(cfg.data.train)
    metrics = run_sft(runtime, rows[: cfg.data.max_questions] if cfg.data.max_questions else rows).metrics()
    metrics["sft/wall_s"] = time.perf_counter() - t0
    with atomic_dir(final, replace=True) as tmp:
        runtime.model.save_pretrained(tmp)
        runtime.tokenizer.save_pretrained(tmp)
        (tmp / "aepo_sft.json").write_text(json.dumps(metrics, indent=1))
    log.info("shared SFT start: %s (batch loss %.3f → %.3f, %.0f s)", final, metrics["sft/loss_first_batch"],
             metrics["sft/loss_last_batch"], metrics["sft/wall_s"])
    return final, metrics


# ------------------------------------------------------------------------------------------------ analysis
def _per_question(tracker: Any, run_id: str, dataset: str, workdir: Path) -> list[dict[str, Any]]:
    """The run's final per-question outcomes (:func:`infra.run.sequential.final_questions`, which the sequential sweep
    reads too) as the records :func:`arm_statistics` takes."""
    from infra.run.sequential import final_questions

    return [{"question_id": q.question_id, "n": q.n, "correct": q.correct,
             **({"family": q.family} if q.family is not None else {})}
            for q in final_questions(tracker.tracking_uri, run_id, dataset_key(dataset), workdir)]


def arm_statistics(per_seed: dict[int, list[dict[str, Any]]], k: int, n_resamples: int,
                   seed: int = 0) -> dict[str, Any]:
    """Per-question Pass@1 / Pass@k averaged over seeds, with bootstrap CIs over questions; each seed's Pass@1 and
    per-question Pass@1."""
    from aepo_core.metrics import bootstrap_ci, pass_at_k

    questions = sorted(set.intersection(*(set(o["question_id"] for o in rows) for rows in per_seed.values())))
    p1: dict[str, float] = {}
    pk: dict[str, float] = {}
    for q in questions:
        outs = [next(o for o in rows if o["question_id"] == q) for rows in per_seed.values()]
        p1[q] = sum(pass_at_k(o["n"], o["correct"], 1) for o in outs) / len(outs)
        pk[q] = sum(pass_at_k(o["n"], o["correct"], min(k, o["n"])) for o in outs) / len(outs)
    m1, lo1, hi1 = bootstrap_ci([p1[q] for q in questions], n_resamples=n_resamples, seed=seed)
    mk, lok, hik = bootstrap_ci([pk[q] for q in questions], n_resamples=n_resamples, seed=seed)
    by_seed = {s: sum(pass_at_k(o["n"], o["correct"], 1) for o in rows) / len(rows) for s, rows in per_seed.items()}
    # each run's own per-question Pass@1: bench/power.py separates seed, question and arm × question variance with it
    p1_by_seed = {s: {o["question_id"]: pass_at_k(o["n"], o["correct"], 1) for o in rows if o["question_id"] in p1}
                  for s, rows in per_seed.items()}
    # question → family (single_hop, two_hop, …) where the evaluation file records it (files before it do not)
    family = {o["question_id"]: o["family"] for rows in per_seed.values() for o in rows
              if o["question_id"] in p1 and "family" in o}
    return {"questions": len(questions), "pass@1": m1, "pass@1_ci": [lo1, hi1], "pass@k": mk, "pass@k_ci": [lok, hik],
            "pass@1_by_seed": by_seed, "per_question_pass@1": p1, "per_question_pass@1_by_seed": p1_by_seed,
            "question_family": family}


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def analyse(result: dict[str, Any], dataset: str, k: int, n_resamples: int, workdir: Path) -> dict[str, Any]:
    """Per-arm statistics from the MLflow store each run row names (``tracking_uri``)."""
    from aepo_core.evaluation import paired_comparison
    from infra.tracking.run import Tracker

    trackers: dict[str, Any] = {}
    by_cell: dict[str, dict[str, Any]] = {}
    for row in result["runs"]:
        if row["dataset"] != dataset:
            continue
        uri = row["tracking_uri"]
        tracker = trackers.get(uri) or trackers.setdefault(uri, Tracker(uri))
        cell = by_cell.setdefault(row["cell"], {"per_seed": {}, "runs": [], "tool_calls": [], "diversity": [],
                                                "branches_max": [], "branches_mean": [], "reward_last": [],
                                                "wall_s": [], "histories": {}, "phases": []})
        rid = row["run_id"]
        cell["per_seed"][int(row["seed"])] = _per_question(tracker, rid, dataset, workdir)
        cell["runs"].append(row["run_name"])
        cell["tool_calls"].append(float(row["tool_calls_per_question"]))
        hist = tracker.metric_history(list(dict.fromkeys([*RUN_METRICS, *CURVE_METRICS])), run_id=rid)
        cell["histories"][int(row["seed"])] = hist
        cell["diversity"] += [v for _, v in hist["rollout/distinct_tool_sequences"]]
        cell["branches_max"] += [v for _, v in hist["rollout/max_branches_per_path"]]
        cell["branches_mean"] += [v for _, v in hist["rollout/branch_samples"]]
        cell["reward_last"] += [hist["rollout/reward_mean"][-1][1]] if hist["rollout/reward_mean"] else []
        cell["wall_s"].append(sum(v for _, v in hist["step/wall_s"]))
        cell["phases"].append(phase_seconds(tracker, rid))
    arms: dict[str, Any] = {}
    for name, cell in by_cell.items():
        stats = arm_statistics(cell["per_seed"], k, n_resamples)
        curves = seed_bands(list(cell["histories"].values()), CURVE_METRICS)
        trend = entropy_trend(curves.get(ENTROPY, []))
        slopes = {s: slope for s, h in cell["histories"].items()
                  if (slope := ols_slope(h.get(ENTROPY, []))) is not None}
        tokens = {s: h[TOKENS][-1][1] for s, h in cell["histories"].items() if h.get(TOKENS)}
        clipped = {s: _mean([v for _, v in h[CLIP]]) for s, h in cell["histories"].items() if h.get(CLIP)}
        arms[name] = {
            **stats,
            "pass@1_over_seeds": dataclasses.asdict(OverSeeds.of(stats["pass@1_by_seed"])),
            "entropy_slope": dataclasses.asdict(OverSeeds.of(slopes)) if slopes else None,
            "generated_tokens_per_run": dataclasses.asdict(OverSeeds.of(tokens)) if tokens else None,
            "clip_frac_per_run": dataclasses.asdict(OverSeeds.of(clipped)) if clipped else None,
            "runs": cell["runs"],
            "tool_calls_per_question": _mean(cell["tool_calls"]),
            "distinct_tool_sequences_per_group": _mean(cell["diversity"]),
            "max_branches_on_one_path": max(cell["branches_max"], default=math.nan),
            "max_branches_per_path_mean": _mean(cell["branches_max"]),
            "branch_samples_per_step": _mean(cell["branches_mean"]),
            "train_reward_last_step": _mean(cell["reward_last"]),
            "rl_wall_s_per_run": _mean(cell["wall_s"]),
            "phases_s": mean_phases(cell["phases"]).as_dict(),
            "entropy_trend": dataclasses.asdict(trend) if trend else None,
            "curves": curves,
        }
    if BASELINE in arms:
        base = arms[BASELINE]["per_question_pass@1"]
        for name, arm in arms.items():
            arm[f"vs_{BASELINE}"] = (paired_comparison(arm["per_question_pass@1"], base, n_resamples=n_resamples)
                                     if name != BASELINE else None)
    return arms


def paired_differences(arms: Mapping[str, Any], n_resamples: int) -> dict[str, Any]:
    """Every pair of arms (in the arms' order: a before b), seed-matched (seed s of a against seed s of b, which share
    the SFT start, data order and sampling seeds): per seed the mean per-question Pass@1 difference a − b on the
    questions both answered, then

    - ``pass@1``: its mean over seeds with a Student-t interval (:class:`OverSeeds`): what a new pair of runs would
      show; the headline, as it carries the seed variance;
    - ``pass@1_given_seeds``: the same mean with a bootstrap over questions within each seed
      (:func:`aepo_core.evaluation.pooled_paired_comparison`): about these runs only, narrower;
    - ``p_over_seeds``: the two-sided one-sample t-test of the per-seed differences (None with one seed), and
      ``p_holm``: the same adjusted by Holm's step-down over all the pairs reported here (they are tested together:
      at 0.05 each, three pairs would show a false difference up to 14 % of the time);
    - ``entropy_slope``: the seed-matched difference of the entropy slopes (nats per RL step), Student-t;
    - ``by_family``: ``pass@1`` on each question family's questions alone (where the evaluations record families):
      exploratory, with no correction for the families × pairs looked at.

    Pairs without a common seed are left out."""
    from aepo_core.evaluation import paired_over_seeds, pooled_paired_comparison
    from aepo_core.metrics import holm_adjust, t_test_p

    out: dict[str, Any] = {}
    names = list(arms)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            qa, qb = arms[a]["per_question_pass@1_by_seed"], arms[b]["per_question_pass@1_by_seed"]
            seeds = sorted(set(qa) & set(qb))
            if not seeds:
                continue
            sa, sb = ((arms[x]["entropy_slope"] or {}).get("per_seed", {}) for x in (a, b))
            slope = {s: sa[s] - sb[s] for s in seeds if s in sa and s in sb}
            diff = paired_over_seeds({s: (qa[s], qb[s]) for s in seeds})
            out[f"{a} - {b}"] = {
                "a": a, "b": b,
                "pass@1": dataclasses.asdict(diff),
                "p_over_seeds": t_test_p(list(diff.per_seed.values())),
                "pass@1_given_seeds": pooled_paired_comparison([(qa[s], qb[s]) for s in seeds],
                                                               n_resamples=n_resamples),
                "entropy_slope": dataclasses.asdict(OverSeeds.of(slope)) if slope else None,
                "by_family": {f: dataclasses.asdict(paired_over_seeds(
                    {s: (_only(qa[s], keep), _only(qb[s], keep)) for s in seeds}))
                    for f, keep in _families(arms[a]["question_family"], arms[b]["question_family"]).items()},
            }
    holm = holm_adjust({name: pair["p_over_seeds"] for name, pair in out.items()})
    for name, pair in out.items():  # NaN (one seed) as None: the JSON holds no NaN
        pair["p_holm"] = None if math.isnan(holm[name]) else holm[name]
        pair["p_over_seeds"] = None if math.isnan(pair["p_over_seeds"]) else pair["p_over_seeds"]
    return out


def _families(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, set[str]]:
    """Family → its questions, where two arms' evaluations agree on a question's family; none with one family."""
    out: dict[str, set[str]] = {}
    for q, f in a.items():
        if b.get(q) == f:
            out.setdefault(f, set()).add(q)
    return dict(sorted(out.items())) if len(out) > 1 else {}


def _only(per_question: Mapping[str, float], keep: set[str]) -> dict[str, float]:
    return {q: v for q, v in per_question.items() if q in keep}


# ------------------------------------------------------------------------------------------------ curves
def seed_bands(histories: Sequence[dict[str, list[tuple[int, float]]]], metrics: Sequence[str]
               ) -> dict[str, list[Band]]:
    """Per metric and RL step, over the seeds' runs that logged it there: (step, mean, min, max). A metric no run
    logged is absent; a step some runs lack (stopped early) averages the others."""
    out: dict[str, list[Band]] = {}
    for metric in metrics:
        by_step: dict[int, list[float]] = {}
        for hist in histories:
            for step, value in hist.get(metric, []):
                by_step.setdefault(int(step), []).append(float(value))
        if by_step:
            out[metric] = [(step, sum(v) / len(v), min(v), max(v)) for step, v in sorted(by_step.items())]
    return out


@dataclass(frozen=True)
class EntropyTrend:
    """How an arm's seed-mean policy entropy moved over training: a description. Whether it rose or fell is judged
    by the runs' slopes over seeds (``entropy_slope``, an interval), not here: a last/first ratio rests on two noisy
    steps and called any rise from a near-zero start (0.04 → 0.10 nats after SFT) "exploded"."""

    first: float  # at the first RL step
    last: float  # at the last
    slope: float  # least-squares slope per RL step


def ols_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope Σ(x − x̄)(y − ȳ) / Σ(x − x̄)² of (step, value) points: the straight line through every
    step, so one noisy step moves it by its share only (a last/first ratio rests on two steps); None with fewer than
    two distinct steps."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        return None
    x_bar, y_bar = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - x_bar) * (y - y_bar) for x, y in zip(xs, ys, strict=True)) / sum((x - x_bar) ** 2 for x in xs)


def entropy_trend(band: Sequence[Band]) -> EntropyTrend | None:
    """The mean curve's first and last values and its slope (:func:`ols_slope`); None with fewer than 2 steps."""
    slope = ols_slope([(b[0], b[1]) for b in band])
    if slope is None:
        return None
    return EntropyTrend(band[0][1], band[-1][1], slope)


def by_tokens(curves: Mapping[str, Sequence[Band]]) -> dict[str, list[Band]]:
    """The :data:`BY_TOKENS` curves of one arm with the step replaced by the cumulative generated tokens through it
    (the seed mean of :data:`TOKENS` there); steps without a token count, and runs from before it, are left out."""
    spent = {step: mean for step, mean, _, _ in curves.get(TOKENS, [])}
    out = {m: [(spent[b[0]], *b[1:]) for b in curves[m] if b[0] in spent] for m in BY_TOKENS if m in curves}
    return {m: band for m, band in out.items() if band}


def curve_figures(arms: dict[str, Any], out_dir: Path, title: str) -> list[Path]:
    """``entropy_over_training.png`` (the policy entropy per arm), ``training_curves.png`` (a panel per curve
    metric any arm logged) and ``curves_by_tokens.png`` (the :data:`BY_TOKENS` curves against the cumulative
    generated tokens) under ``out_dir``; the paths written (none when no arm has a curve)."""
    from infra.plots import arm_curves_figure, save_png

    panels = {m: {name: a["curves"][m] for name, a in arms.items() if m in a["curves"]} for m in CURVE_METRICS}
    panels = {f"{CURVE_METRICS[m]} ({m})": curves for m, curves in panels.items() if curves}
    written = []
    entropy = f"{CURVE_METRICS[ENTROPY]} ({ENTROPY})"
    if entropy in panels:
        written.append(save_png(arm_curves_figure({entropy: panels[entropy]},
                                                  f"{title}: entropy over training (mean and seed range)"),
                                out_dir / "entropy_over_training.png"))
    if panels:
        written.append(save_png(arm_curves_figure(panels, f"{title}: training curves per arm (mean and seed range)"),
                                out_dir / "training_curves.png"))
    spent = {name: by_tokens(a["curves"]) for name, a in arms.items()}
    token_panels = {f"{CURVE_METRICS[m]} ({m})": {name: c[m] for name, c in spent.items() if m in c} for m in BY_TOKENS}
    token_panels = {t: curves for t, curves in token_panels.items() if curves}
    if token_panels:
        written.append(save_png(arm_curves_figure(token_panels, f"{title}: against the tokens spent (mean and seed "
                                                  "range)", xlabel=f"{CURVE_METRICS[TOKENS]} (seed mean)"),
                                out_dir / "curves_by_tokens.png"))
    return written


def log_to_parent(tracking_uri: str, parent_run_id: str, paths: Sequence[Path]) -> None:
    """The figures as artifacts of the sweep's parent MLflow run (``training_curves/``)."""
    from infra.tracking.run import Tracker

    client = Tracker(tracking_uri).client
    for path in paths:
        client.log_artifact(parent_run_id, str(path), CURVES_ARTIFACT_DIR)


# ------------------------------------------------------------------------------------------------ the run
def sweep_spec(path: Path, sets: Sequence[str], seeds: Sequence[int] | None, cells: Sequence[str] | None,
               sft_dir: Path | None) -> dict[str, Any]:
    """The sweep file as a dict, with the shared start and the CLI's overrides applied to every arm."""
    raw = yaml.safe_load(path.read_text())
    spec = dict(raw)
    base = Path(spec["base"])
    spec["base"] = str(base if base.is_absolute() else (path.parent / base).resolve())
    overrides = dict(spec.get("overrides") or {})
    for item in sets:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    if sft_dir is not None:
        # The arms run no SFT, so the base's SFT order seed is moot in them (the start's key holds it); at its default
        # their configs hash as the cells stored before train.sft.seed existed, which a resumed sweep then skips.
        overrides.update({"model.name": str(sft_dir), "train.sft.enabled": False, "train.sft.seed": None,
                          "eval.at_start": False})
    spec["overrides"] = overrides
    if seeds is not None:
        spec["seeds"] = list(seeds)
    if cells is not None:
        wanted = set(cells)
        grid = {axis: {lvl: o for lvl, o in levels.items() if lvl in wanted}
                for axis, levels in (spec.get("grid") or {}).items()}
        spec["grid"] = {axis: levels for axis, levels in grid.items() if levels}
        spec["cells"] = {c: o for c, o in (spec.get("cells") or {}).items() if c in wanted}
        if not spec["grid"]:
            spec.pop("grid")
    spec.pop("runs_dir", None)
    return spec


# ------------------------------------------------------------------------------------------------ sweep
def started(runs: Path, spec: Any) -> bool:
    """Whether a sweep of this name is in the runs dir already: then it is continued (the sweep's ``--resume``: the
    same parent run, finished cells skipped, a cell in progress from its last checkpoint), not started again."""
    from infra.run.resume import NothingToResumeError
    from infra.run.sweep import sweep_to_resume
    from infra.tracking.run import Tracker

    try:
        sweep_to_resume(Tracker.from_config(spec.base, runs, system_metrics=False), spec)
    except NothingToResumeError:
        return False
    return True


def run_sweep(spec: dict[str, Any], runs: Path, pool: Any, child_timeout_s: float | None,
              resume: bool) -> dict[str, Any]:
    """The sweep in this process (``pool`` None) or through the local work pool ``pool``, continuing it when
    ``resume``; the result with every run row tagged with its tracking URI."""
    from flows.sweep import sweep

    if pool is None:
        result = dataclasses.asdict(sweep(sweep_config=spec, runs_dir=str(runs), resume=resume))
    else:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        spec = {**spec, "overrides": {**spec["overrides"], "tracking.tracking_uri": pool.mlflow_url}}
        with temporary_settings(updates={PREFECT_API_URL: pool.prefect_api}):
            result = dataclasses.asdict(sweep(sweep_config=spec, runs_dir=str(runs), deployment=pool.deployment,
                                              max_parallel=pool.workers, child_timeout_s=child_timeout_s,
                                              resume=resume))
    result["runs"] = [{**row, "tracking_uri": result["tracking_uri"]} for row in result["runs"]]
    return result


def stored_runs(runs: Path, checked: Any, tracking_uri: str | None) -> dict[str, Any]:
    """The finished runs of the sweep ``checked`` already in the runs dir's store, shaped like a sweep result
    (newest run of each name): re-analysis without re-running, or of a sweep stopped early."""
    from infra.run.sweep import comparison_frame
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    uri = tracking_uri or tracking_uri_for(runs)  # the pool's server serves the runs dir's store
    children = Tracker(uri).search_runs(filter_string="attributes.status = 'FINISHED'")
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    if not children.empty:
        for row in comparison_frame(children, checked).to_dict(orient="records"):
            if (row["run_name"], row["dataset"]) not in seen:  # newest first: a re-run wins over an older one
                seen.add((row["run_name"], row["dataset"]))
                rows.append({**row, "tracking_uri": uri})
    if not rows:
        raise SystemExit(f"no finished run of sweep {checked.name} under {runs}")
    return {"runs": rows, "tracking_uri": uri, "parent_run_id": None, "out_dir": None}


def report(arms: dict[str, Any], k: int, dataset: str, paired: Mapping[str, Any] | None = None) -> None:
    rows = []
    for name, a in arms.items():
        vs = a.get(f"vs_{BASELINE}")
        rows.append([
            name, len(a["runs"]), interval(a["pass@1"], *a["pass@1_ci"]), interval(a["pass@k"], *a["pass@k_ci"]),
            "–" if vs is None else interval(vs["diff"], vs["ci_low"], vs["ci_high"], signed=True),
            a["tool_calls_per_question"], a["distinct_tool_sequences_per_group"], a["max_branches_on_one_path"],
            a["train_reward_last_step"],
        ])
    print_table(f"AEPO vs baselines on {dataset} (Pass@1/Pass@{k}: per-question mean over seeds, 95% bootstrap CI)",
                ["arm", "runs", "Pass@1 [CI]", f"Pass@{k} [CI]", f"Δ Pass@1 vs {BASELINE} [CI]", "tool calls/q",
                 "distinct tool seqs/group", "max branches/path", "train reward (last)"], rows)
    curves = []
    for name, a in arms.items():
        trend = a["entropy_trend"]
        curves.append([name, "–" if trend is None else f"{trend['first']:.3f} → {trend['last']:.3f}",
                       math.nan if trend is None else trend["slope"],
                       *(_first_to_last(a["curves"].get(m, [])) for m in list(CURVE_METRICS)[1:])])
    print_table("Over seeds (mean and Student-t 95% CI over the training runs: what a new run would give)",
                ["arm", "seeds", "Pass@1 per seed", "Pass@1 [CI]", "generated tokens/run [CI]",
                 "clipped update tokens, % [CI]", "entropy slope/step [CI]", "entropy trend"],
                [_seed_row(name, a) for name, a in arms.items()])
    if paired:
        print_table("Paired differences a − b, seed-matched (Δ Pass@1 over seeds: Student t; given these seeds: "
                    "bootstrap over questions)",
                    ["a − b", "seeds", "Δ Pass@1 [CI over seeds]", "p (t)", "p (Holm)", "Δ Pass@1 [CI given seeds]",
                     "seeds a > b", "Δ entropy slope/step [CI]"], [_paired_row(name, p) for name, p in paired.items()])
    by_family = [[name, f, d["seeds"], " ".join(f"{v:+.3f}" for v in d["per_seed"].values()),
                  over_seeds_interval(d, signed=True)]
                 for name, p in (paired or {}).items() for f, d in p["by_family"].items()]
    if by_family:
        print_table("Paired differences by question family, seed-matched (exploratory: no correction)",
                    ["a − b", "family", "seeds", "Δ Pass@1 per seed", "Δ Pass@1 [CI over seeds]"], by_family)
    print_table("Where a run's time went (wall; mean over seeds)", ["arm", *PHASE_COLUMNS],
                [[name, *phase_row(PhaseSeconds(**a["phases_s"]))] for name, a in arms.items()])
    print_table("Over training (mean over seeds, first → last RL step)",
                ["arm", "entropy", "slope/step", "reward", "tool calls/traj", "branches/q",
                 "max branches/path", "top-1 share", "top-3 share", "informative groups", "generated tokens"], curves)


def over_seeds_interval(value: Mapping[str, Any] | None, digits: int = 3, signed: bool = False) -> str:
    """An :class:`OverSeeds` (as a dict) in one table cell, ``mean [low, high]``; "–" for none."""
    return "–" if value is None else interval(value["mean"], value["low"], value["high"], digits, signed)


def _percent(value: Mapping[str, Any] | None) -> str:
    """An :class:`OverSeeds` of fractions (as a dict) in one table cell, in per cent."""
    return over_seeds_interval(None if value is None else
                               {k: None if value[k] is None else 100 * value[k] for k in ("mean", "low", "high")}, 2)


def _seed_row(name: str, arm: Mapping[str, Any]) -> list[Any]:
    pass1, slope = arm["pass@1_over_seeds"], arm["entropy_slope"]
    return [name, pass1["seeds"], " ".join(f"{v:.3f}" for v in pass1["per_seed"].values()), over_seeds_interval(pass1),
            over_seeds_interval(arm["generated_tokens_per_run"], 0), _percent(arm["clip_frac_per_run"]),
            over_seeds_interval(slope, 4, signed=True),
            "–" if slope is None else TREND_WORDS[OverSeeds(**slope).sign]]


def _paired_row(name: str, pair: Mapping[str, Any]) -> list[Any]:
    d, given = pair["pass@1"], pair["pass@1_given_seeds"]
    return [name, d["seeds"], over_seeds_interval(d, signed=True),
            *("–" if pair[p] is None else f"{pair[p]:.3f}" for p in ("p_over_seeds", "p_holm")),
            interval(given["diff"], given["ci_low"], given["ci_high"], signed=True),
            f"{int(given['positive'])}/{d['seeds']}",  # the seeds whose own mean difference is above 0
            over_seeds_interval(pair["entropy_slope"], 4, True)]


def _first_to_last(band: Sequence[Band]) -> str:
    return f"{band[0][1]:.3g} → {band[-1][1]:.3g}" if band else "–"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=Path, default=DEFAULT_SWEEP, help="sweep file (default: %(default)s)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every arm (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the sweep file's)")
    p.add_argument("--cells", nargs="+", default=None, help="only these arms (default: all)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bench-compare")
    p.add_argument("--no-shared-sft", action="store_true", help="every arm runs its own SFT (base config as is)")
    p.add_argument("--refresh-sft", action="store_true", help="redo the shared SFT even if cached")
    p.add_argument("--quick", action="store_true", help="smoke run: aepo, its ppo_clip ablation and grpo, one seed, "
                   "two tiny steps")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--analyse-only", action="store_true",
                   help="analyse the finished runs already in --runs-dir; run nothing")
    p.add_argument("--workers", type=int, default=0,
                   help="N >= 1: the sweep through a local Prefect work pool of N workers (cores/N torch threads "
                   "each); 0: in this process (default)")
    p.add_argument("--child-timeout", type=float, default=None,
                   help="with --workers: cancel and report a child unfinished this many seconds after submission")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli_logging()
    from flows.cli.environment import sigterm_unwinds

    with sigterm_unwinds():  # `kill` stops the pool's processes and Prefect's temporary server too
        return run(args)


def run(args: argparse.Namespace) -> int:
    """Shared SFT, the sweep (in this process or through a ``--workers`` pool), the analysis, the JSON."""
    from flows.cli.environment import prepare_environment

    if args.workers < 0:
        raise SystemExit(f"--workers must be >= 0; got {args.workers}")
    runs = args.runs_dir.resolve()
    prepare_environment(runs)  # before Prefect is imported
    from infra.config_files import load_config
    from infra.run.sweep_spec import load_sweep

    sets = [*(QUICK_SETS if args.quick else []), *args.sets]
    seeds = [0] if args.quick and args.seeds is None else args.seeds
    cells = ["aepo", "aepo-no-clip-balance", BASELINE] if args.quick and args.cells is None else args.cells
    raw = sweep_spec(args.sweep, sets, seeds, cells, None)
    base = load_config(raw["base"], raw["overrides"])
    env = environment(threads=0)
    t0 = time.perf_counter()
    skip_sft = args.no_shared_sft or args.analyse_only
    sft_dir, sft_metrics = (None, {}) if skip_sft else shared_sft_checkpoint(base, runs, args.refresh_sft)
    t_sft = time.perf_counter() - t0
    spec = sweep_spec(args.sweep, sets, seeds, cells, sft_dir)
    spec["name"] = f"{spec['name']}-bench{'-quick' if args.quick else ''}"
    checked = load_sweep(spec)
    log.info("sweep %s: %d runs (%s)", checked.name, len(checked.runs), ", ".join(checked.cells))
    with contextlib.ExitStack() as stack:
        pool = None
        if args.workers:  # pool runs' artifacts are served by the pool's mlflow server: also for --analyse-only
            from bench.pool import local_pool

            pool = stack.enter_context(local_pool(runs, args.workers))
            log.info("pool %s: %d workers, up in %.1f s (Prefect %s, MLflow %s)", pool.pool, pool.workers,
                     pool.startup_s, pool.prefect_api, pool.mlflow_url)
        t1 = time.perf_counter()
        if args.analyse_only:
            result = stored_runs(runs, checked, pool.mlflow_url if pool else None)
            log.info("analysing %d stored runs of %d", len({r["run_name"] for r in result["runs"]}),
                     len(checked.runs))
        else:
            result = run_sweep(spec, runs, pool, args.child_timeout, resume=started(runs, checked))
        t_sweep = time.perf_counter() - t1
        cfg0 = checked.runs[0].config
        k = cfg0.eval.pass_k
        dataset = sorted({r["dataset"] for r in result["runs"]})[0]
        with tempfile.TemporaryDirectory() as tmp:
            arms = analyse(result, dataset, k, cfg0.eval.bootstrap_samples, Path(tmp))
        paired = paired_differences(arms, cfg0.eval.bootstrap_samples)
        out = args.out or RESULTS_DIR / f"compare_algorithms{'-quick' if args.quick else ''}.json"
        figures = curve_figures(arms, out.with_suffix(""), checked.name)
        if figures and result["parent_run_id"]:  # the pool's server is still up: its runs' artifacts go through it
            log_to_parent(result["tracking_uri"], result["parent_run_id"], figures)
    report(arms, k, dataset, paired)
    env["load_avg_end"] = list(os.getloadavg())
    write_result(out, {
        "benchmark": "compare_algorithms",
        "environment": env,
        "sweep_file": str(args.sweep),
        "arm_overrides": {c: o for c, o in checked.cells.items()},
        "common_overrides": spec["overrides"],
        "seeds": checked.seeds,
        "budget": {"rl_steps": cfg0.train.steps, "questions_per_step": cfg0.train.batch_size, "k": cfg0.rollout.k,
                   "max_response_tokens": cfg0.rollout.max_response_tokens, "lr": cfg0.optim.lr,
                   "eval_dataset": dataset, "eval_questions": cfg0.eval.max_questions,
                   "eval_samples": cfg0.eval.n_samples, "eval_temperature": cfg0.eval.temperature},
        "shared_sft": {"dir": str(sft_dir) if sft_dir else None, **sft_metrics},
        "wall_s": {"sft": t_sft, "sweep": None if args.analyse_only else t_sweep,
                   "pool_startup": pool.startup_s if pool else None,
                   "per_run": None if args.analyse_only else t_sweep / len(checked.runs)},
        "workers": args.workers,
        "analyse_only": args.analyse_only,
        "runs_analysed": len({r["run_name"] for r in result["runs"]}),
        "runs_planned": len(checked.runs),
        "sweep": {"parent_run_id": result["parent_run_id"], "tracking_uri": result["tracking_uri"],
                  "out_dir": result["out_dir"]},
        "arms": {name: {k2: v for k2, v in a.items() if k2 not in PER_ARM_TABLES} for name, a in arms.items()},
        "paired": paired,
        **{key: {name: a[key] for name, a in arms.items()} for key in PER_ARM_TABLES},
        "figures": [str(f) for f in figures],
    })
    print(f"\nresults: {out}" + "".join(f"\nfigure: {f}" for f in figures))
    where = (f"parent run {result['parent_run_id']}" if result["parent_run_id"]
             else "re-analysed: the figures stay out of the sweep's parent run")
    print(f"MLflow: {result['tracking_uri']} ({where}); browse with `aepo ui --runs-dir {runs}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
