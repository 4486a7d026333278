"""Every user mistake a command can meet without a trained run: one line on stderr, exit 2, and nothing created
(no runs dir, no Prefect home, no MLflow store) — table-driven over the commands, each through the installed ``aepo``
in its own process with no Prefect settings inherited (in process, under the suite's Prefect harness, a Prefect home
made too early would go unseen). (The mistakes that need a stored run — an unknown step, question or leaf — are in
test_cli.py, on its trained run.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _store_with_one_experiment(runs: Path) -> None:
    """A runs dir whose MLflow store holds the experiment 'aepo' with one run, and nothing else."""
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    tracker = Tracker(tracking_uri_for(runs), experiment="aepo")
    tracker.client.create_run(tracker.experiment_id(), run_name="only")


CASES = [
    ("train typo", ["train", "-c", TINY, "--set", "rollout.gama=0.3"], "did you mean 'rollout.gamma'?", False),
    ("eval typo", ["eval", "-c", TINY, "--set", "eval.n_sample=2"], "did you mean 'eval.n_samples'?", False),
    ("sweep typo", ["sweep", "-c", str(REPO / "configs" / "sweeps" / "tiny.yaml"), "--set", "optim.lrr=1e-4",
                    "--dry-run"], "did you mean 'optim.lr'?", False),
    ("eval missing checkpoint", ["eval", "-c", TINY, "--checkpoint", "{tmp}/nope"], "nope does not exist", False),
    ("runs without a store", ["runs"], "no MLflow store", False),
    ("runs unknown experiment", ["runs", "-e", "nosuch"], "no experiment 'nosuch' at", True),
    ("trajectories unknown run", ["trajectories", "nosuch"], "no stored trajectories for run 'nosuch'", False),
    ("trajectories unknown experiment", ["trajectories", "only", "-e", "aep"],
     "no experiment 'aep' at", True),
    ("runs experiment typo", ["runs", "-e", "aep"], "(did you mean 'aepo'?)", True),
    ("compare unknown sweep", ["compare", "nosuch"], "no sweep named 'nosuch'", True),
    ("compare without a store", ["compare", "nosuch"], "no MLflow store", False),
]


@pytest.mark.parametrize(("args", "needle", "with_store"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_user_mistake_exits_2_with_one_line_before_anything_is_created(tmp_path: Path, args: list[str],
                                                                          needle: str, with_store: bool) -> None:
    runs = tmp_path / "runs"
    if with_store:
        _store_with_one_experiment(runs)
    before = sorted(p.name for p in runs.iterdir()) if runs.exists() else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AEPO_"))}
    result = subprocess.run([str(Path(sys.executable).with_name("aepo")), *[a.format(tmp=tmp_path) for a in args],
                             "--runs-dir", str(runs)], cwd=tmp_path, env={**env, "COLUMNS": "250"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    after = sorted(p.name for p in runs.iterdir()) if runs.exists() else []
    assert after == before  # no prefect/, no mlflow.db, no runs dir made


@pytest.mark.parametrize(("args", "needle"), [
    (["runs", "--format", "jsn"], "'jsn' is not one of 'table', 'csv', 'json' (did you mean 'json'?)"),
    (["trajectories", "nosuch", "--format", "cvs"], "(did you mean 'csv'?)"),
    (["compare", "nosuch", "--format", "csv", "--table", "pair"], "(did you mean 'pairs'?)"),
    (["runs", "--format", "xml"], "'xml' is not one of 'table', 'csv', 'json'"),
])
def test_a_mistyped_choice_exits_2_and_offers_the_closest(tmp_path: Path, args: list[str], needle: str) -> None:
    """Issue 54 §5: a CLI choice's near miss gets "did you mean", as a config key's does; the command never starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AEPO_"))}
    result = subprocess.run([str(Path(sys.executable).with_name("aepo")), *args, "--runs-dir", str(tmp_path / "runs")],
                            cwd=tmp_path, env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert "did you mean" not in result.stderr or needle.endswith("?)")
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
