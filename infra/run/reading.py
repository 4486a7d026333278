"""What the reading commands read from a tracking store: its newest runs (``aepo runs``), a run's logged config and
metrics (``aepo replay``), and whether an earlier evaluation's files may be there (``aepo eval --compare-to``).

Light at import, as the commands that use it start: MLflow (seconds of CPU, see :mod:`infra.tracking.run_index`) is
imported only by the functions that open a tracker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from infra.fs import is_remote
from infra.tracking.run_index import RunSummary, experiment_names, newest_runs

if TYPE_CHECKING:
    from infra.tracking.run import Tracker

__all__ = ["RunSummary", "experiment_names", "may_exist", "newest_runs", "reading_tracker"]


def may_exist(location: str) -> bool:
    """Whether ``location`` (a checkpoint, an earlier evaluation's files) may be read: not a local path that does not
    exist (a remote one or a registered model is checked when read, which needs the config's storage or registry)."""
    from infra.tracking.registry import is_registered_model

    return is_remote(location) or is_registered_model(location) or Path(location).expanduser().exists()


def reading_tracker(runs: Path, tracking_uri: str | None, experiment: str) -> Tracker:
    """The tracker of experiment ``experiment`` at ``tracking_uri``, default the runs dir's store."""
    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    return Tracker(tracking_uri or tracking_uri_for(runs), experiment=experiment)
