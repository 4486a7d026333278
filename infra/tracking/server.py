"""The options of an ``mlflow server`` (what ``aepo ui`` starts): the backend store and the artifacts destination,
checked before anything starts, the host names it accepts, and the command line and environment it runs with.

A bad value raises :class:`ServerOptionError`, whose message names the option and the value (a database password
redacted), so that the caller can print it as it is; nothing is created until every option is checked.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SQL_DRIVERS = {"postgresql": "psycopg2", "postgresql+psycopg2": "psycopg2", "postgresql+psycopg": "psycopg",
               "postgresql+pg8000": "pg8000"}  # MLflow's SQLAlchemy store: URI scheme → the driver it imports


class ServerOptionError(ValueError):
    """A server option the MLflow server could not run with (its message names the option)."""


def redacted(uri: str) -> str:
    """A database URI without its password (for messages)."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password is None:
        return uri
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parsed._replace(netloc=netloc))


def backend_store(value: str | None, runs: Path) -> str:
    """``--backend-store-uri``: the runs dir's SQLite store by default, another SQLite file, or PostgreSQL (its
    driver must be installed: the server would otherwise die at start with an import error)."""
    from infra.tracking.client import tracking_uri_for

    if value is None:
        return tracking_uri_for(runs)
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme == "sqlite":
        path = Path(value.removeprefix("sqlite:///")).expanduser() if value.startswith("sqlite:///") else None
        if path is None or not path.name:
            raise ServerOptionError(f"--backend-store-uri {value}: a SQLite store is sqlite:///<path of the .db "
                                    "file> (sqlite:////abs/path/mlflow.db)")
        if not path.resolve().parent.is_dir():
            raise ServerOptionError(f"--backend-store-uri {value}: no such directory {path.resolve().parent}")
        return f"sqlite:///{path.resolve()}"
    if scheme in SQL_DRIVERS:
        if not urllib.parse.urlsplit(value).path.strip("/"):
            raise ServerOptionError(f"--backend-store-uri {redacted(value)}: name the database "
                                    f"({scheme}://user:password@host:5432/db)")
        driver = SQL_DRIVERS[scheme]
        if importlib.util.find_spec(driver) is None:
            package = "psycopg2-binary" if driver == "psycopg2" else driver
            raise ServerOptionError(f"--backend-store-uri {scheme}://…: its driver {driver} is not installed in this "
                                    f"environment (pip install {package})")
        return value
    raise ServerOptionError(f"--backend-store-uri {redacted(value)}: expected sqlite:///path/mlflow.db or "
                            "postgresql://user:password@host:5432/db")


def artifacts_destination(value: str | None, runs: Path, s3_endpoint_url: str | None) -> str:
    """``--artifacts-destination``: where the MLflow server keeps the artifacts its clients send it (they go
    through the server: the clients need no access to it): ``<runs>/mlartifacts`` by default, a directory, or
    ``s3://bucket/prefix`` (``--s3-endpoint-url`` for MinIO, moto, …)."""
    from infra.tracking.client import ARTIFACTS_DIR

    if value is None:
        dest = str(runs / ARTIFACTS_DIR)
    elif value.startswith("s3://"):
        if not value.removeprefix("s3://").split("/", 1)[0]:
            raise ServerOptionError(f"--artifacts-destination {value}: name a bucket (s3://bucket/prefix)")
        if importlib.util.find_spec("boto3") is None:
            raise ServerOptionError("--artifacts-destination s3://…: the MLflow server needs boto3 (pip install boto3)")
        dest = value.rstrip("/")
    elif "://" in value and not value.startswith("file://"):
        raise ServerOptionError(f"--artifacts-destination {value}: expected a directory or s3://bucket/prefix")
    else:
        path = Path(urllib.parse.urlsplit(value).path if value.startswith("file://") else value).expanduser()
        if path.exists() and not path.is_dir():
            raise ServerOptionError(f"--artifacts-destination {value}: not a directory")
        dest = str(path.resolve())
    if s3_endpoint_url is not None:
        if not dest.startswith("s3://"):
            raise ServerOptionError("--s3-endpoint-url: only for an s3:// --artifacts-destination")
        if not s3_endpoint_url.startswith(("http://", "https://")):
            raise ServerOptionError(f"--s3-endpoint-url {s3_endpoint_url}: expected http(s)://host:port")
    return dest


def allowed_hosts(public: str) -> list[str]:
    """Host headers the MLflow server accepts when it listens beyond loopback: its defaults (localhost, private
    IPs) plus this machine's names, so that workers may use the host name too."""
    try:
        from mlflow.server.security_utils import get_default_allowed_hosts

        defaults = list(get_default_allowed_hosts())
    except ImportError:  # pragma: no cover - an MLflow without host checks
        return []
    names = sorted({public, socket.gethostname(), socket.getfqdn()})
    return [*defaults, *(n for name in names for n in (name, f"{name}:*"))]


def experiment_id(mlflow_url: str, name: str) -> str | None:
    """The id of experiment ``name`` on the server; None when it has none (or does not answer)."""
    query = urllib.parse.urlencode({"experiment_name": name})
    try:
        with urllib.request.urlopen(f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=10) as resp:
            return str(json.load(resp)["experiment"]["experiment_id"])
    except (OSError, ValueError, KeyError):  # 404 (HTTPError is an OSError): no such experiment yet
        return None


def local_artifact_experiments(mlflow_url: str) -> list[str]:
    """Experiments of the server whose artifacts live on a local path (created by runs that logged straight to
    the SQLite store): a run on another machine would write its artifacts to its own disk there."""
    body = json.dumps({"max_results": 1000}).encode()
    request = urllib.request.Request(f"{mlflow_url}/api/2.0/mlflow/experiments/search", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            experiments = json.load(resp).get("experiments", [])
    except (OSError, ValueError):
        return []
    return [f"{e['name']} ({e['artifact_location']})" for e in experiments
            if str(e.get("artifact_location", "")).startswith(("file:", "/"))]


@dataclass(frozen=True)
class ServerOptions:
    """An ``mlflow server``'s checked options: its database, where it stores artifacts, an S3 endpoint."""

    backend_store_uri: str
    artifacts_destination: str
    s3_endpoint_url: str | None = None

    @classmethod
    def checked(cls, backend_store_uri: str | None, destination: str | None, s3_endpoint_url: str | None,
                runs: Path) -> ServerOptions:
        """The options from the command line's values (None: the runs dir's defaults); raises
        :class:`ServerOptionError` on the first bad one, the backend store first."""
        backend = backend_store(backend_store_uri, runs)
        return cls(backend, artifacts_destination(destination, runs, s3_endpoint_url), s3_endpoint_url)

    @property
    def local_artifacts(self) -> bool:
        """The artifacts go to a directory of this machine (which must exist before the server starts)."""
        return not self.artifacts_destination.startswith("s3://")

    def command(self, bindir: Path, host: str, port: int, accepted_hosts: Sequence[str] = ()) -> list[str]:
        """The ``mlflow server`` command line (one worker); ``accepted_hosts`` (:func:`allowed_hosts`) where it
        listens beyond loopback."""
        cmd = [str(bindir / "mlflow"), "server", "--host", host, "--port", str(port),
               "--backend-store-uri", self.backend_store_uri, "--artifacts-destination", self.artifacts_destination,
               "--workers", "1"]
        return cmd + (["--allowed-hosts", ",".join(accepted_hosts)] if accepted_hosts else [])

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with what the server needs set."""
        env = dict(base)
        # MLflow's job runners (five huey consumers, for GenAI scorer jobs, which no run here submits) poll while the
        # server idles: 23 s of CPU a minute against 0.2 without them (AMD EPYC, 2 cores). Set the variable to true
        # to have them.
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        if self.s3_endpoint_url:
            env["MLFLOW_S3_ENDPOINT_URL"] = self.s3_endpoint_url
        return env
