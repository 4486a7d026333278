"""A Prefect process work pool with N workers on this machine, for the benchmarks: the README's "A sweep on a
process work pool" commands, scripted and timed.

1. ``aepo ui --runs-dir <runs>`` on free ports: a Prefect server and an ``mlflow server`` whose backend is the
   runs dir's SQLite store (so ``--analyse-only`` reads the same runs without a server);
2. ``prefect work-pool create <pool> --type process`` and ``prefect deploy --name train --pool <pool>`` (the
   ``train`` deployment of ``prefect.yaml``);
3. N ``prefect worker start --pool <pool> --limit 1`` processes with cores/N torch threads each.

Every process runs in a session of its own and is stopped with its whole group when the ``with`` block ends
(also on an exception or SIGTERM unwinding through it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.servers import ManagedServer

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEPLOYMENT = "aepo-train/train"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalPool:
    """The servers' URLs and the started processes (logs under ``<runs>/pool-logs``)."""

    runs: Path
    workers: int
    pool: str = "aepo-bench"
    mlflow_url: str = ""
    prefect_api: str = ""
    deployment: str = DEPLOYMENT
    startup_s: float = 0.0
    procs: dict[str, ManagedServer] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.runs / "pool-logs"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        env.update({"PREFECT_API_URL": self.prefect_api, "PREFECT_HOME": str(self.runs / "prefect-cli"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(REPO), **extra})
        return env

    def start(self, name: str, cmd: list[str], env: dict[str, str], health: Sequence[str] = ()) -> None:
        """``cmd`` in a process group of its own, logging to ``<logs>/<name>.log``; returns once ``health``
        answers (at once without one)."""
        self.procs[name] = server = ManagedServer(name, cmd, health=health, env=env, cwd=REPO,
                                                  log_path=self.logs / f"{name}.log")
        server.start(timeout_s=300)

    def prefect(self, *args: str) -> None:
        proc = subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], cwd=REPO, capture_output=True, text=True,
                              env=self.env(PWD=str(REPO), PREFECT_CLI_PROMPT="false"), timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")

    def stop(self) -> None:
        for server in reversed(list(self.procs.values())):  # workers first, the servers last
            server.stop(grace_s=30)


@contextlib.contextmanager
def local_pool(runs: Path, workers: int) -> Iterator[LocalPool]:
    """``aepo ui`` + a process pool with the ``train`` deployment + ``workers`` one-flow-run-at-a-time workers."""
    if workers < 1:
        raise ValueError(f"a pool needs at least one worker; got {workers}")
    pool = LocalPool(runs, workers)
    t0 = time.perf_counter()
    try:
        mlflow_port, prefect_port = _free_port(), _free_port()
        pool.mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        pool.prefect_api = f"http://127.0.0.1:{prefect_port}/api"
        pool.start("ui", [sys.executable, "-m", "flows.cli", "ui", "--runs-dir", str(runs), "--mlflow-port",
                          str(mlflow_port), "--prefect-port", str(prefect_port)], pool.env(COLUMNS="200"),
                   health=[f"{pool.mlflow_url}/health", f"{pool.prefect_api}/health"])
        pool.prefect("work-pool", "create", pool.pool, "--type", "process", "--overwrite")
        pool.prefect("deploy", "--name", "train", "--pool", pool.pool)
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for i in range(1, workers + 1):
            pool.start(f"worker{i}", [str(BIN / "prefect"), "worker", "start", "--pool", pool.pool, "--type",
                                      "process", "--limit", "1", "--name", f"bench-worker{i}"],
                       pool.env(PREFECT_HOME=str(runs / f"prefect-worker{i}"), OMP_NUM_THREADS=threads,
                                MKL_NUM_THREADS=threads, PREFECT_WORKER_QUERY_SECONDS="1",
                                PREFECT_WORKER_PREFETCH_SECONDS="5"))
        pool.startup_s = time.perf_counter() - t0
        yield pool
    finally:
        pool.stop()
