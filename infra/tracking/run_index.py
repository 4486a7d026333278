"""The newest runs of an MLflow experiment, for listing (``aepo runs``): name, status, start, tags, latest metrics.

Two ways to read them, one result: from a local SQLite store straight through ``sqlite3`` (read-only), from any
other store (an ``mlflow server``) through MLflow's client. Why the first: ``aepo runs`` should answer in under
2 s, and importing MLflow's SQLAlchemy store alone costs ~4 s of CPU on this machine (mlflow, sqlalchemy,
alembic: measured 3.7 s user time for ``import mlflow.store.tracking.sqlalchemy_store``) while the query takes
milliseconds. The SQLite path reads MLflow's own tables (``experiments``, ``runs``, ``tags``, ``latest_metrics``,
the columns MLflow's ``run.info`` / ``run.data`` come from); an ``sqlite3.Error`` there (a schema a newer MLflow
has changed) falls back to the client, and ``tests/infra/test_tracking.py`` holds both ways equal on a real store.
No MLflow import at module level (nor in :mod:`infra.tracking.client`, the one module of this package it imports).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from infra.tracking.client import open_store


@dataclass(frozen=True)
class RunSummary:
    """One run as a listing shows it; ``metrics`` are the latest value of each (NaN where MLflow holds NaN)."""

    run_id: str
    run_name: str
    status: str
    start_time: datetime | None
    tags: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


def _time(ms: int | None) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000) if ms is not None else None


def _local_db(tracking_uri: str) -> Path | None:
    """The SQLite file of a local store this module reads directly (None: another store, or none yet)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    return db if db.is_file() else None


def _read_only(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)


def newest_runs(tracking_uri: str, experiment: str, limit: int) -> list[RunSummary]:
    """The ``limit`` newest active runs of ``experiment`` (by start time, as ``MlflowClient.search_runs``)."""
    if (db := _local_db(tracking_uri)) is not None:
        try:
            return _from_sqlite(db, experiment, limit)
        except sqlite3.Error:
            pass  # not the schema this reader knows: MLflow's client reads it
    return _from_client(tracking_uri, experiment, limit)


def experiment_names(tracking_uri: str) -> list[str]:
    """The names of the store's active experiments, sorted."""
    if (db := _local_db(tracking_uri)) is not None:
        try:
            with _read_only(db) as con:
                return sorted(name for (name,) in con.execute(
                    "SELECT name FROM experiments WHERE lifecycle_stage = 'active'"))
        except sqlite3.Error:
            pass  # not the schema this reader knows: MLflow's client reads it
    return sorted(e.name for e in open_store(tracking_uri).search_experiments())


def _from_sqlite(db: Path, experiment: str, limit: int) -> list[RunSummary]:
    with _read_only(db) as con:
        runs = con.execute(
            "SELECT r.run_uuid, r.name, r.status, r.start_time FROM runs r "
            "JOIN experiments e ON e.experiment_id = r.experiment_id "
            "WHERE e.name = ? AND r.lifecycle_stage = 'active' "
            "ORDER BY r.start_time DESC, r.run_uuid LIMIT ?", (experiment, limit)).fetchall()
        ids = [r[0] for r in runs]
        marks = ",".join("?" * len(ids))
        tags: dict[str, dict[str, str]] = {i: {} for i in ids}
        metrics: dict[str, dict[str, float]] = {i: {} for i in ids}
        if ids:
            for run_id, key, value in con.execute(
                    f"SELECT run_uuid, key, value FROM tags WHERE run_uuid IN ({marks})", ids):
                tags[run_id][key] = value
            for run_id, key, value, is_nan in con.execute(
                    f"SELECT run_uuid, key, value, is_nan FROM latest_metrics WHERE run_uuid IN ({marks})", ids):
                metrics[run_id][key] = math.nan if is_nan else float(value)
    return [RunSummary(run_id, name or tags[run_id].get("mlflow.runName", ""), status, _time(start),
                       tags[run_id], metrics[run_id]) for run_id, name, status, start in runs]


def _from_client(tracking_uri: str, experiment: str, limit: int) -> list[RunSummary]:
    from mlflow.entities import ViewType

    client = open_store(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY, max_results=limit,
                              order_by=["attributes.start_time DESC"])
    return [RunSummary(r.info.run_id, r.info.run_name or "", r.info.status, _time(r.info.start_time),
                       dict(r.data.tags), dict(r.data.metrics)) for r in runs]
