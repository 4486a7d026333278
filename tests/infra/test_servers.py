"""The one managed server (infra/servers.py) on real processes: Python's http.server as the server."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.engines.vllm_server import free_port
from infra.servers import ManagedServer, ServerError, live_members

# a server that also starts a grandchild (a worker of its own) before serving
WITH_WORKER = ("import subprocess, sys, http.server;"
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
               "print('serving', flush=True);"
               "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)"
               ".serve_forever()")


@pytest.mark.parametrize(("log", "through_pipe"), [(False, False), (True, False), (True, True)],
                         ids=["pipe", "log-file", "pipe-copied-to-log"])
def test_start_waits_for_health_and_stop_ends_the_whole_group(tmp_path: Path, log: bool, through_pipe: bool) -> None:
    port = free_port()
    server = ManagedServer("toy", [sys.executable, "-c", WITH_WORKER, str(port)], cwd=tmp_path,
                           health=[f"http://127.0.0.1:{port}/"], log_path=tmp_path / "toy.log" if log else None,
                           through_pipe=through_pipe)
    with server:
        assert server.running and server.pid is not None
        pgid = server.pid
        group = live_members(pgid)
        assert len(group) == 2, group  # the server and its worker, in a group of their own
        assert psutil.Process(pgid).children()  # (the worker is the server's child)
        assert "serving" in server.tail()
    assert not server.running and server.pid is None
    assert live_members(pgid) == []  # the worker went with it
    if log:
        assert "serving" in (tmp_path / "toy.log").read_text()
    assert server.stop() is True  # idempotent


def test_a_server_that_dies_while_starting_says_why(tmp_path: Path) -> None:
    server = ManagedServer("doomed", [sys.executable, "-c", "import sys; print('no such model: /x'); sys.exit(3)"],
                           health=[f"http://127.0.0.1:{free_port()}/"])
    with pytest.raises(ServerError) as err:
        server.start(timeout_s=60)
    message = str(err.value)
    assert "the doomed server exited with code 3 while starting" in message and "no such model: /x" in message
    assert server.pid is None


def test_a_server_that_never_answers_is_stopped_and_names_its_timeout_setting(tmp_path: Path) -> None:
    server = ManagedServer("mute", [sys.executable, "-c", "import time; print('loading', flush=True); "
                                                         "time.sleep(600)"],
                           health=[f"http://127.0.0.1:{free_port()}/health"])
    with pytest.raises(ServerError) as err:
        server.start(timeout_s=1, timeout_setting="rollout.vllm.startup_timeout_s")
    message = str(err.value)
    assert "did not answer" in message and "within 1 s (rollout.vllm.startup_timeout_s)" in message
    assert "loading" in message
    assert not server.running


def test_a_server_deaf_to_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(600)")
    server = ManagedServer("deaf", [sys.executable, "-c", deaf]).start()
    pgid = server.pid
    assert pgid is not None
    deadline = time.monotonic() + 60
    while "up" not in server.tail():  # its handler is installed
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.05)
    assert server.stop(grace_s=1) is False  # SIGTERM did not suffice: SIGKILL did
    assert live_members(pgid) == []


def test_a_health_check_answered_by_another_process_is_not_this_server_starting(tmp_path: Path) -> None:
    """The port picked for a server is taken by another HTTP server before ours binds it (a probe-then-bind race:
    two runs at once). The other answers our health URL with 200; before, start() returned as if our server were
    up while it had died on "address already in use", and the run talked to a stranger. Now a health answer counts
    only from a port our server's process group listens on: start() fails with our server's own reason."""
    from json_server import JsonServer

    with JsonServer(lambda path, body: (200, {})) as stranger:
        port = int(stranger.url.rsplit(":", 1)[1])
        server = ManagedServer("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                               health=[f"http://127.0.0.1:{port}/"])
        with pytest.raises(ServerError, match=r"exited with code 1 while starting(.|\n)*[Aa]ddress already in use"):
            server.start(timeout_s=60)
