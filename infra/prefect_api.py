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

import fcntl
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
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
    """Prefect's temporary server, started with a parent-death signal, on a port it holds from the start, and one
    start at a time per ``PREFECT_HOME``.

    Prefect picks a port by probing a random one in 8000–8999 and lets uvicorn bind it later; two runs started at
    once in one runs dir (two seeds of a config) could draw the same port: the second's uvicorn then failed to
    bind while its health check was answered by the first's server, so it ran its flows on a server that stopped
    with the other run (``Connection refused``, ``ConcurrencySlotAcquisitionError``). Forced in
    ``tests/infra/test_prefect_api.py`` by seeding both processes' ``random`` alike: one of them ran on the other's
    server every time. Here the port is bound in this process (port 0: the kernel's choice, never one in use) and
    the listening socket handed to uvicorn (``--fd``), so the server that answers is always this one; and the
    start (which migrates the shared SQLite database) holds a lock on ``PREFECT_HOME``: two migrations at once
    failed with ``database is locked``.
    """

    _listener: socket.socket | None = None

    def start(self, timeout: int | None = None) -> None:
        if self.running:
            return
        home = Path(get_current_settings().home)
        home.mkdir(parents=True, exist_ok=True)
        # Bound, not listening: until uvicorn listens (once the app is up) a health check is refused, as Prefect's
        # start loop expects; a listening socket would accept it into the backlog and time it out.
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        with (home / "server-start.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            try:
                super().start(timeout)
            finally:
                self._listener.close()  # the server holds its own copy: once it is gone, the port is free

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        # The command and environment of Prefect 3.9's SubprocessASGIServer._run_uvicorn_command, with the
        # listening socket passed as a file descriptor in place of --host/--port, plus preexec_fn (Popen offers no
        # other way to run code in the child before exec).
        assert self._listener is not None, "start() binds the port first"
        fd = self._listener.fileno()
        # Telemetry off: nothing outside is reachable (every start logged "Failed to send telemetry"), and its
        # heartbeat was the write that met the other server's with "database is locked" on a shared PREFECT_HOME.
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
                      "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        return subprocess.Popen(
            args=[sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                  "prefect.server.api.server:create_app", "--fd", str(fd), "--log-level", "error",
                  "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            pass_fds=(fd,),
            preexec_fn=_die_with_trainer,
        )


def start_temporary_api() -> None:
    """Start the temporary API server now, bound to this process, when the flows would start one (no
    ``PREFECT_API_URL``, no default server yet, e.g. a test harness's). Call it from the main thread: the
    parent-death signal fires when the thread that started the server exits."""
    if PREFECT_API_URL.value() or SubprocessASGIServer._instances.get(None) is not None:
        return
    TrainerBoundServer().start()
