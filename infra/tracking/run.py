"""A run in MLflow: :class:`Tracker`, one MLflow run per flow run, resumable, usable from worker threads, behind
:class:`RunLogger`, the calls a flow logs a run through (which :class:`RankTracker` takes on the ranks that record
nothing).

The experiment is created with an explicit artifact location (:func:`~infra.tracking.client.resolve_tracking`),
because MLflow on sqlite otherwise writes artifacts to ``./mlruns`` in the working directory.

Why :class:`mlflow.MlflowClient` with explicit run ids rather than ``mlflow.start_run``: Prefect runs tasks in
worker threads, and the fluent API keeps a per-thread active-run stack and one process-global tracking URI (the
fluent calls left go through :func:`~infra.tracking.client.fluent_uri`). The model registry is
:mod:`infra.tracking.registry`, the traces :mod:`infra.tracking.traces`, the URIs, tags and names
:mod:`infra.tracking.client`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

import pandas as pd
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag, ViewType
from mlflow.exceptions import MlflowException

from aepo_core.config import ExperimentConfig
from aepo_core.rollout.rows import SAMPLE_COLUMNS, leaf_row, sample_row
from aepo_core.scoring import check_aligned
from infra.config_files import load_config
from infra.data.rows import QuestionRow
from infra.tracking.client import (
    EXPERIMENT_KIND,
    MAX_KEY,
    MAX_TAG_VALUE,
    METRICS_PER_BATCH,
    PARAMS_PER_BATCH,
    TAG_ALGORITHM,
    TAG_CONFIG_HASH,
    TAG_EXPERIMENT_KIND,
    TAG_EXPERIMENT_NAME,
    TAG_GIT_SHA,
    TAG_MODE,
    TAG_RESUMES,
    TAG_SEED,
    TERMINAL_STATUSES,
    RunOrigin,
    TrackingError,
    download_artifacts,
    git_sha,
    headline_metrics,
    metric_key,
    open_store,
    param_value,
    resolve_tracking,
    run_page,
    ui_run_url,
)
from infra.tracking.logger import MetricLogger
from infra.tracking.traces import (
    TraceKey,
    TraceKind,
    TraceTarget,
    logged_trace_keys,
    rollout_traces,
    trace_key,
    write_traces,
)

if TYPE_CHECKING:
    from aepo_core.rollout.tree import RolloutTree
    from aepo_core.scoring import LeafScore

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class NamedRun:
    """A run found by its name: its id, status, the params it started with (the config, flattened) and its tags."""

    run_id: str
    status: str
    params: Mapping[str, str]
    tags: Mapping[str, str] = field(default_factory=dict)


class RunLogger(MetricLogger, Protocol):
    """What a flow logs a run through, on every rank: the scalars, params, text and files of any logger
    (:class:`~infra.tracking.logger.MetricLogger`) and what is MLflow's: starting and closing the run, its config
    and datasets, figures, traces and trajectory samples.

    :class:`Tracker` records into MLflow. The bodies here record nothing: they are what a rank other than 0
    (:class:`RankTracker`) does, so that class states only what differs (its run id). What only rank 0 does with
    its run (read the metric history, log and register the model, search runs) is :class:`Tracker`'s alone: a flow
    that needs it holds a ``Tracker``.
    """

    tracking_uri: str

    @property
    def run_id(self) -> str:
        """The run's id (MLflow's), set by :meth:`start`."""
        raise NotImplementedError

    def start(self, cfg: ExperimentConfig, run_name: str | None = None, tags: Mapping[str, Any] | None = None,
              resume_run_id: str | None = None, parent_run_id: str | None = None,
              origin: RunOrigin | None = None, group: bool = False, params: Mapping[str, Any] | None = None
              ) -> str:
        """Create (or resume) the run; returns its id."""
        return self.run_id

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run with a terminal status (FINISHED / FAILED / KILLED); idempotent."""
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """Finish the run: FINISHED, KILLED on Ctrl-C, FAILED on any other exception."""
        if exc_type is None:
            self.finish("FINISHED")
        else:
            self.finish("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    def run_url(self, run_id: str | None = None) -> str | None:
        """The run's page in the MLflow UI (None: none to show)."""
        return None

    def log_config(self, cfg: ExperimentConfig, artifact_file: str = "config.yaml") -> None:
        """The resolved config as YAML (what ``aepo train -c`` can re-run)."""
        return None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Extra params (values stringified and cut like config params); params are write-once."""
        return None

    def log_datasets(self, datasets: Sequence[DatasetRecord]) -> None:
        """The datasets the run read."""
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> int:
        """Metrics at ``step``; returns how many were logged."""
        return 0

    def log_text(self, text: str, artifact_file: str) -> None:
        """``text`` as the artifact ``artifact_file``."""
        return None

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """``data`` as a JSON (or YAML, by the file's suffix) artifact."""
        return None

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (e.g. ``plots/curves.png``)."""
        return None

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """A local file (or a directory's contents) as artifacts under ``artifact_path``."""
        return None

    def log_trajectory_sample(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None, *,
                              max_rows: int = 16, step: int | None = None, questions: Mapping[str, str] | None = None,
                              artifact_file: str | None = None) -> pd.DataFrame | None:
        """A sample of trajectories as a table; returns the logged frame (None: nothing logged)."""
        return None

    def log_rollout_traces(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None, *,
                           step: int, kind: TraceKind, label: str, questions: Mapping[str, QuestionRow]
                           ) -> Future[list[str]] | None:
        """Rollout trees as traces of the run at ``step``; the future holds the trace ids (None: none written)."""
        return None

    def flush_traces(self) -> None:
        """Wait until the traces logged so far are written: call it before a stage is made durable (its checkpoint,
        its evaluation file), which a resumed run does not repeat, so a kill after it cannot lose them."""
        return None


class Tracker(RunLogger):
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
        self._traced_before: frozenset[TraceKey] = frozenset()
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
        self._traced_before = logged_trace_keys(self.client, run.info.experiment_id, run_id)
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
        return [NamedRun(r.info.run_id, r.info.status, dict(r.data.params), dict(r.data.tags)) for r in found]

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
            self.flush_traces()
            if self._monitor is not None:
                try:
                    self._monitor.finish()
                except Exception as exc:
                    log.warning("stopping system metrics failed: %s", exc)
                self._monitor = None
            self.client.set_terminated(self._run_id, status=status)
            log.info("MLflow run %s %s", self._run_id, status.lower())
            self._run_id = None

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
        if not datasets:
            return
        inputs = [d.as_input() for d in datasets]
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except MlflowException as exc:
            # MLflow looks for the (experiment, name, digest) row and inserts it when absent, unlocked: two runs logging
            # the same new dataset at once (a sweep's children on two workers) race, and the later insert fails its
            # UNIQUE constraint with nothing written. Once more, the row exists and the input is linked to it.
            if "unique constraint" not in str(exc).lower():
                raise
            log.debug("dataset inputs of run %s raced another run's; logging them again", self.run_id)
            self.client.log_inputs(self.run_id, datasets=inputs)

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
        """Log metrics at ``step`` (names made MLflow-legal), with their :func:`headline_metrics` copies; NaN/inf and
        non-numbers are skipped. Returns count."""
        ts = int(time.time() * 1000)
        items = []
        for name, value in {**metrics, **headline_metrics(metrics)}.items():
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

    def logged_config(self, run_id: str, artifact_file: str = "config.yaml") -> ExperimentConfig:
        """The config a run logged (:meth:`log_config`) as today's code resolves it: keys renamed since under their
        new names, fields added since at their defaults. Raises ``ConfigError`` (invalid today) or
        ``MlflowException`` (no such artifact)."""
        with tempfile.TemporaryDirectory() as tmp:
            return load_config(download_artifacts(self.tracking_uri, f"runs:/{run_id}/{artifact_file}", tmp))

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
        """A sample of trajectories as an MLflow table (one per question first, then round-robin), a row each:
        :func:`~aepo_core.rollout.rows.sample_row`, the leaf's Parquet and trace row cut to what a reader scans.

        ``scores[i][j]`` is the score of leaf ``j`` of ``trees[i]`` (``StepScores.leaves``; None: reward and
        advantage left empty). ``questions`` maps question ids to their text (trees hold token ids only).
        Returns the logged frame.
        """
        if max_rows < 1:
            raise ValueError(f"max_rows must be ≥ 1; got {max_rows}")
        if scores is not None:
            check_aligned(trees, scores)
        rows: list[dict[str, Any]] = []
        depth = max((len(t.leaves) for t in trees), default=0)
        for j in range(depth):
            for ti, t in enumerate(trees):
                if j < len(t.leaves) and len(rows) < max_rows:
                    row = leaf_row(self.run_id, step, t, t.leaves[j], None if scores is None else scores[ti][j])
                    rows.append(sample_row(row, (questions or {}).get(t.question_id, "")))
        df = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
        name = artifact_file or (f"trajectories/step_{step:06d}.json" if step is not None
                                 else "trajectories/sample.json")
        self.client.log_table(self.run_id, data=df, artifact_file=name)
        return df

    def log_rollout_traces(self, trees: Sequence[RolloutTree], scores: Sequence[Sequence[LeafScore]] | None, *,
                           step: int, kind: TraceKind, label: str, questions: Mapping[str, QuestionRow]
                           ) -> Future[list[str]] | None:
        """Each of ``trees`` as an MLflow trace of the run at ``step`` (:mod:`infra.tracking.traces`), built and
        written in the background; the future holds the trace ids. ``kind``/``label`` say what produced them
        (``train``/``step3``, ``eval``/``final/gsm8k``); nothing when ``trees`` is empty.

        Why in the background: the default sample (2 questions × 12 leaves, 194 spans) took 1.5 s a step on a
        loaded 2-core machine (0.3 s building the spans, the rest SQLite), time a step need not wait for. The
        trees are not changed after their step. :meth:`finish` waits for the writes; a failed write is a
        warning (traces are for reading a run, not part of its results)."""
        if scores is not None:
            check_aligned(trees, scores)
        target = TraceTarget(self.experiment_id(), self.run_id, step, kind, label)
        new = [i for i, t in enumerate(trees) if trace_key(target, t.question_id) not in self._traced_before]
        if len(new) < len(trees):  # a resumed run repeating a stage whose traces were written before the kill
            trees = [trees[i] for i in new]
            scores = None if scores is None else [scores[i] for i in new]
        if not trees:
            return None
        end_ns = time.time_ns()
        future = self._background.submit(self._write_traces, target, trees, scores, questions, end_ns)
        self._pending.append(future)
        return future

    def _write_traces(self, target: TraceTarget, trees: Sequence[RolloutTree],
                      scores: Sequence[Sequence[LeafScore]] | None, questions: Mapping[str, QuestionRow], end_ns: int
                      ) -> list[str]:
        """Build and write the traces; their cost is a metric at their step: ``traces/train_s``, and per evaluation
        ``traces/eval/<label>_s`` (``traces/eval/sft/gsm8k_s``: the start and the post-SFT evaluation share step 0,
        and each dataset of a stage its step)."""
        t0 = time.perf_counter()
        ids = write_traces(self.tracking_uri, rollout_traces(target, trees, scores, questions, end_ns))
        key = "traces/train_s" if target.kind == "train" else f"traces/{target.kind}/{target.label}_s"
        # through log_metrics: a resumed run that repeats the step does not log it a second time
        self.log_metrics({key: time.perf_counter() - t0}, target.step)
        return ids

    def flush_traces(self) -> None:
        """Wait for the background trace writes; report the failed ones."""
        pending, self._pending = self._pending, []
        for future in pending:
            if exc := future.exception():
                log.warning("MLflow traces of run %s not written: %s", self._run_id, exc)

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


class RankTracker(RunLogger):
    """The tracker of a data-parallel rank other than 0: it takes the train flow's tracking calls and records
    nothing (:class:`RunLogger`'s bodies), so a run under ``torchrun``/``deepspeed`` has one MLflow run, rank 0's.
    Its ``run_id`` is a label (``rank<N>``), never an MLflow id."""

    def __init__(self, rank: int, tracking_uri: str = "") -> None:
        self.rank = rank
        self.tracking_uri = tracking_uri

    @property
    def run_id(self) -> str:
        return f"rank{self.rank}"


__all__ = ["DatasetRecord", "NamedRun", "RankTracker", "RunLogger", "Tracker"]
