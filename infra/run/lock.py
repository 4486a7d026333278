"""One live process per training run and per sweep, on one machine.

A run is resumed by finding it in MLflow, and a sweep is continued by its name; nothing stopped a second process
from doing either while the first was still at work (a second `bench.demo_seeds` started by mistake resumed the
sweep parent the first was running and began its cells; had it reached the cell in progress it would have
resumed a run another process was writing: two writers of one MLflow run and one checkpoint folder). Each live
run and sweep therefore holds an exclusive lock, ``<runs dir>/locks/<kind>-<id>.lock`` (``flock``), and a
second process that asks for it fails at once with the first one's pid. The kernel releases the lock when its
process dies, SIGKILL included, so a killed run never leaves a stale lock and always resumes. Processes that share
no runs dir (other machines) are not covered: one writer per run there is the user's to keep, as for checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Self

LOCKS_DIR = "locks"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]")


class BusyError(RuntimeError):
    """Another live process holds the run or sweep."""


def lock_path(runs_dir: str | os.PathLike[str], kind: str, ident: str) -> Path:
    """Where the lock of ``kind`` (``run``, ``sweep``) ``ident`` (a run id, a sweep name) lives."""
    return Path(runs_dir) / LOCKS_DIR / f"{kind}-{_UNSAFE.sub('_', ident)}.lock"


@contextlib.contextmanager
def held(runs_dir: str | os.PathLike[str], kind: str, ident: str, what: str, wait: bool = False) -> Iterator[Path]:
    """Hold the lock of ``kind`` ``ident`` while inside; :class:`BusyError` (naming ``what`` and the holder's pid)
    when another live process holds it, or with ``wait`` once it lets go (a stored evaluation one process computes
    while the others wait for it, :mod:`infra.run.start_evaluation`)."""
    path = lock_path(runs_dir, kind, ident)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise BusyError(f"{what} is in progress in another process (pid {holder}; lock {path}): wait for it to "
                            "end, or stop it, then run this again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class Claims:
    """The runs and sweeps this process works on, each held (:func:`held`) from its claim until the ``with`` ends.
    ``runs_dir`` None claims nothing (a data-parallel rank other than 0: rank 0 holds the run for all)."""

    def __init__(self, runs_dir: str | os.PathLike[str] | None, run_id: str | None = None,
                 sweep: str | None = None) -> None:
        self.runs_dir = runs_dir
        self._first_run = run_id
        self._first_sweep = sweep
        self._held: set[tuple[str, str]] = set()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        """Claims the run and the sweep given at construction (a resumed one: before anything of it is touched)."""
        self._stack.__enter__()
        try:
            if self._first_sweep is not None:
                self.sweep(self._first_sweep)
            self.run(self._first_run)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(self, run_id: str | None) -> None:
        """Hold the MLflow run ``run_id`` (None, or held already: nothing to do)."""
        if run_id is not None:
            self._claim("run", run_id, f"MLflow run {run_id}")

    def sweep(self, name: str) -> None:
        """Hold the sweep called ``name``."""
        self._claim("sweep", name, f"sweep {name!r}")

    def _claim(self, kind: str, ident: str, what: str) -> None:
        if self.runs_dir is None or (kind, ident) in self._held:
            return
        self._stack.enter_context(held(self.runs_dir, kind, ident, what))
        self._held.add((kind, ident))
