"""The narrow metric logger (infra.tracking.logger): four methods that MLflow's tracker, the ranks' null logger and
the file logger all implement; the file logger's record reads back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from infra.tracking.logger import JsonlLogger, MetricLogger
from infra.tracking.run import RankTracker, RunLogger, Tracker


def test_the_metric_logger_is_narrow_and_every_logger_implements_it(tmp_path: Path) -> None:
    members = {m for m in vars(MetricLogger) if not m.startswith("_")}
    assert members == {"log_metrics", "log_params", "log_text", "log_artifact"}
    assert issubclass(Tracker, MetricLogger) and issubclass(RunLogger, MetricLogger)
    assert isinstance(RankTracker(1), MetricLogger) and isinstance(JsonlLogger(tmp_path), MetricLogger)


def test_the_file_logger_records_a_run_that_reads_back(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path / "run")
    assert logger.log_metrics({"train/loss": 0.5, "eval/pass@1": 1, "bad": math.nan, "text": "x"}, step=1) == 2
    assert logger.log_metrics({"train/loss": 0.25}, step=2) == 1
    frame = pd.read_json(tmp_path / "run" / "metrics.jsonl", lines=True)
    assert frame.to_dict(orient="records") == [{"step": 1, "key": "train/loss", "value": 0.5},
                                               {"step": 1, "key": "eval/pass@1", "value": 1.0},
                                               {"step": 2, "key": "train/loss", "value": 0.25}]
    logger.log_params({"seed": 0, "algorithm.loss": "aepo"})
    logger.log_params({"seed": 1, "model.name": "tiny"})  # write-once: seed keeps its first value
    assert json.loads((tmp_path / "run" / "params.json").read_text()) == {
        "seed": "0", "algorithm.loss": "aepo", "model.name": "tiny"}
    assert JsonlLogger(tmp_path / "run")._params["seed"] == "0"  # a reopened record keeps them
    logger.log_text("hello", "notes/a.txt")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "curves.png").write_bytes(b"png")
    (tmp_path / "one.json").write_text("{}")
    logger.log_artifact(tmp_path / "plots", "plots")
    logger.log_artifact(tmp_path / "one.json")
    files = sorted(str(p.relative_to(tmp_path / "run" / "artifacts"))
                   for p in (tmp_path / "run" / "artifacts").rglob("*") if p.is_file())
    assert files == ["notes/a.txt", "one.json", "plots/curves.png"]
    assert (tmp_path / "run" / "artifacts" / "notes" / "a.txt").read_text() == "hello"
