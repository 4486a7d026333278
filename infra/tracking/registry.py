"""The model registry: a run's final policy logged as an MLflow model, registered as a version of a named model, and
fetched back (with its agent protocol and its training run's config) to be evaluated.

A logged policy carries its :class:`~aepo_core.protocol.AgentProtocol` in its MLmodel metadata
(:data:`PROTOCOL_METADATA`); a registered version is tagged with its evaluation metrics, its training step, what
made it (:class:`PolicyProvenance`: algorithm, rollout mode, base model, seed, config hash) and the LoggedModel it
came from (:data:`VERSION_TAG_MODEL_ID`), by which an evaluation run links to it. The link goes both ways: the
LoggedModel lists its versions (MLflow 3's ``mlflow.modelVersions`` tag, which its page reads: without it the page
said "Not registered" and offered to register a duplicate). The alias ``best`` follows the highest
:attr:`PolicyProvenance.selection_metric` so far (``models:/<name>@best``); the newest version needs none
(``models:/<name>/latest``, and MLflow reserves the alias name ``latest``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from mlflow.entities import LoggedModelStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from aepo_core.protocol import AgentProtocol
from infra.tracking.client import (
    TAG_REGISTERED_MODEL,
    TrackingError,
    download_artifacts,
    fluent_uri,
    metric_key,
)
from infra.tracking.run import Tracker

log = logging.getLogger(__name__)


class RegistryError(TrackingError):
    """A registered model that cannot be evaluated as asked (unknown name or version, not an AEPO policy)."""


PROTOCOL_METADATA = "aepo_protocol"
"""The MLmodel metadata key under which a logged policy carries its :class:`AgentProtocol`."""
REGISTRY_SCHEME = "models:/"
VERSION_TAG_MODEL_ID = "model_id"
"""The model version tag naming its MLflow LoggedModel (by which an evaluation run is linked to it)."""
MODEL_TAG_STEP = "aepo.step"
"""The LoggedModel tag holding the training step of the weights it holds."""


@dataclass(frozen=True)
class LoggedPolicy:
    """A policy logged by :func:`log_model`: its model URI (``models:/m-…``) and MLflow LoggedModel id."""

    uri: str
    model_id: str


@dataclass(frozen=True)
class PolicyProvenance:
    """What made a registered policy, as version tags: enough to tell versions apart in the registry's list."""

    algorithm: str  # algorithm.loss
    rollout_mode: str  # rollout.mode
    base_model: str  # model.name
    seed: int
    config_hash: str  # ExperimentConfig.config_hash()
    selection_metric: str  # the final-evaluation metric the ``best`` alias follows (higher is better)

    def tags(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "rollout_mode": self.rollout_mode, "base_model": self.base_model,
                "seed": str(self.seed), "config_hash": self.config_hash, "selection_metric": self.selection_metric}


ALIAS_BEST = "best"


@dataclass(frozen=True)
class RegisteredPolicy:
    """A registered policy version fetched for evaluation: where it lies locally (the MLflow model directory, HF
    weights in ``model/``), its protocol, the training run that logged it and that run's resolved config."""

    uri: str  # models:/<name>/<version>, the version resolved (a /latest or @alias given)
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


def log_model(tracker: Tracker, model: Any, tokenizer: Any, step: int, name: str = "model",
              task: str = "text-generation", protocol: AgentProtocol | None = None) -> LoggedPolicy:
    """Log a transformers model + tokenizer at training ``step`` with ``mlflow.transformers``; with a
    ``protocol``, the model carries it (metadata :data:`PROTOCOL_METADATA`) and its prompt template is the rollout
    prompt, so a served model answers from the system prompt it was trained with.

    Once per run and step: a run resumed after a kill finds the model an earlier attempt logged whole (READY, tag
    :data:`MODEL_TAG_STEP` = ``step``) and returns it; one that attempt left half-written (still PENDING, or FAILED)
    is deleted first. Without this a kill during model logging left the run with two ``policy`` models."""
    import mlflow.transformers
    import torch
    import transformers

    from infra.models import chat_prompt_template

    run_id = tracker.run_id
    experiment = tracker.client.get_run(run_id).info.experiment_id
    for earlier in tracker.client.search_logged_models(
            experiment_ids=[experiment], filter_string=f"source_run_id = '{run_id}' AND name = '{name}'"):
        if earlier.tags.get(MODEL_TAG_STEP) != str(step):
            continue  # the policy of an earlier end of this run (resumed with more steps): kept
        if earlier.status == LoggedModelStatus.READY:
            log.info("model %s of run %s at step %d was logged before the resume", earlier.model_id, run_id, step)
            return LoggedPolicy(f"{REGISTRY_SCHEME}{earlier.model_id}", earlier.model_id)
        log.info("deleting model %s (%s): left half-logged by a killed attempt", earlier.model_id, earlier.status)
        tracker.client.delete_logged_model(earlier.model_id)
    reqs = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    # Created here so it belongs to the run's experiment (the fluent path would use the process's active
    # experiment, "Default", and its ./mlruns artifact root).
    # The run's params on the model (its page's Parameters), as the fluent log_model would set them.
    logged = tracker.client.create_logged_model(experiment, name=name, source_run_id=run_id,
                                                tags={MODEL_TAG_STEP: str(step)},
                                                params=dict(tracker.client.get_run(run_id).data.params))
    extra: dict[str, Any] = {}
    if protocol is not None:
        extra = {"metadata": {PROTOCOL_METADATA: protocol.as_dict()},
                 "prompt_template": chat_prompt_template(tokenizer, protocol.system_prompt)}
    with fluent_uri(tracker.tracking_uri), _quieter("mlflow.transformers", logging.ERROR):
        # Its two warnings are about the Hugging Face Hub (no model card for a local path, no license found):
        # every local checkpoint gets both.
        info = mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer}, name=name, task=task,
            run_id=run_id, model_id=logged.model_id, pip_requirements=reqs,  # explicit reqs: no slow inference
            # the step the run's output names and whose metrics MLflow links to the model: the final one (the
            # final evaluation). At the default 0 the model showed the SFT evaluation's metrics as its own.
            step=step, **extra,
        )
    log.info("logged model %s of run %s", info.model_uri, run_id)
    return LoggedPolicy(info.model_uri, logged.model_id)


def register_model(tracker: Tracker, logged: LoggedPolicy, name: str, metrics: Mapping[str, float], step: int,
                   description: str, provenance: PolicyProvenance) -> str:
    """Register ``logged`` as a new version of ``name`` (created when absent), tagged with ``metrics`` (MLflow
    names), its training ``step`` and its ``provenance``; link the LoggedModel back to it and point ``best`` at it
    when its selection metric is at least the best's; returns ``models:/<name>/<version>``.

    Once per LoggedModel: a run resumed after a kill during registration finds the version already made from
    ``logged`` and finishes linking it instead of adding a second version of the same weights."""
    try:
        tracker.client.create_registered_model(name, description="AEPO policies: each version the final policy "
                                               "of a training run, with its evaluation metrics as tags.")
    except MlflowException as exc:  # another run registered the name first: add a version to it
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {metric_key(k): f"{v:.6g}" for k, v in metrics.items() if math.isfinite(v)}
    tags["step"] = str(step)
    tags[VERSION_TAG_MODEL_ID] = logged.model_id  # the SQL registry stores no model_id of its own (3.17)
    tags.update(provenance.tags())
    # The source is the model's models:/m-… URI, MLflow 3's link: the registry page shows "Source Model" (a link to
    # the model's page) only for such a source. MLflow's SQL registry resolves it through the process-global
    # tracking URI, not this client's (an MLflow limitation), hence fluent_uri; it keeps no model_id of its own
    # (3.17: None on the version however it is created), so the version tag above names the model too.
    made = [v for v in tracker.client.search_model_versions(f"name = '{name}' AND run_id = '{tracker.run_id}'")
            if v.tags.get(VERSION_TAG_MODEL_ID) == logged.model_id]
    if made:
        version = made[0]
    else:
        with fluent_uri(tracker.tracking_uri):
            version = tracker.client.create_model_version(name, source=f"{REGISTRY_SCHEME}{logged.model_id}",
                                                          run_id=tracker.run_id, tags=tags, description=description,
                                                          model_id=logged.model_id)
    uri = f"{REGISTRY_SCHEME}{name}/{version.version}"
    _link_logged_model(tracker, logged.model_id, name, str(version.version))
    client = tracker.client
    selection = metric_key(provenance.selection_metric)  # summaries say pass@1, MLflow names pass_at_1
    score = {metric_key(k): v for k, v in metrics.items()}.get(selection, math.nan)
    try:
        best = client.get_model_version_by_alias(name, ALIAS_BEST)
        best_score = float(best.tags.get(selection, "nan"))
    except MlflowException:  # no best yet
        best_score = -math.inf
    if math.isfinite(score) and not score < best_score:  # a best without that metric (NaN) is replaced
        client.set_registered_model_alias(name, ALIAS_BEST, version.version)
    tracker.set_tags({TAG_REGISTERED_MODEL: uri})
    log.info("registered %s (run %s)", uri, tracker.run_id)
    return uri


def _link_logged_model(tracker: Tracker, model_id: str, name: str, version: str) -> None:
    """Append (name, version) to the LoggedModel's ``mlflow.modelVersions`` tag, as ``mlflow.register_model`` does
    (we call the client's ``create_model_version``, which does not: see :func:`register_model`)."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    model = tracker.client.get_logged_model(model_id)
    listed = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    if {"name": name, "version": version} in listed:  # linked before a kill
        return
    tracker.client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [*listed, {"name": name, "version": version}])})


def resolve_version(tracker: Tracker, uri: str) -> ModelVersion:
    """The version ``uri`` names: ``models:/<name>/<version>``, ``models:/<name>/latest`` or ``models:/<name>@<alias>``
    (e.g. ``@best``); :class:`RegistryError` when there is none."""
    rest = uri.removeprefix(REGISTRY_SCHEME)
    name, at, alias = rest.rpartition("@")
    version = ""
    if not at:
        name, _, version = rest.rpartition("/")
    if not name or not ((at and alias) or version.isdigit() or version == "latest"):
        raise RegistryError(f"{uri}: expected models:/<name>/<version>, models:/<name>/latest or "
                            "models:/<name>@<alias>")
    client = tracker.client
    try:
        if at:
            return client.get_model_version_by_alias(name, alias)
        if version == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise RegistryError(f"{uri}: registered model {name!r} has no versions at {tracker.tracking_uri}")
            return max(versions, key=lambda v: int(v.version))
        return client.get_model_version(name, version)
    except MlflowException as exc:
        raise RegistryError(f"{uri}: no such registered model version at {tracker.tracking_uri} "
                            f"({exc.message})") from None


def fetch_registered(tracker: Tracker, uri: str, cache_dir: str | os.PathLike[str]) -> RegisteredPolicy:
    """A registered policy version (``models:/<name>/<version>``, ``/latest`` or ``@<alias>``) downloaded under
    ``cache_dir/<name>/<version>`` (reused when already there), with its protocol and its training run's config;
    :class:`RegistryError` when the version does not exist or is not an AEPO policy."""
    from mlflow.models import Model

    mv = resolve_version(tracker, uri)
    name, version = mv.name, str(mv.version)
    local = Path(cache_dir) / name / version
    if not (local / "MLmodel").is_file():
        download_artifacts(tracker.tracking_uri, f"{REGISTRY_SCHEME}{name}/{version}", local)  # the version resolved
    metadata = Model.load(str(local / "MLmodel")).metadata or {}
    if PROTOCOL_METADATA not in metadata:
        raise RegistryError(f"{uri}: not an AEPO policy (its MLmodel carries no {PROTOCOL_METADATA})")
    try:
        protocol = AgentProtocol.from_dict(metadata[PROTOCOL_METADATA], source=uri)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
    config: dict[str, object] = {}
    if mv.run_id:
        text = tracker.client.download_artifacts(mv.run_id, "config.yaml", str(local))
        config = yaml.safe_load(Path(text).read_text()) or {}
    return RegisteredPolicy(f"{REGISTRY_SCHEME}{name}/{version}", name, version, local, protocol, mv.run_id,
                            mv.tags.get(VERSION_TAG_MODEL_ID), int(mv.tags.get("step", "0")), config)


def link_model(tracker: Tracker, policy: RegisteredPolicy) -> None:
    """Record on the run that it used ``policy``: a model input (MLflow 3's run ↔ logged-model link) and the
    ``registered_model`` tag (as on the training run that registered it)."""
    from mlflow.entities import LoggedModelInput

    if policy.model_id:
        tracker.client.log_inputs(tracker.run_id, models=[LoggedModelInput(policy.model_id)])
    tracker.set_tags({TAG_REGISTERED_MODEL: policy.uri})


def load_model(tracking_uri: str, model_uri: str, return_type: str = "components") -> Any:
    """Load a model logged by :func:`log_model` (a dict of components, or a pipeline)."""
    import mlflow.transformers

    with fluent_uri(tracking_uri):
        return mlflow.transformers.load_model(model_uri, return_type=return_type)


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


__all__ = [
    "ALIAS_BEST",
    "LoggedPolicy",
    "PolicyProvenance",
    "RegisteredPolicy",
    "RegistryError",
    "fetch_registered",
    "is_registered_model",
    "link_model",
    "load_model",
    "log_model",
    "register_model",
    "resolve_version",
]
