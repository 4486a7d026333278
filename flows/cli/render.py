"""What the commands print: the consoles, a user error's one line and exit status, the result tables (or their
rows as CSV or JSON), and the progress bar that the flows' structured progress events drive."""

from __future__ import annotations

import csv
import enum
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from aepo_core.evaluation import EvalSummary
from flows.cli.environment import sigterm_unwinds, verbosity
from infra.run.preflight import is_http
from tasks.progress import Progress as ProgressEvent
from tasks.progress import progress_of

EXIT_USAGE = 2
CLI_TAGS = ("aepo", "cli")
"""Prefect tags of the flow runs the CLI starts (deployments' runs carry ``aepo`` alone)."""


PLAIN_WIDTH = 100_000
"""The console width when the stream is not a terminal and COLUMNS is unset: unlimited in practice. Rich's default
there is 80 columns, which split numbers across lines (``-0.76`` / ``4``), broke question ids into 4-character
chunks and cut the run id in ``aepo runs | cat``; a table is only as wide as its cells, so nothing else changes."""


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        return Console(stderr=stderr, width=PLAIN_WIDTH)
    return console


def out() -> Console:
    """stdout: the results."""
    return _console(stderr=False)


TRANSCRIPT_WIDTH = 100
"""The width of a transcript (``aepo trajectories --show``) off a terminal with COLUMNS unset: its rules span the
console, so at :data:`PLAIN_WIDTH` each was 100 000 ``─`` (2.1 MB for a 34-line transcript in a file); its text
wraps at this width instead, as on a terminal."""


def transcript_out() -> Console:
    """stdout for a transcript: the terminal's width, or COLUMNS, else :data:`TRANSCRIPT_WIDTH`."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        return Console(width=TRANSCRIPT_WIDTH)
    return console


def err() -> Console:
    """stderr: progress and errors."""
    return _console(stderr=True)


class OutputFormat(str, enum.Enum):
    """How a command prints its rows (``--format``)."""

    table = "table"  # for a person: aligned, numbers rounded
    csv = "csv"  # one header line, then a line per row, values unrounded
    json = "json"  # a list of objects, values unrounded, unknown as null


def print_records(title: str, records: Sequence[dict[str, Any]], output: OutputFormat,
                  cell: Callable[[str, Any], str] | None = None, right: Sequence[str] = (),
                  fold: Sequence[str] = ()) -> None:
    """Rows (one dict per row, the same keys in each; the keys are the columns) on stdout: as a table whose cells
    ``cell(column, value)`` renders (default :func:`fmt`), with the ``right`` columns right-aligned and the
    ``fold`` ones allowed to fold on a narrow terminal; or as CSV or JSON with the values as they are (NaN as
    empty / null), for a program to read back, under identifier keys (:func:`identifier`: ``run id`` →
    ``run_id``, ``pass@1`` → ``pass_at_1``)."""
    columns = list(records[0]) if records else []
    if output is OutputFormat.json:
        sys.stdout.write(json.dumps(plain_records(records), indent=1) + "\n")
        return
    if output is OutputFormat.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([identifier(c) for c in columns])
        writer.writerows([["" if v is None else v for v in map(_plain, r.values())] for r in records])
        return
    render = cell or (lambda _col, v: fmt(v))
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left", no_wrap=col not in fold,
                         overflow="fold")
    for r in records:
        table.add_row(*(render(k, v) for k, v in r.items()))
    out().print(table)


def plain_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a program reads them: identifier keys (:func:`identifier`), NaN as None, numpy scalars as Python's."""
    return [{identifier(k): _plain(v) for k, v in r.items()} for r in records]


def identifier(column: str) -> str:
    """A table heading as a CSV/JSON key a program can use as a name: lower case, ``@`` → ``_at_``, ``/`` →
    ``_per_``, every other run of non-alphanumerics → ``_`` (``CPU s`` → ``cpu_s``, ``tool calls/leaf`` →
    ``tool_calls_per_leaf``)."""
    text = column.lower().replace("@", "_at_").replace("/", "_per_")
    return re.sub(r"[^a-z0-9]+", "_", text).strip("_")


def _plain(value: Any) -> Any:
    """A value for CSV/JSON: NaN as None, numpy scalars as Python's."""
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, then exit (2: bad input, nothing was created)."""
    err().print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def as_count(x: float | None) -> int | None:
    """A count logged as a float metric (tokens, tool calls) as an int; None when missing or NaN."""
    return None if x is None or math.isnan(x) else round(x)


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return "–" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def interval(value: float | None, low: float | None, high: float | None, digits: int = 3,
             signed: bool = False) -> str:
    """An estimate and its interval in one cell, ``value [low, high]`` (``+`` shown when ``signed``, for differences);
    "–" for a missing (None or NaN) value or bound."""
    def one(x: float | None) -> str:
        return "–" if x is None or math.isnan(x) else f"{x:{'+' if signed else ''}.{digits}f}"

    return "–" if value is None or math.isnan(value) else f"{one(value)} [{one(low)}, {one(high)}]"


def eval_table(title: str, summaries: Mapping[str, EvalSummary], k: int,
               extra: Mapping[str, float] | None = None, stages: Mapping[str, Mapping[str, EvalSummary]] | None = None,
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
        row = ([stage] if stage is not None else []) + [ds, fmt(s.questions, 0), fmt(s.pass1.value),
               f"{fmt(s.pass1.low)}–{fmt(s.pass1.high)}", fmt(s.pass_k.value), fmt(s.f1),
               fmt(s.tool_calls_per_question, 2), fmt(s.answered_rate, 2)]
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


def ui_hint(tracking_uri: str, runs: Path) -> str:
    """How to browse the runs of ``tracking_uri``."""
    if is_http(tracking_uri):
        return f"browse: {tracking_uri} (the MLflow server); `aepo runs --tracking-uri {tracking_uri}` lists the runs"
    return (f"browse: `mlflow ui --backend-store-uri {tracking_uri}` or `aepo ui --runs-dir {runs}` "
            "(Prefect + MLflow)")


def print_numerics(description: str) -> None:
    """The dtypes the run will compute in and the machine they were chosen for (``Numerics.describe``), once, on
    stderr."""
    err().print(escape(description), soft_wrap=True, highlight=False)


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
    console = err()
    progress = (Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TimeElapsedColumn(), console=console, transient=False, disable=verbosity() > 0)
                if console.is_terminal or verbosity() > 0 else ProgressLines(console))
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


class ProgressLines(Progress):
    """The progress of a run whose stderr is not a terminal (a log file, a pipe, CI): no live bar (rich draws one
    line there, at the end: `make demo > log` showed a single spinner line in 46 minutes) but one plain,
    timestamped line each time the description changes (a stage, a step, an evaluation)."""

    def __init__(self, console: Console) -> None:
        super().__init__(console=console, disable=True)
        self._said: dict[Any, str] = {}

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> Any:
        task_id = super().add_task(description, *args, **kwargs)
        self.update(task_id)
        return task_id

    def update(self, task_id: Any, *args: Any, **kwargs: Any) -> None:
        super().update(task_id, *args, **kwargs)
        task = next(t for t in self.tasks if t.id == task_id)
        if self._said.get(task_id) == task.description:
            return
        self._said[task_id] = task.description
        count = f" {task.completed:g}/{task.total:g}" if task.total is not None else ""
        elapsed = int(task.elapsed or 0)
        self.console.print(f"{time.strftime('%H:%M:%S')} {task.description}{count} "
                           f"({elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d} elapsed)",
                           markup=False, highlight=False, soft_wrap=True)
