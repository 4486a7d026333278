"""Helpers of the tests that run flows in child processes (their own process group) and kill them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (the flow process and anything it started) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def log_tail(runs: Path, name: str = "run.log") -> str:
    """The end of a child's log in its runs dir (for assertion messages)."""
    path = runs / name
    return path.read_text()[-3000:] if path.exists() else ""
