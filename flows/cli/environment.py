"""The process environment the commands share: Prefect's home and temporary-server settings, a quiet terminal,
the ``-v`` count of this invocation, Prefect's temporary API, and SIGTERM that unwinds like Ctrl-C (never lost).

Prefect and MLflow read their settings once, when they are imported: everything here runs before that.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFECT_ENV = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "DO_NOT_TRACK": "1"}  # the client's telemetry banner too ("Prefect collects anonymous usage data")
QUIET_ENV = {
    # Prefect's console: warnings and errors only ("Finished in state Completed()" per task, the temporary server's
    # start/stop); the progress bar says where the run is, and the flow/task logs still reach the Prefect UI.
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    # MLflow's INFO lines: table creation on a new store, system-metrics monitor start/stop.
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    # transformers' "Loading weights" bar at every model load (transformers reads it from huggingface_hub at import).
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # MLflow's "Downloading artifacts" bar, once per downloaded file (aepo compare reads every run's evaluation).
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
"""Settings of a quiet terminal (the default; ``-v`` leaves every library at its own level). Set before Prefect and
MLflow are imported, which read them once."""

_verbosity = 0
"""``-v`` count of this invocation (:func:`set_verbosity`, from the app's options)."""


def set_verbosity(count: int) -> None:
    global _verbosity
    _verbosity = count


def verbosity() -> int:
    """``-v`` count of this invocation: 0 is a quiet terminal with a progress bar."""
    return _verbosity


def prefect_home(runs: Path, rank: int = 0) -> Path:
    """``PREFECT_HOME`` of the runs dir: ``<runs>/prefect``, a private one per data-parallel rank > 0."""
    return runs / ("prefect" if rank == 0 else f"prefect-rank{rank}")


def prepare_environment(runs: Path, rank: int = 0) -> None:
    """Point Prefect at ``<runs>/prefect`` before it is imported (afterwards its settings are fixed: then this
    only warns, e.g. under a test harness that already configured Prefect).

    A data-parallel ``rank`` > 0 (under ``torchrun``/``deepspeed``) runs the same flow against a private ephemeral
    Prefect API in ``<runs>/prefect-rank<N>`` (``PREFECT_API_URL`` dropped): the flow run, its task runs and
    artifacts that people and the Prefect UI see are rank 0's alone.
    """
    home = prefect_home(runs, rank)
    if "prefect" in sys.modules:
        log.debug("prefect already imported: PREFECT_HOME stays %s", os.environ.get("PREFECT_HOME"))
        return
    home.mkdir(parents=True, exist_ok=True)
    os.environ["PREFECT_HOME"] = str(home)
    if rank:
        os.environ.pop("PREFECT_API_URL", None)
    for key, value in quiet_environment(_verbosity).items():
        os.environ.setdefault(key, value)


def quiet_environment(verbosity: int) -> dict[str, str]:
    """The environment a command sets (unless already set) before importing Prefect and MLflow: Prefect's
    temporary-server settings, and at verbosity 0 :data:`QUIET_ENV` plus ``DS_ACCELERATOR=cpu`` on a machine
    without CUDA (DeepSpeed's auto-detection warns "Setting accelerator to CPU" on every import; named, it logs that
    at INFO, below its WARNING level)."""
    env = dict(PREFECT_ENV)
    if verbosity == 0:
        env.update(QUIET_ENV)
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
    return env


def server_environment(runs: Path, prefect_ui_api_url: str) -> dict[str, str]:
    """The environment of the servers ``aepo ui`` starts: this process's, with the runs dir's Prefect home, no
    analytics, the API URL the Prefect UI calls, and no ``PREFECT_API_URL`` (the Prefect server is that API)."""
    env = {**os.environ, "PREFECT_HOME": str(prefect_home(runs)), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": prefect_ui_api_url}
    env.pop("PREFECT_API_URL", None)
    return env


def start_prefect_api() -> None:
    """Start Prefect's temporary API server (when there is no ``PREFECT_API_URL``) here, in the main thread, so
    that it dies with this process even when SIGKILL leaves no time to stop it (:mod:`infra.prefect_api`)."""
    from infra.run.services import start_temporary_api

    start_temporary_api()


REDELIVERY_DELAY_S = 0.05
"""How long after a dropped stop it is delivered again: long enough for the hook that saw it to return."""


class Terminated(SystemExit):
    """The exit SIGTERM raises while :func:`sigterm_unwinds` is in force."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def stop_signal(exc: BaseException | None) -> int | None:
    """The signal a stop exception stands for (Ctrl-C, SIGTERM as the CLI or Prefect's flow engine raise it), or
    ``None`` for any other exception."""
    if isinstance(exc, Terminated):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    if "prefect.exceptions" in sys.modules:  # imported lazily: Prefect reads its settings at import (above)
        from prefect.exceptions import TerminationSignal

        if isinstance(exc, TerminationSignal):
            return exc.signal
    return None


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside (main thread only), SIGTERM raises SystemExit: ``finally`` blocks run, a flow and its MLflow
    run end as failed, and Prefect's temporary API server is stopped instead of being left orphaned.

    A stop is never lost:
    - a signal whose exception Python had to drop (raised inside a garbage-collector or weakref callback, a
      ``__del__``: "Exception ignored") is delivered again, so it raises at the next bytecode outside the callback.
      CI saw this once: Prefect's bridge, which replaces this handler while a flow runs, raised inside a SQLAlchemy
      weakref callback and the trainer trained 20 more steps;
    - the exit is re-raised on the way out if something in between swallowed it (seen once: a SIGTERM that landed
      while Prefect's engine was handling a task's result let the command exit 0), so a stopped run never exits as
      a success."""
    received: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        received.append(signum)
        raise Terminated(signum)

    def on_unraisable(unraisable: Any) -> None:
        previous_hook(unraisable)
        signum = stop_signal(unraisable.exc_value)
        if signum is not None:
            log.warning("%s arrived inside %r, where Python drops exceptions: delivered again",
                        signal.Signals(signum).name, unraisable.object)
            # From another thread, a moment later: raised here, the handler would run before this hook returns
            # (at the next bytecode) and its exception would be dropped again.
            threading.Timer(REDELIVERY_DELAY_S, os.kill, (os.getpid(), signum)).start()

    previous = None
    previous_hook = sys.unraisablehook
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        sys.unraisablehook = on_unraisable
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            sys.unraisablehook = previous_hook
    if received:
        raise Terminated(received[0])
