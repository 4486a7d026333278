"""The per-question evaluation table (``runs/eval/<run>/<dataset>.parquet``) is documented like the trajectory store's:
a description on every column, in the file too, and a ``stage`` column that tells a run's evaluations apart (start,
sft, stepN, final; ``eval`` for ``aepo eval``); files written before the column still read."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from aepo_core.config import StorageConfig
from aepo_core.evaluation import EvalSummary, QuestionOutcome
from infra.data.rows import QuestionRow
from infra.run.evaluation import (
    QUESTION_SCHEMA,
    EvalReport,
    EvalSource,
    ResultsDir,
    read_question_results,
    write_question_results,
)


def _report() -> EvalReport:
    outcomes = [QuestionOutcome(f"q{i}", "synthetic:test", "single_hop", 2, i % 3, 0.5, 0.5, 1.0, 0.0, 1.0)
                for i in range(3)]
    rows = {o.question_id: QuestionRow(o.question_id, f"question {o.question_id}?", ("a",), "test", "single_hop")
            for o in outcomes}
    return EvalReport("synthetic:test", "synthetic_test", EvalSummary.of(outcomes, 2), {},
                      outcomes, answers={q: ["a", None] for q in rows}, questions=rows)


def test_every_column_is_described_in_the_schema_and_in_the_file(tmp_path: Path) -> None:
    undescribed = [f.name for f in QUESTION_SCHEMA if not (f.metadata or {}).get(b"description")]
    assert undescribed == []
    where = ResultsDir(str(tmp_path / "eval" / "run"), tmp_path / "eval" / "run")
    written = write_question_results(_report(), 2, EvalSource("rid", "run", None, 3, "final"), where,
                                     StorageConfig())
    meta = pq.read_metadata(written).metadata
    columns = json.loads(meta[b"aepo.columns"])
    assert set(columns) == set(QUESTION_SCHEMA.names) and all(columns.values())
    assert meta[b"aepo.table"] == b"eval_questions"


def test_a_stage_column_tells_a_run_s_evaluations_apart(tmp_path: Path) -> None:
    for stage, step in (("sft", 0), ("final", 3)):
        where = ResultsDir(str(tmp_path / "eval" / "run" / stage), tmp_path / "eval" / "run" / stage)
        write_question_results(_report(), 2, EvalSource("rid", "run", None, step, stage), where, StorageConfig())
    table = pq.read_table(tmp_path / "eval" / "run").to_pandas()
    assert table.groupby("stage")["checkpoint_step"].max().to_dict() == {"final": 3, "sft": 0}
    assert len(table) == 6


def test_a_file_written_before_the_stage_column_still_reads(tmp_path: Path) -> None:
    where = ResultsDir(str(tmp_path), tmp_path)
    written = write_question_results(_report(), 2, EvalSource("rid", "run", None, 0, "eval"), where,
                                     StorageConfig())
    old = pq.read_table(written).drop_columns(["stage"])
    old = old.replace_schema_metadata({"aepo.table": "eval_questions", "aepo.schema_version": "1"})
    pq.write_table(old, tmp_path / "old.parquet")
    assert read_question_results(tmp_path / "old.parquet") == {"synthetic:test": {"q0": 0.0, "q1": 0.5, "q2": 1.0}}
    assert pa.types.is_string(QUESTION_SCHEMA.field("stage").type)
