"""Child processes that must not outlive the process that started them (servers a run starts for itself), and the
CPU time a process and its children have used."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
from collections.abc import Iterable

import psutil

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


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts); the owner check of resources named by the
    process that made them (a killed process leaves them behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cpu_seconds(trees: Iterable[int] = ()) -> float:
    """CPU seconds (user + system) used so far by this process (all its threads), by its children that have been
    waited for (e.g. each sandboxed call's processes), and by the live process tree of each pid in ``trees`` (a
    long-lived child not waited for yet, such as a managed vLLM server, with the children it has reaped).

    Only differences of two readings mean anything: a phase's CPU seconds are the reading after it minus the one
    before. A tree process that exits between the readings without being reaped inside the tree is lost."""
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for pid in trees:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in (root, *root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
    return total
