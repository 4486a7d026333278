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
  docs/how-to/work-pool.md has the commands for a process work pool with N workers.
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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from aepo_core.config_keys import ConfigError
from aepo_core.sequential import Design
from flows.common import Logger, artifact_key, flow_runs_dir, run_origin
from flows.train import train
from infra.run.flight import Flight, Landing, Outcome, check_fan_out
from infra.run.lock import Claims
from infra.run.sequential import SequentialBook, outcome_lines, sequential_design
from infra.run.sweep import ChildFailure, FinishedChild, Launch, SweepBook, SweepRow
from infra.run.sweep_spec import SweepRun, sweep_spec
from tasks.progress import Progress, report

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
    sequential: list[str] = field(default_factory=list)
    """A sequential sweep's design and decisions, a line each (:func:`infra.run.sequential.outcome_lines`)."""

    def rows(self) -> list[SweepRow]:
        """The per-run records (``runs``, as ``runs.csv`` holds them) as typed rows."""
        return [SweepRow.from_record(r) for r in self.runs]


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
          dated: bool = False, sequential: bool = False) -> SweepResult:
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
    date-time, every cell run again (see :mod:`infra.run.sweep`: why, and why not a code version in the hash).
    ``sequential``: the file's ``sequential:`` design, wave by wave (:func:`_run_sequential`)."""
    logger = get_run_logger()
    spec = sweep_spec(sweep_config, shard, overrides, cells)
    design = sequential_design(spec, shard) if sequential else None
    check_fan_out(deployment, max_parallel, child_timeout_s, child_lost_after_s)
    runs = flow_runs_dir(runs_dir, spec.runs_dir or spec.base.storage.runs_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    book = SweepBook.open(spec, runs)
    if deployment is not None:
        _warn_unshared_tracking(deployment, book.tracking_uri, logger)
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
            failed, todo, lines = _execute(book, launch, design, todo, started,
                                           (deployment, max_parallel, (child_timeout_s, child_lost_after_s)), logger)
            for name, run_id in book.end_abandoned(launch, failed).items():
                logger.warning("sweep run %s: its MLflow run %s was still RUNNING: ended KILLED", name, run_id)
            comparison = book.compare(launch)
            artifact_id = create_markdown_artifact(
                markdown="\n".join([comparison.markdown, *(["", "## Sequential design", ""] if lines else []),
                                    *(f"- {line}" for line in lines)]),
                key=artifact_key("sweep", spec.name), description=f"comparison of sweep {spec.name}")
            if failed:  # the parent run ends FAILED; the comparison of the runs that finished is written
                raise RuntimeError(f"sweep {spec.name}: {len(failed)} of {len(spec.runs)} runs failed: "
                                   f"{', '.join(f'{f.run_name} ({f.state})' for f in failed)} "
                                   f"(comparison written to {launch.out_dir})")
        return SweepResult(spec.name, launch.parent, str(runs), str(launch.out_dir), book.tracking_uri,
                           str(artifact_id), {k: str(v) for k, v in comparison.files.items()},
                           comparison.runs.to_dict(orient="records"), comparison.summary.to_dict(orient="records"),
                           [r.run_name for r in todo], sorted(done), launch.date, lines)


Fan = tuple[str | None, int, tuple[float | None, float | None]]
"""Where the children run: (deployment or None: here, max_parallel, (child_timeout_s, child_lost_after_s))."""


def _execute(book: SweepBook, launch: Launch, design: Design | None, todo: Sequence[SweepRun], started: set[str],
             fan: Fan, logger: Logger) -> tuple[list[ChildFailure], list[SweepRun], list[str]]:
    """Run ``todo`` (here or on ``fan``'s deployment), or with a ``design`` wave by wave (:func:`_run_sequential`);
    returns the failed runs, the runs started and the sequential design's lines (none without one)."""
    deployment, max_parallel, limits = fan

    def run_batch(batch: Sequence[SweepRun]) -> list[ChildFailure]:
        if deployment is None:
            return _run_children(book, launch, batch, started, logger)
        return _fan_out(book, launch, batch, started, deployment, max_parallel, limits, logger)

    if design is None:
        return run_batch(todo), list(todo), []
    datasets = book.spec.sequential.datasets if book.spec.sequential else None
    return _run_sequential(SequentialBook(book, design, datasets), launch, run_batch, logger)


def _run_sequential(seq: SequentialBook, launch: Launch,
                    run_batch: Callable[[Sequence[SweepRun]], list[ChildFailure]], logger: Logger
                    ) -> tuple[list[ChildFailure], list[SweepRun], list[str]]:
    """Wave by wave: look at the finished cells (:meth:`SequentialBook.look`: a pure function of them, so a resumed
    sweep re-decides nothing), run the next wave's cells of the arms still running, until the design stops (or a
    cell fails); records every look in the parent run. Returns the failed runs, the runs started, the table's
    lines."""
    failed: list[ChildFailure] = []
    ran: list[SweepRun] = []
    while True:
        outcome, wave = seq.look(launch)
        if outcome.looks:
            logger.info("sweep %s look %d (%d seeds): %s", seq.book.spec.name, len(outcome.looks),
                        len(outcome.looks[-1].seeds), "; ".join(outcome_lines(outcome)[2:]))
        if failed or not wave:
            break
        logger.info("sweep %s: wave of %d runs (arms %s)", seq.book.spec.name, len(wave),
                    ", ".join(outcome.active_arms()))
        ran += wave
        failed += run_batch(wave)
    path = seq.record(launch, outcome)
    logger.info("sweep %s: sequential design %s; looks in %s", seq.book.spec.name,
                "stopped" if outcome.stopped else "not finished", path)
    return failed, ran, outcome_lines(outcome)


def _warn_unshared_tracking(deployment: str, tracking_uri: str, logger: Logger) -> None:
    """The children's tracking URI should be one that workers on other machines can reach."""
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


def _fan_out(book: SweepBook, launch: Launch, todo: Sequence[SweepRun], started: set[str], deployment: str,
             max_parallel: int, limits: tuple[float | None, float | None], logger: Logger) -> list[ChildFailure]:
    """Every (cell, seed) as a flow run of ``deployment`` (named like its MLflow run), at most ``max_parallel``
    submitted and unfinished at once; polls their states and returns the runs that did not complete (ended in
    another state, timed out or lost after ``limits``, (child_timeout_s, child_lost_after_s): see
    :mod:`infra.run.flight`). If the sweep itself is stopped (an exception, Ctrl-C, SIGTERM), the children in flight
    are cancelled."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return _fly(book, launch, todo, started, deployment, max_parallel, Flight(client, *limits), logger)


def _fly(book: SweepBook, launch: Launch, todo: Sequence[SweepRun], started: set[str], deployment: str,
         max_parallel: int, flight: Flight, logger: Logger) -> list[ChildFailure]:
    from prefect.deployments import run_deployment

    pending, failed, landed = list(todo), [], 0
    try:
        while pending or len(flight):
            while pending and len(flight) < max_parallel:
                run = pending.pop(0)
                submitted = run_deployment(
                    deployment, timeout=0, flow_run_name=run.run_name, tags=["aepo-sweep", book.spec.name],
                    # one child flow run per child and sweep flow run: a retry of this flow run submits
                    # nothing twice, a resumed sweep (another flow run) submits afresh
                    idempotency_key=f"{launch.parent}/{run.run_name}/{flow_run.id}",
                    parameters=_child_parameters(book, launch, run, resume=run.run_name in started))
                flight.add(submitted.id, run.run_name)
                report(logger, Progress("cell", done=landed, total=len(todo), name=run.run_name),
                       "sweep run %s submitted to %s as flow run %s (%d in flight)", run.run_name, deployment,
                       submitted.id, len(flight))
            time.sleep(POLL_S)
            for landing in flight.poll():
                landed += 1
                _log_landing(landing, landed, len(todo), logger)
                if landing.failure is not None:
                    failed.append(ChildFailure(landing.name, landing.failure))
    except BaseException:
        for name, flow_run_id in flight.cancel_all():
            logger.warning("sweep stopped: cancelled %s (flow run %s)", name, flow_run_id)
        raise
    return failed


def _child_parameters(book: SweepBook, launch: Launch, run: SweepRun, resume: bool) -> dict[str, Any]:
    """The ``train`` deployment's parameters of one child."""
    return {"config": book.configs[run.run_name].to_dict(), "runs_dir": str(book.runs), "run_name": run.run_name,
            "parent_run_id": launch.parent, "overrides": [], "resume": resume, "tags": launch.tags(book.spec, run),
            "machine": launch.machine}


def _log_landing(landing: Landing, landed: int, total: int, logger: Logger) -> None:
    name, flow_run_id = landing.name, landing.flow_run_id
    if landing.outcome is Outcome.COMPLETED:
        report(logger, Progress("cell", done=landed, total=total, name=name),
               "sweep run %s completed (%d of %d ended)", name, landed, total)
    elif landing.outcome is Outcome.ENDED:
        logger.error("sweep run %s (flow run %s) ended %s: %s", name, flow_run_id, landing.state, landing.message)
    elif landing.outcome is Outcome.LOST:
        logger.error("sweep run %s (flow run %s) sent no heartbeat for over %g s: its worker is gone; marked "
                     "Crashed", name, flow_run_id, landing.seconds)
    else:
        logger.error("sweep run %s (flow run %s) still %s after %g s: cancelled", name, flow_run_id, landing.state,
                     landing.seconds)
