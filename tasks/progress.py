"""Progress as structured records: what a flow or task reports for machines (the CLI's bar), beside its log line.

A progress event rides on the log record of the human-readable line (``extra={"aepo_progress": event}``), so one
call both logs and reports, and a reader (:func:`progress_of`) never parses the message: rewording a log line
cannot break a progress bar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

FIELD = "aepo_progress"

Stage = Literal["start", "rollout", "update", "evaluate", "cell"]


@dataclass(frozen=True)
class Progress:
    """One event.

    - ``start``: a run of ``total`` steps named ``name`` begins (``done``: steps already done, on resume);
    - ``rollout`` / ``update``: step ``done`` has finished its rollout / its update;
    - ``evaluate``: dataset ``name`` evaluated (``label``: start, sft, stepN, final, eval);
    - ``cell``: sweep child ``name`` begins (in process), is submitted or has completed (fan-out to a
      deployment); ``done`` of the ``total`` children have ended before it.
    """

    stage: Stage
    done: int = 0
    total: int | None = None
    name: str = ""
    label: str = ""


def report(logger: logging.Logger | logging.LoggerAdapter[Any], event: Progress, message: str, *args: object) -> None:
    """Log ``message % args`` at INFO with ``event`` attached."""
    logger.info(message, *args, extra={FIELD: event})


def progress_of(record: logging.LogRecord) -> Progress | None:
    """The event a log record carries, if any."""
    event = record.__dict__.get(FIELD)  # logging puts `extra` into the record's attributes
    return event if isinstance(event, Progress) else None
