"""What a test needs from the machine: skipped on a developer's machine that lacks it, a failure under ``CI=true``.

A green CI must mean the feature was tested: CI builds ``.venv-vllm``, installs DeepSpeed, runs as root with user and
mount namespaces and has the shipped data beside it, so a capability missing there is a broken set-up, not a reason
to pass without testing.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def require(available: bool, what: str) -> None:
    """Carry on when ``available``; else skip (``what`` says what is missing), or fail under ``CI=true``."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI=true, and this test cannot run: {what}", pytrace=False)
    pytest.skip(what, allow_module_level=True)
