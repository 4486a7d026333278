"""Deployments of the train / evaluate / study / compare / sweep flows for ``prefect.serve`` (``aepo serve``).

For users without a work pool: one long-running process polls the Prefect API for runs of these deployments
and executes them in subprocesses.  With a process work pool, ``prefect.yaml`` declares the same flows as
deployments ``train``, ``evaluate``, ``sweep`` (``prefect deploy --all`` then ``prefect worker start --pool
aepo-process``).

The served deployments are named apart (``train-served``, …): a deployment is keyed by flow and name on the
server, so serving ``aepo-train/train`` after ``prefect deploy`` replaced the declared deployment with one that
has no pull steps and no pool, and its next run crashed (``Downloading flow code from storage at None …
FileNotFoundError``). Both sets now coexist on one server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.compare import compare
from flows.evaluate import evaluate
from flows.study import rollout_study
from flows.sweep import sweep
from flows.train import train
from infra.run.preflight import read_config_file

DEFAULT_CONFIG = "configs/tiny.yaml"
DEFAULT_SWEEP = "configs/sweeps/tiny.yaml"
WEEKLY_SWEEP_CRON = "0 3 * * 1"  # Mondays 03:00: what `aepo serve --cron` is typically given (none by default)
SERVED_SUFFIX = "-served"
"""Appended to the names of served deployments (see the module docstring)."""


def build_deployments(runs_dir: str | Path = "runs", config: str | Path = DEFAULT_CONFIG,
                      sweep_file: str | Path = DEFAULT_SWEEP, sweep_cron: str | None = None) -> list[Any]:
    """RunnerDeployments named ``train-served``, ``evaluate-served``, ``rollout-study-served``, ``compare-served`` and
    ``sweep-served`` (the last on ``sweep_cron`` when asked for one, e.g. :data:`WEEKLY_SWEEP_CRON`; None, the
    default: no schedule), their runs in ``runs_dir``. A scheduled sweep deployment passes ``dated``: each firing is
    a new sweep, its cells all run again (:mod:`flows.sweep`); without a schedule a run of it is like ``aepo sweep``
    (finished cells reused).

    The train deployment's ``config`` parameter is the resolved config (the UI renders it as a form); the
    evaluate, compare and sweep deployments take file paths, resolved to absolute paths here so runs do not depend on
    the serving process's working directory.
    """
    cfg = read_config_file(Path(config))
    runs = str(Path(runs_dir).expanduser().resolve())
    return [
        train.to_deployment(name=f"train{SERVED_SUFFIX}", parameters={"config": cfg.to_dict(), "runs_dir": runs},
                            description="RL training run (edit the config form; overrides as dotted key=value)",
                            tags=["aepo"]),
        evaluate.to_deployment(name=f"evaluate{SERVED_SUFFIX}",
                               parameters={"config": str(Path(config).resolve()), "checkpoint": None,
                                           "runs_dir": runs},
                               description="Evaluate a checkpoint (None: the configured model)", tags=["aepo"]),
        rollout_study.to_deployment(name=f"rollout-study{SERVED_SUFFIX}",
                                    parameters={"config": str(Path(config).resolve()), "checkpoint": None,
                                                "runs_dir": runs},
                                    description="Rollout study at a fixed policy: sampling modes × k on the same "
                                    "questions, paired seeds, bootstrap CIs", tags=["aepo"]),
        compare.to_deployment(name=f"compare{SERVED_SUFFIX}",
                              parameters={"sweep": str(Path(sweep_file).resolve()), "runs_dir": runs},
                              description="Compare a sweep's arms over seeds (paired differences, Holm, curves), "
                              "logged to its parent MLflow run", tags=["aepo"]),
        sweep.to_deployment(name=f"sweep{SERVED_SUFFIX}", cron=sweep_cron,
                            parameters={"sweep_config": str(Path(sweep_file).resolve()), "runs_dir": runs,
                                        **({"dated": True} if sweep_cron else {})},
                            description=("Scheduled sweep (a new dated sweep each firing)" if sweep_cron else "Sweep")
                            + " of training runs with a comparison table", tags=["aepo"]),
    ]
