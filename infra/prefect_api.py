"""Prefect's temporary API server, bound to the process that runs the flows.

Without ``PREFECT_API_URL`` the Prefect engine starts a temporary server (``python -m uvicorn … prefect.server.api.
server:create_app``, :class:`~prefect.server.api.server.SubprocessASGIServer`) on first use and stops it at exit
(``atexit``). A SIGKILL of the trainer (the OOM killer) runs no ``atexit``: the server was left running as an orphan
(~230 MB, busy). So the CLI starts that server itself, from the main thread, before any flow runs, as a subclass
whose only change is a parent-death signal (:func:`~infra.processes.set_parent_death_signal`): the kernel kills it
when the trainer dies. Prefect's own ``SubprocessASGIServer()`` calls then return this instance (one per port,
the default one under the key None), so everything else about the server stays Prefect's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings

from infra.processes import set_parent_death_signal


def _die_with_trainer() -> None:  # pragma: no cover - runs in the server's process, pre-exec
    # SIGKILL, not SIGTERM: nobody can use the server once the trainer is gone, and a hung graceful shutdown
    # would keep the orphan this exists to prevent.
    set_parent_death_signal(signal.SIGKILL)


class TrainerBoundServer(SubprocessASGIServer):
    """Prefect's temporary server, started with a parent-death signal."""

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        # The command and environment of Prefect 3.9's SubprocessASGIServer._run_uvicorn_command, plus preexec_fn
        # (Popen offers no other way to run code in the child before exec).
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        return subprocess.Popen(
            args=[sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                  "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                  "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            preexec_fn=_die_with_trainer,
        )


def start_temporary_api() -> None:
    """Start the temporary API server now, bound to this process, when the flows would start one (no
    ``PREFECT_API_URL``, no default server yet, e.g. a test harness's). Call it from the main thread: the
    parent-death signal fires when the thread that started the server exits."""
    if PREFECT_API_URL.value() or SubprocessASGIServer._instances.get(None) is not None:
        return
    TrainerBoundServer().start()
