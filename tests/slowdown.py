"""How much slower this machine runs right now than the one the suite's deadlines were set on: one factor per test
run, by which per-test timeouts and child deadlines are scaled (issue 50 §6).

These VMs are sometimes ~5× slower than usual (another tenant, a slower CPU kind); a fixed deadline then fails a
correct run. The probe is a fixed piece of the suite's kind of work (an interpreted loop, float32 matmuls on
torch's threads and freshly touched memory), three rounds summed, against ``REFERENCE_S``: the same probe on the
2-core AMD EPYC (Zen 4) where the deadlines were set, idle. The factor never goes below 1 (a faster machine keeps
the deadlines as written). It is measured once, by the pytest process, and handed to every child through
``AEPO_TEST_SLOWDOWN`` (a child process that sets its own deadlines reads the same factor).
"""

from __future__ import annotations

import math
import os
import time

ENV = "AEPO_TEST_SLOWDOWN"
REFERENCE_S = 1.3
"""The probe on the reference machine, idle (2-core AMD EPYC Zen 4, torch 2.13 CPU: 1.12–1.33 s in 4 runs). Its
arithmetic part alone, best of 3, read ~5× its idle time beside a CPU-bound job at nice 19 here."""


def probe_seconds() -> float:
    """Three rounds, summed (not the best: a slow state is what it must see): an interpreted loop, float32 matmuls
    on torch's threads, and 128 MB of fresh memory touched once (README, "How long it takes": in the VMs' slow state
    arithmetic ran at its usual speed and freshly touched memory ~40× slower)."""
    import torch

    a = torch.randn(384, 384)
    total_s = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        acc = 0
        for i in range(1_500_000):
            acc += i * i
        for _ in range(300):
            a = torch.tanh(a @ a.T / 384)
        fresh = torch.ones(32 * 1024 * 1024)  # 128 MB, new pages
        del fresh
        total_s += time.perf_counter() - t0
    return total_s


def factor() -> float:
    """The slowdown of this test run (measured at its first call, then read from ``AEPO_TEST_SLOWDOWN``)."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{max(1.0, probe_seconds() / REFERENCE_S):.2f}"
    return float(os.environ[ENV])


def scaled(seconds: float) -> int:
    """``seconds`` as written for the reference machine, on this one now (whole seconds, rounded up: some take only
    an int, such as a sweep's ``child_timeout_s``)."""
    return math.ceil(seconds * factor())
