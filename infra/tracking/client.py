"""MLflow plumbing every part of the client side shares: where a run's store and artifacts are (URIs), the tags
and names a run carries, and the one way to open a store and to make a fluent MLflow call.

Defaults keep everything under the runs dir: the tracking store ``sqlite:///<runs_dir>/mlflow.db`` and the
artifact root ``<runs_dir>/mlartifacts``.  Both can be overridden from :class:`~aepo_core.config.TrackingConfig`
(e.g. ``http://127.0.0.1:5000`` for an ``mlflow server``, whose own artifact root then applies unless one is given).

MLflow metric names may only hold letters, digits, ``_ - . : / `` and spaces: :func:`metric_key` maps the rest
(``pass@1`` is stored as ``pass_at_1``).

No MLflow import at module level: ``aepo runs`` and the CLI's option checks read URIs from here, and importing
MLflow costs seconds of CPU (see :mod:`infra.tracking.run_index`); MLflow is imported by the calls that use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aepo_core.config import ExperimentConfig

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)

ARTIFACTS_DIR = "mlartifacts"
DB_NAME = "mlflow.db"
MAX_PARAM_VALUE = 6000  # MLflow's limit on a param value
MAX_KEY = 250  # MLflow's limit on a param / metric / tag key
MAX_TAG_VALUE = 8000
PARAMS_PER_BATCH = 100  # MLflow's limit on params (and tags) in one log_batch
METRICS_PER_BATCH = 1000
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")

# Tag names (besides MLflow's own mlflow.runName / mlflow.parentRunId / mlflow.source.git.commit).
TAG_ALGORITHM = "algorithm"
TAG_MODE = "mode"
TAG_SEED = "seed"
TAG_GIT_SHA = "git_sha"
TAG_CONFIG_HASH = "config_hash"
TAG_FLOW_RUN = "prefect_flow_run_id"
TAG_EXPERIMENT_NAME = "experiment_name"
TAG_RESUMES = "resumes"
# The experiment's type in MLflow 3 (earlier 3.x UIs open an untagged experiment that has traces as a GenAI app,
# on an empty GenAI overview). MLflow 3.17's UI ignores it for the landing page: a global GenAI / "Model training"
# switch decides (the URL's ?workflowType=machine_learning, else the browser's last choice, else GenAI).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
TAG_FLOW_RUN_URL = "prefect_flow_run_url"
TAG_REGISTERED_MODEL = "registered_model"  # models:/<name>/<version> a run registered (training) or used (eval)
TAG_DESCRIPTION = "mlflow.note.content"  # what the MLflow UI shows as the run's description
TAG_SOURCE_NAME = "mlflow.source.name"
TAG_SOURCE_TYPE = "mlflow.source.type"

_BAD_METRIC_CHARS = re.compile(r"[^\w.\- :/]")
HEADLINE_SECTION = "Summary"
"""Pass@1 on each dataset and the training reward are logged once more under ``Summary/``: MLflow's UI orders a run's
chart sections by name, byte by byte (measured on 3.17: ``0top``, ``Headline``, ``Zed``, ``_top``, ``aaa``, ``cost``),
so a capitalised section opens first, before ``cost/*`` (which had Pass@1 wait behind a search)."""
_PASS1 = re.compile(r"^eval/(?P<dataset>[^/]+)/pass_at_1$")
_model_lock = threading.Lock()  # guards the process-global tracking URI during fluent calls


def headline_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The :data:`HEADLINE_SECTION` copies of ``metrics``' Pass@1 (``eval/<dataset>/pass_at_1`` →
    ``Summary/pass_at_1_<dataset>``) and training reward (``rollout/reward_mean`` → ``Summary/reward``)."""
    out = {}
    for name, value in metrics.items():
        key = metric_key(name)
        if found := _PASS1.match(key):
            out[f"{HEADLINE_SECTION}/pass_at_1_{found.group('dataset')}"] = value
        elif key == "rollout/reward_mean":
            out[f"{HEADLINE_SECTION}/reward"] = value
    return out


class TrackingError(RuntimeError):
    """A tracking problem the caller can act on (unknown run to resume, tracker not started, bad status)."""


@dataclass(frozen=True)
class RunOrigin:
    """Where a run comes from, recorded as its tags: the code that ran it (``mlflow.source.name``, e.g.
    ``flows/train.py:train``), a description (the MLflow UI's), and the Prefect flow run it ran in (id and UI URL,
    None outside a flow or without a Prefect UI)."""

    source_name: str
    description: str
    flow_run_id: str | None = None
    flow_run_url: str | None = None

    def tags(self) -> dict[str, str]:
        """The MLflow tags of this origin. The description (the run page's, rendered as markdown) ends with a link
        to the flow run: the id tag alone showed truncated, as text."""
        description = self.description
        if self.flow_run_url:
            description += f"\n\nPrefect flow run: [{self.flow_run_id or self.flow_run_url}]({self.flow_run_url})"
        tags = {TAG_SOURCE_NAME: self.source_name, TAG_SOURCE_TYPE: "JOB", TAG_DESCRIPTION: description}
        if self.flow_run_id:
            tags[TAG_FLOW_RUN] = self.flow_run_id
        if self.flow_run_url:
            tags[TAG_FLOW_RUN_URL] = self.flow_run_url
        return tags


def tracking_uri_for(runs_dir: str | os.PathLike[str]) -> str:
    """The default tracking URI: a SQLite store inside the runs dir (absolute, so the cwd does not matter)."""
    return f"sqlite:///{Path(runs_dir).expanduser().resolve() / DB_NAME}"


def unreadable_sqlite_store(uri: str) -> str | None:
    """Why the SQLite file of a ``sqlite:///`` tracking URI cannot be used ("<path>: file is not a database",
    "…: database disk image is malformed"), else None (no file yet: MLflow creates it; another scheme).

    Read-only (``mode=ro``): the file is never changed. ``PRAGMA quick_check`` reads every page (about 10 ms for a
    1 MB store here), which finds a truncated store as well as a foreign file."""
    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///"))
    if not path.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as db:
            verdict = db.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as exc:
        return f"{path}: {exc}"
    return None if verdict is not None and verdict[0] == "ok" else f"{path}: {verdict[0] if verdict else 'empty'}"


def artifact_location_for(runs_dir: str | os.PathLike[str]) -> str:
    """The default artifact root: ``<runs_dir>/mlartifacts`` as a file URI."""
    return (Path(runs_dir).expanduser().resolve() / ARTIFACTS_DIR).as_uri()


def resolve_tracking(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str] | None = None) -> tuple[str, str | None]:
    """(tracking URI, artifact location) for a config; None artifact location leaves a server's default."""
    runs = Path(runs_dir if runs_dir is not None else cfg.storage.runs_dir)
    uri = cfg.tracking.tracking_uri or tracking_uri_for(runs)
    art = cfg.tracking.artifact_location
    if art is None:
        remote = uri.startswith(("http://", "https://", "databricks"))
        art = None if remote and cfg.tracking.tracking_uri else artifact_location_for(runs)
    elif "://" not in art:
        art = Path(art).expanduser().resolve().as_uri()
    return uri, art


UI_MLFLOW_PORT = 5000
"""The port of the MLflow server ``aepo ui`` starts by default (its ``--mlflow-port``)."""


ML_WORKFLOW = "workflowType=machine_learning"
"""MLflow 3.17's UI opens its GenAI layout unless the URL says otherwise (:data:`TAG_EXPERIMENT_KIND`)."""


def run_page(server_url: str, experiment_id: str, run_id: str) -> str:
    """The URL of a run's page in the MLflow UI at ``server_url``, in the classic ("Model training") layout."""
    return f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_WORKFLOW}"


def landing_page(server_url: str, experiment_id: str | None) -> str:
    """Where ``aepo ui`` sends a person: the experiment's runs in the classic layout (its bare URL opened MLflow's
    GenAI view, a "Detect Issues" pop-over over a latency chart); the experiments list before any run."""
    where = f"experiments/{experiment_id}" if experiment_id else "experiments"
    return f"{server_url.rstrip('/')}/#/{where}?{ML_WORKFLOW}"


def ui_run_url(experiment_id: str, run_id: str) -> str:
    """Where ``aepo ui`` (default ports, this machine) shows a run of the runs dir's own SQLite store."""
    return run_page(f"http://127.0.0.1:{UI_MLFLOW_PORT}", experiment_id, run_id)


def open_store(tracking_uri: str) -> MlflowClient:
    """A client of ``tracking_uri`` whose store exists and is migrated.

    MLflow creates and migrates a SQLite store on first use, without any locking of its own: two first runs in a
    fresh runs dir raced on the schema migration and one died (``duplicate column name``). So the first use of a
    SQLite store happens under an exclusive ``flock`` on ``<db>.lock`` next to it; the second process waits, then
    finds the schema current. Servers (``http://…``) migrate their store themselves.
    """
    from mlflow.tracking import MlflowClient

    if not tracking_uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=tracking_uri)
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        client = MlflowClient(tracking_uri=tracking_uri)
        client.search_experiments(max_results=1)  # the store is created and migrated now, under the lock
    return client


def metric_key(name: str) -> str:
    """The MLflow-legal form of a metric name: ``@`` → ``_at_``, other illegal characters → ``_``."""
    key = _BAD_METRIC_CHARS.sub("_", name.replace("@", "_at_"))
    return key[:MAX_KEY]


def param_value(value: Any) -> str:
    """A config value as an MLflow param string (JSON for collections), cut to MLflow's length limit."""
    text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    if len(text) > MAX_PARAM_VALUE:
        log.debug("param value cut from %d to %d characters", len(text), MAX_PARAM_VALUE)
        text = text[: MAX_PARAM_VALUE - 3] + "..."
    return text


def git_sha(start: str | os.PathLike[str] | None = None) -> str | None:
    """The commit checked out in the repository containing ``start`` (cwd by default), read from ``.git``.

    Reads files only (no ``git`` subprocess); ``$AEPO_GIT_SHA`` overrides (e.g. in containers without .git).
    """
    if env := os.environ.get("AEPO_GIT_SHA"):
        return env
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        dotgit = d / ".git"
        if dotgit.is_file():  # worktree or submodule: "gitdir: <path>"
            text = dotgit.read_text(encoding="utf-8", errors="replace").strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (d / text.split(":", 1)[1].strip()).resolve()
        elif dotgit.is_dir():
            gitdir = dotgit
        else:
            continue
        return _read_head(gitdir)
    return None


def _read_head(gitdir: Path) -> str | None:
    try:
        head = (gitdir / "HEAD").read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / (gitdir / "commondir").read_text(encoding="utf-8").strip()).resolve()
    for base in (gitdir, common):
        if (base / ref).is_file():
            return (base / ref).read_text(encoding="utf-8").strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None  # an unborn branch


@contextlib.contextmanager
def fluent_uri(tracking_uri: str) -> Iterator[None]:
    """Point MLflow's process-global tracking URI at ``tracking_uri`` for one fluent call (serialized).

    Why the client elsewhere (:class:`mlflow.MlflowClient` with explicit run ids, not ``mlflow.start_run``): Prefect
    runs tasks in worker threads, and the fluent API keeps a per-thread active-run stack and one process-global
    tracking URI. The fluent calls left (``mlflow.transformers.log_model`` / ``load_model``,
    ``mlflow.artifacts.download_artifacts``) run under a lock with the URI set for their duration."""
    import mlflow

    with _model_lock:
        env_before = os.environ.get("MLFLOW_TRACKING_URI")
        # unset stays unset: get_tracking_uri() of an unset process is its default, sqlite:///<cwd>/mlflow.db
        before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        mlflow.set_tracking_uri(tracking_uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(before)
            if env_before is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env_before


def download_artifacts(tracking_uri: str, artifact_uri: str, dst_path: str | os.PathLike[str]) -> Path:
    """Copy artifacts (``runs:/…`` or ``models:/…``) of the store at ``tracking_uri`` to a local directory."""
    import mlflow.artifacts

    with fluent_uri(tracking_uri):
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst_path)))
