"""`make test` builds .venv-vllm in the background (Makefile: ``.venv-vllm.build.pid``, ``.rc``, ``.log``) while the
tests that do not need it run; the vLLM tests run last (conftest.py) and wait here for the build to end."""

from __future__ import annotations

import functools
import time

import psutil
import pytest

from infra.engines.vllm_server import DEFAULT_VENV, PROJECT_ROOT

PID, RC, LOG = (PROJECT_ROOT / f"{DEFAULT_VENV}.build.{s}" for s in ("pid", "rc", "log"))
STAMP = PROJECT_ROOT / DEFAULT_VENV / ".installed"  # the Makefile's VLLM_STAMP
WAIT_S = 1200.0  # `make vllm` took 2.5-4.5 min on 2 cores; a build that takes 20 is broken


def pending() -> bool:
    """A background build started by `make test` is still running (no stamp, no exit code yet)."""
    if STAMP.is_file() or RC.is_file() or not PID.is_file():
        return False
    try:
        return psutil.pid_exists(int(PID.read_text().strip()))
    except ValueError:
        return False


@functools.cache
def wait() -> None:
    """Return once no background build is pending; fail (once, for every vLLM test) when it failed or hung."""
    deadline = time.monotonic() + WAIT_S
    while pending():
        if time.monotonic() > deadline:
            pytest.fail(f".venv-vllm still building after {WAIT_S:.0f} s (log: {LOG})", pytrace=False)
        time.sleep(2)
    if RC.is_file() and RC.read_text().strip() not in ("", "0"):
        tail = "\n".join(LOG.read_text(errors="replace").splitlines()[-20:]) if LOG.is_file() else ""
        pytest.fail(f"building .venv-vllm failed (exit {RC.read_text().strip()}; log {LOG}):\n{tail}", pytrace=False)
