"""What a run records about its inputs and where it comes from: the datasets it read (MLflow's inputs) and its
origin (the flow run it ran in), and an evaluation's kept samples as traces. Shared by the training, evaluation,
study and sweep flows, which hand over their values and never reach the tracking adapter themselves."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from infra.data.loaders import dataset_key
from infra.data.rows import QuestionRow
from infra.run.evaluation import EvalReport
from infra.run.runtime import PolicyRuntime
from infra.tracking.client import RunOrigin
from infra.tracking.run import DatasetRecord, RunLogger

__all__ = ["DatasetRecord", "RunOrigin", "check_eval_datasets", "dataset_record", "log_eval_traces"]


def dataset_record(spec: str, rows: Sequence[QuestionRow], context: str, among: Sequence[str] = ()) -> DatasetRecord:
    """What MLflow records of a dataset a run read: its key, a digest of its rows' content (ids, questions, gold
    answers: the same rows give the same digest wherever the file lies), its spec and its row count."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.id, r.question, list(r.golds)], ensure_ascii=False).encode())
    return DatasetRecord(dataset_key(spec, among), h.hexdigest()[:16], spec, len(rows), context)


def check_eval_datasets(runtime: PolicyRuntime) -> list[DatasetRecord]:
    """Read every evaluation dataset once before the MLflow run is created: a bad row (a user error) then fails the
    flow before any run exists, instead of leaving a FAILED run behind after the training it followed. Returns
    their records (:func:`dataset_record`, context ``evaluation``)."""
    specs = runtime.eval_datasets()
    return [dataset_record(spec, runtime.load_rows(spec), "evaluation", specs) for spec in specs]


def log_eval_traces(tracker: RunLogger, report: EvalReport, step: int, label: str) -> None:
    """The evaluation's kept samples (``tracking.eval_traces`` first questions) as MLflow traces at ``step``,
    labelled ``<label>/<dataset key>`` (``final/synthetic_test``)."""
    if report.traced is not None:
        tracker.log_rollout_traces(report.traced.trees, report.traced.scores, step=step, kind="eval",
                                   label=f"{label}/{report.key}", questions=report.traced.questions)
