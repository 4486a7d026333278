"""One managed server process: started in a process group of its own, waited for until its health URLs answer,
stopped with its whole group, and when it dies, the reason read from its last log lines.

The vLLM server a run starts (:mod:`infra.engines.vllm_server`), ``aepo ui``'s MLflow and Prefect servers, the
benchmarks' work pool (``bench/pool.py``) and the tests' server stack (``tests/server_stack.py``) all start their
servers through :class:`ManagedServer`. (Prefect's temporary API server is Prefect's own object:
:mod:`infra.prefect_api` only adds a parent-death signal to it.)

Output goes to ``log_path`` when there is one (the child writes the file itself, so a server outlives a parent that
stops reading: ``aepo ui``'s servers), else through a pipe into an in-memory tail. ``through_pipe`` sends it through
the pipe and copies it to ``log_path``: the vLLM server's engine processes are not the server's process group
leader, so the parent-death signal does not reach them; when the trainer dies, their next write to the broken pipe
ends them (with the log written by the child itself, a SIGKILLed trainer left two of them running).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import psutil

from infra.processes import set_parent_death_signal


class ServerError(RuntimeError):
    """A managed server exited while starting, or did not answer in time; the message holds its last lines."""


class ManagedServer:
    """``command`` as a server named ``name``: :meth:`start` returns once every URL of ``health`` answers 200.

    ``parent_death``: the signal the server gets when the thread that started it dies (a SIGKILLed trainer leaves
    no orphan); ``None`` lets it outlive its parent (a server that stops on its own signal handling).
    ``tail_filter(lines, n)``: the lines :meth:`tail` shows (default: the last ``n``; vLLM's drops its shutdown
    noise and keeps the first error line)."""

    def __init__(self, name: str, command: Sequence[str], *, health: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, parent_death: signal.Signals | None = None,
                 tail_filter: Callable[[list[str], int], list[str]] | None = None, through_pipe: bool = False
                 ) -> None:
        self.name = name
        self.command = list(command)
        self.health = list(health)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.log_path = Path(log_path) if log_path is not None else None
        self.parent_death = parent_death
        self.tail_filter = tail_filter
        self.through_pipe = through_pipe
        self._log_fh: BinaryIO | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._lines: deque[str] = deque(maxlen=400)
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 180.0, timeout_setting: str = "") -> ManagedServer:
        """Start the server (once) and wait until it answers; on failure it is stopped and :class:`ServerError`
        says why (naming ``timeout_setting``, the setting that holds ``timeout_s``, if it timed out)."""
        self.launch()
        try:
            self.wait_healthy(timeout_s, timeout_setting)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        """Start the process (once) without waiting for it: :meth:`wait_healthy` then waits (several servers
        started at once come up side by side)."""
        if self.proc is not None:
            return
        sig = self.parent_death

        def pre_exec() -> None:  # pragma: no cover - runs in the child between fork and exec
            os.setsid()
            if sig is not None:
                set_parent_death_signal(sig)

        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path is not None and not self.through_pipe:
            with open(self.log_path, "ab") as fh:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                             stdout=fh, stderr=subprocess.STDOUT, preexec_fn=pre_exec)
        else:
            if self.log_path is not None:
                self._log_fh = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=pre_exec)
            self._reader = threading.Thread(target=self._pump, name=f"{self.name}-log", daemon=True)
            self._reader.start()

    def wait_healthy(self, timeout_s: float, timeout_setting: str = "") -> None:
        """Return when every health URL answers 200; :class:`ServerError` if the server exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.health)
        while pending:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                time.sleep(0.2)  # let the log reader drain the last lines
                code = None if proc is None else proc.returncode
                raise ServerError(f"the {self.name} server exited with code {code} while starting; its last lines:"
                                  f"\n{self.tail()}")
            try:
                with urllib.request.urlopen(pending[0], timeout=2) as resp:
                    if resp.status == 200 and self.listens_on(urllib.parse.urlsplit(pending[0]).port):
                        pending.pop(0)
                        continue
            except OSError:  # not listening yet: poll again
                pass
            if time.monotonic() > deadline:
                setting = f" ({timeout_setting})" if timeout_setting else ""
                raise ServerError(f"the {self.name} server did not answer at {pending[0]} within {timeout_s:.0f} s"
                                  f"{setting}; its last lines:\n{self.tail()}")
            time.sleep(0.5)

    def listens_on(self, port: int | None) -> bool:
        """Whether this server's process, its group or its descendants (``aepo ui`` starts its servers in groups
        of their own) listen on ``port``: a health answer counts only then. The port was free when picked, but
        another process can bind it before ours does (two runs started at once); that one then answers our health
        URL while ours dies on "address already in use"."""
        if port is None or self.proc is None:
            return True  # a URL without a port: nothing to tell apart
        pids = set(live_members(self.proc.pid))
        with contextlib.suppress(psutil.NoSuchProcess):
            pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        for pid in pids:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for c in psutil.Process(pid).net_connections("inet")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, grace_s: float = 20.0) -> bool:
        """Stop the whole process group: SIGTERM, then SIGKILL to whatever of it is left after ``grace_s``;
        returns when no process of the group is left, True if SIGTERM sufficed. Idempotent."""
        proc, self.proc = self.proc, None
        clean = True
        if proc is not None:
            signal_group(proc.pid, signal.SIGTERM)
            if not wait_group_gone(proc, grace_s):
                clean = False
                signal_group(proc.pid, signal.SIGKILL)
                wait_group_gone(proc, 10.0)
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return clean

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ output
    def lines(self) -> list[str]:
        """The server's output so far (the last 400 lines of the pipe, or of the log file)."""
        if self.log_path is None or self.through_pipe:
            return list(self._lines)
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-400:]
        except OSError:
            return []

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of its output, as ``tail_filter`` picks them."""
        lines = self.lines()
        return "\n".join(self.tail_filter(lines, n) if self.tail_filter is not None else lines[-n:])

    def _pump(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        for raw in proc.stdout:
            self._lines.append(raw.decode(errors="replace").rstrip())
            if self._log_fh is not None:
                self._log_fh.write(raw)
                self._log_fh.flush()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group ``pgid``, if it still exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def live_members(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (an orphaned zombie waits for init to reap it, and
    holds nothing). Without /proc: the group exists or not."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - Linux has /proc
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp …, after the parenthesised command
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry.name))
    return live


def wait_group_gone(leader: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait until no process of the leader's group exists (the leader reaped, its children gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leader.poll()  # reap the leader, or it stays a zombie member of its group
        if not live_members(leader.pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
