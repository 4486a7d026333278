"""``aepo compare`` and its flow (issue 54 §1) on a sweep's MLflow store made here (tests/compare_store.py): the flow
logs the comparison to the sweep's parent run and to Prefect; the command, through the installed ``aepo`` in its own
process and piped through ``cat`` as a script would read it, prints JSON and CSV that parse back to the values
``infra.run.compare`` computes, in a bounded size."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from compare_store import make_store

from infra.run.compare import compare_runs, find_runs

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    runs = tmp_path_factory.mktemp("runs")
    uri, parent = make_store(runs)
    return runs, uri, parent


def _aepo(runs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``aepo compare <args> --runs-dir <runs> | cat`` with no Prefect settings inherited (its temporary API)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AEPO_"))}
    command = " ".join([str(BIN / "aepo"), "compare", *args, "--runs-dir", str(runs), "| cat"])
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=300)


def test_the_flow_logs_to_the_parent_run_and_to_prefect(prefect_harness: Any, store: tuple[Path, str, str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.compare import compare
    from infra.tracking.run import Tracker

    runs, uri, parent = store
    state = compare(sweep="tiny-sweep", runs_dir=str(runs), return_state=True)
    assert state.is_completed()
    result = state.result()
    assert result.logged_to == parent and result.name == "tiny-sweep"
    assert [Path(f).name for f in result.figures] == ["entropy_over_training.png", "training_curves.png",
                                                      "curves_by_tokens.png"]
    assert all(Path(f).parent == runs / "compare" / "tiny-sweep" for f in result.figures)
    logged = {f.path for f in Tracker(uri).client.list_artifacts(parent, "compare")}
    assert logged == {"compare/arms.json", "compare/runs.json", "compare/pairs.json", "compare/curves.json",
                      "compare/comparison.json"}
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[state.state_details.flow_run_id])))
    tables = {a.key: json.loads(a.data) if isinstance(a.data, str) else a.data for a in arts if a.type == "table"}
    assert set(tables) == {"compare-tiny-sweep-arms", "compare-tiny-sweep-pairs"}
    assert [r["arm"] for r in tables["compare-tiny-sweep-arms"]] == ["aepo", "grpo"]
    # runs named by id have no parent: nothing is logged to MLflow
    ids = [r.run_id for r in find_runs(uri, "tiny-sweep", []).runs]
    alone = compare(run_ids=ids, runs_dir=str(runs))
    assert alone.logged_to is None and alone.artifacts == [] and alone.name == "runs"


def test_json_and_csv_parse_back_to_the_values(store: tuple[Path, str, str]) -> None:
    """Every table in the JSON document and in CSV, numbers as numbers under identifier keys, equal to the
    comparison computed in this process; a few KB, not the width of a terminal rule."""
    runs, uri, _ = store
    with tempfile.TemporaryDirectory() as tmp:
        expected = compare_runs(find_runs(uri, "tiny-sweep", []), Path(tmp))
    shown = _aepo(runs, "tiny-sweep", "--format", "json", "--no-log")
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout) < 40_000
    doc = json.loads(shown.stdout)
    assert (doc["dataset"], doc["k"], doc["baseline"], doc["sweep"]) == ("synthetic_test", 2, "grpo", "tiny-sweep")
    arms = {r["arm"]: r for r in doc["arms"]}
    for want in expected.arm_records():
        got = arms[want["arm"]]
        assert got["pass_at_1"] == pytest.approx(want["pass@1"]) and got["seeds"] == want["seeds"]
        assert got["pass_at_1_over_questions_low"] == pytest.approx(want["pass@1 over questions low"])
        assert got["dataset"] == "synthetic_test"
    assert isinstance(arms["aepo"]["clipped_update_tokens"], float) and arms["grpo"]["clipped_update_tokens"] is None
    assert [(r["arm"], r["seed"]) for r in doc["runs"]] == [("aepo", 0), ("aepo", 1), ("grpo", 1)]
    assert doc["pairs"][0]["delta_pass_at_1"] == pytest.approx(expected.pairs[0].pass1.mean)
    assert {r["metric"] for r in doc["curves"]} >= {"train/entropy_mean"}


def test_every_csv_table_parses_back(store: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """The same printer as the command (one process start each would cost ~20 s of Prefect): every ``--table``."""
    from flows.cli.compare import CompareTable, print_comparison
    from flows.cli.render import OutputFormat

    _, uri, _ = store
    with tempfile.TemporaryDirectory() as tmp:
        expected = compare_runs(find_runs(uri, "tiny-sweep", []), Path(tmp))
    for table, key, count in ((CompareTable.arms, "arm", 2), (CompareTable.runs, "run_id", 3),
                              (CompareTable.pairs, "pair", 3), (CompareTable.curves, "metric", None)):
        print_comparison(expected, OutputFormat.csv, table)
        text = capsys.readouterr().out
        rows = list(csv.DictReader(io.StringIO(text)))
        assert rows and all(row[key] for row in rows) and len(text) < 40_000
        assert count is None or len(rows) == count
    print_comparison(expected, OutputFormat.csv)
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert float(rows[0]["pass_at_1"]) == pytest.approx(expected.arms[0].pass1_over_seeds.mean)


def test_the_table_for_a_person(store: tuple[Path, str, str]) -> None:
    runs, _, _ = store
    shown = _aepo(runs, "tiny-sweep", "--no-log", "-a", "grpo", "-a", "aepo")
    assert shown.returncode == 0, shown.stderr
    assert "Arms over seeds" in shown.stdout and "grpo - aepo" in shown.stdout and "Over training" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) < 400  # no rule wider than its table


@pytest.mark.parametrize(("args", "needle"), [
    (["nosuch"], "no sweep named 'nosuch'"),
    (["tiny-sweep", "-a", "dapo"], "no arm dapo among the runs (did you mean 'aepo'?) (arms: aepo, grpo)"),
    (["tiny-sweep", "--seed", "9"], "no run of seed 9"),
    (["tiny-sweep", "--run", "0123456789abcdef0123456789abcdef"], "not both"),
    (["--run", "0123456789abcdef0123456789abcdef"], "no run 0123456789abcdef0123456789abcdef"),
    (["tiny-sweep", "--table", "pairs"], "--table picks the CSV table"),
])
def test_a_mistake_exits_2_before_prefect_starts(store: tuple[Path, str, str], args: list[str], needle: str) -> None:
    runs, _, _ = store
    before = sorted(p.name for p in runs.iterdir())
    shown = _aepo(runs, *args)
    assert shown.returncode == 2 and needle in shown.stderr and len(shown.stderr.strip().splitlines()) == 1, shown
    assert sorted(p.name for p in runs.iterdir()) == before  # no prefect/ home, nothing written
