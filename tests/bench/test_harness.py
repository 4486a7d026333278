"""bench.harness.write_result, the one writer of bench/results/: every result names the commit (marked -dirty when
the tree differed from it) and the CPU (model and torch's kernel capability) it was measured on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bench.harness import REPO, tree_commit, write_result


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.org", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_tree_commit_is_head_marked_dirty_while_a_tracked_file_differs(tmp_path: Path) -> None:
    repo, elsewhere = tmp_path / "repo", tmp_path / "no-repo"
    repo.mkdir(), elsewhere.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")
    assert tree_commit(repo) == head
    (repo / "a.txt").write_text("two\n")
    assert tree_commit(repo) == f"{head}-dirty"
    (repo / "a.txt").write_text("one\n")
    (repo / "untracked.txt").write_text("scratch\n")  # an untracked file changes no measured code
    assert tree_commit(repo) == head
    assert tree_commit(elsewhere) is None


def test_write_result_puts_commit_and_cpu_first(tmp_path: Path) -> None:
    out = tmp_path / "results" / "x.json"
    write_result(out, {"benchmark": "x", "value": 1.5})
    data = json.loads(out.read_text())
    assert list(data)[:2] == ["commit", "cpu"]
    assert data["commit"].removesuffix("-dirty") == git(REPO, "rev-parse", "HEAD")
    assert data["cpu"].endswith(f" ({torch.backends.cpu.get_cpu_capability()})") and len(data["cpu"]) > 8
    assert data["benchmark"] == "x" and data["value"] == 1.5
    write_result(out, {"commit": "abc1234", "cpu": "given", "benchmark": "y"})  # a result that names them keeps them
    assert json.loads(out.read_text()) == {"commit": "abc1234", "cpu": "given", "benchmark": "y"}


def test_a_long_bench_names_the_commit_it_started_on(tmp_path: Path) -> None:
    """A bench imports its code at start; a commit made while it runs (a sweep of hours) is not what measured it.
    environment() records the commit at start, and write_result names that one, and the tree at writing beside it
    when they differ."""
    from bench.harness import environment

    env = environment(threads=1)
    assert env["commit"] == tree_commit()
    out = tmp_path / "r.json"
    write_result(out, {"benchmark": "x", "environment": {**env, "commit": "0123abc"}})
    data = json.loads(out.read_text())
    assert data["commit"] == "0123abc" and data["commit_at_write"] == tree_commit()
    write_result(out, {"benchmark": "x", "environment": env})
    assert "commit_at_write" not in json.loads(out.read_text())


_BENCH_WITH_A_FLOW = """
import sys, time
from pathlib import Path
from bench.harness import flow_bench_main

def body(runs):
    from prefect import flow

    @flow
    def noop():
        return 1

    noop()  # a flow run: Prefect's temporary API server is up
    print("flowed", flush=True)
    time.sleep(600)
    return 0

sys.exit(flow_bench_main("probe", Path(sys.argv[1]), body))
"""


@pytest.mark.slow
def test_a_sigkilled_bench_leaves_no_temporary_prefect_server(tmp_path: Path) -> None:
    """A bench killed by SIGKILL (the OOM killer, `kill -9`) runs no atexit: Prefect's temporary API server, which
    Prefect starts on the first flow run, was left behind as an orphan (seen after a bench was killed by hand).
    Like the CLI, the harness starts that server itself, bound to the bench's process."""
    import contextlib
    import os
    import sys
    import time

    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    proc = subprocess.Popen([sys.executable, "-c", _BENCH_WITH_A_FLOW, str(tmp_path / "runs")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # until the flow has run
            lines.append(line)
            if line.strip() == "flowed":
                break
        assert lines and lines[-1].strip() == "flowed", "".join(lines)[-3000:]
        servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "uvicorn" in " ".join(p.cmdline())]
        assert servers, "no temporary Prefect server was started: nothing to check"
        proc.kill()
        proc.wait()
        deadline = time.time() + 15
        _, alive = psutil.wait_procs(servers, timeout=max(0.0, deadline - time.time()))
        assert not alive, f"orphaned Prefect server: {[p.pid for p in alive]}"
    finally:
        for p in servers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def test_prefect_logs_to_the_session_stream_not_to_a_test_capture(prefect_imported: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A bench's ``main`` under capsys must not be where Prefect first configures its logging: its console handlers
    would keep capsys's stream, closed after the test, and a later test's flow then fails in a recursion of logging
    errors. With ``prefect_imported`` (a session fixture, set up before capsys) they hold the session's stream."""
    import logging
    import sys

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    handlers = [h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)]
    assert handlers, "prefect.main was not imported: Prefect's logging is configured later, inside some test"
    assert all(h.stream is not sys.stderr for h in handlers)  # sys.stderr is capsys's stream here


def test_a_quiet_bench_keeps_the_libraries_to_warnings() -> None:
    import logging

    from bench.harness import QUIET_LOGGERS, cli_logging

    before = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        cli_logging(quiet=True)
        assert all(logging.getLogger(name).level == logging.WARNING for name in QUIET_LOGGERS)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
