"""The local services the commands run: the MLflow tracking server and the Prefect server of ``aepo ui``, and the
temporary Prefect API a command's flow runs against.

``aepo ui`` decides where they listen and checks that they can (:func:`plan_ui`, :class:`~infra.run.preflight.
InputError` on a host that is not this machine's, a busy port, a bad store or destination), then starts them
together and stops them together (:class:`UIServers`); the MLflow server's own options are
:mod:`infra.tracking.server`'s, the processes :class:`~infra.servers.ManagedServer`'s.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.prefect_api import start_temporary_api
from infra.run.preflight import EXIT_FAILED, InputError
from infra.servers import ManagedServer, ServerError
from infra.tracking.client import landing_page
from infra.tracking.server import (
    ServerOptionError,
    ServerOptions,
    allowed_hosts,
    experiment_id,
    local_artifact_experiments,
    redacted,
)

__all__ = ["UIServers", "plan_ui", "start_temporary_api"]

WILDCARD_HOSTS = ("0.0.0.0", "::")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_listen(host: str, port: int, option: str) -> None:
    """The server can listen on ``host:port``: the host is an address of this machine and the port is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise InputError(f"--host {host}: unknown host name") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            raise InputError(f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def public_host(host: str) -> str:
    """The host name that other machines use: ``host`` itself, or for a wildcard (0.0.0.0, ::) the address of
    the interface of the default route (no packet is sent), else the host name."""
    if host not in WILDCARD_HOSTS:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
    except OSError:
        return socket.gethostname()


@dataclass
class UIServers:
    """The servers of ``aepo ui`` (:func:`plan_ui`): MLflow's, and Prefect's unless left out."""

    host: str
    public: str
    """The host name other machines reach them at (:func:`public_host`)."""
    mlflow_url: str
    prefect_url: str | None
    """None: ``--no-prefect``."""
    options: ServerOptions
    servers: list[ManagedServer]
    logs: Path
    local_url: str
    """The MLflow server as reachable from this machine (a wildcard host listens on loopback too)."""

    @property
    def local_only(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    @property
    def names(self) -> list[str]:
        return [server.name for server in self.servers]

    def start(self, timeout_s: float) -> None:
        """Launch every server, then wait for each to answer; :class:`~infra.run.preflight.InputError` (code 1)
        naming the one that did not come up and its log."""
        for server in self.servers:
            server.launch()
        for server in self.servers:
            try:
                server.wait_healthy(timeout_s)
            except ServerError:
                raise InputError(f"the {server.name} server did not come up (log: {server.log_path})",
                                 code=EXIT_FAILED) from None

    def dead(self) -> list[str]:
        """The servers that have exited."""
        return [server.name for server in self.servers if not server.running]

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop(grace_s=15)

    def stores(self) -> str:
        """Where the MLflow server keeps runs and artifacts (the database's password redacted)."""
        return f"runs: {redacted(self.options.backend_store_uri)}; artifacts: {self.options.artifacts_destination}"

    def landing_url(self, experiment: str) -> str:
        """The page to open: ``experiment``'s runs in MLflow's classic layout (:func:`landing_page`), the experiments
        list while it does not exist."""
        found = experiment_id(self.local_url, experiment)
        return landing_page(self.mlflow_url, found)

    def local_artifact_experiments(self) -> list[str]:
        """Experiments whose artifacts live on a local path: runs of other machines would write them to their own
        disks."""
        return local_artifact_experiments(self.local_url)


def plan_ui(runs: Path, host: str, mlflow_port: int, prefect_port: int | None, backend_store_uri: str | None,
            artifacts_destination: str | None, s3_endpoint_url: str | None,
            environment: Callable[[str], Mapping[str, str]]) -> UIServers:
    """The servers ``aepo ui`` starts (``prefect_port`` None: MLflow's alone), checked: each can listen, the MLflow
    server's store and destination are usable; their folders made. ``environment(prefect API URL)``: the servers'
    environment (the runs dir's Prefect home, the API URL the Prefect UI calls). Raises
    :class:`~infra.run.preflight.InputError` before anything starts."""
    check_listen(host, mlflow_port, "--mlflow-port")
    if prefect_port is not None:
        check_listen(host, prefect_port, "--prefect-port")
    try:
        options = ServerOptions.checked(backend_store_uri, artifacts_destination, s3_endpoint_url, runs)
    except ServerOptionError as exc:
        raise InputError(str(exc)) from None
    public = public_host(host)
    hostport = f"[{public}]" if ":" in public else public
    runs.mkdir(parents=True, exist_ok=True)
    if options.local_artifacts:
        Path(options.artifacts_destination).mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    local = hostport if host not in WILDCARD_HOSTS else "[::1]" if host == "::" else "127.0.0.1"  # reachable here
    commands = {"mlflow": options.command(bindir, host, mlflow_port,
                                          [] if host in LOOPBACK_HOSTS else allowed_hosts(public))}
    health = {"mlflow": f"http://{local}:{mlflow_port}/health"}
    if prefect_port is not None:
        commands["prefect"] = [str(bindir / "prefect"), "server", "start", "--host", host, "--port", str(prefect_port)]
        health["prefect"] = f"http://{local}:{prefect_port}/api/health"
    logs = runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prefect_url = f"http://{hostport}:{prefect_port}"
    server_env = options.environment(environment(f"{prefect_url}/api"))
    servers = [ManagedServer(name, cmd, health=[health[name]], env=server_env, log_path=logs / f"{name}-server.log")
               for name, cmd in commands.items()]  # each in its own process group: stopping one reaches its workers
    return UIServers(host, public, f"http://{hostport}:{mlflow_port}",
                     prefect_url if prefect_port is not None else None, options, servers, logs,
                     f"http://{local}:{mlflow_port}")
