"""Does the demo learn on every seed? Its RL gain per seed and micro-batch size, and pooled (issue 27 §1).

Runs a config (default ``configs/demo.yaml``: SFT → evaluation → RL → evaluation) once per ``--seeds`` and, with
``--micro-batch-tokens``, once per micro-batch size too, through the sweep flow: one nested MLflow run per (size,
seed) under a parent named ``--name``. Where the config fixes ``train.sft.seed`` (the demo does) every seed starts RL
from the same SFT and the seeds vary RL alone; ``--set train.sft.seed=null`` lets each seed order SFT too. The same
command continues a stopped one (the sweep's ``--resume``, chosen when a sweep of that name is in the runs dir): the
runs that FINISHED with the same config are not run again, the one in progress resumes from its last checkpoint, in
the same parent run. Then, from each run's per-question evaluation files (``eval/sft/…``, ``eval/final/…``):

- per run: Pass@1 after SFT and at the end, the paired difference final − sft [bootstrap 95% CI over questions],
  tool calls per question at both evaluations, tool calls per trajectory at each RL step, the run's wall time;
- per micro-batch size: how many seeds gained (final − sft > 0), and the pooled difference: the mean of the runs'
  mean differences, its CI by a stratified bootstrap (each run's questions redrawn within that run;
  :func:`aepo_core.evaluation.pooled_paired_comparison`). The seeds are the strata, not resampled: the interval
  says how sure the figure is for these seeds, and "positive on every seed" is reported beside it.

A micro-batch size changes only the order of float sums in the update; a conclusion that changes with it is the
trajectory's luck, not the algorithm's. Each run's micro-batch as it ran (``train/micro_batch_tokens``: after
``optim.memory_budget_gb``'s cap, which binds without activation checkpointing) is shown, and a run whose size is not
its cell's is named in a warning.

Run: ``.venv/bin/python -m bench.demo_seeds [-c configs/demo.yaml] [--seeds 0 1 2] [--micro-batch-tokens 1024 2048
4096] [--set optim.lr=2e-5 …] [--analyse-only]``. Prints the tables and writes
``bench/results/demo_seeds.json`` (``--out``); the runs go to ``--runs-dir`` (default ``runs/bench-demo-seeds``).
Budget ~15 min a run on 2 idle AMX cores, so 3 seeds × 3 sizes is ~2 h 15 min: stop it at any time and run the
same command again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aepo_core.config import ExperimentConfig
from bench.harness import RESULTS_DIR, environment, flow_bench_main, print_table, write_result
from bench.phases import PhaseSeconds, phase_seconds
from flows.cli.render import interval

log = logging.getLogger("bench.demo_seeds")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
TOOL_CALLS = "rollout/tool_calls_mean"
MICRO_BATCH = "train/micro_batch_tokens"
STAGES = ("sft", "final")
AXIS = "micro_batch"


def sweep_spec(config: Path, sets: Sequence[str], seeds: Sequence[int], micro_batches: Sequence[int],
               name: str) -> dict[str, Any]:
    """The sweep: the config with ``sets`` (``key=value``, parsed by the sweep) on every run, one cell per micro-batch
    size (``mb<n>``; none given: the config's own, cell ``base``), each at every seed."""
    spec: dict[str, Any] = {"name": name, "base": str(config.resolve()), "overrides": list(sets),
                            "seeds": list(seeds)}
    if micro_batches:
        spec["grid"] = {AXIS: {f"mb{n}": {"optim.micro_batch_tokens": n} for n in micro_batches}}
    return spec


@dataclass(frozen=True)
class RunRecord:
    """One demo run's result: its Pass@1 per question at each evaluation, tool use, wall time."""

    cell: str
    seed: int
    run_name: str
    run_id: str
    pass1: Mapping[str, Mapping[str, float]]
    """stage → question → Pass@1 (correct / samples)."""
    family: Mapping[str, str]
    """question → its family (single_hop, two_hop, …)."""
    tool_calls: Mapping[str, Mapping[str, float]]
    """stage → question → mean tool calls per sampled answer."""
    tool_calls_by_step: Sequence[tuple[int, float]]
    """(RL step, tool calls per trajectory in that step's rollouts)."""
    wall_s: float
    phases: PhaseSeconds
    """Wall seconds by phase over the run."""
    micro_batch_tokens: float
    """The update's micro-batch as it ran: ``optim.micro_batch_tokens`` after the memory budget's cap (NaN for runs
    that predate the metric)."""

    def mean_pass1(self, stage: str) -> float:
        values = self.pass1[stage].values()
        return sum(values) / len(values)

    @property
    def tool_calls_per_question(self) -> dict[str, float]:
        """stage → mean tool calls per sampled answer at that evaluation (a question's mean, averaged)."""
        return {s: statistics.fmean(by_q.values()) for s, by_q in self.tool_calls.items()}

    def of_family(self, family: str) -> RunRecord:
        """The record restricted to one family's questions (evaluations only)."""
        keep = {q for q, f in self.family.items() if f == family}

        def only(by_stage: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
            return {s: {q: v for q, v in by_q.items() if q in keep} for s, by_q in by_stage.items()}

        return dataclasses.replace(self, pass1=only(self.pass1), tool_calls=only(self.tool_calls),
                                   family={q: family for q in keep})


def read_run(tracker: Any, row: Mapping[str, Any], dataset: str, workdir: Path) -> RunRecord:
    """A finished run's record from MLflow: the per-question evaluation files and the tool-call history."""
    from infra.data.loaders import dataset_key
    from infra.tracking.client import download_artifacts

    rid = row["run_id"]
    pass1: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, float]] = {}
    family: dict[str, str] = {}
    for stage in STAGES:
        path = download_artifacts(tracker.tracking_uri, f"runs:/{rid}/eval/{stage}/{dataset_key(dataset)}.json",
                                  workdir / rid / stage)
        questions = json.loads(Path(path).read_text())["questions"]
        pass1[stage] = {q["question_id"]: q["correct"] / q["n"] for q in questions}
        calls[stage] = {q["question_id"]: q["tool_calls_mean"] for q in questions}
        family.update({q["question_id"]: q["family"] for q in questions})
    mlflow_run = tracker.client.get_run(rid)
    info = mlflow_run.info
    wall = (info.end_time - info.start_time) / 1000 if info.end_time else math.nan
    history = tracker.metric_history([TOOL_CALLS, MICRO_BATCH], run_id=rid)
    micro = history[MICRO_BATCH][-1][1] if history[MICRO_BATCH] else math.nan
    return RunRecord(row["cell"], int(row["seed"]), row["run_name"], rid, pass1, family, calls, history[TOOL_CALLS],
                     wall, phase_seconds(tracker, rid), micro)


def capped_runs(records: Sequence[RunRecord], configs: Mapping[str, ExperimentConfig]) -> list[str]:
    """One line per run whose micro-batch was not the size its cell asked for (the memory budget capped it: without
    activation checkpointing a token keeps ~11× the activations), else the cells would not differ as labelled."""
    out = []
    for r in records:
        asked = configs[r.run_name].optim.micro_batch_tokens
        if math.isfinite(r.micro_batch_tokens) and r.micro_batch_tokens != asked:
            out.append(f"{r.run_name}: micro-batches of {r.micro_batch_tokens:.0f} tokens, not the {asked} asked: "
                       f"optim.memory_budget_gb capped them (raise it, or set optim.activation_checkpointing=true)")
    return out


def run_gain(record: RunRecord, n_resamples: int) -> dict[str, float]:
    from aepo_core.evaluation import paired_comparison

    return paired_comparison(record.pass1["final"], record.pass1["sft"], n_resamples=n_resamples)


def cell_summary(records: Sequence[RunRecord], n_resamples: int) -> dict[str, Any]:
    """A micro-batch size over its seeds: seeds that gained, the pooled final − sft, tool calls, wall time."""
    from aepo_core.evaluation import paired_over_seeds, pooled_paired_comparison

    pooled = pooled_paired_comparison([(r.pass1["final"], r.pass1["sft"]) for r in records],
                                      n_resamples=n_resamples)
    over_seeds = paired_over_seeds({r.seed: (r.pass1["final"], r.pass1["sft"]) for r in records})
    return {"seeds": [r.seed for r in records], "pooled_gain": pooled,
            "gain_over_seeds": dataclasses.asdict(over_seeds),
            "positive_seeds": int(pooled["positive"]),
            "sft_pass1": statistics.fmean(r.mean_pass1("sft") for r in records),
            "final_pass1": statistics.fmean(r.mean_pass1("final") for r in records),
            "tool_calls_per_question": {s: statistics.fmean(r.tool_calls_per_question[s] for r in records)
                                        for s in STAGES},
            "wall_s_mean": statistics.fmean(r.wall_s for r in records)}


def family_summaries(records: Sequence[RunRecord], n_resamples: int) -> dict[str, dict[str, Any]]:
    """:func:`cell_summary` of each question family alone: a gain that is one family's gain and the other's loss
    reads as ~0 overall (the demo's RL once took single-hop 0.61 → 0.86 and two-hop 0.45 → 0.10)."""
    families = sorted({f for r in records for f in r.family.values()})
    return {f: cell_summary([r.of_family(f) for r in records], n_resamples) for f in families}


UNCLOSED = "unclosed_"
"""Prefix of the reward reasons of a trajectory that ended inside a tag (``unclosed_answer``, ``unclosed_result``,
…): cut by the token budget, or by the segment cap (``rollout.max_segment_tokens``)."""


def training_leaves(store: Any, run_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The runs' RL training leaves by (question family, tool calls): how many, their mean reward, advantage and
    length (response tokens, tool results included), and the share that ended inside a tag (cut). What the updates were
    shown: in R2/R3, two-hop answers with two searches ran at the budget and a fifth were cut (reward −1)."""
    frame = store.read_trajectories(columns=["run_id", "family", "num_tool_calls", "reward", "advantage",
                                             "response_tokens", "reward_reason"])
    frame = frame[frame["run_id"].isin(list(run_ids))]
    frame = frame.assign(tokens=frame["response_tokens"].map(len),
                         unclosed=frame["reward_reason"].fillna("").str.startswith(UNCLOSED))
    groups = frame.groupby(["family", "num_tool_calls"], sort=True)
    return [{"family": family, "tool_calls": int(calls), "leaves": len(g), "reward": float(g["reward"].mean()),
             "advantage": float(g["advantage"].mean()), "tokens": float(g["tokens"].mean()),
             "unclosed": float(g["unclosed"].mean())} for (family, calls), g in groups]


def _ci(d: Mapping[str, float]) -> str:
    return interval(d["diff"], d["ci_low"], d["ci_high"], signed=True)


def report(records: Sequence[RunRecord], gains: Mapping[str, Mapping[str, float]],
           cells: Mapping[str, Mapping[str, Any]], by_family: Mapping[str, Mapping[str, Mapping[str, Any]]],
           dataset: str) -> None:
    from bench.compare_algorithms import over_seeds_interval

    print_table(f"The demo per run on {dataset} (Pass@1; final − sft paired over questions, 95% bootstrap CI)",
                ["cell", "seed", "sft", "final", "final − sft [CI]", "tool calls/q sft → final",
                 "tool calls/traj by RL step", "wall min", "sft / eval / rollout / update min"],
                [[r.cell, r.seed, f"{r.mean_pass1('sft'):.3f}", f"{r.mean_pass1('final'):.3f}",
                  _ci(gains[r.run_name]),
                  f"{r.tool_calls_per_question['sft']:.2f} → {r.tool_calls_per_question['final']:.2f}",
                  " ".join(f"{v:.2f}" for _, v in r.tool_calls_by_step), f"{r.wall_s / 60:.1f}",
                  " / ".join(f"{v / 60:.1f}" for v in (r.phases.sft, r.phases.eval, r.phases.rollout, r.phases.update))]
                 for r in records])
    print_table("Pooled over seeds (mean of the runs' final − sft; CI: questions redrawn within each run, about these "
                "seeds; and Student t over the seeds, about a new one)",
                ["cell", "seeds", "gained", "sft", "final", "final − sft [CI]", "[CI over seeds]",
                 "tool calls/q sft → final", "wall min (mean)"],
                [[cell, len(c["seeds"]), f"{c['positive_seeds']}/{len(c['seeds'])}", f"{c['sft_pass1']:.3f}",
                  f"{c['final_pass1']:.3f}", _ci(c["pooled_gain"]),
                  over_seeds_interval(c["gain_over_seeds"], signed=True),
                  f"{c['tool_calls_per_question']['sft']:.2f} → {c['tool_calls_per_question']['final']:.2f}",
                  f"{c['wall_s_mean'] / 60:.1f}"] for cell, c in cells.items()])
    print_table("Pooled over seeds, by question family (each family's questions alone; same CI)",
                ["cell", "family", "questions/run", "gained", "sft", "final", "final − sft [CI]",
                 "tool calls/q sft → final"],
                [[cell, family, f"{c['pooled_gain']['questions'] / c['pooled_gain']['runs']:.0f}",
                  f"{c['positive_seeds']}/{len(c['seeds'])}", f"{c['sft_pass1']:.3f}", f"{c['final_pass1']:.3f}",
                  _ci(c["pooled_gain"]),
                  f"{c['tool_calls_per_question']['sft']:.2f} → {c['tool_calls_per_question']['final']:.2f}"]
                 for cell, families in by_family.items() for family, c in families.items()])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG, help="experiment config (%(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--micro-batch-tokens", type=int, nargs="*", default=[],
                   help="one cell per size (optim.micro_batch_tokens); none: the config's own")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run (repeatable)")
    p.add_argument("--name", default=None, help="the sweep's name (default: <config stem>-seeds)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bench-demo-seeds")
    p.add_argument("--analyse-only", action="store_true", help="analyse the finished runs; run nothing")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "demo_seeds.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return flow_bench_main("bench.demo_seeds", args.runs_dir, lambda runs: run(args, runs))


def check_measurable(spec: Any) -> None:
    """Every run must evaluate after SFT and at the end: the gain is final − sft on the same questions."""
    from aepo_core.config_keys import ConfigError

    for run in spec.runs:
        if not (run.config.train.sft.enabled and run.config.eval.at_start):
            raise ConfigError(f"run {run.run_name}: the gain final − sft needs train.sft.enabled=true and "
                              f"eval.at_start=true (the evaluation after SFT); got {run.config.train.sft.enabled} "
                              f"and {run.config.eval.at_start}")


def run(args: argparse.Namespace, runs: Path) -> int:
    from bench.compare_algorithms import started, stored_runs
    from infra.run.sweep_spec import load_sweep
    from infra.store import TrajectoryStore
    from infra.tracking.run import Tracker

    name = args.name or f"{args.config.stem}-seeds"
    spec = sweep_spec(args.config, args.sets, args.seeds, args.micro_batch_tokens, name)
    checked = load_sweep(spec)
    check_measurable(checked)
    env = environment(threads=0)
    t0 = time.perf_counter()
    if args.analyse_only:
        rows = stored_runs(runs, checked, None)["runs"]
    else:
        from flows.sweep import sweep

        result = sweep(sweep_config=spec, runs_dir=str(runs), resume=started(runs, checked))
        rows = [{**r, "tracking_uri": result.tracking_uri} for r in result.runs]
    wall = time.perf_counter() - t0
    dataset = sorted({r["dataset"] for r in rows})[0]
    cfg0 = checked.runs[0].config
    n_resamples = cfg0.eval.bootstrap_samples
    tracker = Tracker(rows[0]["tracking_uri"])
    with tempfile.TemporaryDirectory() as tmp:
        records = [read_run(tracker, r, dataset, Path(tmp)) for r in rows if r["dataset"] == dataset]
    gains = {r.run_name: run_gain(r, n_resamples) for r in records}
    cells = {cell: cell_summary([r for r in records if r.cell == cell], n_resamples)
             for cell in dict.fromkeys(r.cell for r in records)}
    by_family = {cell: family_summaries([r for r in records if r.cell == cell], n_resamples) for cell in cells}
    store = TrajectoryStore.from_config(cfg0.storage) if cfg0.storage.trajectories_uri else TrajectoryStore(runs)
    leaves = {cell: training_leaves(store, [r.run_id for r in records if r.cell == cell]) for cell in cells}
    report(records, gains, cells, by_family, dataset)
    capped = capped_runs(records, {run.run_name: run.config for run in checked.runs})
    for line in capped:
        print(f"WARNING {line}")
    print_table(f"Training leaves by family and tool calls (budget {cfg0.rollout.max_response_tokens} tokens; "
                "unclosed: ended inside a tag, cut)", ["cell", "family", "tool calls", "leaves", "reward", "advantage",
                                                       "tokens", "unclosed"],
                [[cell, g["family"], g["tool_calls"], g["leaves"], f"{g['reward']:+.2f}", f"{g['advantage']:+.2f}",
                  f"{g['tokens']:.0f}", f"{g['unclosed']:.0%}"] for cell, groups in leaves.items()
                 for g in groups])
    env["load_avg_end"] = list(os.getloadavg())
    write_result(args.out, {
        "benchmark": "demo_seeds",
        "environment": env,
        "config": str(args.config),
        "overrides": spec["overrides"],
        "cells": checked.cells,
        "seeds": checked.seeds,
        "dataset": dataset,
        "regime": {"rl_steps": cfg0.train.steps, "questions_per_step": cfg0.train.batch_size, "k": cfg0.rollout.k,
                   "mini_batch_size": cfg0.optim.mini_batch_size, "lr": cfg0.optim.lr,
                   "sft_examples": cfg0.train.sft.max_examples, "sft_epochs": cfg0.train.sft.epochs,
                   "sft_seed": cfg0.train.sft.seed,
                   "eval_questions": cfg0.eval.max_questions, "eval_samples": cfg0.eval.n_samples},
        "analyse_only": args.analyse_only,
        "wall_s": None if args.analyse_only else wall,
        "runs": [{"cell": r.cell, "seed": r.seed, "run_name": r.run_name, "run_id": r.run_id,
                  "pass1": {s: r.mean_pass1(s) for s in STAGES}, "gain": gains[r.run_name],
                  "tool_calls_per_question": dict(r.tool_calls_per_question),
                  "tool_calls_by_step": [list(p) for p in r.tool_calls_by_step], "wall_s": r.wall_s,
                  "phases_s": r.phases.as_dict(),
                  "micro_batch_tokens": None if math.isnan(r.micro_batch_tokens) else r.micro_batch_tokens}
                 for r in records],
        "capped": capped,
        "pooled": cells,
        "pooled_by_family": by_family,
        "training_leaves": leaves,
    })
    print(f"\nresults: {args.out}\nMLflow: {tracker.tracking_uri}; browse with `aepo ui --runs-dir {runs}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
