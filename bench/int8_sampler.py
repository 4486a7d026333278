"""Does sampling the training rollouts from the int8 copy change what the demo learns? (issue 52, item 1)

The demo (``configs/demo.yaml``: SFT → evaluation → 3 AEPO steps → evaluation) run per seed twice, seed-matched:
``model.sampler_dtype=int8`` (what ``auto`` chooses on a CPU whose int8 path is fast) and ``generation`` (the
bf16 copy or the training weights, as before). Both arms share the SFT start (``train.sft.seed``) and evaluate with
the policy's own engine, so their post-SFT evaluations are the same samples and their final evaluations differ only
by what RL learned from the two samplers. Run the arms with ``bench.demo_seeds`` (one sweep name per arm and seed, so
an interrupted study resumes where it stopped and its finished pairs are usable)::

    for s in 0 1 2; do for arm in int8 generation; do
      .venv/bin/python -m bench.demo_seeds --seeds $s --name s6-$arm-s$s --set model.sampler_dtype=$arm \\
          --runs-dir RUNS --out /tmp/demo_$arm-s$s.json
    done; done
    .venv/bin/python -m bench.int8_sampler --runs-dir RUNS --prefix s6 --seeds 0 1 2

This script reads the runs back from the runs dir's MLflow store and reports, per seed and pooled:

- Pass@1 after SFT (the same in both arms: a check) and at the end, each arm's gain final − SFT, and the paired
  difference int8 − generation of the final Pass@1 (per question, then over seeds: the mean of the seeds' mean
  differences with the Student-t interval over seeds, :func:`aepo_core.evaluation.paired_over_seeds`, and the
  stratified bootstrap over questions within seeds, :func:`aepo_core.evaluation.pooled_paired_comparison`);
- the sampler–trainer gap the updates logged (``train/rollout_trainer_logprob_gap``, its p99 and max), the TIS
  weights (``train/rollout_is_weight_mean``, ``train/rollout_is_truncated_frac``), the entropy, tool calls;
- each run's wall time and its phases (rollout, update, evaluation, SFT).

``--engine-ab CHECKPOINT`` instead times the rollout engines alone on a trained demo policy (a checkpoint directory
of a demo run, ``checkpoints/<run>/<run id>/step-000003``): 12 training questions, AEPO rollouts, the same seed per
repetition, the arms interleaved (A B C, C B A): ``int8`` (the int8 copy over the generation dtype), ``generation``
(the bf16 copy where ``auto`` picks bf16), ``int8:same`` (the int8 copy over float32), generated tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aepo_core.evaluation import paired_over_seeds, pooled_paired_comparison
from bench.harness import REPO, RESULTS_DIR, environment, print_table, write_result
from bench.phases import phase_seconds

ARMS = ("int8", "generation")
DATASET = "synthetic_test"
STEP_METRICS = ("train/rollout_trainer_logprob_gap", "train/rollout_trainer_logprob_gap_p99",
                "train/rollout_trainer_logprob_gap_max", "train/rollout_is_weight_mean",
                "train/rollout_is_truncated_frac", "train/entropy_mean", "rollout/tool_calls_mean")


def run_name(prefix: str, arm: str, seed: int) -> str:
    """The demo run of ``arm`` and ``seed``: ``bench.demo_seeds --name <prefix>-<arm>-s<seed>`` names its one cell
    ``<name>-base-s<seed>``."""
    return f"{prefix}-{arm}-s{seed}-base-s{seed}"


def read_run(tracking_uri: str, name: str, workdir: Path) -> dict[str, Any] | None:
    """One finished run: its per-question Pass@1 after SFT and at the end, its per-step metrics' means, wall time
    and phases; None when no FINISHED run has that name."""
    from infra.run.sequential import final_questions
    from infra.tracking.run import Tracker

    tracker = Tracker(tracking_uri)
    client = tracker.client
    runs = [r for e in client.search_experiments() for r in client.search_runs(
        [e.experiment_id], filter_string=f"tags.mlflow.runName = '{name}' and attributes.status = 'FINISHED'")]
    if not runs:
        return None
    run = runs[0]
    pass1 = {stage: {q.question_id: q.correct / q.n
                     for q in final_questions(tracking_uri, run.info.run_id, DATASET, workdir, stage)}
             for stage in ("sft", "final")}
    steps = {m: [h.value for h in client.get_metric_history(run.info.run_id, m)] for m in STEP_METRICS}
    return {"run_id": run.info.run_id, "pass1": pass1,
            "steps": {m: (statistics.fmean(v) if v else None) for m, v in steps.items()},
            "per_step": steps, "wall_s": (run.info.end_time - run.info.start_time) / 1000.0,
            "phases_s": phase_seconds(tracker, run.info.run_id).as_dict(),
            "sampler": run.data.params.get("numerics.sampler_dtype"),
            "correction": run.data.params.get("numerics.rollout_correction")}


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def analyse(runs: dict[str, dict[int, dict[str, Any]]], seeds: Sequence[int]) -> dict[str, Any]:
    """The per-seed rows and the pooled comparison of the seeds both arms finished."""
    paired = [s for s in seeds if all(s in runs[a] for a in ARMS)]
    out: dict[str, Any] = {"paired_seeds": paired}
    if not paired:
        return out
    final = {s: (runs["int8"][s]["pass1"]["final"], runs["generation"][s]["pass1"]["final"]) for s in paired}
    over = paired_over_seeds(final)
    out["final_int8_minus_generation"] = {
        "over_seeds": {"mean": over.mean, "low": over.low, "high": over.high, "per_seed": over.per_seed},
        "pooled_questions": pooled_paired_comparison(list(final.values()))}
    for arm in ARMS:
        gains = {s: (runs[arm][s]["pass1"]["final"], runs[arm][s]["pass1"]["sft"]) for s in paired}
        g = paired_over_seeds(gains)
        out[f"gain_{arm}"] = {"over_seeds": {"mean": g.mean, "low": g.low, "high": g.high, "per_seed": g.per_seed},
                              "pooled_questions": pooled_paired_comparison(list(gains.values()))}
        out[f"steps_{arm}"] = {m: mean([runs[arm][s]["steps"][m] for s in paired
                                        if runs[arm][s]["steps"][m] is not None]) for m in STEP_METRICS}
        out[f"wall_s_{arm}"] = mean([runs[arm][s]["wall_s"] for s in paired])
        phases = [runs[arm][s]["phases_s"] for s in paired if runs[arm][s]["phases_s"]]
        out[f"phases_s_{arm}"] = {k: mean([p[k] for p in phases]) for k in phases[0]} if phases else None
    out["sft_equal"] = all(runs["int8"][s]["pass1"]["sft"] == runs["generation"][s]["pass1"]["sft"] for s in paired)
    return out


def engine_ab(checkpoint: Path, arms: Sequence[str], reps: int = 2) -> dict[str, list[dict[str, float]]]:
    """Each arm's rollouts of the same 12 questions from ``checkpoint``'s weights, interleaved (see the docstring):
    per repetition its generate seconds and generated tokens."""
    from infra.config_files import load_config
    from infra.run.runtime import build_runtime

    runtimes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            sampler, _, generation = arm.partition(":")
            sets = [f"model.sampler_dtype={sampler}", *([f"model.generation_dtype={generation}"] if generation else [])]
            runtime = build_runtime(load_config(REPO / "configs" / "demo.yaml", sets), Path(tmp) / arm)
            runtime.load_checkpoint_weights(checkpoint)
            runtimes[arm] = runtime
        rows = runtimes[arms[0]].load_rows("synthetic:train")[:12]
        out: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for rep in range(reps):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                runtime = runtimes[arm]
                stats = runtime.sample(rows, runtime.cfg.rollout, seed=100 + rep).stats
                out[arm].append({"generate_s": stats["generate_s"], "tokens": stats["tokens_generated"],
                                 "tokens_per_s": stats["tokens_generated"] / stats["generate_s"]})
                print(f"{arm} rep {rep}: {stats['tokens_generated']:.0f} tokens in {stats['generate_s']:.1f} s "
                      f"({out[arm][-1]['tokens_per_s']:.1f}/s)", flush=True)
        for runtime in runtimes.values():
            runtime.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.int8_sampler", description=__doc__.split("\n")[0])
    p.add_argument("--runs-dir", type=Path, required=True, help="the runs dir of the bench.demo_seeds runs")
    p.add_argument("--prefix", default="s6", help="the sweep names' prefix (<prefix>-<arm>-s<seed>)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "int8_sampler_demo.json")
    p.add_argument("--engine-ab", type=Path, default=None, metavar="CHECKPOINT",
                   help="time the rollout engines on this checkpoint's policy instead (see the docstring)")
    p.add_argument("--arms", nargs="+", default=["int8", "generation", "int8:same"])
    args = p.parse_args(argv)
    if args.engine_ab is not None:
        ab = engine_ab(args.engine_ab, args.arms)
        print_table("rollout engines on a trained demo policy", ["arm", "tokens/s per repetition", "mean"],
                    [[arm, " ".join(f"{r['tokens_per_s']:.1f}" for r in reps),
                      f"{mean([r['tokens_per_s'] for r in reps]):.1f}"] for arm, reps in ab.items()])
        write_result(args.out, {"benchmark": "int8_sampler_engines", "environment": environment(0),
                                "checkpoint": str(args.engine_ab), "arms": ab})
        return 0
    uri = f"sqlite:///{(args.runs_dir / 'mlflow.db').resolve()}"
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ARMS:
            for seed in args.seeds:
                found = read_run(uri, run_name(args.prefix, arm, seed), Path(tmp))
                if found is not None:
                    runs[arm][seed] = found
    result = analyse(runs, args.seeds)
    rows = []
    for seed in args.seeds:
        cells = [runs[a].get(seed) for a in ARMS]
        if not all(cells):
            rows.append([seed, "(not finished)", "", "", "", "", ""])
            continue
        i8, gen = cells
        assert i8 is not None and gen is not None
        rows.append([seed, f"{mean(list(i8['pass1']['sft'].values())):.3f}",
                     f"{mean(list(i8['pass1']['final'].values())):.3f}",
                     f"{mean(list(gen['pass1']['final'].values())):.3f}",
                     f"{i8['steps']['train/rollout_trainer_logprob_gap'] or 0:.4f} / "
                     f"{gen['steps']['train/rollout_trainer_logprob_gap'] or 0:.4f}",
                     f"{i8['steps']['train/rollout_is_truncated_frac'] or 0:.3f}",
                     f"{i8['wall_s']:.0f} / {gen['wall_s']:.0f}"])
    print_table("the demo, int8 sampler vs the generation engine, seed-matched",
                ["seed", "SFT Pass@1", "final int8", "final generation", "gap int8 / gen (nats)",
                 "TIS truncated (int8)", "wall s int8 / gen"], rows)
    if result.get("paired_seeds"):
        d = result["final_int8_minus_generation"]
        print(f"final int8 − generation over {len(result['paired_seeds'])} seeds: {d['over_seeds']['mean']:+.3f} "
              f"[{d['over_seeds']['low']}, {d['over_seeds']['high']}] (t over seeds); pooled questions "
              f"{d['pooled_questions']['diff']:+.3f} [{d['pooled_questions']['ci_low']:+.3f}, "
              f"{d['pooled_questions']['ci_high']:+.3f}]; SFT evaluations equal: {result['sft_equal']}")
    write_result(args.out, {"benchmark": "int8_sampler", "environment": environment(0), "seeds": args.seeds,
                            "runs_dir": str(args.runs_dir), "runs": runs, **result})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
