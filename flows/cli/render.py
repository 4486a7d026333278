"""What the commands print: the consoles, a user error's one line and exit status, the result tables, and the
progress bar that the flows' structured progress events drive."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from aepo_core.config import ExperimentConfig
from flows.cli.environment import sigterm_unwinds, verbosity
from tasks.progress import Progress as ProgressEvent
from tasks.progress import progress_of

EXIT_USAGE = 2
CLI_TAGS = ("aepo", "cli")
"""Prefect tags of the flow runs the CLI starts (deployments' runs carry ``aepo`` alone)."""


def out() -> Console:
    return Console()


def err() -> Console:
    return Console(stderr=True)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, then exit (2: bad input, nothing was created)."""
    err().print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def eval_table(title: str, summaries: dict[str, dict[str, float]], k: int,
               extra: dict[str, float] | None = None, stages: dict[str, dict[str, dict[str, float]]] | None = None,
               ) -> Table:
    """One row per dataset (or per stage × dataset when ``stages`` is given: start, sft, …, final); fits a
    100-column terminal without folding a number (``test_cli``)."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    if stages is not None:
        table.add_column("stage")
    table.add_column("dataset", overflow="fold")
    for col in ("n", "pass@1", "95% CI", f"pass@{k}", "F1", "tools/q", "answered"):
        table.add_column(col, justify="right", no_wrap=True)
    if extra is not None:
        table.add_column("judge", justify="right", no_wrap=True)
    rows = ([(stage, ds, s) for stage, by_ds in stages.items() for ds, s in by_ds.items()] if stages is not None
            else [(None, ds, s) for ds, s in summaries.items()])
    for stage, ds, s in rows:
        row = ([stage] if stage is not None else []) + [ds, fmt(s.get("questions"), 0), fmt(s["pass@1"]),
               f"{fmt(s['pass@1_ci_low'])}–{fmt(s['pass@1_ci_high'])}",
               fmt(s.get(f"pass@{k}")), fmt(s.get("f1")), fmt(s.get("tool_calls_per_question"), 2),
               fmt(s.get("answered_rate"), 2)]
        if extra is not None:
            row.append(fmt(extra.get(ds)))
        table.add_row(*row)
    return table


def where_table(rows: Sequence[tuple[str, str]]) -> Table:
    """Where things are: one bold name and its location a row."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def is_http(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(("http://", "https://"))


def ui_hint(tracking_uri: str, runs: Path) -> str:
    """How to browse the runs of ``tracking_uri``."""
    if is_http(tracking_uri):
        return f"browse: {tracking_uri} (the MLflow server); `aepo runs --tracking-uri {tracking_uri}` lists the runs"
    return (f"browse: `mlflow ui --backend-store-uri {tracking_uri}` or `aepo ui --runs-dir {runs}` "
            "(Prefect + MLflow)")


def print_numerics(cfg: ExperimentConfig) -> None:
    """The dtypes the run will compute in and the machine they were chosen for, once, on stderr."""
    from infra.numerics import numerics_for

    err().print(escape(numerics_for(cfg).describe()), soft_wrap=True, highlight=False)


class ProgressHandler(logging.Handler):
    """Feeds the structured progress events on the flows' log records (:mod:`tasks.progress`) to a callback; the
    message text is never read, so the flows stay unaware of the CLI and a reworded log line breaks nothing."""

    def __init__(self, on_event: Callable[[ProgressEvent], None]) -> None:
        super().__init__(logging.INFO)
        self.on_event = on_event

    def emit(self, record: logging.LogRecord) -> None:
        event = progress_of(record)
        if event is not None:
            self.on_event(event)


@contextmanager
def flow_progress(label: str, total: int | None,
                  on_event: Callable[[Progress, Any, ProgressEvent], None]) -> Iterator[Progress]:
    """A rich progress bar fed by the progress events of the Prefect run loggers while a flow runs
    (``on_event(bar, task, event)``).

    SIGTERM (``kill``, a scheduler's stop) unwinds like Ctrl-C while it runs (:func:`sigterm_unwinds`). The flow
    run (and every run it starts) is tagged :data:`CLI_TAGS`, so the Prefect UI tells runs started from a shell
    from those of deployments and schedules.
    """
    from prefect import tags

    # -v: the libraries' log lines instead of a bar (their console handlers write to the stderr they saw at import,
    # past rich's redirection, and would tear a live bar).
    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err(), transient=False, disable=verbosity() > 0)
    task = progress.add_task(label, total=total)
    handler = ProgressHandler(lambda event: on_event(progress, task, event))
    loggers = [logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with sigterm_unwinds(), progress, tags(*CLI_TAGS):
            yield progress
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
