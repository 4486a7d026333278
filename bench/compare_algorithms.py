"""AEPO vs ARPO vs GRPO, and AEPO's ablations, on the synthetic deep-search task (issue 6, item 5).

1. **One shared start.** Cold-start SFT on oracle transcripts is run once for the sweep's base config and the
   result saved as a plain HF model directory in the model cache (``compare-sft-<hash>``, reused by later runs
   with the same model / SFT / data / tools / protocol settings). Every arm starts from these weights.
2. **The sweep** ``configs/sweeps/algorithms.yaml`` (AEPO, ARPO, GRPO + four AEPO ablations, 3 seeds) runs
   through the real sweep flow (Prefect child flow runs, nested MLflow runs), with the same rollout budget
   (k, questions per step, steps, token caps) and the same learning rate for every arm; only the keys the sweep
   file names differ. ``--set`` adds overrides for every arm (e.g. a smaller CPU budget).
3. **The comparison** is ``aepo compare``'s (:mod:`infra.run.compare`, here called on the sweep's runs): per arm
   Pass@1 / Pass@k over seeds (Student t) and over questions (bootstrap), each arm against GRPO per question, every
   pair seed-matched (t over seeds, Holm over the pairs, given the seeds, by question family, Δ entropy slope), what
   the mechanisms acted on (clipped update tokens, ΔH after tools), training curves against steps and generated
   tokens; the figures go to ``bench/results/<out stem>/`` and, when the sweep ran here, to its parent MLflow run.
4. **What only a bench reports**: where each arm's runs spent their wall time (SFT, evaluation, rollout, scoring
   pass, the rest of the update: :mod:`bench.phases`), the sweep's own wall time, the JSON for ``bench/power.py``.

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
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.harness import RESULTS_DIR, cli_logging, environment, print_table, write_result
from bench.phases import PHASE_COLUMNS, PhaseSeconds, mean_phases, phase_row, phase_seconds
from flows.cli.render import interval
from infra.atomic import atomic_dir
from infra.run.compare import comparison_figures, log_comparison

log = logging.getLogger("bench.compare_algorithms")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SWEEP = REPO / "configs" / "sweeps" / "algorithms.yaml"
BASELINE = "grpo"
# What the shared SFT checkpoint depends on (every other key may differ between arms without invalidating it).
SFT_KEYS = ("model", "data", "tools", "train.sft", "optim.micro_batch_tokens", "seed")
# Per-arm tables that go to the JSON's top level (keyed by arm) rather than into its arm summaries.
PER_ARM_TABLES = ("per_question_pass@1", "per_question_pass@1_by_seed", "question_family", "curves")
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
    if not parts["train.sft"]["varied"]:  # (issue 53) at its default the same transcripts: the caches keep their key
        del parts["train.sft"]["varied"]
    # model.sampler_dtype (issue 52) picks the training rollouts' engine: SFT never samples, so it is left out.
    del parts["model"]["sampler_dtype"]
    # tools.<name>.latency (issue 56) delays a call, never changes its result: the transcripts are the same.
    for tool in ("search", "python"):
        del parts["tools"][tool]["latency"]
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


def report(comparison: Any, phases: Mapping[str, PhaseSeconds]) -> None:
    """``aepo compare``'s tables, then where each arm's runs spent their time (a bench's concern)."""
    from flows.cli.compare import print_comparison
    from flows.cli.render import OutputFormat

    print_comparison(comparison, OutputFormat.table)
    print_table("Where a run's time went (wall; mean over seeds)", ["arm", *PHASE_COLUMNS],
                [[name, *phase_row(p)] for name, p in phases.items()])


def over_seeds_interval(value: Mapping[str, Any] | None, digits: int = 3, signed: bool = False) -> str:
    """An :class:`OverSeeds` (as a dict) in one table cell, ``mean [low, high]``; "–" for none."""
    return "–" if value is None else interval(value["mean"], value["low"], value["high"], digits, signed)


def arm_phases(comparison: Any) -> dict[str, PhaseSeconds]:
    """Per arm, its runs' mean wall seconds by phase (the ``time/*`` metrics)."""
    from infra.tracking.run import Tracker

    tracker = Tracker(comparison.tracking_uri)
    return {a.name: mean_phases([phase_seconds(tracker, rid) for rid in a.run_ids]) for a in comparison.arms}


def analyse(result: Mapping[str, Any], dataset: str, sweep_name: str, workdir: Path) -> Any:
    """The sweep result's runs on ``dataset`` compared (:func:`infra.run.compare.compare_runs`, what ``aepo compare``
    computes), GRPO the baseline."""
    from infra.run.compare import ComparedRun, Selection, compare_runs

    runs = [ComparedRun(str(r["cell"]), int(r["seed"]), str(r["run_id"]), str(r["run_name"]))
            for r in result["runs"] if r["dataset"] == dataset]
    return compare_runs(Selection(runs, result["tracking_uri"], result["parent_run_id"], sweep_name), workdir, dataset,
                        BASELINE)


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
        dataset = sorted({r["dataset"] for r in result["runs"]})[0]
        with tempfile.TemporaryDirectory() as tmp:
            comparison = analyse(result, dataset, checked.name, Path(tmp))
        out = args.out or RESULTS_DIR / f"compare_algorithms{'-quick' if args.quick else ''}.json"
        figures = comparison_figures(comparison, out.with_suffix(""), checked.name)
        if result["parent_run_id"]:  # the pool's server is still up: its runs' artifacts go through it
            log_comparison(comparison, result["parent_run_id"], figures)
        phases = arm_phases(comparison)
    report(comparison, phases)
    document = comparison.as_json()
    for name, p in phases.items():
        document["arms"][name]["phases_s"] = p.as_dict()
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
        **{key: document[key] for key in ("arms", "paired", *PER_ARM_TABLES)},
        "figures": [str(f) for f in figures],
    })
    print(f"\nresults: {out}" + "".join(f"\nfigure: {f}" for f in figures))
    where = (f"parent run {result['parent_run_id']}" if result["parent_run_id"]
             else "re-analysed: the figures stay out of the sweep's parent run")
    print(f"MLflow: {result['tracking_uri']} ({where}); browse with `aepo ui --runs-dir {runs}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
