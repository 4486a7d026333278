"""Real servers for the tests that need them, no mocks: a moto S3 server and ``aepo ui`` (an ``mlflow server``
with its artifacts proxied to a bucket of that S3, and a ``prefect server``), on free ports of 127.0.0.1.

Every process runs in its own session; :meth:`Stack.stop` stops its whole process group (``aepo ui`` stops the
servers it started, each in its own group). One stack per test session (the ``server_stack`` fixture of
tests/conftest.py, with prefect.yaml's deployments on :data:`POOL`), shared by ``test_deployments.py``,
``test_sweep_fanout.py`` (which adds workers) and ``test_tracking_server.py`` (in tests/flows): starting it costs
~35 s on 2 cores, and each used to start its own.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from infra.servers import ManagedServer, ServerError

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "aepo-process"
"""prefect.yaml's process work pool (its deployments' ``work_pool``)."""
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    """The test's environment without its Prefect/MLflow settings (each process gets its own, explicitly)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": str(REPO), **AWS, **extra})
    return env


@dataclass
class Stack:
    """URLs of the servers, the started processes (with logs under ``tmp``) and helpers to drive them."""

    tmp: Path
    bucket: str
    s3_url: str = ""
    mlflow_url: str = ""
    prefect_api: str = ""
    procs: dict[str, ManagedServer] = field(default_factory=dict)

    @property
    def ui_runs(self) -> Path:
        """``aepo ui``'s runs dir (its SQLite store, Prefect home and server logs)."""
        return self.tmp / "ui"

    def start(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path = REPO, health: Sequence[str] = (),
              timeout_s: float = 180.0) -> ManagedServer:
        """``cmd`` in a process group of its own, logging to ``<tmp>/<name>.log``; returns once ``health`` answers
        (at once without one). A start that fails fails the test with the logs."""
        server = ManagedServer(name, cmd, health=health, env=env, cwd=cwd, log_path=self.tmp / f"{name}.log")
        self.procs[name] = server
        try:
            return server.start(timeout_s)
        except ServerError as exc:
            pytest.fail(f"{exc}\n{self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 40) -> str:
        paths = [self.tmp / f"{name}.log"]
        if name == "ui":  # and the logs of the servers it started
            paths += sorted((self.ui_runs / "logs").glob("*.log"))
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:])
                         for p in paths if p.is_file())

    def start_s3(self) -> None:
        """A moto S3 server with the stack's bucket."""
        self.s3_url = f"http://127.0.0.1:{free_port()}"
        self.start("moto", [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", self.s3_url.rsplit(":", 1)[1]],
                   base_env(), health=[f"{self.s3_url}/moto-api/"], timeout_s=60)
        self.s3().create_bucket(Bucket=self.bucket)

    def s3(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_url, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        """The keys of the stack's bucket under ``prefix``."""
        pages = self.s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def start_ui(self) -> None:
        """``aepo ui`` (the README's command), its artifacts proxied to ``s3://<bucket>/mlartifacts`` (with no S3
        started: in its runs dir)."""
        mlflow_port, prefect_port = free_port(), free_port()
        s3 = ["--artifacts-destination", f"s3://{self.bucket}/mlartifacts", "--s3-endpoint-url",
              self.s3_url] if self.s3_url else []
        self.mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        self.prefect_api = f"http://127.0.0.1:{prefect_port}/api"
        self.start("ui", [sys.executable, "-m", "flows.cli", "ui", "--runs-dir", str(self.ui_runs), "--host",
                          "127.0.0.1", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                          *s3], base_env(COLUMNS="200"),
                   health=[f"{self.mlflow_url}/health", f"{self.prefect_api}/health"])

    def prefect_cli(self, *args: str, timeout_s: float = 180.0) -> str:
        env = base_env(PREFECT_API_URL=self.prefect_api, PREFECT_HOME=str(self.tmp / "prefect-cli"),
                       PWD=str(REPO), PREFECT_CLI_PROMPT="false")
        proc = subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=timeout_s)
        assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def stop(self, name: str) -> None:
        """Stop ``name``'s process group (SIGTERM, then SIGKILL after 30 s) and forget it."""
        self.procs.pop(name).stop(grace_s=30)


@contextlib.contextmanager
def running_stack(tmp: Path, bucket: str) -> Iterator[Stack]:
    """moto S3 + ``aepo ui``; every process started on the stack (also later, e.g. workers) is stopped on exit."""
    st = Stack(tmp, bucket)
    env = pytest.MonkeyPatch()
    if "PREFECT_HOME" not in os.environ:  # this process's Prefect files (the session harness sets its own)
        env.setenv("PREFECT_HOME", str(tmp / "prefect-test"))  # never ~/.prefect
    env.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        st.start_s3()
        st.start_ui()
        yield st
    finally:
        for name in reversed(list(st.procs)):
            st.stop(name)
        env.undo()
