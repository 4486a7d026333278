"""Starting one sandboxed call: the runner (``runner.py``) under a launch prefix, fed the code, watched, reaped.

``run_launcher`` starts ``python -I -c <runner source> <json settings>`` behind a launch prefix (``setpriv``,
``unshare``: see ``capabilities.py``) in its own session, with a scrubbed environment, the code on stdin and a
status pipe that only the runner's supervisor writes; it kills the whole group at the deadline and returns what
happened (``LaunchResult``). ``interpreter_layout`` says what the private root must hold for an interpreter.

The values the runner and this side must agree on (exit codes, the nested uid) are defined here once and handed
to the runner in its settings; the runner has no copy of them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
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

from .cgroups import CallCgroup

logger = logging.getLogger(__name__)

RUNNER_SOURCE = (Path(__file__).with_name("runner.py")).read_text(encoding="utf-8")
# The runner's exit status when its setup failed, and when the code hit its CPU-time rlimit (SIGXCPU).
EXIT_SETUP_FAILED = 125
EXIT_CPU_LIMIT = 152
# Per-call uids when the parent is root: a high range no real account or subuid mapping uses.
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SPAN = 1_000_000
NOBODY_UID = 65534
NESTED_UID = 65534  # the code's uid in its nested user namespace (caller not root)
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_ROOT_STAGE = "/tmp"  # mount point of the private root inside the launcher's own mount namespace
_TMPFS_INODES = 16384


@dataclass
class LaunchResult:
    """What one launch did: exit, output (cut), the supervisor's report and the call limits it reached."""

    returncode: int
    timed_out: bool
    output: str
    output_bytes: int
    truncated: bool
    status: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    limits_hit: tuple[str, ...] = ()
    peak_memory_bytes: int | None = None


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


_LAYOUT_CODE = """
import json, os, site, sys
base = getattr(sys, "_base_executable", sys.executable)
print(json.dumps({
    "executable": os.path.realpath(base if os.path.exists(base) else sys.executable),
    "prefixes": [sys.base_prefix, sys.base_exec_prefix],
    "venv": sys.prefix != sys.base_prefix,
    "site": site.getsitepackages() if hasattr(site, "getsitepackages") else [],
}))
"""


def _under(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def interpreter_layout(interpreter: str) -> dict[str, Any]:
    """What the private root must hold for this interpreter (asked from the interpreter itself).

    The real (base) executable is what runs in the sandbox; its installation prefix is bound whole; a venv's
    site-packages directories are bound one by one and added with ``site.addsitedir`` (so their .pth files
    work), never the venv itself (it may sit in the checkout).
    """
    out = subprocess.run([interpreter, "-I", "-c", _LAYOUT_CODE], capture_output=True, text=True, timeout=30,
                         check=True)
    info = json.loads(out.stdout)
    prefixes = sorted({os.path.realpath(p) for p in info["prefixes"]})
    site_dirs = [os.path.realpath(p) for p in info["site"] if os.path.isdir(p)]
    binds = [d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    binds += [p for p in prefixes if not _under(p, binds)]
    extra_site = [p for p in site_dirs if not _under(p, prefixes)] if info["venv"] else []
    binds += [p for p in extra_site if not _under(p, binds)]
    exe_dir = os.path.dirname(info["executable"])
    if not _under(exe_dir, binds):
        binds.append(exe_dir)
    return {
        "executable": info["executable"],
        "binds": binds,
        "site_dirs": extra_site,
        "symlinks": {d: os.readlink(d) for d in _SYSTEM_DIRS if os.path.islink(d)},
    }


def run_launcher(
    prefix: tuple[str, ...],
    interpreter: str,
    code: str,
    *,
    timeout_s: float,
    limits: dict[str, int],
    uid: int | None,
    user_namespace: bool,
    max_output_chars: int,
    workdir_root: str | None,
    layout: dict[str, Any] | None = None,
    disk_mb: int = 64,
    cgroup: CallCgroup | None = None,
) -> LaunchResult:
    """Start the launcher (a private root when ``layout`` is given, else a fresh host working directory) in its
    own session; kill the group at the deadline; collect output, the supervisor's report and the cgroup's."""
    host_workdir: str | None = None
    root: dict[str, Any] | None = None
    if layout is not None:
        workdir = f"/tmp/aepo-py-{secrets.token_hex(6)}"
        interpreter = layout["executable"]
        root = {"stage": _ROOT_STAGE, "binds": layout["binds"], "symlinks": layout["symlinks"],
                "etc_files": list(_ETC_FILES), "disk_mb": disk_mb, "inodes": _TMPFS_INODES, "workdir": workdir}
    else:
        workdir = host_workdir = tempfile.mkdtemp(prefix="aepo-py-", dir=workdir_root)
    status_r, status_w = os.pipe()
    started = time.perf_counter()
    proc: subprocess.Popen[bytes] | None = None
    try:
        if host_workdir is not None:
            os.chmod(host_workdir, stat.S_IRWXU)
            if uid is not None:
                os.chown(host_workdir, uid, uid)
        settings = {
            "status_fd": status_w,
            "workdir": workdir,
            "root": root,
            "site_dirs": layout["site_dirs"] if layout is not None else [],
            "cgroups": cgroup.procs_files if cgroup is not None else [],
            "limits": limits,
            "uid": uid,
            "user_namespace": user_namespace,
            "max_repr_chars": max_output_chars,
            # The runner's only copy of the values both sides must agree on.
            "exit_codes": {"setup_failed": EXIT_SETUP_FAILED, "cpu_limit": EXIT_CPU_LIMIT},
            "nested_uid": NESTED_UID,
        }
        cmd = [*prefix, interpreter, "-I", "-c", RUNNER_SOURCE, json.dumps(settings)]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=host_workdir or "/",
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
        hit, peak = cgroup.limits_hit() if cgroup is not None else ([], None)
        report = _parse_status(status.text()[0])
        if layout is not None and report.get("disk_free") is not None and report["disk_free"] < max(
            1 << 20, disk_mb << 14  # under 1 MiB or 1/64 of the budget left
        ):
            hit.append("disk")
        returncode = proc.returncode
        if isinstance(report.get("signal"), int):
            returncode = -report["signal"]
        return LaunchResult(
            returncode=returncode,
            timed_out=timed_out,
            output=text,
            output_bytes=output.total,
            truncated=truncated,
            status=report,
            wall_s=wall,
            limits_hit=tuple(hit),
            peak_memory_bytes=peak,
        )
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if host_workdir is not None:
            _remove_tree(host_workdir)


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
