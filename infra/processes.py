"""Child processes that must not outlive the process that started them (servers a run starts for itself)."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in a child, pre-exec
    """The calling process gets ``sig`` when its parent dies, however it dies (SIGKILL, the OOM killer: no
    ``finally``, no ``atexit`` runs there). Linux ``prctl``; a no-op elsewhere.

    The kernel sends it when the *thread* that forked the child exits, so start such children from a thread that
    lives as long as the process (the main thread)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass
