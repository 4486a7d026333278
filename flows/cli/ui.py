"""``aepo ui``: the MLflow tracking server and the Prefect server (UIs and APIs) for this machine or, with
``--host 0.0.0.0``, for workers on others; Ctrl-C or SIGTERM stops both. The MLflow server's options are
:mod:`infra.tracking.server`'s; here: where the servers listen, their processes, and what is printed."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from flows.cli.environment import prefect_home, server_environment
from flows.cli.inputs import RunsOpt, resolve_runs_dir
from flows.cli.render import err, fail, out, where_table
from infra.servers import ManagedServer, ServerError
from infra.tracking.server import (
    ServerOptionError,
    ServerOptions,
    allowed_hosts,
    local_artifact_experiments,
    redacted,
)

WILDCARD_HOSTS = ("0.0.0.0", "::")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _check_listen(host: str, port: int, option: str) -> None:
    """The server can listen on ``host:port``: the host is an address of this machine and the port is free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        fail(f"--host {host}: unknown host name")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: a TIME_WAIT port is free
        try:
            sock.bind(address)
        except OSError as exc:
            fail(f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror})")


def _public_host(host: str) -> str:
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


def ui(
    runs_dir: RunsOpt = None,
    host: Annotated[str, typer.Option("--host", help="Interface both servers listen on: 127.0.0.1 (this machine "
                                      "only) or 0.0.0.0 (workers on other machines can log to them).")
                    ] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option("--prefect-port", min=1, max=65535)] = 4200,
    mlflow_port: Annotated[int, typer.Option("--mlflow-port", min=1, max=65535)] = 5000,  # tracking.UI_MLFLOW_PORT
    backend_store_uri: Annotated[str | None, typer.Option(
        "--backend-store-uri", help="MLflow's database: sqlite:///path/mlflow.db or postgresql://user:password@host"
                                    ":5432/db (default: <runs dir>/mlflow.db).")] = None,
    artifacts_destination: Annotated[str | None, typer.Option(
        "--artifacts-destination", help="Where the MLflow server stores the artifacts its clients send it: a "
                                        "directory or s3://bucket/prefix (default: <runs dir>/mlartifacts).")] = None,
    s3_endpoint_url: Annotated[str | None, typer.Option(
        "--s3-endpoint-url", help="S3-compatible endpoint of an s3:// destination (MinIO, …): the server's "
                                  "MLFLOW_S3_ENDPOINT_URL.")] = None,
    no_prefect: Annotated[bool, typer.Option("--no-prefect", help="Start the MLflow server only.")] = False,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for each server.")
                               ] = 180,
) -> None:
    """Start the MLflow tracking server and the Prefect server (UIs and APIs); Ctrl-C or SIGTERM stops both.

    Workers on other machines log to them with --host 0.0.0.0: their runs set tracking.tracking_uri to the
    printed MLflow URL, their Prefect clients PREFECT_API_URL to the printed API URL. Artifacts go through the
    MLflow server to --artifacts-destination, so the workers need no access to it.

    \b
    Examples:
      aepo ui --runs-dir runs
      aepo ui --host 0.0.0.0 --artifacts-destination s3://bucket/mlartifacts
    """
    rdir = resolve_runs_dir(runs_dir)
    servers = [("mlflow", mlflow_port, "--mlflow-port")] + ([] if no_prefect else [("prefect", prefect_port,
                                                                                     "--prefect-port")])
    for _, port, option in servers:
        _check_listen(host, port, option)
    try:
        mlflow_server = ServerOptions.checked(backend_store_uri, artifacts_destination, s3_endpoint_url, rdir)
    except ServerOptionError as exc:
        fail(str(exc))
    public = _public_host(host)
    local_only = host in LOOPBACK_HOSTS
    hostport = f"[{public}]" if ":" in public else public
    mlflow_url, prefect_url = f"http://{hostport}:{mlflow_port}", f"http://{hostport}:{prefect_port}"

    rdir.mkdir(parents=True, exist_ok=True)
    if mlflow_server.local_artifacts:
        Path(mlflow_server.artifacts_destination).mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    env = mlflow_server.environment(server_environment(rdir, f"{prefect_url}/api"))
    commands = {"mlflow": mlflow_server.command(bindir, host, mlflow_port, [] if local_only else allowed_hosts(public))}
    if not no_prefect:
        prefect_home(rdir).mkdir(parents=True, exist_ok=True)
        commands["prefect"] = [str(bindir / "prefect"), "server", "start", "--host", host, "--port",
                               str(prefect_port)]
    logs = rdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    local = hostport if host not in WILDCARD_HOSTS else "[::1]" if host == "::" else "127.0.0.1"  # reachable here
    health = {"mlflow": f"http://{local}:{mlflow_port}/health", "prefect": f"http://{local}:{prefect_port}/api/health"}
    servers = [ManagedServer(name, cmd, health=[health[name]], env=env, log_path=logs / f"{name}-server.log")
               for name, cmd in commands.items()]  # each in its own process group: stopping one reaches its workers
    console = out()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the servers too (finally)
    try:
        for server in servers:
            server.launch()
        with console.status(f"starting {' and '.join(commands)}…"):
            for server in servers:
                try:
                    server.wait_healthy(startup_timeout)
                except ServerError:
                    fail(f"the {server.name} server did not come up (log: {server.log_path})", code=1)
        console.print(where_table([
            ("MLflow", f"{mlflow_url}   (runs: {redacted(mlflow_server.backend_store_uri)}; artifacts: "
                       f"{mlflow_server.artifacts_destination})"),
            *([] if no_prefect else [("Prefect", prefect_url)]),
            ("runs dir", str(rdir)),
            ("server logs", str(logs)),
        ]))
        console.print(f"Workers {'on this machine' if local_only else 'and clients'} use them with:\n"
                      f"  --set tracking.tracking_uri={mlflow_url}   (or tracking.tracking_uri in the config / the "
                      "sweep file's overrides; `aepo runs --tracking-uri` reads them)"
                      + ("" if no_prefect else f"\n  export PREFECT_API_URL={prefect_url}/api"))
        if local_only:
            console.print(f"(listening on {host} only: --host 0.0.0.0 lets workers on other machines in)")
        else:
            err().print("[yellow]warning:[/] the servers have no authentication: whoever reaches "
                        f"{public} can read and write the runs")
            for exp in local_artifact_experiments(f"http://{local}:{mlflow_port}"):
                err().print(f"[yellow]warning:[/] experiment {escape(exp)} keeps its artifacts on a local path: "
                            "runs of other machines would write them to their own disks (use another "
                            "tracking.experiment)", soft_wrap=True)
        console.print("Ctrl-C stops the servers")
        while all(server.running for server in servers):
            time.sleep(1.0)
        dead = [server.name for server in servers if not server.running]
        fail(f"{', '.join(dead)} server exited (logs in {logs})", code=1)
    except KeyboardInterrupt:
        console.print("stopping…")
    finally:
        for server in reversed(servers):
            server.stop(grace_s=15)
        signal.signal(signal.SIGTERM, previous)
