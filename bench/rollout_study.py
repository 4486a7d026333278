"""AEPO's rollout-level claims at a fixed policy (issue 16, item 1): aepo vs arpo vs independent sampling.

The policy is the shared cold-start SFT start of ``bench/compare_algorithms.py`` (the demo config's SFT, cached as
``compare-sft-<hash>`` in the model cache; made here when missing). The study itself is the Prefect flow
``flows/study.py:rollout_study`` (also the ``rollout-study`` deployment): every (k, mode) arm samples the same
questions (synthetic train, validation, test splits in order: 280 with the demo's world) with paired seeds, on the
managed vLLM server by default (``--engine hf``: the in-process engine), and every group is profiled: branch
concentration, exploration, informative groups, budget split, cost; bootstrap 95% CIs over questions and paired
differences between modes.

Run: ``.venv/bin/python -m bench.rollout_study [--questions 200] [--ks 8 12] [--modes aepo arpo independent]``;
``--analyse-only --study-dir <runs>/studies/<name>`` re-summarizes a finished (or stopped) study from its
``profiles.parquet``. Prints the tables, writes ``bench/results/rollout_study.json`` and the figures under
``bench/results/rollout_study/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR, cli_logging, environment, print_table, write_result
from flows.cli.render import interval

log = logging.getLogger("bench.rollout_study")

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "rollout_study.yaml"  # frozen: the cached SFT start and the resumed arms depend on it
# vLLM-CPU: eager (a ~30 s start; torch.compile takes minutes on 2 cores), 3 GiB of KV for 256-384 concurrent
# trajectories of ≤ 320 response tokens (SmolLM2-135M: 23 KB of bf16 KV per token).
VLLM_SETS = ["rollout.engine=vllm", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gb=3"]
ROWS: tuple[tuple[str, str], ...] = (
    ("branch points/q", "branch_points"), ("top-1 share", "top1_share"), ("top-3 share", "top3_share"),
    ("max on a path", "max_branches_on_path"), ("l ≥ 1 share", "consecutive_branch_share"),
    ("distinct tool seqs", "distinct_tool_sequences"), ("distinct answers", "distinct_answers"),
    ("Pass@k", "pass_at_k"), ("leaf accuracy", "accuracy"), ("informative", "informative"),
    ("m", "global_budget"), ("model tokens/q", "model_tokens"),
    ("high-H step after high-H", "consecutive_high_entropy_share"),
    ("  chance: any step after high-H", "consecutive_high_entropy_chance"),
    ("branch samples, top-1 root", "branch_samples_top1_root"), ("top-2 roots", "branch_samples_top2_root"),
    ("top-3 roots", "branch_samples_top3_root"), ("penalized decisions/q", "penalized"),
)


def _ci(e: dict[str, Any] | None, signed: bool = False) -> str:
    return "–" if e is None else interval(e["mean"], e["low"], e["high"], signed=signed)


def report(summary: dict[str, Any]) -> None:
    arms = summary["arms"]
    labels = list(arms)
    print_table(f"Rollout study: {summary['questions']} questions, policy {Path(summary['policy']).name} "
                "(mean over questions [95% bootstrap CI])", ["quantity", *labels],
                [[name, *(_ci(arms[a]["estimates"][q]) for a in labels)] for name, q in ROWS]
                + [["r(m, H_root − H̄_tool)", *(_ci(arms[a]["budget_correlation"]) for a in labels)],
                   ["wall s", *(f"{arms[a]['cost']['wall_s']:.0f}" if arms[a]["cost"] else "–" for a in labels)],
                   ["tokens generated", *(f"{arms[a]['cost']['tokens_generated']:.0f}" if arms[a]["cost"] else "–"
                                          for a in labels)]])
    pairs = list(summary["paired"])
    print_table("Paired differences on the same questions (a − b [95% CI]; an interval excluding 0 is a difference)",
                ["quantity", *pairs],
                [[name, *(_ci(summary["paired"][p][q], signed=True) for p in pairs)] for name, q in ROWS])
    hist = [[a, ", ".join(f"l={k}: {n}" for k, n in arms[a]["consecutive_histogram"].items()) or "–"] for a in labels]
    print_table("Branches created by consecutive-branch count l", ["arm", "branches"], hist)
    rates = [[a, *(_ci(arms[a].get("branch_rate_by_l", {}).get(str(l_count))) for l_count in range(3))] for a in labels]
    print_table("P(branch | l, budget open), pooled over questions [95% CI]", ["arm", "l = 0", "l = 1", "l = 2"], rates)


def policy_dir(runs: Path) -> Path:
    """The shared SFT start (cached in the model cache; trained once when missing)."""
    from bench.compare_algorithms import shared_sft_checkpoint
    from infra.config_files import load_config

    path, _ = shared_sft_checkpoint(load_config(BASE), runs)
    return path


def analyse(study_dir: Path, n_resamples: int) -> dict[str, Any]:
    """Re-summarize a study from its profiles.parquet and costs.json; settings from its summary.json when present."""
    from infra.run.study import Arm, read_costs, read_profiles, summarize_study, write_study_figures, write_summary

    profiles = read_profiles(study_dir / "profiles.parquet")
    # A stopped study (chunk by chunk, every arm in turn) holds one chunk more in some arms: every arm is
    # summarized on the questions all of them have, so the arms' means are over the same questions.
    common = min(len(ps) for ps in profiles.values())
    if any(len(ps) > common for ps in profiles.values()):
        log.warning("a stopped study: every arm summarized on its first %d questions (%s)", common,
                    ", ".join(f"{a.label} {len(ps)}" for a, ps in profiles.items()))
    profiles = {arm: ps[:common] for arm, ps in profiles.items()}
    old = json.loads((study_dir / "summary.json").read_text()) if (study_dir / "summary.json").is_file() else {}
    costs = read_costs(study_dir / "costs.json")
    meta = {k: v for k, v in old.items() if k not in ("arms", "paired")}
    meta["questions"] = len(next(iter(profiles.values())))
    meta.setdefault("policy", "unknown (the study has no summary.json)")
    summary = summarize_study(profiles, n_resamples)
    data = write_summary(study_dir / "summary.json", summary, costs, meta)
    write_study_figures(summary, profiles, study_dir, f"rollout study, {meta['questions']} questions")
    missing = [a.label for a in (Arm(k, m) for k in {a.k for a in profiles} for m in ("aepo", "arpo", "independent"))
               if a not in profiles]
    if missing:
        log.warning("arms not in the study (stopped early?): %s", ", ".join(missing))
    return data


def log_to_study_run(runs: Path, study_dir: Path) -> dict[str, str] | None:
    """The re-analysed folder (summary, figures, costs) as artifacts ``study/`` of the study's own MLflow run in the
    runs dir's store (the run named like the folder), when there is one; a study stopped before its end logged none."""
    from infra.run.reading import reading_tracker

    tracker = reading_tracker(runs, None, "aepo")
    found = tracker.search_runs(filter_string=f"attributes.run_name = '{study_dir.name}'")
    if found.empty:
        log.warning("no MLflow run named %s in %s: the figures stay files", study_dir.name, tracker.tracking_uri)
        return None
    run_id = str(found.iloc[0]["run_id"])
    tracker.client.log_artifacts(run_id, str(study_dir), "study")
    log.info("logged %s to MLflow run %s", study_dir, run_id)
    return {"run_id": run_id, "tracking_uri": tracker.tracking_uri}


STUDY_FILES = ("study.json", "profiles.parquet", "costs.json")


def seed_study(source: Path, target: Path) -> None:
    """Copy a kept study's files into its folder under the runs dir, unless that folder already has a study."""
    if (target / "study.json").is_file():
        log.info("%s already holds a study: resuming it, not %s", target, source)
        return
    target.mkdir(parents=True, exist_ok=True)
    for name in STUDY_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    log.info("resuming the study kept in %s", source)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 12])
    p.add_argument("--modes", nargs="+", default=["aepo", "arpo", "independent"])
    p.add_argument("--chunk", type=int, default=32, help="questions per rollout call (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bench-study")
    p.add_argument("--run-name", default=None)
    p.add_argument("--resume-from", type=Path, default=None,
                   help="a study folder kept elsewhere (study.json, profiles.parquet, costs.json, e.g. committed under "
                        "bench/results/): copied into <runs>/studies/<--run-name> when that has none, then resumed")
    p.add_argument("--analyse-only", action="store_true", help="re-analyse --study-dir; sample nothing")
    p.add_argument("--study-dir", type=Path, default=None, help="with --analyse-only: <runs>/studies/<name>")
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "rollout_study.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli_logging()
    from flows.cli.environment import prepare_environment, sigterm_unwinds

    runs = args.runs_dir.resolve()
    prepare_environment(runs)
    env = environment(threads=0)
    t0 = time.perf_counter()
    with sigterm_unwinds():  # `kill` stops the vLLM server and Prefect's temporary server too
        if args.analyse_only:
            if args.study_dir is None:
                raise SystemExit("--analyse-only needs --study-dir <runs>/studies/<name>")
            study_dir = args.study_dir.resolve()
            data = analyse(study_dir, args.bootstrap)
            data = {**data, "mlflow": log_to_study_run(runs, study_dir)}
        else:
            from flows.study import STUDIES_DIR, rollout_study

            if args.resume_from is not None:
                if args.run_name is None:
                    raise SystemExit("--resume-from needs --run-name (the study's name)")
                seed_study(args.resume_from, runs / STUDIES_DIR / args.run_name)
            sets = [f"model.name={policy_dir(runs)}", "train.sft.enabled=false",
                    f"eval.bootstrap_samples={args.bootstrap}", *(VLLM_SETS if args.engine == "vllm" else []),
                    *args.sets]
            result = rollout_study(config=str(BASE), overrides=sets, runs_dir=str(runs), modes=args.modes,
                                   ks=args.ks, max_questions=args.questions, chunk_questions=args.chunk,
                                   seed=args.seed, run_name=args.run_name)
            study_dir, data = Path(result.out_dir), result.summary
            data = {**data, "mlflow": {"run_id": result.run_id, "tracking_uri": result.tracking_uri}}
    report(data)
    figures = RESULTS_DIR / args.out.stem
    figures.mkdir(parents=True, exist_ok=True)
    for png in study_dir.glob("*.png"):
        shutil.copyfile(png, figures / png.name)
    env["load_avg_end"] = list(os.getloadavg())
    write_result(args.out, {"benchmark": "rollout_study", "environment": env, "study_dir": str(study_dir),
                                 "wall_s": time.perf_counter() - t0, "analyse_only": args.analyse_only, **data})
    print(f"\nresults: {args.out}, figures: {figures}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
