"""Fixtures shared by the infra tests."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest


@pytest.fixture()
def sandbox_launches(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The command lines of the real processes the Python sandbox starts during the test (Popen is counted)."""
    from infra.tools.sandbox import launcher

    launched: list[object] = []
    real_popen = subprocess.Popen

    def counting_popen(*args: Any, **kwargs: Any) -> Any:
        launched.append(args[0])
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(launcher.subprocess, "Popen", counting_popen)
    return launched
