"""How much slower this machine runs right now than the one the suite's deadlines were set on: one factor per test
run, by which per-test timeouts and child deadlines are scaled (issue 50 §6).

These VMs are sometimes ~5× slower than usual (another tenant, a slower CPU kind); a fixed deadline then fails a
correct run. The probe is a fixed piece of the suite's kind of work (an interpreted loop and float32 matmuls on
torch's threads), timed best of 3, against ``REFERENCE_S``: the same probe on the 2-core AMD EPYC (Zen 4) where the
deadlines were set, idle. The factor never goes below 1 (a faster machine keeps the deadlines as written). It is
measured once, by the pytest process, and handed to every child through ``AEPO_TEST_SLOWDOWN`` (a child process
that sets its own deadlines reads the same factor).
"""

from __future__ import annotations

import math
import os
import time

ENV = "AEPO_TEST_SLOWDOWN"
REFERENCE_S = 0.40
"""The probe's best of 3 on the reference machine, idle (2-core AMD EPYC Zen 4, torch 2.13 CPU: 0.31–0.48 s in 4 runs).

Under load it reads far slower (1.9 s beside a niced CPU-bound job here): what a deadline must allow for."""


def probe_seconds() -> float:
    import torch

    a = torch.randn(384, 384)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(1_500_000):
            total += i * i
        for _ in range(300):
            a = torch.tanh(a @ a.T / 384)
        best = min(best, time.perf_counter() - t0)
    return best


def factor() -> float:
    """The slowdown of this test run (measured at its first call, then read from ``AEPO_TEST_SLOWDOWN``)."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{max(1.0, probe_seconds() / REFERENCE_S):.2f}"
    return float(os.environ[ENV])


def scaled(seconds: float) -> int:
    """``seconds`` as written for the reference machine, on this one now (whole seconds, rounded up: some take only
    an int, such as a sweep's ``child_timeout_s``)."""
    return math.ceil(seconds * factor())
