"""Corrupt files a user meets (issue 50 §4): one line naming the file, exit code 2, no traceback, nothing overwritten.

Before: a damaged ``mlflow.db`` gave ``aepo train`` exit 1 after a SQLAlchemy traceback ("file is not a database",
"database disk image is malformed"); a damaged trajectory part gave ``aepo trajectories`` a StoreError traceback and
exit 1. A non-Parquet or truncated ``data.train`` already exits 2 naming the key and the file (kept here).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from test_cli import TINY, invoke, sets

pytestmark = pytest.mark.slow  # one tiny training run


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(prefect_harness: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import flows.train  # noqa: F401  (Prefect's log handler on pytest's stream, see test_cli.trained)

    runs = tmp_path_factory.mktemp("corrupt") / "runs"
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), *sets("train.steps=1", "eval.max_questions=1"))
    assert result.exit_code == 0, result.output
    return runs


def copy_of(runs: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(runs, tmp_path / "runs"))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_mlflow_store_is_one_error_naming_it(trained: Path, tmp_path: Path, damage: str) -> None:
    runs = copy_of(trained, tmp_path)
    db = runs / "mlflow.db"
    data = db.read_bytes()
    db.write_bytes(b"\x17" * 4096 if damage == "garbage" else data[: len(data) // 3])
    before = digest(db)
    for args in (["train", "-c", TINY, "--resume", *sets("train.steps=2")], ["train", "-c", TINY],
                 ["eval", "-c", TINY, *sets("eval.max_questions=1")], ["runs"]):
        result = invoke(*args, "--runs-dir", str(runs))
        assert result.exit_code == 2, (args, result.output)
        assert str(db) in result.stderr and "not a readable SQLite database" in result.stderr, result.stderr
        assert "Traceback" not in result.output
        assert digest(db) == before


def test_a_damaged_trajectory_part_is_one_error_naming_it(trained: Path, tmp_path: Path) -> None:
    runs = copy_of(trained, tmp_path)
    (part,) = (runs / "trajectories").rglob("step-000001.parquet")
    part.write_bytes(part.read_bytes()[:300])
    before = digest(part)
    for extra in ([], ["--step", "1"]):
        result = invoke("trajectories", part.parent.name, *extra, "--runs-dir", str(runs))
        assert result.exit_code == 2, result.output
        assert str(part) in result.stderr and "Traceback" not in result.output, result.output
    assert digest(part) == before


@pytest.mark.parametrize("table", ["trajectories", "nodes"])
def test_a_damaged_trajectory_part_stops_a_resume_naming_it(trained: Path, tmp_path: Path, table: str) -> None:
    """Before: --resume trained on past it (a step at or before the checkpoint is never read again), and the run
    ended with a part no reader could open."""
    runs = copy_of(trained, tmp_path)
    (part,) = (runs / table).rglob("step-000001.parquet")
    part.write_bytes(part.read_bytes()[:300])
    before = digest(part)
    result = invoke("train", "-c", TINY, "--resume", "--runs-dir", str(runs), *sets("train.steps=2"))
    assert result.exit_code == 2, result.output
    assert str(part) in result.stderr and "damaged" in result.stderr and "Traceback" not in result.output
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr
    assert digest(part) == before and not (part.parent / "step-000002.parquet").exists()


@pytest.mark.parametrize("damage", ["not parquet", "truncated"])
def test_a_damaged_training_file_is_one_error_naming_it(tmp_path: Path, damage: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["What is 2+2?"] * 50, "answer": ["4"] * 50}), data)
    data.write_bytes(b"question,answer\n" if damage == "not parquet" else data.read_bytes()[:200])
    runs = tmp_path / "runs"
    result = invoke("train", "-c", TINY, "--runs-dir", str(runs), *sets(f"data.train={data}"))
    assert result.exit_code == 2 and "data.train" in result.stderr and str(data) in result.stderr, result.output
    assert not runs.exists()
