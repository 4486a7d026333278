"""User errors met inside a flow (deployments run flows without the CLI's checks): a bad dataset row is not
retried as if it were transient, and it fails the flow before an MLflow run exists (no FAILED run left)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.data.rows import BadRowError

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _bad_jsonl(path: Path) -> Path:
    path.write_text('{"question": "What is 2+2?", "answer": "4"}\n\n{"answer": "no question"}\n', encoding="utf-8")
    return path


def test_a_bad_row_is_not_retried(prefect_harness: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect import flow

    import tasks.data
    from aepo_core.config import DataConfig

    calls: list[str] = []
    real = tasks.data.load_dataset_rows

    def counting(spec: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(tasks.data, "load_dataset_rows", counting)
    spec = str(_bad_jsonl(tmp_path / "bad.jsonl"))

    @flow
    def prepare() -> Any:
        return tasks.data.prepare_data(spec, DataConfig(), "fingerprint")

    with pytest.raises(BadRowError, match="line 3: question: missing"):
        prepare()
    assert calls == [spec]  # attempted once: prepare_data's retry is for transient failures


def test_train_flow_with_a_bad_eval_row_leaves_no_mlflow_run(prefect_harness: Any, tmp_path: Path) -> None:
    from flows.train import train
    from infra.config_files import load_config
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    bad = _bad_jsonl(tmp_path / "bad.jsonl")
    runs = tmp_path / "runs"
    cfg = load_config(TINY, [f"eval.datasets=[{bad}]", "train.steps=1"])
    with pytest.raises(BadRowError, match="line 3"):
        train(config=cfg, runs_dir=str(runs))
    frame = Tracker(tracking_uri_for(runs)).search_runs() if (runs / "mlflow.db").exists() else None
    assert frame is None or frame.empty, list(frame["status"])
