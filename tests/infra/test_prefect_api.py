"""Prefect's temporary API server as the CLI starts it (infra/prefect_api.py): two runs started at once in one runs
dir each get a server of their own, on a port the server holds from the start (issue 50 §3 and §6).

Prefect probes a random free port in 8000–8999 and lets uvicorn bind it later. Both processes here seed ``random``
alike, so they draw the same port at the same moment: the race two seeds of one config started together could
lose by chance, forced. Before the fix, every try left one process running its flow on the *other* process's
server (its own uvicorn had died on "address already in use"), which stops when the other run ends; and the two
servers' start-up migrations or telemetry writes on the shared SQLite database failed with "database is locked".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slowdown import scaled

pytestmark = pytest.mark.slow  # two Prefect servers

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, random, sys, time
random.seed(7)  # the same "free" port for both processes
from infra.prefect_api import start_temporary_api
start_temporary_api()
import psutil
from prefect import flow
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer._instances[None]

@flow
def hello() -> int:
    return 1

assert hello() == 1
time.sleep(6)  # both servers up at once
listening = [c.laddr.port for c in psutil.Process(server.server_process.pid).net_connections("tcp")
             if c.status == "LISTEN"]
print(json.dumps({"port": server.port, "listening": listening, "alive": server.server_process.poll() is None}))
"""


def test_two_runs_started_at_once_in_one_runs_dir_each_run_on_their_own_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    done = [p.communicate(timeout=scaled(300)) for p in procs]
    seen = []
    for proc, (out, err) in zip(procs, done, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert "database is locked" not in err and "address already in use" not in err, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["alive"] and got["listening"] == [got["port"]], got  # the server that answered is its own
        seen.append(got["port"])
    assert len(set(seen)) == 2
