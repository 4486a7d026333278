"""The ``<python>`` tool: model code runs once, in a confined separate process.

Confinement, strongest first, each used when the machine allows it (``sandbox_capabilities()`` says which):

- network: ``unshare --net`` (a new network namespace with loopback down: no connection anywhere, 127.0.0.1
  included); with ``--pid --mount-proc`` the code also gets its own PID namespace (it sees only its own
  processes, none of the parent's ``/proc/<pid>/environ``, and everything it forked dies with it) and a private
  tmpfs over /tmp, /var/tmp and /dev/shm. Not root: the same under a user namespace (``unshare -r``).
- uid: when the parent is root the code runs under a fresh unprivileged uid per call (root ignores RLIMIT_NPROC
  and may write anywhere; a per-call uid also keeps concurrent calls out of each other's files and process
  budgets);
- hard rlimits: CPU seconds, address space, file size, process count, open files, no core dumps;
- a fresh temporary working directory (deleted afterwards), a scrubbed environment (PATH, LANG, HOME/TMPDIR =
  the working directory, single-threaded BLAS; no secrets, no proxies);
- a wall timeout that SIGKILLs the whole process group (``start_new_session``).

Results: stdout and stderr are captured together and cut to ``max_output_chars`` (head and tail kept). Code that
prints nothing returns the ``repr`` of its last expression, REPL-style, or ``(no output)``; it is run once, never
re-run. An exception in the model's code is reported as ``ok=False, error="exception"`` with the output and the
traceback tail as text: the model reads the traceback like any result, while metrics can count failing code
apart from sandbox failures (``timeout``, ``cpu_limit``, ``killed``, ``sandbox_error``). The rollout loop should
treat every one of these as an ordinary tool result, not as a broken trajectory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aepo_core.config import PythonToolConfig
from aepo_core.interfaces import ToolResult

logger = logging.getLogger(__name__)

RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text(encoding="utf-8")
EXIT_SETUP_FAILED = 125  # keep in sync with sandbox_runner
EXIT_CPU_LIMIT = 152
NO_OUTPUT = "(no output)"
# Per-call uids when the parent is root: a high range no real account or subuid mapping uses.
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SPAN = 1_000_000
NOBODY_UID = 65534
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxCapabilities:
    """What confinement this machine gives model code; measured once by running the launcher for real."""

    command_prefix: tuple[str, ...]
    network_isolated: bool
    pid_namespace: bool
    private_tmp: bool
    user_namespace: bool
    drop_privileges: str | None  # "per-call uid", "nobody" or None
    nproc_limit_effective: bool
    notes: tuple[str, ...] = ()
    reveal: dict[str, list[str]] = field(default_factory=dict)  # see sandbox_runner._private_mounts

    def as_dict(self) -> dict[str, Any]:
        return {
            "command_prefix": list(self.command_prefix),
            "network_isolated": self.network_isolated,
            "pid_namespace": self.pid_namespace,
            "private_tmp": self.private_tmp,
            "user_namespace": self.user_namespace,
            "drop_privileges": self.drop_privileges,
            "nproc_limit_effective": self.nproc_limit_effective,
            "revealed_paths": self.reveal,
            "rlimits": ["cpu", "address_space", "file_size", "processes", "open_files", "core"],
            "notes": list(self.notes),
        }


@dataclass
class _Run:
    returncode: int
    timed_out: bool
    output: str
    output_bytes: int
    truncated: bool
    status: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the (more useful) tail of long output, marking what was cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n…[{len(text) - max_chars} characters truncated]…\n"
    room = max(0, max_chars - len(marker))
    head = int(room * 0.4)
    return text[:head] + marker + text[len(text) - (room - head) :] if room else text[-max_chars:]


class _BoundedReader(threading.Thread):
    """Drains a pipe so the child never blocks on it, keeping only a head and a tail of ``limit`` bytes each."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.limit = limit
        self.head = bytearray()
        self.tail: deque[bytes] = deque()
        self.tail_len = 0
        self.total = 0

    def run(self) -> None:
        try:
            while chunk := os.read(self.fd, 65536):
                self.total += len(chunk)
                room = self.limit - len(self.head)
                if room > 0:
                    self.head += chunk[:room]
                    chunk = chunk[room:]
                if chunk:
                    self.tail.append(chunk)
                    self.tail_len += len(chunk)
                    while self.tail_len - len(self.tail[0]) >= self.limit:
                        self.tail_len -= len(self.tail.popleft())
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def text(self) -> tuple[str, bool]:
        """Decoded capture, and whether bytes between head and tail were dropped."""
        tail = b"".join(self.tail)
        dropped = self.total - len(self.head) - len(tail)
        if dropped <= 0:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace"), False
        marker = f"\n…[{dropped} bytes truncated]…\n"
        return (
            self.head.decode("utf-8", errors="replace") + marker + tail.decode("utf-8", errors="replace"),
            True,
        )


def _scrubbed_env(workdir: str, interpreter: str) -> dict[str, str]:
    """Only what Python needs; nothing of the parent's environment (secrets, proxies, tokens) is passed."""
    bin_dir = os.path.dirname(os.path.abspath(interpreter))
    return {
        "PATH": f"{bin_dir}:{_SAFE_PATH}",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


def _remove_tree(path: str) -> None:
    """Delete the working directory even if the code made parts of it read-only."""

    def retry(func: Any, target: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(target), stat.S_IRWXU)
            os.chmod(target, stat.S_IRWXU)
            func(target)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)
    if os.path.exists(path):
        logger.warning("could not fully remove sandbox working directory %s", path)


def _run_launcher(
    prefix: tuple[str, ...],
    interpreter: str,
    code: str,
    *,
    timeout_s: float,
    limits: dict[str, int],
    uid: int | None,
    private_tmp: bool,
    max_output_chars: int,
    workdir_root: str | None,
    reveal: dict[str, list[str]] | None = None,
) -> _Run:
    """Start the launcher in a fresh working directory and session; kill the group at the deadline."""
    workdir = tempfile.mkdtemp(prefix="aepo-py-", dir=workdir_root)
    status_r, status_w = os.pipe()
    started = time.perf_counter()
    proc: subprocess.Popen[bytes] | None = None
    try:
        os.chmod(workdir, stat.S_IRWXU)
        if uid is not None:
            os.chown(workdir, uid, uid)
        settings = {
            "status_fd": status_w,
            "workdir": workdir,
            "private_tmp": private_tmp,
            "reveal": reveal or {},
            "tmp_size_mb": max(64, 4 * limits.get("fsize", 0) // (1 << 20)),
            "limits": limits,
            "uid": uid,
            "gid": uid,
            "max_repr_chars": max_output_chars,
        }
        cmd = [*prefix, interpreter, "-I", "-c", RUNNER_SOURCE, json.dumps(settings)]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=_scrubbed_env(workdir, interpreter),
            start_new_session=True,
            pass_fds=(status_w,),
            close_fds=True,
        )
        os.close(status_w)
        status_w = -1
        assert proc.stdin is not None and proc.stdout is not None
        output = _BoundedReader(os.dup(proc.stdout.fileno()), limit=8 * max_output_chars)
        proc.stdout.close()
        status = _BoundedReader(status_r, limit=4 * max_output_chars + 65536)
        status_r = -1
        output.start()
        status.start()
        stdin = proc.stdin

        def feed() -> None:
            try:
                stdin.write(code.encode("utf-8", errors="replace"))
            except OSError:
                pass
            finally:
                try:
                    stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)
        proc.wait()
        wall = time.perf_counter() - started
        for reader in (output, status):
            reader.join(timeout=2.0)  # only stragglers outside a PID namespace can hold the pipes longer
        text, truncated = output.text()
        return _Run(
            returncode=proc.returncode,
            timed_out=timed_out,
            output=text,
            output_bytes=output.total,
            truncated=truncated,
            status=_parse_status(status.text()[0]),
            wall_s=wall,
        )
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(workdir)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group: the code and everything it started (also after a normal exit)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _parse_status(raw: str) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            status.update(record)
    return status


# --------------------------------------------------------------------------------------------------------------
# Capability detection (once per process and settings)
# --------------------------------------------------------------------------------------------------------------

_PROBE_CODE = """
import errno, socket
s = socket.socket()
s.settimeout(0.5)
try:
    s.connect(("127.0.0.1", 9))
    net = "connected"
except OSError as e:
    net = errno.errorcode.get(e.errno, str(e.errno))
net
"""
_capabilities_lock = threading.Lock()
_capabilities: dict[tuple[str, bool], SandboxCapabilities] = {}


def _candidate_prefixes(isolate_network: bool) -> list[tuple[str, ...]]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return [()]
    try:
        help_text = subprocess.run([unshare, "--help"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return [()]
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    pid = ("--pid", "--fork", "--mount-proc") + (("--kill-child",) if "--kill-child" in help_text else ())
    candidates = []
    if isolate_network:
        candidates += [(unshare, *user, "--net", *pid), (unshare, *user, "--net")]
    candidates += [(unshare, *user, *pid), ()]
    return candidates


def _interpreter_prefixes(interpreter: str) -> list[str]:
    """Where the interpreter's standard library and site-packages live (asked from the interpreter itself)."""
    code = "import sys, json; print(json.dumps([sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix]))"
    try:
        out = subprocess.run([interpreter, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
        return sorted({os.path.realpath(p) for p in json.loads(out.stdout)})
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning("cannot ask %s for its prefixes: %s", interpreter, exc)
        return []


def _reveal_map(paths: list[str]) -> dict[str, list[str]]:
    """For each path behind a directory others cannot traverse (e.g. /root): that directory → paths to keep."""
    reveal: dict[str, list[str]] = {}
    for path in paths:
        target = Path(path)
        for ancestor in [*reversed(target.parents), target][:-1]:
            try:
                blocked = not os.stat(ancestor).st_mode & stat.S_IXOTH
            except OSError:
                break
            if blocked:
                reveal.setdefault(str(ancestor), []).append(path)
                break
    return reveal


def _probe_uid() -> list[tuple[int, str]]:
    if os.geteuid() != 0:
        return [(-1, "")]
    return [(SANDBOX_UID_BASE, "per-call uid"), (NOBODY_UID, "nobody"), (-1, "")]


def sandbox_capabilities(interpreter: str | None = None, isolate_network: bool = True) -> SandboxCapabilities:
    """Find, once, the strongest confinement that works here by running the launcher under each candidate."""
    interpreter = interpreter or sys.executable
    key = (interpreter, isolate_network)
    with _capabilities_lock:
        if key in _capabilities:
            return _capabilities[key]
        notes: list[str] = []
        limits = {"cpu": 10, "as": 1 << 30, "fsize": 1 << 24, "nofile": 256, "core": 0}
        chosen: SandboxCapabilities | None = None
        reveal = _reveal_map(_interpreter_prefixes(interpreter)) if os.geteuid() == 0 else {}
        for prefix in _candidate_prefixes(isolate_network):
            user_ns = "--user" in prefix
            for uid, drop_mode in _probe_uid() if not user_ns else [(-1, "")]:
                run = _run_launcher(
                    prefix, interpreter, _PROBE_CODE, timeout_s=15.0, limits=limits,
                    uid=uid if uid >= 0 else None, private_tmp="--mount-proc" in prefix,
                    max_output_chars=2000, workdir_root=None, reveal=reveal if uid >= 0 else None,
                )
                if run.returncode != 0 or not run.status.get("setup"):
                    notes.append(f"{' '.join(prefix) or 'no unshare'} (uid {uid}): rc {run.returncode} "
                                 f"{run.status.get('setup_error', '')} {run.output.strip()[-200:]}".strip())
                    continue
                net_isolated = "--net" in prefix and run.status.get("last_repr") == repr("ENETUNREACH")
                if "--net" in prefix and not net_isolated:
                    notes.append(f"{' '.join(prefix)}: loopback still reachable ({run.status.get('last_repr')})")
                    continue
                dropped = drop_mode if uid >= 0 else None
                chosen = SandboxCapabilities(
                    command_prefix=prefix,
                    network_isolated=net_isolated,
                    pid_namespace="--pid" in prefix,
                    private_tmp=bool(run.status.get("private_tmp")),
                    user_namespace=user_ns,
                    drop_privileges=dropped,
                    nproc_limit_effective=os.geteuid() != 0 or dropped is not None,
                    notes=(),
                    reveal=reveal if dropped is not None and "--mount-proc" in prefix else {},
                )
                break
            if chosen is not None:
                break
        if chosen is None:  # not even a plain process worked: report it; calls will fail with sandbox_error
            chosen = SandboxCapabilities((), False, False, False, False, None, os.geteuid() != 0)
        if isolate_network and not chosen.network_isolated:
            notes.append("network NOT isolated: unshare --net is unavailable on this machine")
        if not chosen.nproc_limit_effective:
            notes.append("running as root without a uid drop: the process-count limit is not enforced")
        chosen = SandboxCapabilities(**{**chosen.__dict__, "notes": tuple(notes)})
        level = logging.WARNING if (isolate_network and not chosen.network_isolated) else logging.INFO
        logger.log(level, "python sandbox capabilities: %s", chosen.as_dict())
        _capabilities[key] = chosen
        return chosen


# --------------------------------------------------------------------------------------------------------------
# The tool
# --------------------------------------------------------------------------------------------------------------


class PythonSandbox:
    """Runs model code once per call in a confined process; always returns text (see the module docstring)."""

    name = "python"

    def __init__(
        self,
        cpu_seconds: int = 10,
        memory_mb: int = 1024,
        file_size_mb: int = 16,
        max_processes: int = 64,
        max_output_chars: int = 4000,
        timeout_s: float = 30.0,
        isolate_network: bool = True,
        interpreter: str | None = None,
        workdir_root: str | None = None,
        max_open_files: int = 256,
    ) -> None:
        self.interpreter = interpreter or sys.executable
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.isolate_network = isolate_network
        self.workdir_root = workdir_root
        self.limits = {
            "cpu": cpu_seconds,
            "as": memory_mb << 20,
            "fsize": file_size_mb << 20,
            "nproc": max_processes,
            "nofile": max_open_files,
            "core": 0,
        }
        self._rng = random.SystemRandom()

    @classmethod
    def from_config(cls, cfg: PythonToolConfig, timeout_s: float = 30.0) -> PythonSandbox:
        return cls(
            cpu_seconds=cfg.cpu_seconds,
            memory_mb=cfg.memory_mb,
            file_size_mb=cfg.file_size_mb,
            max_processes=cfg.max_processes,
            max_output_chars=cfg.max_output_chars,
            timeout_s=timeout_s,
            isolate_network=cfg.isolate_network,
            interpreter=cfg.interpreter,
            workdir_root=cfg.workdir_root,
        )

    @property
    def capabilities(self) -> SandboxCapabilities:
        return sandbox_capabilities(self.interpreter, self.isolate_network)

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
            uid = self._uid(caps)
            run = _run_launcher(
                caps.command_prefix, self.interpreter, argument, timeout_s=self.timeout_s, limits=self.limits,
                uid=uid, private_tmp=caps.private_tmp, max_output_chars=self.max_output_chars,
                workdir_root=self.workdir_root, reveal=caps.reveal,
            )
        except Exception as exc:  # the sandbox itself failed (disk full, fork refused): still a text result
            logger.exception("python sandbox failed to run code")
            return ToolResult(text=f"Python sandbox error: {type(exc).__name__}: {exc}", ok=False,
                              error="sandbox_error", latency_s=time.perf_counter() - started)
        return self._result(run, caps, uid, time.perf_counter() - started)

    def _result(self, run: _Run, caps: SandboxCapabilities, uid: int | None, latency: float) -> ToolResult:
        output = run.output
        error: str | None = None
        note = ""
        exception = run.status.get("exception")
        if run.timed_out:
            error, note = "timeout", f"Killed: wall time limit of {self.timeout_s:g}s exceeded."
        elif run.returncode == 0:
            pass
        elif exception is not None and run.returncode == 1:
            error = "exception"
        elif run.returncode == EXIT_CPU_LIMIT or run.returncode == -signal.SIGXCPU:
            error, note = "cpu_limit", f"Killed: CPU time limit of {self.limits['cpu']}s exceeded."
        elif run.returncode == EXIT_SETUP_FAILED and "setup_error" in run.status:
            error, note = "sandbox_error", f"Sandbox setup failed: {run.status.get('setup_error', 'unknown')}"
        elif run.returncode < 0:
            name = signal.Signals(-run.returncode).name if -run.returncode in signal.valid_signals() else "?"
            error, note = "killed", f"Killed by {name} (a resource limit: memory, CPU or processes)."
        else:
            error, note = "exit_status", f"Exited with status {run.returncode}."
        if not output.strip() and not note:
            last = run.status.get("last_repr")
            output = last if (last is not None and error is None) else NO_OUTPUT
        full = output.rstrip("\n")
        if note:
            full = f"{full}\n{note}" if full.strip() else note
        text = truncate_middle(full, self.max_output_chars)
        meta: dict[str, object] = {
            "returncode": run.returncode,
            "wall_s": round(run.wall_s, 3),
            "output_chars": len(run.output),
            "output_bytes": run.output_bytes,
            "truncated": run.truncated or len(text) < len(full),
            "isolation": {
                "network": caps.network_isolated,
                "pid_namespace": caps.pid_namespace,
                "private_tmp": bool(run.status.get("private_tmp")),
                "uid": run.status.get("uid", uid),
            },
        }
        if exception is not None:
            meta["exception"] = exception
        if self.isolate_network and not caps.network_isolated:
            meta["warning"] = "network not isolated: unshare --net is unavailable on this machine"
        return ToolResult(text=text, ok=error is None, error=error, latency_s=latency, meta=meta)
