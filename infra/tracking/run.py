"""MLflow tracking: one MLflow run per training flow run, resumable, usable from worker threads.

Defaults keep everything under the runs dir: the tracking store ``sqlite:///<runs_dir>/mlflow.db`` and the
artifact root ``<runs_dir>/mlartifacts``.  The experiment is created with that artifact location explicitly,
because MLflow on sqlite otherwise writes artifacts to ``./mlruns`` in the working directory.  Both can be
overridden from :class:`~aepo_core.config.TrackingConfig` (e.g. ``http://127.0.0.1:5000`` for an ``mlflow
server``, whose own artifact root then applies unless one is given).

Why :class:`mlflow.MlflowClient` with explicit run ids rather than ``mlflow.start_run``: Prefect runs tasks in
worker threads, and the fluent API keeps a per-thread active-run stack and one process-global tracking URI.
The only fluent call left, ``mlflow.transformers.log_model``, is given the run id and runs under a lock with
the tracking URI set for its duration.

MLflow metric names may only hold letters, digits, ``_ - . : / `` and spaces: :func:`metric_key` maps the rest
(``pass@1`` is stored as ``pass_at_1``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag, Trace, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracing.client import TracingClient
from mlflow.tracing.constant import SpansLocation, TraceTagKey
from mlflow.tracking import MlflowClient

from aepo_core.config import ExperimentConfig
from aepo_core.protocol import AgentProtocol
from infra.tracking.run_index import tracking_uri_for
from infra.tracking.traces import TraceKind, TraceTarget, rollout_traces

if TYPE_CHECKING:
    from aepo_core.rollout.tree import RolloutTree
    from aepo_core.scoring import LeafScore

log = logging.getLogger(__name__)

ARTIFACTS_DIR = "mlartifacts"
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
_model_lock = threading.Lock()  # guards the process-global tracking URI during fluent calls


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
        """The MLflow tags of this origin."""
        tags = {TAG_SOURCE_NAME: self.source_name, TAG_SOURCE_TYPE: "JOB", TAG_DESCRIPTION: self.description}
        if self.flow_run_id:
            tags[TAG_FLOW_RUN] = self.flow_run_id
        if self.flow_run_url:
            tags[TAG_FLOW_RUN_URL] = self.flow_run_url
        return tags


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset a run read, as MLflow records it (``log_inputs``): its key, a digest of its rows, where it came
    from, how many rows, and the context (``training`` / ``evaluation``)."""

    name: str
    digest: str
    source: str
    rows: int
    context: str

    def as_input(self) -> DatasetInput:
        source_type = "synthetic" if self.source.startswith("synthetic") else "local"
        dataset = Dataset(self.name, self.digest, source_type, json.dumps({"uri": self.source}),
                          profile=json.dumps({"num_rows": self.rows}))
        return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", self.context)])


class TrackingError(RuntimeError):
    """A tracking problem the caller can act on (unknown run to resume, tracker not started, bad status)."""


@dataclass(frozen=True)
class NamedRun:
    """A run found by its name: its id, status and the params it started with (the config, flattened)."""

    run_id: str
    status: str
    params: Mapping[str, str]


class RegistryError(TrackingError):
    """A registered model that cannot be evaluated as asked (unknown name or version, not an AEPO policy)."""


PROTOCOL_METADATA = "aepo_protocol"
"""The MLmodel metadata key under which a logged policy carries its :class:`AgentProtocol`."""
REGISTRY_SCHEME = "models:/"
VERSION_TAG_MODEL_ID = "model_id"
"""The model version tag naming its MLflow LoggedModel (by which an evaluation run is linked to it)."""


@dataclass(frozen=True)
class LoggedPolicy:
    """A policy logged by :meth:`Tracker.log_model`: its model URI (``models:/m-…``) and MLflow LoggedModel id."""

    uri: str
    model_id: str


@dataclass(frozen=True)
class RegisteredPolicy:
    """A registered policy version fetched for evaluation: where it lies locally (the MLflow model directory, HF
    weights in ``model/``), its protocol, the training run that logged it and that run's resolved config."""

    uri: str
    name: str
    version: str
    local_dir: Path
    protocol: AgentProtocol
    run_id: str | None
    model_id: str | None
    step: int
    config: dict[str, object]


def is_registered_model(location: str | None) -> bool:
    """Whether ``location`` names a registered model version (``models:/<name>/<version>``)."""
    return location is not None and location.startswith(REGISTRY_SCHEME)


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


def run_page(server_url: str, experiment_id: str, run_id: str) -> str:
    """The URL of a run's page in the MLflow UI at ``server_url``."""
    return f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


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


class Tracker:
    """One MLflow run at a time, driven through :class:`MlflowClient` with an explicit run id.

    Thread-safe for logging (MLflow's client and stores are); :meth:`start` and :meth:`finish` are serialized.
    """

    def __init__(self, tracking_uri: str, experiment: str = "aepo", artifact_location: str | None = None,
                 system_metrics: bool = False, system_metrics_interval_s: float = 10.0) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_location = artifact_location
        self.system_metrics = system_metrics
        self.system_metrics_interval_s = system_metrics_interval_s
        self.client = open_store(tracking_uri)
        self._lock = threading.Lock()
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._monitor: Any = None
        self._renamed_keys: set[str] = set()
        self._logged_before: frozenset[tuple[str, int]] = frozenset()
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aepo-traces")
        self._pending: list[Future[list[str]]] = []

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, runs_dir: str | os.PathLike[str] | None = None,
                    **kwargs: Any) -> Tracker:
        """A tracker for ``cfg.tracking`` with defaults under ``runs_dir`` (else ``cfg.storage.runs_dir``)."""
        uri, art = resolve_tracking(cfg, runs_dir)
        kwargs.setdefault("system_metrics", cfg.tracking.system_metrics)
        return cls(uri, experiment=cfg.tracking.experiment, artifact_location=art, **kwargs)

    def __repr__(self) -> str:
        return f"Tracker({self.tracking_uri!r}, experiment={self.experiment!r}, run_id={self._run_id!r})"

    # ---- experiment and run lifecycle ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            raise TrackingError("the tracker has no run: call start() first")
        return self._run_id

    @property
    def active(self) -> bool:
        return self._run_id is not None

    def experiment_id(self) -> str:
        """Get or create the experiment (with the explicit artifact location); restores a deleted one."""
        if self._experiment_id is not None:
            return self._experiment_id
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                self._experiment_id = self.client.create_experiment(self.experiment,
                                                                    artifact_location=self.artifact_location,
                                                                    tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
                log.info("created MLflow experiment %r (artifacts: %s)", self.experiment,
                         self.artifact_location or "server default")
                return self._experiment_id
            except MlflowException:  # another process created it meanwhile
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            log.warning("restoring deleted MLflow experiment %r", self.experiment)
            self.client.restore_experiment(exp.experiment_id)
        if TAG_EXPERIMENT_KIND not in exp.tags:  # an older experiment: opens on runs too (a user's choice is kept)
            self.client.set_experiment_tag(exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        if self.artifact_location and exp.artifact_location != self.artifact_location:
            log.debug("experiment %r keeps its artifact location %s", self.experiment, exp.artifact_location)
        self._experiment_id = exp.experiment_id
        return self._experiment_id

    def start(self, cfg: ExperimentConfig, run_name: str | None = None, tags: Mapping[str, Any] | None = None,
              resume_run_id: str | None = None, parent_run_id: str | None = None,
              origin: RunOrigin | None = None, group: bool = False, params: Mapping[str, Any] | None = None
              ) -> str:
        """Create (or, with ``resume_run_id``, reopen) the run; log the config as params and the standard tags.

        ``params`` are logged beside the config's (the numerics the run's ``auto`` dtypes resolved to).

        ``parent_run_id`` makes it a nested child run (sweeps); ``origin`` tags where it comes from; a ``group``
        run (a sweep's parent) stands for runs of several configs: it gets neither the config's params nor its
        algorithm / mode / seed tags.  Returns the MLflow run id.
        """
        with self._lock:
            if self._run_id is not None:
                raise TrackingError(f"the tracker already has run {self._run_id}: finish() it first")
            all_tags = self._standard_tags(cfg, group)
            all_tags.update(origin.tags() if origin is not None else {})
            all_tags.update({str(k): str(v) for k, v in (tags or {}).items()})
            if parent_run_id:
                self._check_run(parent_run_id, "parent")
                all_tags["mlflow.parentRunId"] = parent_run_id
            new_params = {} if group else {**{k: param_value(v) for k, v in cfg.flat().items()},
                                           **{str(k): param_value(v) for k, v in (params or {}).items()}}
            if resume_run_id:
                run_id = self._resume(resume_run_id, new_params, all_tags)
            else:
                name = cfg.run_name_for(run_name)
                run = self.client.create_run(self.experiment_id(), run_name=name, tags=all_tags)
                run_id = run.info.run_id
                if not group:
                    self._log_params(run_id, new_params)
                log.info("MLflow run %s (%s) started in experiment %r at %s", run_id, name, self.experiment,
                         self.tracking_uri)
            self._run_id = run_id
            if self.system_metrics and cfg.tracking.system_metrics:
                self._start_system_metrics(resume=bool(resume_run_id))
            return run_id

    def _check_run(self, run_id: str, what: str) -> Any:
        try:
            return self.client.get_run(run_id)
        except MlflowException as exc:
            raise TrackingError(f"{what} MLflow run {run_id!r} not found at {self.tracking_uri}: {exc}") from None

    def _resume(self, run_id: str, new: dict[str, str], tags: dict[str, str]) -> str:
        run = self._check_run(run_id, "resumed")
        if run.info.lifecycle_stage == "deleted":
            raise TrackingError(f"cannot resume MLflow run {run_id}: it was deleted")
        old = run.data.params
        changed = sorted(k for k in new if k in old and old[k] != new[k])
        if changed:  # MLflow params are immutable: keep the originals, record what differs
            log.warning("resumed run %s: config keys changed since it started (params keep the old values): %s",
                        run_id, ", ".join(changed))
            tags["resume_changed_params"] = ",".join(changed)[:MAX_TAG_VALUE]
        tags[TAG_RESUMES] = str(int(run.data.tags.get(TAG_RESUMES, "0")) + 1)
        self._log_params(run_id, {k: v for k, v in new.items() if k not in old})
        self._set_tags(run_id, tags)
        self._logged_before = self._logged_steps(run_id)
        self.client.update_run(run_id, status="RUNNING")
        log.info("MLflow run %s resumed (resume #%s)", run_id, tags[TAG_RESUMES])
        return run_id

    def _logged_steps(self, run_id: str) -> frozenset[tuple[str, int]]:
        """Every (metric key, step) the run already has: a resumed run repeats the steps after its checkpoint (or all
        of them, without one), and MLflow can neither replace nor delete a logged point, only add a second one."""
        keys = self.client.get_run(run_id).data.metrics
        return frozenset((key, m.step) for key in keys for m in self.client.get_metric_history(run_id, key))

    def runs_named(self, name: str) -> list[NamedRun]:
        """The experiment's (not deleted) runs called ``name``, newest first."""
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            return []
        quoted = name.replace("'", "\\'")
        found = self.client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{quoted}'",
                                        run_view_type=ViewType.ACTIVE_ONLY, order_by=["attributes.start_time DESC"])
        return [NamedRun(r.info.run_id, r.info.status, dict(r.data.params)) for r in found]

    def _standard_tags(self, cfg: ExperimentConfig, group: bool) -> dict[str, str]:
        """The config's tags (algorithm, mode, seed, hash: none for a ``group`` run) and the code's commit."""
        tags = {TAG_EXPERIMENT_NAME: cfg.name}
        if not group:
            tags.update({TAG_ALGORITHM: cfg.algorithm.loss, TAG_MODE: cfg.rollout.mode, TAG_SEED: str(cfg.seed),
                         TAG_CONFIG_HASH: cfg.config_hash()})
        sha = git_sha() or git_sha(Path(__file__).parent)
        if sha:
            tags[TAG_GIT_SHA] = sha
            tags["mlflow.source.git.commit"] = sha
        return tags

    def _start_system_metrics(self, resume: bool) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.system_metrics_interval_s,
                                                 resume_logging=resume, tracking_uri=self.tracking_uri)
            self._monitor.start()
        except Exception as exc:  # system metrics are a nicety: never fail a run over them
            log.warning("system metrics disabled: %s", exc)
            self._monitor = None

    def finish(self, status: str = "FINISHED") -> None:
        """Stop system metrics and mark the run terminated (FINISHED / FAILED / KILLED); idempotent."""
        if status not in TERMINAL_STATUSES:
            raise TrackingError(f"status must be one of {TERMINAL_STATUSES}; got {status!r}")
        with self._lock:
            if self._run_id is None:
                return
            self._drain_traces()
            if self._monitor is not None:
                try:
                    self._monitor.finish()
                except Exception as exc:
                    log.warning("stopping system metrics failed: %s", exc)
                self._monitor = None
            self.client.set_terminated(self._run_id, status=status)
            log.info("MLflow run %s %s", self._run_id, status.lower())
            self._run_id = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    # ---- params, tags, metrics ---------------------------------------------------------------------------

    def _log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        items = [Param(k[:MAX_KEY], v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i: i + PARAMS_PER_BATCH])

    def _set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        items = [RunTag(k[:MAX_KEY], str(v)[:MAX_TAG_VALUE]) for k, v in tags.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i: i + PARAMS_PER_BATCH])

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Extra params (values stringified and cut like config params); params are write-once in MLflow."""
        self._log_params(self.run_id, {k: param_value(v) for k, v in params.items()})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._set_tags(self.run_id, {k: str(v) for k, v in tags.items()})

    def log_datasets(self, datasets: Sequence[DatasetRecord]) -> None:
        """The datasets the run read, as MLflow dataset inputs (the run page's "Datasets used")."""
        if datasets:
            self.client.log_inputs(self.run_id, datasets=[d.as_input() for d in datasets])

    def run_url(self, run_id: str | None = None) -> str | None:
        """The run's page in the MLflow UI: on the ``http(s)://`` tracking server, else (a SQLite store no UI is
        known to serve) where ``aepo ui`` shows it with its default ports (:func:`ui_run_url`)."""
        rid = run_id or self.run_id
        if not self.served():
            return ui_run_url(self.experiment_id(), rid)
        return run_page(self.tracking_uri, self.experiment_id(), rid)

    def served(self) -> bool:
        """Whether the tracking URI is an MLflow server (whose UI shows the runs at that URL)."""
        return self.tracking_uri.startswith(("http://", "https://"))

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> int:
        """Log metrics at ``step`` (names made MLflow-legal); NaN/inf and non-numbers are skipped. Returns count."""
        ts = int(time.time() * 1000)
        items = []
        for name, value in metrics.items():
            try:
                if isinstance(value, (str, bytes)):
                    raise TypeError(type(value).__name__)
                x = float(value)  # ints, numpy scalars, 0-d tensors
            except (TypeError, ValueError):
                log.warning("metric %s: %r is not a number; skipped", name, value)
                continue
            if not math.isfinite(x):
                log.debug("metric %s at step %d is %s; skipped", name, step, x)
                continue
            key = metric_key(name)
            if (key, int(step)) in self._logged_before:  # logged before the resume: a step's metrics go in once
                continue
            if key != name and name not in self._renamed_keys:
                self._renamed_keys.add(name)
                log.info("metric %r is logged as %r (MLflow name rules)", name, key)
            items.append(Metric(key, x, ts, int(step)))
        for i in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i: i + METRICS_PER_BATCH])
        return len(items)

    def metric_history(self, keys: Sequence[str] | None = None,
                       run_id: str | None = None) -> dict[str, list[tuple[int, float]]]:
        """``{metric: [(step, value), …]}`` sorted by step (all the run's metrics when ``keys`` is None)."""
        rid = run_id or self.run_id
        if keys is None:
            keys = sorted(self.client.get_run(rid).data.metrics)
        out = {}
        for key in keys:
            hist = self.client.get_metric_history(rid, metric_key(key))
            out[key] = sorted((m.step, m.value) for m in hist)
        return out

    # ---- artifacts ---------------------------------------------------------------------------------------

    def log_config(self, cfg: ExperimentConfig, artifact_file: str = "config.yaml") -> None:
        """The resolved config as YAML (what ``aepo train -c`` can re-run)."""
        self.client.log_text(self.run_id, cfg.to_yaml(), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, dict(data), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (e.g. ``plots/curves.png``)."""
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """A local file (or a directory's contents) as artifacts under ``artifact_path``."""
        p = Path(local_path)
        if not p.exists():
            raise TrackingError(f"cannot log artifact {p}: no such file or directory")
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def list_artifacts(self, path: str | None = None) -> list[str]:
        return [f.path for f in self.client.list_artifacts(self.run_id, path)]

    def log_trajectory_sample(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None, *,
                              max_rows: int = 16, step: int | None = None, questions: Mapping[str, str] | None = None,
                              artifact_file: str | None = None) -> pd.DataFrame:
        """A sample of trajectories as an MLflow table (one per question first, then round-robin).

        ``scores[i][j]`` is the score of leaf ``j`` of ``trees[i]`` (``StepScores.leaves``; None: reward and
        advantage left empty). ``questions`` maps question ids to their text (trees hold token ids only).
        Returns the logged frame.
        """
        if max_rows < 1:
            raise ValueError(f"max_rows must be ≥ 1; got {max_rows}")
        if scores is not None:
            from aepo_core.scoring import check_aligned

            check_aligned(trees, scores)
        rows: list[dict[str, Any]] = []
        depth = max((len(t.leaves) for t in trees), default=0)
        for j in range(depth):
            for ti, t in enumerate(trees):
                if j < len(t.leaves) and len(rows) < max_rows:
                    rows.append(_sample_row(t, j, None if scores is None else scores[ti][j], step, questions))
        df = pd.DataFrame(rows, columns=list(_SAMPLE_COLUMNS))
        name = artifact_file or (f"trajectories/step_{step:06d}.json" if step is not None
                                 else "trajectories/sample.json")
        self.client.log_table(self.run_id, data=df, artifact_file=name)
        return df

    def log_rollout_traces(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None, *,
                           step: int, kind: TraceKind, label: str, questions: Mapping[str, str]
                           ) -> Future[list[str]] | None:
        """Each of ``trees`` as an MLflow trace of the run at ``step`` (:mod:`infra.tracking.traces`), built and
        written in the background; the future holds the trace ids. ``kind``/``label`` say what produced them
        (``train``/``step3``, ``eval``/``final/gsm8k``); nothing when ``trees`` is empty.

        Why in the background: the default sample (2 questions × 12 leaves, 194 spans) took 1.5 s a step on a
        loaded 2-core machine (0.3 s building the spans, the rest SQLite), time a step need not wait for. The
        trees are not changed after their step. :meth:`finish` waits for the writes; a failed write is a
        warning (traces are for reading a run, not part of its results)."""
        if scores is not None:
            from aepo_core.scoring import check_aligned

            check_aligned(trees, scores)
        if not trees:
            return None
        target = TraceTarget(self.experiment_id(), self.run_id, step, kind, label)
        end_ns = time.time_ns()
        future = self._background.submit(self._write_traces, target, trees, scores, questions, end_ns)
        self._pending.append(future)
        return future

    def _write_traces(self, target: TraceTarget, trees: Sequence[RolloutTree],
                      scores: Sequence[Sequence[LeafScore]] | None, questions: Mapping[str, str], end_ns: int
                      ) -> list[str]:
        """Build and write the traces; their cost is the metric ``traces/<kind>_s`` at their step."""
        t0 = time.perf_counter()
        ids = self.log_traces(rollout_traces(target, trees, scores, questions, end_ns))
        # through log_metrics: a resumed run that repeats the step does not log it a second time
        self.log_metrics({f"traces/{target.kind}_s": time.perf_counter() - t0}, target.step)
        return ids

    def _drain_traces(self) -> None:
        """Wait for the background trace writes; report the failed ones."""
        pending, self._pending = self._pending, []
        for future in pending:
            if exc := future.exception():
                log.warning("MLflow traces of run %s not written: %s", self._run_id, exc)

    def log_traces(self, traces: Sequence[Trace]) -> list[str]:
        """Write finished traces to the tracking store, the way MLflow's own exporter does but synchronously
        and with this tracker's URI: the spans first (a SQL store keeps them in its tables), then each trace's
        info; a store that keeps no spans gets them as the trace's artifact."""
        if not traces:
            return []
        tracing = TracingClient(self.tracking_uri)
        experiment_id = traces[0].info.experiment_id
        in_store = True
        try:
            tracing.log_spans(experiment_id, [s for t in traces for s in t.data.spans])
        except NotImplementedError:
            in_store = False
        ids = []
        for t in traces:
            info = tracing.start_trace(t.info)
            if not in_store or info.tags.get(TraceTagKey.SPANS_LOCATION) != SpansLocation.TRACKING_STORE.value:
                tracing._upload_trace_data(info, t.data)  # the exporter's own fallback (no public equivalent)
            ids.append(info.trace_id)
        return ids

    # ---- models ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _fluent_uri(self) -> Iterator[None]:
        """Point MLflow's process-global tracking URI at ours for one fluent call (serialized)."""
        import mlflow

        with _model_lock:
            env_before = os.environ.get("MLFLOW_TRACKING_URI")
            before = mlflow.get_tracking_uri()
            mlflow.set_tracking_uri(self.tracking_uri)
            try:
                yield
            finally:
                mlflow.set_tracking_uri(before)
                if env_before is None:
                    os.environ.pop("MLFLOW_TRACKING_URI", None)
                else:
                    os.environ["MLFLOW_TRACKING_URI"] = env_before

    def log_model(self, model: Any, tokenizer: Any, name: str = "model", task: str = "text-generation",
                  protocol: AgentProtocol | None = None) -> LoggedPolicy:
        """Log a transformers model + tokenizer with ``mlflow.transformers``; with a ``protocol``, the model carries
        it (metadata :data:`PROTOCOL_METADATA`) and its prompt template is the rollout prompt, so a served model
        answers from the system prompt it was trained with."""
        import mlflow.transformers
        import torch
        import transformers

        from infra.models import chat_prompt_template

        reqs = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
        run_id = self.run_id
        # Created here so it belongs to the run's experiment (the fluent path would use the process's active
        # experiment, "Default", and its ./mlruns artifact root).
        logged = self.client.create_logged_model(self.client.get_run(run_id).info.experiment_id, name=name,
                                                 source_run_id=run_id)
        extra: dict[str, Any] = {}
        if protocol is not None:
            extra = {"metadata": {PROTOCOL_METADATA: protocol.as_dict()},
                     "prompt_template": chat_prompt_template(tokenizer, protocol.system_prompt)}
        with self._fluent_uri(), _quieter("mlflow.transformers", logging.ERROR):
            # Its two warnings are about the Hugging Face Hub (no model card for a local path, no license found):
            # every local checkpoint gets both.
            info = mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name=name, task=task,
                run_id=run_id, model_id=logged.model_id, pip_requirements=reqs,  # explicit reqs: no slow inference
                **extra,
            )
        log.info("logged model %s of run %s", info.model_uri, run_id)
        return LoggedPolicy(info.model_uri, logged.model_id)

    def register_model(self, logged: LoggedPolicy, name: str, metrics: Mapping[str, float], step: int,
                       description: str) -> str:
        """Register ``logged`` as a new version of ``name`` (created when absent), tagged with ``metrics`` (MLflow
        names) and its training ``step``; returns ``models:/<name>/<version>``."""
        try:
            self.client.create_registered_model(name, description="AEPO policies: each version the final policy "
                                                "of a training run, with its evaluation metrics as tags.")
        except MlflowException as exc:  # another run registered the name first: add a version to it
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = {metric_key(k): f"{v:.6g}" for k, v in metrics.items() if math.isfinite(v)}
        tags["step"] = str(step)
        tags[VERSION_TAG_MODEL_ID] = logged.model_id  # the SQL registry stores no model_id of its own (3.17)
        # The source is the model's artifact location, not its models:/m-… URI: MLflow's SQL registry resolves
        # the latter through the process-global tracking URI (its own TODO), not this client's.
        source = self.client.get_logged_model(logged.model_id).artifact_location
        version = self.client.create_model_version(name, source=source, run_id=self.run_id, tags=tags,
                                                   description=description, model_id=logged.model_id)
        uri = f"{REGISTRY_SCHEME}{name}/{version.version}"
        self.set_tags({TAG_REGISTERED_MODEL: uri})
        log.info("registered %s (run %s)", uri, self.run_id)
        return uri

    def fetch_registered(self, uri: str, cache_dir: str | os.PathLike[str]) -> RegisteredPolicy:
        """A registered policy version (``models:/<name>/<version>``) downloaded under ``cache_dir/<name>/<version>``
        (reused when already there), with its protocol and its training run's config; :class:`RegistryError` when
        the version does not exist or is not an AEPO policy."""
        from mlflow.models import Model

        name, _, version = uri.removeprefix(REGISTRY_SCHEME).rpartition("/")
        if not name or not version.isdigit():
            raise RegistryError(f"{uri}: expected models:/<name>/<version> (a version number)")
        try:
            mv = self.client.get_model_version(name, version)
        except MlflowException as exc:
            raise RegistryError(f"{uri}: no such registered model version at {self.tracking_uri} "
                                f"({exc.message})") from None
        local = Path(cache_dir) / name / version
        if not (local / "MLmodel").is_file():
            self.download_artifacts(uri, local)
        metadata = Model.load(str(local / "MLmodel")).metadata or {}
        if PROTOCOL_METADATA not in metadata:
            raise RegistryError(f"{uri}: not an AEPO policy (its MLmodel carries no {PROTOCOL_METADATA})")
        try:
            protocol = AgentProtocol.from_dict(metadata[PROTOCOL_METADATA], source=uri)
        except ValueError as exc:
            raise RegistryError(str(exc)) from None
        config: dict[str, object] = {}
        if mv.run_id:
            text = self.client.download_artifacts(mv.run_id, "config.yaml", str(local))
            config = yaml.safe_load(Path(text).read_text()) or {}
        return RegisteredPolicy(uri, name, version, local, protocol, mv.run_id, mv.tags.get(VERSION_TAG_MODEL_ID),
                                int(mv.tags.get("step", "0")), config)

    def link_model(self, policy: RegisteredPolicy) -> None:
        """Record on the run that it used ``policy``: a model input (MLflow 3's run ↔ logged-model link) and the
        ``registered_model`` tag (as on the training run that registered it)."""
        from mlflow.entities import LoggedModelInput

        if policy.model_id:
            self.client.log_inputs(self.run_id, models=[LoggedModelInput(policy.model_id)])
        self.set_tags({TAG_REGISTERED_MODEL: policy.uri})

    def load_model(self, model_uri: str, return_type: str = "components") -> Any:
        """Load a model logged by :meth:`log_model` (a dict of components, or a pipeline)."""
        import mlflow.transformers

        with self._fluent_uri():
            return mlflow.transformers.load_model(model_uri, return_type=return_type)

    def download_artifacts(self, artifact_uri: str, dst_path: str | os.PathLike[str]) -> Path:
        """Copy artifacts (``runs:/…`` or ``models:/…``) to a local directory."""
        import mlflow.artifacts

        with self._fluent_uri():
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst_path)))

    # ---- queries -----------------------------------------------------------------------------------------

    def search_runs(self, experiment: str | None = None, filter_string: str = "",
                    order_by: Sequence[str] | None = None, max_results: int = 10_000) -> pd.DataFrame:
        """Runs of an experiment (default: ours) as a frame shaped like ``mlflow.search_runs``'s."""
        name = experiment or self.experiment
        exp = self.client.get_experiment_by_name(name)
        rows: list[dict[str, Any]] = []
        if exp is not None:
            token = None
            while len(rows) < max_results:
                page = self.client.search_runs([exp.experiment_id], filter_string=filter_string,
                                               run_view_type=ViewType.ACTIVE_ONLY,
                                               max_results=min(1000, max_results - len(rows)),
                                               order_by=list(order_by or ["attributes.start_time DESC"]),
                                               page_token=token)
                rows.extend(_run_row(r) for r in page)
                token = page.token
                if not token:
                    break
        base = ["run_id", "experiment_id", "run_name", "status", "artifact_uri", "start_time", "end_time"]
        df = pd.DataFrame(rows)
        return df if not df.empty else pd.DataFrame(columns=base)


_SAMPLE_COLUMNS = ("step", "question_id", "question", "leaf_id", "sample_kind", "status", "reward", "advantage",
                   "num_tool_calls", "tools", "response")


@contextlib.contextmanager
def _quieter(logger: str, level: int) -> Iterator[None]:
    """``logger`` at ``level`` or above while inside (unless it is configured to show more: DEBUG stays)."""
    lg = logging.getLogger(logger)
    before = lg.level
    if before == logging.NOTSET or before > logging.DEBUG:
        lg.setLevel(max(level, before))
    try:
        yield
    finally:
        lg.setLevel(before)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _sample_row(tree: RolloutTree, j: int, score: LeafScore | None, step: int | None,
                questions: Mapping[str, str] | None) -> dict[str, Any]:
    leaf = tree.leaves[j]
    events = tree.tool_events(leaf)
    return {"step": step, "question_id": tree.question_id, "question": (questions or {}).get(tree.question_id, ""),
            "leaf_id": leaf.leaf_id, "sample_kind": leaf.sample_kind, "status": leaf.status,
            "reward": _finite_or_none(score.reward if score else None),
            "advantage": _finite_or_none(score.advantage if score else None),
            "num_tool_calls": len(events), "tools": ",".join(e.name for e in events), "response": tree.text(leaf)}


def _ms_to_ts(ms: int | None) -> pd.Timestamp | None:
    return pd.Timestamp(ms, unit="ms", tz="UTC") if ms else None


def _run_row(run: Any) -> dict[str, Any]:
    info, data = run.info, run.data
    row: dict[str, Any] = {"run_id": info.run_id, "experiment_id": info.experiment_id, "run_name": info.run_name,
                           "status": info.status, "artifact_uri": info.artifact_uri,
                           "start_time": _ms_to_ts(info.start_time), "end_time": _ms_to_ts(info.end_time)}
    row.update({f"metrics.{k}": v for k, v in data.metrics.items()})
    row.update({f"params.{k}": v for k, v in data.params.items()})
    row.update({f"tags.{k}": v for k, v in data.tags.items()})
    return row


__all__ = [
    "DatasetRecord",
    "LoggedPolicy",
    "RegisteredPolicy",
    "RegistryError",
    "RunOrigin",
    "Tracker",
    "TrackingError",
    "artifact_location_for",
    "git_sha",
    "metric_key",
    "open_store",
    "param_value",
    "resolve_tracking",
    "tracking_uri_for",
]


class RankTracker:
    """The tracker of a data-parallel rank other than 0: it takes the train flow's tracking calls and records
    nothing, so a run under ``torchrun``/``deepspeed`` has one MLflow run, rank 0's. Its ``run_id`` is a label
    (``rank<N>``), never an MLflow id; :meth:`metric_history` is empty."""

    def __init__(self, rank: int, tracking_uri: str = "") -> None:
        self.rank = rank
        self.tracking_uri = tracking_uri

    @property
    def run_id(self) -> str:
        return f"rank{self.rank}"

    def start(self, cfg: ExperimentConfig, **_: Any) -> str:
        return self.run_id

    def __enter__(self) -> RankTracker:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def log_config(self, cfg: ExperimentConfig, artifact_file: str = "config.yaml") -> None:
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> int:
        return 0

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        return None

    def log_datasets(self, datasets: Sequence[DatasetRecord]) -> None:
        return None

    def run_url(self, run_id: str | None = None) -> str | None:
        return None

    def served(self) -> bool:
        return False

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        return None

    def metric_history(self, keys: Sequence[str] | None = None) -> dict[str, list[tuple[int, float]]]:
        return {}

    def log_model(self, model: Any, tokenizer: Any, name: str = "model", protocol: AgentProtocol | None = None
                  ) -> None:
        return None

    def log_trajectory_sample(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None,
                              **_: Any) -> None:
        return None

    def log_rollout_traces(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None,
                           **_: Any) -> None:
        return None
