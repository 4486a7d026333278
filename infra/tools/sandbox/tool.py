"""The ``<python>`` tool: model code runs once, in a confined separate process.

Confinement, each layer used when the machine allows it (``sandbox_capabilities()`` measures which, by running
the launcher for real, and reports it):

- a **private root** (the code sees none of the host's files): in its own mount namespace the launcher builds a
  root on a tmpfs holding, read-only, only the system's programs and libraries (/usr, /bin, /lib…), the
  interpreter's installation and its site-packages directories (numpy, sympy…; a venv inside the checkout
  shows only its site-packages, never the checkout), a generated minimal /etc and a few device nodes, plus a
  fresh /proc of its own PID namespace; then ``pivot_root``. The checkout, the data (gold answers), the runs dir
  (checkpoints, ``mlflow.db``) and ``$HOME`` are simply not there. See ``runner._build_root``.
- an **unprivileged uid, always**: a fresh uid per call when the caller is root; when it is not (a user
  namespace, ``unshare -r``), uid 65534 in a nested user namespace with no capabilities. ``no_new_privs``; the
  system directories are bound ``nosuid``. Code never runs as root: a machine where no drop works runs nothing.
- **per-call limits**: the call gets its own cgroup (v2, or v1 — whichever this machine lets us create, nested
  under the caller's own cgroup): memory (``memory_mb`` for all its processes together, and the files it
  writes, which live in memory), process count (``max_processes``) and CPU bandwidth (``cpu_cores``). Its only
  writable place is one size-capped tmpfs (``disk_mb``) at /tmp holding the working directory, with /var/tmp
  and /dev/shm pointing into it; nothing reaches the host's disk and it vanishes with the call. What stopped a
  call is reported (``meta["limits_hit"]``: memory, processes, disk, cpu_time, wall_time) and said in the text.
  Per-process hard rlimits stay underneath (CPU seconds, address space, file size, processes, open files, no
  core dumps).
- network: ``unshare --net`` (a new network namespace with loopback down: no connection anywhere, 127.0.0.1
  included); a PID namespace (the code sees only its own processes, and everything it forked dies with it).
- **process hygiene**: the launcher chain dies with its caller — ``setpriv --pdeathsig KILL`` in front of
  ``unshare``, ``--kill-child`` on the launcher, whose exit kills the whole PID namespace — so a trainer killed
  by SIGKILL leaves no process and, with a private root, no working directory behind. The launcher's status
  pipe is written only by the supervisor (PID 1 of the namespace, which never runs model code): the code's
  process closes it before the code starts, so the code cannot forge the uid or the setup in the metadata.
- a scrubbed environment (PATH, LANG, HOME/TMPDIR = the working directory, single-threaded BLAS; no secrets, no
  proxies); a wall timeout that SIGKILLs the whole process group (``start_new_session``).

Where the machine cannot build the private root (no ``unshare``, no mount namespace), ``unconfined`` decides:
``"refuse"`` (default) — every call returns ``ok=False, error="sandbox_unavailable"`` and the reason is logged as
an error — or ``"warn"`` — the code runs with rlimits, a uid drop when root and a host temp dir, each result's
``meta["warning"]`` says it is not confined, and a warning is logged once.

Results: stdout and stderr are captured together and cut to ``max_output_chars`` (head and tail kept). Code that
prints nothing returns the ``repr`` of its last expression, REPL-style, or ``(no output)``; it is run once, never
re-run. An exception in the model's code is reported as ``ok=False, error="exception"`` with the output and the
traceback tail as text: the model reads the traceback like any result, while metrics can count failing code
apart from sandbox failures (``timeout``, ``cpu_limit``, ``killed``, ``sandbox_error``, ``sandbox_unavailable``).
The rollout loop should treat every one of these as an ordinary tool result, not as a broken trajectory.

This module is the tool; the rest of the package does the confinement: ``capabilities.py`` measures what holds on
this machine, ``launcher.py`` starts one call, ``cgroups.py`` makes its cgroup, ``runner.py`` runs inside it.
"""

from __future__ import annotations

import logging
import random
import signal
import sys
import time

from aepo_core.interfaces import ToolResult
from aepo_core.tool_config import PythonToolConfig

from .capabilities import SandboxCapabilities, sandbox_capabilities
from .cgroups import CallCgroup, CgroupRoots
from .launcher import (
    EXIT_CPU_LIMIT,
    EXIT_SETUP_FAILED,
    NOBODY_UID,
    SANDBOX_UID_BASE,
    SANDBOX_UID_SPAN,
    LaunchResult,
    run_launcher,
)

logger = logging.getLogger(__name__)

NO_OUTPUT = "(no output)"
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE of each process of a call


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the (more useful) tail of long output, marking what was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n…[{len(text) - max_chars} characters truncated]…\n"
    room = max(0, max_chars - len(marker))
    head = int(room * 0.4)
    return text[:head] + marker + text[len(text) - (room - head) :] if room else text[-max_chars:]



class PythonSandbox:
    """Runs model code once per call in a confined process; always returns text (see the module docstring)."""

    name = "python"

    def __init__(self, cfg: PythonToolConfig, *, timeout_s: float = 30.0) -> None:
        """``cfg``: the tool's limits and confinement (``tools.python``); ``timeout_s``: every tool call's wall
        timeout (``tools.timeout_s``)."""
        self.cfg = cfg
        self.interpreter = cfg.interpreter or sys.executable
        self.timeout_s = timeout_s
        self.limits = {
            "cpu": cfg.cpu_seconds,
            "as": cfg.memory_mb << 20,
            "fsize": cfg.file_size_mb << 20,
            "nproc": cfg.max_processes,
            "nofile": MAX_OPEN_FILES,
            "core": 0,
        }
        self._rng = random.SystemRandom()
        self._warned = False

    @property
    def capabilities(self) -> SandboxCapabilities:
        return sandbox_capabilities(self.interpreter, self.cfg.isolate_network, disk_mb=self.cfg.disk_mb)

    def _uid(self, caps: SandboxCapabilities) -> int | None:
        if caps.drop_privileges == "per-call uid":
            return SANDBOX_UID_BASE + self._rng.randrange(SANDBOX_UID_SPAN)
        if caps.drop_privileges == "nobody":
            return NOBODY_UID
        return None

    def __call__(self, argument: str) -> ToolResult:
        started = time.perf_counter()
        if not argument.strip():
            return ToolResult(text="Python error: the code is empty; put code between <python> and </python>.",
                              ok=False, error="empty_code")
        try:
            caps = self.capabilities
            if not caps.confined:
                if self.cfg.unconfined == "refuse":
                    return ToolResult(
                        text="Python sandbox unavailable: this machine cannot confine the code "
                        "(no private root or no unprivileged uid), so it was not run.",
                        ok=False, error="sandbox_unavailable", latency_s=time.perf_counter() - started,
                        meta={"notes": list(caps.notes)},
                    )
                if not self._warned:
                    self._warned = True
                    logger.warning("python tool runs model code UNCONFINED (unconfined=warn): %s",
                                   "; ".join(caps.notes))
            uid = self._uid(caps)
            cgroup_dirs = caps.launch.get("cgroups")
            cgroup = CallCgroup(
                CgroupRoots(caps.cgroup or "v1", cgroup_dirs), memory_bytes=self.cfg.memory_mb << 20,
                max_processes=self.cfg.max_processes + 1, cpu_cores=self.cfg.cpu_cores,  # +1: the launcher's supervisor
            ) if cgroup_dirs else None
            limits = dict(self.limits)
            if "processes" in caps.call_limits:  # the cgroup stops a fork bomb first, and says so
                limits["nproc"] = self.cfg.max_processes + 8
            try:
                run = run_launcher(
                    caps.command_prefix, self.interpreter, argument, timeout_s=self.timeout_s, limits=limits,
                    uid=uid, user_namespace=caps.user_namespace, max_output_chars=self.cfg.max_output_chars,
                    workdir_root=self.cfg.workdir_root, layout=caps.launch.get("layout"), disk_mb=self.cfg.disk_mb,
                    cgroup=cgroup,
                )
            finally:
                if cgroup is not None:
                    cgroup.close()
        except Exception as exc:  # the sandbox itself failed (disk full, fork refused): still a text result
            logger.exception("python sandbox failed to run code")
            return ToolResult(text=f"Python sandbox error: {type(exc).__name__}: {exc}", ok=False,
                              error="sandbox_error", latency_s=time.perf_counter() - started)
        return self._result(run, caps, time.perf_counter() - started)

    def _result(self, run: LaunchResult, caps: SandboxCapabilities, latency: float) -> ToolResult:
        output = run.output
        error: str | None = None
        note = ""
        exception = run.status.get("exception")
        hit = list(run.limits_hit)
        if run.timed_out:
            error, note = "timeout", f"Killed: wall time limit of {self.timeout_s:g}s exceeded."
            hit.append("wall_time")
        elif run.returncode == 0:
            pass
        elif exception is not None and run.returncode == 1:
            error = "exception"
        elif run.returncode == EXIT_CPU_LIMIT or run.returncode == -signal.SIGXCPU:
            error, note = "cpu_limit", f"Killed: CPU time limit of {self.limits['cpu']}s exceeded."
            hit.append("cpu_time")
        elif run.returncode == EXIT_SETUP_FAILED and "setup_error" in run.status:
            error, note = "sandbox_error", f"Sandbox setup failed: {run.status.get('setup_error', 'unknown')}"
        elif run.returncode < 0:
            name = signal.Signals(-run.returncode).name if -run.returncode in signal.valid_signals() else "?"
            error, note = "killed", f"Killed by {name} (a resource limit: memory, CPU or processes)."
            if "memory" in hit:
                note = f"Killed: the call's memory limit of {self.cfg.memory_mb} MiB was reached."
        else:
            error, note = "exit_status", f"Exited with status {run.returncode}."
        extra = []
        if "memory" in hit and "memory limit" not in note:
            extra.append(f"A process of this call was killed: the call's memory limit of {self.cfg.memory_mb} MiB "
                         "was reached.")
        if "processes" in hit:
            extra.append(f"The call's process limit ({self.cfg.max_processes}) was reached: a fork was refused.")
        if "disk" in hit:
            extra.append(f"The call's disk space ({self.cfg.disk_mb} MiB for the working directory, /tmp and /dev/shm "
                         "together) ran out.")
        note = "\n".join(n for n in (note, *extra) if n)
        if not output.strip() and not note:
            last = run.status.get("last_repr")
            output = last if (last is not None and error is None) else NO_OUTPUT
        full = output.rstrip("\n")
        if note:
            full = f"{full}\n{note}" if full.strip() else note
        text = truncate_middle(full, self.cfg.max_output_chars)
        meta: dict[str, object] = {
            "returncode": run.returncode,
            "wall_s": round(run.wall_s, 3),
            "output_chars": len(run.output),
            "output_bytes": run.output_bytes,
            "truncated": run.truncated or len(text) < len(full),
            "limits_hit": sorted(set(hit)),
            "isolation": {
                "network": caps.network_isolated,
                "pid_namespace": caps.pid_namespace,
                "private_root": bool(run.status.get("private_root")),
                "private_tmp": bool(run.status.get("private_root")),
                "uid": run.status.get("uid"),
                "call_limits": list(caps.call_limits),
            },
        }
        if run.peak_memory_bytes is not None:
            meta["peak_memory_mb"] = round(run.peak_memory_bytes / 2**20, 1)
        if exception is not None:
            meta["exception"] = exception
        warnings = []
        if self.cfg.isolate_network and not caps.network_isolated:
            warnings.append("network not isolated: unshare --net is unavailable on this machine")
        if not caps.confined:
            warnings.append("code ran unconfined: no private root on this machine (sees the host's files)")
        if warnings:
            meta["warning"] = "; ".join(warnings)
        return ToolResult(text=text, ok=error is None, error=error, latency_s=latency, meta=meta)
