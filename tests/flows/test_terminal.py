"""What a researcher sees in the terminal: a quiet `aepo train` whose final table fits 100 columns, `--version`,
`config show --describe`, `sweep --dry-run/--cells/--set`, and `aepo eval` of the configured model (no checkpoint)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from slowdown import scaled
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.environment import QUIET_ENV, quiet_environment

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
SWEEP = str(REPO / "configs" / "sweeps" / "tiny.yaml")
FAST = ["rollout.k=2", "rollout.initial_rollouts=1", "rollout.max_response_tokens=48", "rollout.max_segment_tokens=16",
        "rollout.entropy_window=16", "eval.max_questions=2", "eval.top_p=1.0"]

# Lines the libraries print at their default levels, each seen in a plain `aepo train` before the terminal was
# made quiet: Prefect's telemetry banner and per-task states, MLflow's store creation and system-metrics monitor,
# bm25s's DEBUG, DeepSpeed's accelerator auto-detection, mlflow.transformers' Hub warnings, transformers' weight
# loading bar.
NOISE = ["Prefect collects anonymous usage data", "Finished in state", "Creating initial MLflow database tables",
         "system_metrics", "bm25s", "Setting accelerator to CPU", "model card could not be retrieved",
         "Unable to find license information", "Loading weights"]


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"}, catch_exceptions=False)


@pytest.mark.slow
def test_train_prints_no_library_noise_and_a_table_that_fits_100_columns(tmp_path: Path, model_cache: Path) -> None:
    """A real `aepo train` process (its own temporary Prefect API, a fresh MLflow store, the model logged): stderr
    holds the progress bar only, stdout the tables within 100 columns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DS_", "HF_HUB_"))}
    env.update({"PYTHONPATH": str(REPO), "AEPO_MODEL_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
                "COLUMNS": "100"})
    env.pop("DO_NOT_TRACK", None)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", TINY, "--runs-dir", str(tmp_path / "runs"),
                           *sets("train.steps=1", "tracking.log_model=true", "tracking.system_metrics=true", *FAST)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [n for n in NOISE if n in proc.stderr + proc.stdout]
    assert not noise, f"{noise} in:\n{proc.stderr[-3000:]}"
    assert "evaluations (1 RL steps)" in proc.stdout
    too_wide = [line for line in proc.stdout.splitlines() if len(line) > 100]
    assert not too_wide, too_wide
    numbers = [line for line in proc.stdout.splitlines() if "synthetic_test" in line]
    assert numbers and all("–" in line or "." in line for line in numbers)  # the table rows are whole, not folded


def test_verbose_leaves_the_libraries_at_their_own_levels() -> None:
    quiet, verbose = quiet_environment(0), quiet_environment(1)
    assert QUIET_ENV.items() <= quiet.items()
    assert not set(QUIET_ENV) & set(verbose) and "DS_ACCELERATOR" not in verbose
    assert verbose["DO_NOT_TRACK"] == "1"  # telemetry stays off either way


def test_version() -> None:
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"aepo {version('aepo')}"


def test_config_show_describe_comments_every_field_and_still_loads() -> None:
    from aepo_core.config import ExperimentConfig

    plain, described = invoke("config", "show", "-c", TINY), invoke("config", "show", "-c", TINY, "--describe")
    assert plain.exit_code == described.exit_code == 0
    assert yaml.safe_load(described.stdout) == yaml.safe_load(plain.stdout)
    lines = described.stdout.splitlines()
    described_keys = sum(1 for a, b in zip(lines, lines[1:], strict=False)
                         if a.lstrip().startswith("#") and not b.lstrip().startswith("#"))
    assert described_keys >= len(ExperimentConfig.model_fields)
    desc = ExperimentConfig.model_fields["seed"].description
    assert f"# {desc.split()[0]}" in described.stdout


def test_sweep_dry_run_lists_the_selected_cells_with_the_overrides_and_creates_nothing(tmp_path: Path) -> None:
    from infra.run.sweep_spec import load_sweep

    cells = list(load_sweep(SWEEP).cells)
    assert len(cells) >= 2
    runs = tmp_path / "runs"
    result = invoke("sweep", "-c", SWEEP, "--runs-dir", str(runs), "--dry-run", "--cells", cells[-1],
                    "--set", "train.steps=7")
    assert result.exit_code == 0, result.stderr
    assert f"-{cells[-1]}-s" in result.stdout and f"-{cells[0]}-s" not in result.stdout
    assert "train.steps=7" in result.stdout and "nothing started" in result.stdout
    assert not runs.exists()
    spec = load_sweep(SWEEP, ["train.steps=7"], [cells[-1]])
    assert {r.cell for r in spec.runs} == {cells[-1]} and all(r.config.train.steps == 7 for r in spec.runs)
    bad = invoke("sweep", "-c", SWEEP, "--dry-run", "--cells", "no-such-cell")
    assert bad.exit_code == 2 and "no-such-cell" in bad.stderr and cells[0] in bad.stderr


def test_eval_without_checkpoint_evaluates_the_configured_model(prefect_harness: Any, tmp_path: Path) -> None:
    import flows.evaluate  # noqa: F401  (Prefect's console handler binds to pytest's stderr, see test_cli)

    result = invoke("eval", "-c", TINY, "--runs-dir", str(tmp_path / "runs"), *sets(*FAST))
    assert result.exit_code == 0, result.stderr
    assert "synthetic_test" in result.stdout and "(step 0)" in result.stdout


def test_a_stream_that_is_not_a_terminal_gets_whole_cells_and_plain_progress_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Written to a file or a pipe with COLUMNS unset, rich wrapped tables at 80 columns (a 12-digit number split
    over two lines) and drew its progress bar once, at the end; now cells stay whole and every new stage or step
    is one timestamped line. An explicit COLUMNS is still obeyed."""
    import io

    from rich.console import Console
    from rich.table import Table

    from flows.cli.render import PLAIN_WIDTH, ProgressLines, out

    monkeypatch.delenv("COLUMNS", raising=False)
    console = out()
    assert not console.is_terminal and console.width == PLAIN_WIDTH
    table = Table("question", "value")
    table.add_row("synthetic_test-q-000123-" * 4, "-0.7641234567891")
    console.file = io.StringIO()
    console.print(table)
    assert "-0.7641234567891" in console.file.getvalue() and "synthetic_test-q-000123-" * 4 in console.file.getvalue()
    monkeypatch.setenv("COLUMNS", "90")
    assert out().width == 90

    sink = io.StringIO()
    lines = ProgressLines(Console(file=sink, width=40))
    task = lines.add_task("run: starting", total=3)
    lines.update(task, completed=1, description="step 1 done")
    lines.update(task, completed=1, description="step 1 done")  # nothing new: nothing said
    lines.update(task, advance=1, description="step 2 done")
    said = sink.getvalue().splitlines()
    assert [line.split(" ", 1)[1].split(" (")[0] for line in said] == ["run: starting 0/3", "step 1 done 1/3",
                                                                        "step 2 done 2/3"]
    assert all(line.endswith("elapsed)") for line in said)  # one line each, even at a width of 40


@pytest.mark.parametrize("command", [["train"], ["eval"], ["sweep"], ["serve"], ["runs"], ["trajectories"], ["ui"],
                                     ["config", "show"]])
def test_every_command_helps_with_an_example_and_no_bool_metavar(command: list[str]) -> None:
    """Plain help (it survives a pipe): no flag shows a misleading ``<bool>`` value (``--resume <bool>`` read as if
    it took one), overrides read ``KEY=VALUE``, and every command shows examples."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout and "<list[str]>" not in result.stdout
    assert "Examples:\n    aepo " in result.stdout or "Examples:\n    PREFECT_API_URL" in result.stdout
    if "--set" in result.stdout:
        assert "--set KEY=VALUE" in result.stdout


def test_an_estimate_and_its_interval_read_as_one_cell() -> None:
    """Every table that prints an interval (replay, the benches) goes through ``interval``: signs for differences,
    a dash for what is missing, never "nan"."""
    from flows.cli.render import interval

    assert interval(0.4306, 0.31, 0.5667) == "0.431 [0.310, 0.567]"
    assert interval(0.051, -0.056, 0.167, signed=True) == "+0.051 [-0.056, +0.167]"
    assert interval(0.0049, 0.0, 0.0212, 4, signed=True) == "+0.0049 [+0.0000, +0.0212]"
    assert interval(0.2, None, float("nan")) == "0.200 [–, –]"
    assert interval(None, 0.1, 0.2) == interval(float("nan"), 0.1, 0.2) == "–"


_STOP_IN_A_GC_CALLBACK = """
import os, signal, sys, time, weakref
from flows.cli.environment import sigterm_unwinds
from prefect.utilities.engine import capture_sigterm  # the bridge every flow run installs over ours

class Session:
    pass

def on_collected(_):  # run by the garbage collector: Python prints "Exception ignored" and drops what it raises
    os.kill(os.getpid(), signal.Signals[sys.argv[1]])
    for _ in range(100_000):  # the handler runs here, between two bytecodes of the callback
        pass

with sigterm_unwinds(), capture_sigterm():
    session = Session()
    ref = weakref.ref(session, on_collected)
    del session
    for step in range(40):
        print("step", step, flush=True)
        time.sleep(0.05)
print("trained to the end", flush=True)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_that_lands_in_a_garbage_collector_callback_still_stops_the_run(name: str) -> None:
    """CI once saw `kill <trainer>` lost: Prefect's bridge raised its TerminationSignal inside a SQLAlchemy weakref
    callback, where Python drops exceptions ("Exception ignored"), and the trainer went on for 20 more steps. Here the
    same: the real Prefect bridge over the CLI's handler, SIGTERM delivered while a weakref callback runs. The run
    must stop at once (a step or two), not run to its end, and exit as stopped by the signal. Ctrl-C (SIGINT, Python's
    KeyboardInterrupt) is dropped there the same way."""
    import signal

    signum = signal.Signals[name]
    result = subprocess.run([sys.executable, "-c", _STOP_IN_A_GC_CALLBACK, name], capture_output=True, text=True,
                            timeout=scaled(60), cwd=Path(__file__).resolve().parents[2])
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert "trained to the end" not in result.stdout, result.stderr[-2000:]
    assert result.returncode in (128 + signum, -signum), (result.returncode, result.stderr[-2000:])
    # A lost stop runs all 40 steps; a redelivered one stops after REDELIVERY_DELAY_S (one step idle; 2 printed in
    # 4 of 10 runs, and a loaded machine's scheduler adds a few): far from the end is what tells them apart.
    assert len(steps) <= 10, steps
