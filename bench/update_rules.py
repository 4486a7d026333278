"""Update rules side by side on the same rollouts (issue 29 §2–3): what AEPO's update does that PPO's, DAPO's,
GPPO's and CISPO's do not, measured on one SmolLM2 run's stored steps.

Trains ``--config`` (default the demo's: SFT, then RL) with a checkpoint after every step, unless a finished run of
``--name`` is in the runs dir already; then, for each of ``--steps``, every rule of ``--losses`` updates from the
checkpoint before that step on that step's stored samples (``aepo replay --losses``, the flow
``aepo-replay-rules``). Per token class — tool-call tokens, high-entropy tokens (the run's top
``algorithm.high_entropy_quantile`` by start entropy), the rest — the share of token updates whose gradient the rule
zeroed, the class's share of the gradient weight |∂L/∂logπ_t|, the sampled tokens' log-prob change, the KL to the
start policy and the entropy after the update: 95 % CIs over questions (redrawn within their step, each with all its
samples: a question's leaves share prefixes and one advantage normalisation) and each rule's paired difference from
the first (:mod:`aepo_core.update_comparison`).

The paper's update-phase claim this tests: under PPO/DAPO clipping the gradients of high-entropy tokens are dropped,
under AEPO's stop-gradient clip they are kept (rescaled). Report it whichever way it falls.

Run: ``.venv/bin/python -m bench.update_rules [--steps 2 3 4] [--losses aepo ppo_clip dapo gppo cispo]
[--set optim.mini_batch_size=1 …]``; writes ``bench/results/update_rules.json`` and ``.png`` (``--out``); the run
goes to ``--runs-dir`` (default ``runs/bench-update-rules``). Budget on 2 AMX cores: the demo run with 4 RL steps
~15 min, then ~2 min per rule and step.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR, environment, flow_bench_main, print_table, write_result

log = logging.getLogger("bench.update_rules")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
DEFAULT_RULES = ("aepo", "ppo_clip", "dapo", "gppo", "cispo")
PANELS = {"zeroed_share": "token updates with the gradient zeroed", "gradient_weight_share": "share of |∂L/∂logπ|",
          "logprob_change": "Δ log π of the sampled tokens", "kl_to_start": "KL(π_start ‖ π_after) per token",
          "entropy_after": "entropy after the update", "entropy_change": "entropy change"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--name", default="update-rules", help="The training run's name (reused when finished).")
    p.add_argument("--train-steps", type=int, default=4, help="RL steps of the training run.")
    p.add_argument("--steps", type=int, nargs="+", default=[2, 3, 4], help="Replayed steps (≥ 2: step 1 has no "
                   "checkpoint before it).")
    p.add_argument("--losses", nargs="+", default=list(DEFAULT_RULES), help="<loss>[@key=value,…]; the first is "
                   "the reference of the paired differences.")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="Applied to every compared rule (not to the training run).")
    p.add_argument("--train-set", dest="train_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="Applied to the training run.")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bench-update-rules")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "update_rules.json")
    return p.parse_args(argv)


def training_overrides(args: argparse.Namespace) -> list[str]:
    """The run that makes every replayed step possible: a checkpoint after each of its steps, all kept."""
    return [f"name={args.name}", f"train.steps={args.train_steps}", "checkpoint.every=1",
            f"checkpoint.keep={args.train_steps + 1}", "tracking.log_model=false", *args.train_sets]


def ensure_run(args: argparse.Namespace, runs: Path) -> str:
    """The id of the finished run ``--name`` (trained now when there is none)."""
    from infra.config_files import load_config
    from infra.run.reading import reading_tracker

    finished = [r for r in reading_tracker(runs, None, "aepo").runs_named(args.name) if r.status == "FINISHED"]
    if finished:
        log.info("using the finished run %s (%s)", args.name, finished[0].run_id)
        return finished[0].run_id
    from flows.train import train

    cfg = load_config(args.config, training_overrides(args))
    log.info("training %s: %s with %s", args.name, args.config, " ".join(training_overrides(args)))
    return train(config=cfg, runs_dir=str(runs)).run_id


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from infra.run.checkpoints import CheckpointError
    from infra.run.replay import ReplayError

    return flow_bench_main("bench.update_rules", args.runs_dir, lambda runs: run(args, runs),
                           (ReplayError, CheckpointError))


def run(args: argparse.Namespace, runs: Path) -> int:
    from flows.replay import replay_rules
    from infra.config_files import load_config
    from infra.run.replay import rule_configs

    rule_configs(load_config(args.config, training_overrides(args)), args.losses, args.sets)  # a bad rule: now
    env = environment(threads=0)
    t0 = time.perf_counter()
    run_id = ensure_run(args, runs)
    t_train = time.perf_counter() - t0
    compared = replay_rules(run=run_id, steps=list(args.steps), rules=list(args.losses), overrides=list(args.sets),
                            runs_dir=str(runs), n_resamples=args.resamples)
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {
        "benchmark": "update_rules", "environment": env, "config": str(args.config),
        "training_overrides": training_overrides(args), "run_name": compared.run_name, "run_id": compared.run_id,
        "steps": compared.steps, "samples": compared.samples, "questions": compared.questions, "rules": compared.rules,
        "reference": compared.reference, "overrides": compared.overrides, "numerics": compared.numerics,
        "train_wall_s": t_train, "wall_s": wall,
        "rows": [asdict(r) for r in compared.rows], "update_metrics": compared.update_metrics,
    }
    write_result(args.out, result)
    figure = write_figure(compared, args.out.with_suffix(".png"))
    print_rows(compared)
    print(f"wrote {args.out} and {figure}")
    return 0


def write_figure(compared: Any, path: Path) -> Path:
    """One panel per quantity: per token class, one bar per rule with its 95 % CI."""
    from aepo_core.rollout.study import Estimate
    from aepo_core.update_comparison import TOKEN_CLASSES
    from infra.plots import estimates_figure, save_png

    panels: dict[str, dict[str, dict[str, Estimate]]] = {}
    for r in compared.rows:
        panel = panels.setdefault(PANELS[r.quantity], {}).setdefault(r.rule, {})
        panel[r.token_class] = Estimate(r.value, r.ci_low, r.ci_high, r.tokens)
    title = (f"Update rules on the same samples: {compared.run_name}, steps "
             f"{', '.join(map(str, compared.steps))} ({sum(compared.samples.values())} samples of "
             f"{sum(compared.questions.values())} questions; 95% CI over questions)")
    return save_png(estimates_figure(panels, list(TOKEN_CLASSES), title), path)


def print_rows(compared: Any) -> None:
    from flows.cli.replay import rule_records

    print_table(f"Update rules on the same samples (diff = rule − {compared.reference}, paired, 95% CI over "
                "questions)",
                ["quantity", "class", "rule", "value", "diff", "tokens"],
                [list(record.values()) for record in rule_records(compared)])


if __name__ == "__main__":
    raise SystemExit(main())
