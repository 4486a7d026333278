"""Prefect's temporary API server, bound to the process that runs the flows.

Without ``PREFECT_API_URL`` the Prefect engine starts a temporary server (``python -m uvicorn … prefect.server.api.
server:create_app``, :class:`~prefect.server.api.server.SubprocessASGIServer`) on first use and stops it at exit
(``atexit``). A SIGKILL of the trainer (the OOM killer) runs no ``atexit``: the server was left running as an orphan
(~230 MB, busy). So the CLI starts that server itself, from the main thread, before any flow runs, as a subclass
whose only change is a parent-death signal (:func:`~infra.processes.set_parent_death_signal`): the kernel kills it
when the trainer dies. Prefect's own ``SubprocessASGIServer()`` calls then return this instance (one per port,
the default one under the key None), so everything else about the server stays Prefect's.

And the watch over a sweep's child flow runs (:mod:`flows.sweep`): whether the deployment exists, when a child
counts as lost with its worker (:func:`lost_after`, :mod:`infra.run.flight`), and its flow-run heartbeats
(:class:`ChildRun`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings

from aepo_core.config_keys import ConfigError
from infra.processes import set_parent_death_signal

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.events.schemas.events import ReceivedEvent

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------------ a sweep's children

HEARTBEAT_CHECK_S = 5.0  # seconds between two reads of a running child's newest heartbeat event
LOST_HEARTBEATS = 3  # default child_lost_after_s: this many heartbeat intervals (as Prefect's zombie automation)
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"


def check_deployment(deployment: str) -> None:
    """The deployment must exist on the Prefect API this process talks to (a sweep's typo fails before any run
    starts): raises :class:`ConfigError` naming the API and the expected form."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise ConfigError(f"sweep deployment {deployment!r} not found on the Prefect API at "
                              f"{client.api_url}: register it (`prefect deploy --name train`) or fix the name "
                              "('<flow name>/<deployment name>', e.g. 'aepo-train/train')") from None


def lost_after(child_lost_after_s: float | None) -> float | None:
    """``child_lost_after_s``, else 3 heartbeat intervals of this process's Prefect settings (None: heartbeats off)."""
    if child_lost_after_s is not None:
        return child_lost_after_s
    from prefect.settings import get_current_settings

    frequency = get_current_settings().flows.heartbeat_frequency
    return LOST_HEARTBEATS * frequency if frequency else None


@dataclass
class ChildRun:
    """A child flow run in flight: its (run) name, when it was submitted, and the newest heartbeat seen of it."""

    name: str
    submitted: float
    heartbeat: tuple[UUID, datetime] | None = None  # (event id, occurred)
    seen_at: float = 0.0  # monotonic time that heartbeat was first seen (this machine's clock only)
    interval_s: float = 0.0  # the longest gap seen between two of its heartbeats
    checked_at: float = 0.0

    def silent_for(self, client: SyncPrefectClient, flow_run_id: UUID, lost_after_s: float, now: float) -> float | None:
        """How long the child has been silent (no new heartbeat), if that makes it lost; else None.

        Only a child that has sent a heartbeat can be lost (with heartbeats off on its worker only the timeout
        applies), and never before two of its own heartbeat intervals: a worker that beats slower than this
        process's settings assume is not mistaken for a lost one."""
        if now - self.checked_at < HEARTBEAT_CHECK_S:
            return None
        self.checked_at = now
        try:
            event = _newest_heartbeat(client, flow_run_id)
        except Exception as exc:  # no verdict without the events API; the state poll goes on
            log.debug("reading the heartbeats of flow run %s failed: %s", flow_run_id, exc)
            return None
        if event is None:
            return None
        if self.heartbeat is None or event.id != self.heartbeat[0]:
            if self.heartbeat is not None:
                self.interval_s = max(self.interval_s, (event.occurred - self.heartbeat[1]).total_seconds())
            self.heartbeat, self.seen_at = (event.id, event.occurred), now
            return None
        limit = max(lost_after_s, 2 * self.interval_s)
        return limit if now - self.seen_at > limit else None


def _newest_heartbeat(client: SyncPrefectClient, flow_run_id: UUID) -> ReceivedEvent | None:
    """The newest ``prefect.flow-run.heartbeat`` event of a flow run (None: none yet)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOrder, EventResourceFilter

    page = client.read_events(EventFilter(event=EventNameFilter(name=[HEARTBEAT_EVENT]),
                                          resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
                                          order=EventOrder.DESC), limit=1)
    return page.events[0] if page.events else None
