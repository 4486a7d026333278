"""A run's stored rollout trees as ``aepo trajectories`` reads them: which store (``--store``, else the runs dir)
and which stored run a run id, a prefix of one or an MLflow run name means."""

from __future__ import annotations

from pathlib import Path

from infra.store import StoreError, TrajectoryStore

__all__ = ["StoreError", "TrajectoryStore", "reading_store", "stored_run_id"]


def reading_store(runs: Path, store_uri: str | None) -> TrajectoryStore:
    """The trajectory store a reading command reads: ``store_uri`` (a local directory or ``s3://…``), else the runs
    dir (its ``trajectories/`` and ``nodes/``)."""
    return TrajectoryStore(store_uri or runs)


def stored_run_id(store: TrajectoryStore, run: str, tracking_uri: str | None, experiment: str) -> str | None:
    """A stored run id from a run id, a unique prefix of one, or an MLflow run name (looked up at ``tracking_uri``
    when given, the newest run of that name that the store holds); None when none matches."""
    stored = store.run_ids()
    if run in stored:
        return run
    prefixed = [r for r in stored if r.startswith(run)]
    if len(prefixed) == 1:
        return prefixed[0]
    if tracking_uri is not None:
        from infra.tracking.run import Tracker

        frame = Tracker(tracking_uri, experiment=experiment).search_runs(
            filter_string=f"attributes.run_name = '{run}'")
        ids = [r for r in frame["run_id"] if r in stored] if not frame.empty else []
        if ids:
            return ids[0]  # newest first
    return None
