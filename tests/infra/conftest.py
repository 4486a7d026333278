"""Fixtures shared by the infra tests."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest


@pytest.fixture()
def sandbox_launches(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The command lines of the real processes the Python sandbox starts during the test (Popen is counted)."""
    from infra.tools.sandbox import tool as python_sandbox

    launched: list[object] = []
    real_popen = subprocess.Popen

    def counting_popen(*args: Any, **kwargs: Any) -> Any:
        launched.append(args[0])
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(python_sandbox.subprocess, "Popen", counting_popen)
    return launched
