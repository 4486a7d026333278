"""The sweep flow: a grid of training runs over config overrides, compared in one table.

Each (cell, seed) is a child ``train`` flow run and a nested MLflow run under one parent run named after the
sweep; the sweep ends with a comparison table built from ``mlflow.search_runs`` over the children (a markdown
Prefect artifact, CSVs and a PNG, logged to the parent run and written to ``<runs_dir>/sweeps/<name>/``).

Where the children run:

- ``deployment=None`` (the default, no server needed): here, one after another, as subflows of this process.
- ``deployment="aepo-train/train"`` (CLI ``--deployment``): each child is submitted as a flow run of that
  deployment (``prefect.deployments.run_deployment``, named like its MLflow run, linked as a subflow), at most
  ``max_parallel`` in flight at once (on top of any concurrency limit of the work pool), and the sweep polls
  their states every 2 s. Workers of the deployment's pool run them, on this machine or others: the child's
  parameters carry its whole resolved config, with the parent's MLflow tracking URI written in, so every child
  logs under the one parent run; for workers on other machines that URI must be an ``mlflow server``
  (``tracking.tracking_uri: http://…``). A child that ends in any state but Completed (Failed, Crashed,
  Cancelled, or still unfinished ``child_timeout_s`` after its submission: then it is cancelled) is reported by
  name and state; the others go on, the comparison of the finished ones is written, and the sweep ends failed.
  A worker lost with its flow run (machine gone, both processes killed) leaves the flow run Running for ever:
  nothing is left to report it, and Prefect's server does not notice. The sweep does: a Running child whose
  flow-run heartbeats (``prefect.flow-run.heartbeat`` events, every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` s,
  180 by default) stop for ``child_lost_after_s`` is marked Crashed and reported as lost, and its MLflow run,
  left RUNNING, is ended KILLED. (A worker killed alone is different: the flow run lives in a session of its
  own, notices that its worker is gone and reports itself Crashed within seconds.)
  README "Scaling out" has the commands for a process work pool with N workers.
- ``shard="i/N"`` (CLI ``--shard i/N``) selects every N-th (cell, seed) from the i-th, under its own parent run
  ``<name>-shard<i>of<N>``: it was the way to spread a sweep before the work pool (``bench/compare_algorithms.py
  --workers N`` still uses it and merges the shards' stores) and now only narrows the run list; it combines with
  either way of running.

Re-running a sweep (same name) skips the children that already FINISHED with the config they would run with now,
re-parented under the newest parent run; a scheduled sweep (flow parameter ``dated``) is a new sweep each time it
fires: :mod:`infra.run.sweep` has the bookkeeping and why.

The numerics are decided once per sweep (issue 49 §8): the parent run records the machine's facts (``system.*`` tags
and ``numerics.auto``, read back on ``--resume``) and every cell computes in them (the train flow's ``machine``
parameter, :func:`infra.numerics.numerics_for`): two arms never differ in numerics because of the load when each
started. A cell on a worker of another machine kind says so in one line, and refuses where the sweep chose bf16 and
bf16 is the slow path there.

``--resume`` (flow parameter ``resume``) continues a stopped sweep instead — Ctrl-C, SIGKILL, a lost worker, the
end of a working session: in the same parent run (the newest of the sweep's name), skipping the finished children
as above, and resuming each child that started and did not finish (same config) from its last checkpoint in its own
MLflow run (the train flow's resume). The final table equals an uninterrupted sweep's (``tests/flows/test_sweep.py``).
A sweep may also be continued a share at a time (``cells``, or ``bench.compare_algorithms --seeds N`` seed by seed):
the comparison logged to the parent covers every finished child of the sweep under it, not only the share that
invocation ran.

The sweep file's format is in :mod:`infra.run.sweep_spec`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import SyncPrefectClient
from prefect.runtime import flow_run

from aepo_core.config_keys import ConfigError
from flows.common import artifact_key, flow_runs_dir, run_origin
from flows.train import train
from infra.prefect_api import ChildRun, Watch, check_deployment, lost_after
from infra.run.lock import Claims
from infra.run.sweep import ChildFailure, FinishedChild, Launch, SweepBook
from infra.run.sweep_spec import SweepRun, sweep_spec
from tasks.progress import Progress, report

Logger = logging.Logger | logging.LoggerAdapter[Any]
POLL_S = 2.0  # seconds between two reads of the children's states in a fan-out (one API call per child in flight)


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep: its parent MLflow run, the comparison files, and the tables as records."""

    name: str
    parent_run_id: str
    runs_dir: str
    out_dir: str
    tracking_uri: str
    markdown_artifact_id: str
    files: dict[str, str]
    runs: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    started: list[str] = field(default_factory=list)
    """Run names of the children this invocation ran (or submitted)."""
    reused: list[str] = field(default_factory=list)
    """Run names of the children that had already FINISHED in MLflow and were not run again."""
    date: str | None = None
    """A dated sweep's (a scheduled firing's) UTC date-time: its parent run is ``<name>-<date>``."""


def sweep_flow_run_name() -> str:
    """The name of an ``aepo-sweep`` flow run: its MLflow parent run's, the sweep's name (``aepo-sweep`` when the
    sweep file does not load: the flow itself then fails with the error)."""
    params = flow_run.parameters
    try:
        return sweep_spec(params["sweep_config"], params.get("shard"), params.get("overrides"),
                          params.get("cells")).name
    except (ConfigError, OSError):
        return "aepo-sweep"


@flow(name="aepo-sweep", flow_run_name=sweep_flow_run_name, log_prints=True)
def sweep(sweep_config: str | dict[str, Any], runs_dir: str | None = None, shard: str | None = None,
          deployment: str | None = None, max_parallel: int = 4,
          child_timeout_s: float | None = None, child_lost_after_s: float | None = None,
          overrides: list[str] | None = None, cells: list[str] | None = None, resume: bool = False,
          dated: bool = False) -> SweepResult:
    """Run every (cell, seed) of the sweep — or of one shard ``"i/N"`` — as a nested training run, then compare
    them; returns the tables' paths. ``overrides`` (``"key=value"``) apply to every cell after its own;
    ``cells`` keeps only those cells.

    ``deployment`` (e.g. ``"aepo-train/train"``) submits each child as a flow run of that deployment, at most
    ``max_parallel`` in flight, and waits for them (a child still unfinished ``child_timeout_s`` after its
    submission is cancelled and reported failed; None: wait for ever). A Running child that sent heartbeats and
    then none for ``child_lost_after_s`` (None: 3 × this process's ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, which
    the workers should share) is lost with its worker: marked Crashed and reported failed. None runs them here,
    one after another.
    Children that already FINISHED in MLflow with the same run name, sweep name and config are not run again.

    ``resume`` continues a stopped sweep (Ctrl-C, SIGKILL, a lost worker, the end of a working session) in its own
    parent MLflow run, the newest of this sweep's name: finished children are skipped as above, and a child that
    started and did not finish (same config) resumes from its last checkpoint in its own MLflow run.

    ``dated`` (what a schedule passes) makes this call a new sweep: a parent run of its own named after the firing's
    date-time, every cell run again (see :mod:`infra.run.sweep`: why, and why not a code version in the hash)."""
    logger = get_run_logger()
    spec = sweep_spec(sweep_config, shard, overrides, cells)
    _check_limits(max_parallel, child_timeout_s, child_lost_after_s)
    runs = flow_runs_dir(runs_dir, spec.runs_dir or spec.base.storage.runs_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    book = SweepBook.open(spec, runs)
    if deployment is not None:
        _check_deployment(deployment, book.tracking_uri, logger)
    # One live process per sweep (infra.run.lock): a second invocation of this sweep fails here, before it
    # touches the parent run or starts a cell.
    with Claims(runs, sweep=spec.name):
        launch = book.start(resume, _firing_date() if dated else None, deployment, run_origin(
            "flows/sweep.py:sweep", f"AEPO sweep {spec.name}: {len(spec.cells)} cells × {len(spec.seeds)} seeds, "
            "one nested training run each."))
        logger.info("sweep %s: numerics for every cell decided on %s (auto: %s)", spec.name, launch.decided_on,
                    launch.auto)
        with book:
            done, todo, started = _plan(book, launch, resume, logger)
            if deployment is None:
                failed = _run_children(book, launch, todo, started, logger)
            else:
                watch = Watch(child_timeout_s, lost_after(child_lost_after_s))
                failed = _fan_out(book, launch, todo, started, deployment, max_parallel, watch, logger)
            for name, run_id in book.end_abandoned(launch, failed).items():
                logger.warning("sweep run %s: its MLflow run %s was still RUNNING: ended KILLED", name, run_id)
            comparison = book.compare(launch)
            artifact_id = create_markdown_artifact(markdown=comparison.markdown, key=artifact_key("sweep", spec.name),
                                                   description=f"comparison of sweep {spec.name}")
            if failed:  # the parent run ends FAILED; the comparison of the runs that finished is written
                raise RuntimeError(f"sweep {spec.name}: {len(failed)} of {len(spec.runs)} runs failed: "
                                   f"{', '.join(f'{f.run_name} ({f.state})' for f in failed)} "
                                   f"(comparison written to {launch.out_dir})")
        return SweepResult(spec.name, launch.parent, str(runs), str(launch.out_dir), book.tracking_uri,
                           str(artifact_id), {k: str(v) for k, v in comparison.files.items()},
                           comparison.runs.to_dict(orient="records"), comparison.summary.to_dict(orient="records"),
                           [r.run_name for r in todo], sorted(done), launch.date)


def _check_limits(max_parallel: int, child_timeout_s: float | None, child_lost_after_s: float | None) -> None:
    """The fan-out's limits must make sense (a bad one fails before anything starts)."""
    if max_parallel < 1:
        raise ConfigError(f"sweep max_parallel must be >= 1; got {max_parallel}")
    if child_timeout_s is not None and child_timeout_s <= 0:
        raise ConfigError(f"sweep child_timeout_s must be > 0 (or None); got {child_timeout_s}")
    if child_lost_after_s is not None and child_lost_after_s <= 0:
        raise ConfigError(f"sweep child_lost_after_s must be > 0 (or None); got {child_lost_after_s}")


def _check_deployment(deployment: str, tracking_uri: str, logger: Logger) -> None:
    """The deployment must exist on the Prefect API this flow talks to (a typo fails before any run starts), and
    the children's tracking URI should be one that workers on other machines can reach."""
    check_deployment(deployment)
    if not tracking_uri.startswith(("http://", "https://")):
        logger.warning("sweep children of %s log to %s: only workers that share this filesystem can write there; "
                       "set tracking.tracking_uri to an `mlflow server` (http://…) for workers on other machines",
                       deployment, tracking_uri)


def _firing_date() -> str:
    """The UTC date-time a dated sweep is named after: its flow run's scheduled start (a schedule's firing time)."""
    start = flow_run.scheduled_start_time or datetime.now(timezone.utc)
    return start.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")



def _plan(book: SweepBook, launch: Launch, resume: bool, logger: Logger
          ) -> tuple[dict[str, FinishedChild], list[SweepRun], set[str]]:
    """The children already FINISHED (reused, not run again), the runs left to do, and (``resume``) those of them
    that started and did not finish (they resume from their last checkpoint)."""
    done = book.reuse_finished(launch)
    for name, old in done.items():
        logger.info("sweep run %s already FINISHED in MLflow (run %s): not run again", name, old.run_id)
    todo = [r for r in book.spec.runs if r.run_name not in done]
    started = book.started(launch) if resume else set()
    for name in sorted(started & {r.run_name for r in todo}):
        logger.info("sweep run %s started and did not finish: it resumes from its last checkpoint", name)
    return done, todo, started


def _run_children(book: SweepBook, launch: Launch, todo: Sequence[SweepRun], started: set[str], logger: Logger
                  ) -> list[ChildFailure]:
    """Every (cell, seed) as a child ``train`` flow run nested under the parent (resumed when ``started``);
    returns the failed runs."""
    failed = []
    for i, run in enumerate(todo):
        report(logger, Progress("cell", done=i, total=len(todo), name=run.run_name),
               "sweep cell %d/%d: %s (%s)", i + 1, len(todo), run.run_name,
               ", ".join(f"{k}={v}" for k, v in run.overrides.items()))
        state = train(config=book.configs[run.run_name], runs_dir=str(book.runs), run_name=run.run_name,
                      parent_run_id=launch.parent, tags=launch.tags(book.spec, run), resume=run.run_name in started,
                      machine=launch.machine, return_state=True)
        if not state.is_completed():
            failed.append(ChildFailure(run.run_name, state.name or state.type.value))
            logger.error("sweep run %s ended %s: %s", run.run_name, state.type.value, state.message)
    return failed


@dataclass
class _FanOut:
    """One fan-out's children in flight on ``deployment`` (see :func:`_fan_out`): submitted, polled, given up on."""

    book: SweepBook
    launch: Launch
    deployment: str
    watch: Watch
    started: set[str]
    total: int
    client: SyncPrefectClient
    logger: Logger
    in_flight: dict[UUID, ChildRun] = field(default_factory=dict)
    failed: list[ChildFailure] = field(default_factory=list)
    finished: int = 0

    def submit(self, run: SweepRun) -> None:
        """``run`` as a flow run of the deployment, named like its MLflow run."""
        from prefect.deployments import run_deployment

        spec, launch = self.book.spec, self.launch
        submitted = run_deployment(
            self.deployment, timeout=0, flow_run_name=run.run_name, tags=["aepo-sweep", spec.name],
            # one child flow run per child and sweep flow run: a retry of this flow run submits
            # nothing twice, a resumed sweep (another flow run) submits afresh
            idempotency_key=f"{launch.parent}/{run.run_name}/{flow_run.id}",
            parameters={"config": self.book.configs[run.run_name].to_dict(), "runs_dir": str(self.book.runs),
                        "run_name": run.run_name, "parent_run_id": launch.parent, "overrides": [],
                        "resume": run.run_name in self.started, "tags": launch.tags(spec, run),
                        "machine": launch.machine})
        self.in_flight[submitted.id] = ChildRun(run.run_name, time.monotonic())
        report(self.logger, Progress("cell", done=self.finished, total=self.total, name=run.run_name),
               "sweep run %s submitted to %s as flow run %s (%d in flight)", run.run_name, self.deployment,
               submitted.id, len(self.in_flight))

    def poll(self) -> None:
        """Read each child's state once: one that ended, went silent (lost) or timed out leaves the flight."""
        for flow_run_id, child in list(self.in_flight.items()):
            self._check(flow_run_id, child)

    def _check(self, flow_run_id: UUID, child: ChildRun) -> None:
        from prefect.states import Cancelling, Crashed

        now, watch, logger = time.monotonic(), self.watch, self.logger
        state = self.client.read_flow_run(flow_run_id).state
        silent = (child.silent_for(self.client, flow_run_id, watch.lost_after_s, now)
                  if watch.lost_after_s is not None and state is not None and state.is_running() else None)
        if state is not None and state.is_final():
            self._land(flow_run_id)
            if not state.is_completed():
                self.failed.append(ChildFailure(child.name, state.name or state.type.value))
                logger.error("sweep run %s (flow run %s) ended %s: %s", child.name, flow_run_id, state.name,
                             state.message)
            else:
                report(logger, Progress("cell", done=self.finished, total=self.total, name=child.name),
                       "sweep run %s completed (%d of %d ended)", child.name, self.finished, self.total)
        elif silent is not None:
            self._land(flow_run_id)
            self.failed.append(ChildFailure(child.name, f"lost: no heartbeat for over {silent:g} s"))
            logger.error("sweep run %s (flow run %s) sent no heartbeat for over %g s: its worker is gone; marked "
                         "Crashed", child.name, flow_run_id, silent)
            self.client.set_flow_run_state(flow_run_id, Crashed(
                message=f"aepo sweep: no heartbeat for over {silent:g} s (worker lost)"), force=True)
        elif watch.timeout_s is not None and now - child.submitted > watch.timeout_s:
            self._land(flow_run_id)
            where = state.name if state is not None else "no state"
            self.failed.append(ChildFailure(child.name, f"timed out after {watch.timeout_s:g} s in {where}"))
            logger.error("sweep run %s (flow run %s) still %s after %g s: cancelled", child.name, flow_run_id,
                         where, watch.timeout_s)
            self.client.set_flow_run_state(flow_run_id, Cancelling(), force=True)

    def _land(self, flow_run_id: UUID) -> None:
        del self.in_flight[flow_run_id]
        self.finished += 1

    def cancel_all(self) -> None:
        from prefect.states import Cancelling

        for flow_run_id, child in self.in_flight.items():
            self.logger.warning("sweep stopped: cancelling %s (flow run %s)", child.name, flow_run_id)
            self.client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


def _fan_out(book: SweepBook, launch: Launch, todo: Sequence[SweepRun], started: set[str], deployment: str,
             max_parallel: int, watch: Watch, logger: Logger) -> list[ChildFailure]:
    """Every (cell, seed) as a flow run of ``deployment`` (named like its MLflow run), at most ``max_parallel``
    submitted and unfinished at once; polls their states and returns the runs that did not complete (ended in
    another state, timed out, or lost: see :class:`infra.prefect_api.Watch`). If the sweep itself is stopped (an
    exception, Ctrl-C, SIGTERM), the children in flight are cancelled."""
    from prefect.client.orchestration import get_client

    pending = list(todo)
    with get_client(sync_client=True) as client:
        fan = _FanOut(book, launch, deployment, watch, started, len(todo), client, logger)
        try:
            while pending or fan.in_flight:
                while pending and len(fan.in_flight) < max_parallel:
                    fan.submit(pending.pop(0))
                time.sleep(POLL_S)
                fan.poll()
        except BaseException:
            fan.cancel_all()
            raise
    return fan.failed
