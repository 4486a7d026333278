"""Which task failures are worth a retry: transient ones, never the user's own input."""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from aepo_core.config_keys import ConfigError
from infra.data.rows import BadRowError
from infra.run.lock import BusyError
from infra.run.preflight import InputError

USER_ERRORS: tuple[type[Exception], ...] = (BadRowError, ConfigError, BusyError, InputError)
"""Failures caused by what the user gave (a bad dataset row, a bad config, a run to resume that is not there:
:mod:`infra.run.preflight`) or asked for while it cannot be done (a run or sweep another live process is working
on): the same request fails the same way again, so a retry only repeats the error (and, for a large training file,
the time it took). The commands exit 2 on them."""


def transient_only(task: Any, task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the task failed on a user error (:data:`USER_ERRORS`).

    Prefect hands the failure to the condition as a Failed state whose data is the raised exception."""
    return not isinstance(state.data, USER_ERRORS)
