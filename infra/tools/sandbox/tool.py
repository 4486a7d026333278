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
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
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
from typing import Any, Literal

from aepo_core.config import PythonToolConfig
from aepo_core.interfaces import ToolResult

logger = logging.getLogger(__name__)

RUNNER_SOURCE = (Path(__file__).with_name("runner.py")).read_text(encoding="utf-8")
EXIT_SETUP_FAILED = 125  # keep in sync with runner.py
EXIT_CPU_LIMIT = 152
NO_OUTPUT = "(no output)"
# Per-call uids when the parent is root: a high range no real account or subuid mapping uses.
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SPAN = 1_000_000
NOBODY_UID = 65534
NESTED_UID = 65534  # keep in sync with runner.py
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_ROOT_STAGE = "/tmp"  # mount point of the private root inside the launcher's own mount namespace
_TMPFS_INODES = 16384


@dataclass(frozen=True)
class SandboxCapabilities:
    """What confinement this machine gives model code; measured once by running the launcher for real."""

    command_prefix: tuple[str, ...]
    network_isolated: bool
    pid_namespace: bool
    private_tmp: bool
    user_namespace: bool
    drop_privileges: str | None  # "per-call uid", "nobody", "nested user namespace" or None
    nproc_limit_effective: bool
    notes: tuple[str, ...] = ()
    private_root: bool = False
    call_limits: tuple[str, ...] = ()  # per-call limits that hold: memory, processes, cpu (cgroup), disk (tmpfs)
    cgroup: str | None = None  # "v1" or "v2"
    parent_death: bool = False  # the call dies with its caller (setpriv --pdeathsig + a PID namespace)
    launch: dict[str, Any] = field(default_factory=dict)  # interpreter and root layout (see _interpreter_layout)

    @property
    def confined(self) -> bool:
        return self.private_root and self.drop_privileges is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "command_prefix": list(self.command_prefix),
            "network_isolated": self.network_isolated,
            "pid_namespace": self.pid_namespace,
            "private_root": self.private_root,
            "private_tmp": self.private_tmp,
            "user_namespace": self.user_namespace,
            "drop_privileges": self.drop_privileges,
            "nproc_limit_effective": self.nproc_limit_effective,
            "call_limits": list(self.call_limits),
            "cgroup": self.cgroup,
            "parent_death": self.parent_death,
            "root_binds": list((self.launch.get("layout") or {}).get("binds", [])),
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
    limits_hit: tuple[str, ...] = ()
    peak_memory_bytes: int | None = None


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


# --------------------------------------------------------------------------------------------------------------
# Per-call cgroups (v2, or v1 per controller), nested under the caller's own cgroup
# --------------------------------------------------------------------------------------------------------------

_CGROUP_CONTROLLERS = ("memory", "pids", "cpu")
_CGROUP_BASE = "aepo-sandbox"
_call_counter = itertools.count()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_keyed(path: str) -> dict[str, int]:
    """``key value`` lines (memory.events, pids.events, memory.oom_control) as a dict; {} if unreadable."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                    found[parts[0]] = int(parts[1])
    except OSError:
        pass
    return found


@dataclass(frozen=True)
class _CgroupRoots:
    """Where this process may create per-call cgroups: controller → base directory (one for all in v2)."""

    version: str
    dirs: dict[str, str]


def _cgroup_mounts() -> tuple[dict[str, str], str | None]:
    """v1 mount point per controller we use, and the cgroup2 mount point (from /proc/self/mountinfo)."""
    v1: dict[str, str] = {}
    v2: str | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            root, mount_point, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
            if root != "/":
                continue
            if fstype == "cgroup2":
                v2 = mount_point
            elif fstype == "cgroup":
                for controller in set(options.split(",")) & set(_CGROUP_CONTROLLERS):
                    v1[controller] = mount_point
    return v1, v2


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for the v2 hierarchy) → this process's cgroup path (from /proc/self/cgroup)."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hid, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def _find_cgroup_roots() -> tuple[_CgroupRoots | None, list[str]]:
    """The per-call cgroup parents that work here (created and tried for real), and notes on what failed."""
    notes: list[str] = []
    try:
        v1, v2 = _cgroup_mounts()
        own = _own_cgroups()
    except (OSError, ValueError, IndexError) as exc:
        return None, [f"cgroups: cannot read the mount table: {exc}"]
    if v2 is not None and "" in own:
        here = os.path.join(v2, own[""].lstrip("/"))
        try:
            with open(os.path.join(here, "cgroup.controllers")) as f:
                available = set(f.read().split()) & set(_CGROUP_CONTROLLERS)
            if available:
                enable = " ".join(f"+{c}" for c in sorted(available))
                with open(os.path.join(here, "cgroup.subtree_control")) as f:
                    if not available <= set(f.read().split()):
                        _write(os.path.join(here, "cgroup.subtree_control"), enable)
                base = os.path.join(here, _CGROUP_BASE)
                os.makedirs(base, exist_ok=True)
                _write(os.path.join(base, "cgroup.subtree_control"), enable)
                roots = _CgroupRoots("v2", {c: base for c in available})
                return roots, notes if _try_cgroup(roots, notes) else [*notes, "cgroup v2: a call cgroup failed"]
        except OSError as exc:
            notes.append(f"cgroup v2 unusable: {exc}")
    dirs = {}
    for controller, mount_point in v1.items():
        if controller in own:
            dirs[controller] = os.path.join(mount_point, own[controller].lstrip("/"), _CGROUP_BASE)
    usable = {}
    for controller, base in dirs.items():
        try:
            os.makedirs(base, exist_ok=True)
            if _try_cgroup(_CgroupRoots("v1", {controller: base}), notes):
                usable[controller] = base
        except OSError as exc:
            notes.append(f"cgroup v1 {controller} unusable: {exc}")
    return (_CgroupRoots("v1", usable) if usable else None), notes


def _try_cgroup(roots: _CgroupRoots, notes: list[str]) -> bool:
    try:
        cgroup = _CallCgroup(roots, memory_bytes=64 << 20, max_processes=8, cpu_cores=1.0)
    except OSError as exc:
        notes.append(f"cgroup {roots.version} {sorted(roots.dirs)}: {exc}")
        return False
    cgroup.close()
    return True


def _sweep_stale_cgroups(roots: _CgroupRoots) -> None:
    """Remove call cgroups left by callers that died (e.g. SIGKILLed mid-call): ``call-<pid>-<n>``."""
    for base in set(roots.dirs.values()):
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for name in entries:
            parts = name.split("-")
            if len(parts) != 3 or parts[0] != "call" or not parts[1].isdigit():
                continue
            try:
                os.kill(int(parts[1]), 0)
                continue  # its caller is alive
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


class _CallCgroup:
    """One call's cgroup(s): memory (processes and tmpfs files together), process count, CPU bandwidth."""

    def __init__(self, roots: _CgroupRoots, *, memory_bytes: int, max_processes: int, cpu_cores: float) -> None:
        self.version = roots.version
        name = f"call-{os.getpid()}-{next(_call_counter)}"
        self.dirs: dict[str, str] = {}
        try:
            for controller, base in roots.dirs.items():
                path = os.path.join(base, name)
                if path not in self.dirs.values():
                    os.mkdir(path)
                self.dirs[controller] = path
                self._limit(controller, path, memory_bytes, max_processes, cpu_cores)
        except OSError:
            self.close()
            raise

    def _limit(self, controller: str, path: str, memory_bytes: int, max_processes: int, cpu_cores: float) -> None:
        period = 100_000
        quota = max(1000, int(cpu_cores * period))
        v2 = self.version == "v2"
        if controller == "memory":
            _write(os.path.join(path, "memory.max" if v2 else "memory.limit_in_bytes"), str(memory_bytes))
            swap = os.path.join(path, "memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):
                _write(swap, "0" if v2 else str(memory_bytes))
        elif controller == "pids":
            _write(os.path.join(path, "pids.max"), str(max_processes))
        elif controller == "cpu":
            if v2:
                _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
            else:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))

    @property
    def procs_files(self) -> list[str]:
        return sorted({os.path.join(path, "cgroup.procs") for path in self.dirs.values()})

    def limits_hit(self) -> tuple[list[str], int | None]:
        """Which call limits were reached (memory: an OOM kill; processes: a refused fork), and peak memory."""
        hit = []
        peak = None
        memory = self.dirs.get("memory")
        if memory is not None:
            if self.version == "v2":
                events = _read_keyed(os.path.join(memory, "memory.events"))
                peak_file = os.path.join(memory, "memory.peak")
            else:
                events = _read_keyed(os.path.join(memory, "memory.oom_control"))
                peak_file = os.path.join(memory, "memory.max_usage_in_bytes")
            if events.get("oom_kill", 0) > 0:
                hit.append("memory")
            try:
                with open(peak_file) as f:
                    peak = int(f.read().strip())
            except (OSError, ValueError):
                pass
        pids = self.dirs.get("pids")
        if pids is not None and _read_keyed(os.path.join(pids, "pids.events")).get("max", 0) > 0:
            hit.append("processes")
        return hit, peak

    def close(self) -> None:
        """Kill whatever is left in the cgroup (nothing, normally) and remove it."""
        for path in sorted(set(self.dirs.values()), reverse=True):
            for _ in range(100):
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                logger.warning("could not remove the sandbox call cgroup %s", path)


# --------------------------------------------------------------------------------------------------------------
# Launching one call
# --------------------------------------------------------------------------------------------------------------

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


def _interpreter_layout(interpreter: str) -> dict[str, Any]:
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


def _run_launcher(
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
    cgroup: _CallCgroup | None = None,
) -> _Run:
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
        return _Run(
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


def _help_text(program: str) -> str:
    try:
        return subprocess.run([program, "--help"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _candidate_prefixes(isolate_network: bool) -> list[tuple[str, ...]]:
    """Launch prefixes, strongest first; each is tried for real by ``sandbox_capabilities``."""
    unshare = shutil.which("unshare")
    if unshare is None or not (help_text := _help_text(unshare)):
        return [()]
    setpriv = shutil.which("setpriv")
    deaths = [(setpriv, "--pdeathsig", "KILL")] if setpriv and "--pdeathsig" in _help_text(setpriv) else []
    deaths.append(())
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    pid = ("--pid", "--fork", "--mount-proc") + (("--kill-child",) if "--kill-child" in help_text else ())
    candidates: list[tuple[str, ...]] = []
    for death in deaths:
        if isolate_network:
            candidates.append((*death, unshare, *user, "--net", *pid))
        candidates.append((*death, unshare, *user, *pid))
    if isolate_network:
        candidates.append((unshare, *user, "--net"))
    return [*candidates, ()]


def _probe_uids(prefix: tuple[str, ...]) -> list[tuple[int | None, str | None]]:
    if "--user" in prefix:
        return [(None, "nested user namespace")]
    if os.geteuid() == 0:
        return [(SANDBOX_UID_BASE, "per-call uid"), (NOBODY_UID, "nobody")]
    return [(None, None)]  # not root, no user namespace: the caller's own uid (unconfined)


def sandbox_capabilities(
    interpreter: str | None = None, isolate_network: bool = True, *, disk_mb: int = 64
) -> SandboxCapabilities:
    """Find, once, the strongest confinement that works here by running the launcher under each candidate."""
    interpreter = interpreter or sys.executable
    key = (interpreter, isolate_network)
    with _capabilities_lock:
        if key in _capabilities:
            return _capabilities[key]
        notes: list[str] = []
        limits = {"cpu": 10, "as": 1 << 30, "fsize": 1 << 24, "nofile": 256, "core": 0}
        try:
            layout: dict[str, Any] | None = _interpreter_layout(interpreter)
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            layout = None
            notes.append(f"cannot ask {interpreter} for its installation: {exc}")
        roots, cgroup_notes = _find_cgroup_roots()
        notes += cgroup_notes
        if roots is not None:
            _sweep_stale_cgroups(roots)
        chosen: SandboxCapabilities | None = None
        for prefix in _candidate_prefixes(isolate_network):
            with_root = "--mount-proc" in prefix and layout is not None
            for uid, drop_mode in _probe_uids(prefix):
                for use_cgroup in ([True, False] if roots is not None else [False]):
                    cgroup = _CallCgroup(roots, memory_bytes=256 << 20, max_processes=16, cpu_cores=1.0) \
                        if use_cgroup and roots is not None else None
                    try:
                        run = _run_launcher(
                            prefix, interpreter, _PROBE_CODE, timeout_s=15.0, limits=limits, uid=uid,
                            user_namespace="--user" in prefix, max_output_chars=2000, workdir_root=None,
                            layout=layout if with_root else None, disk_mb=disk_mb, cgroup=cgroup,
                        )
                    finally:
                        if cgroup is not None:
                            cgroup.close()
                    if run.returncode == 0 and run.status.get("setup") and (run.status.get("private_root")
                                                                             or not with_root):
                        break
                    notes.append(f"{' '.join(prefix) or 'no unshare'} (uid {uid}, cgroup {use_cgroup}): rc "
                                 f"{run.returncode} {run.status.get('setup_error', '')} "
                                 f"{run.output.strip()[-200:]}".strip())
                else:
                    continue
                net_isolated = "--net" in prefix and run.status.get("last_repr") == repr("ENETUNREACH")
                if "--net" in prefix and not net_isolated:
                    notes.append(f"{' '.join(prefix)}: loopback still reachable ({run.status.get('last_repr')})")
                    continue
                call_limits = [name for controller, name in (("memory", "memory"), ("pids", "processes"),
                                                              ("cpu", "cpu"))
                               if use_cgroup and roots is not None and controller in roots.dirs]
                if with_root:
                    call_limits.append("disk")
                chosen = SandboxCapabilities(
                    command_prefix=prefix,
                    network_isolated=net_isolated,
                    pid_namespace="--pid" in prefix,
                    private_tmp=with_root,
                    user_namespace="--user" in prefix,
                    drop_privileges=drop_mode,
                    nproc_limit_effective=os.geteuid() != 0 or uid is not None,
                    private_root=with_root,
                    call_limits=tuple(call_limits),
                    cgroup=roots.version if use_cgroup and roots is not None else None,
                    parent_death="--pdeathsig" in prefix and "--pid" in prefix,
                    launch={"layout": layout if with_root else None,
                            "cgroups": roots.dirs if use_cgroup and roots is not None else None,
                            "cgroup_version": roots.version if roots is not None else None},
                )
                break
            if chosen is not None:
                break
        if chosen is None:  # nothing worked, not even a plain process: calls will fail with sandbox_error
            chosen = SandboxCapabilities((), False, False, False, False, None, os.geteuid() != 0)
        if isolate_network and not chosen.network_isolated:
            notes.append("network NOT isolated: unshare --net is unavailable on this machine")
        if not chosen.private_root:
            notes.append("NO private root: model code would see the host's files (data, checkout, runs dir)")
        missing = {"memory", "processes", "cpu", "disk"} - set(chosen.call_limits)
        if missing:
            notes.append(f"per-call limits missing ({', '.join(sorted(missing))}): only per-process rlimits hold")
        if not chosen.parent_death:
            notes.append("the call may outlive a killed caller (no setpriv --pdeathsig or no PID namespace)")
        chosen = SandboxCapabilities(**{**chosen.__dict__, "notes": tuple(notes)})
        level = logging.INFO if chosen.confined else logging.ERROR
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
        disk_mb: int = 64,
        cpu_cores: float = 1.0,
        unconfined: Literal["refuse", "warn"] = "refuse",
    ) -> None:
        self.interpreter = interpreter or sys.executable
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.isolate_network = isolate_network
        self.workdir_root = workdir_root
        self.memory_mb = memory_mb
        self.max_processes = max_processes
        self.disk_mb = disk_mb
        self.cpu_cores = cpu_cores
        self.unconfined = unconfined
        self.limits = {
            "cpu": cpu_seconds,
            "as": memory_mb << 20,
            "fsize": file_size_mb << 20,
            "nproc": max_processes,
            "nofile": max_open_files,
            "core": 0,
        }
        self._rng = random.SystemRandom()
        self._warned = False

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
            disk_mb=cfg.disk_mb,
            cpu_cores=cfg.cpu_cores,
            unconfined=cfg.unconfined,
        )

    @property
    def capabilities(self) -> SandboxCapabilities:
        return sandbox_capabilities(self.interpreter, self.isolate_network, disk_mb=self.disk_mb)

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
                if self.unconfined == "refuse":
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
            cgroup = _CallCgroup(
                _CgroupRoots(caps.cgroup or "v1", cgroup_dirs), memory_bytes=self.memory_mb << 20,
                max_processes=self.max_processes + 1, cpu_cores=self.cpu_cores,  # +1: the launcher's supervisor
            ) if cgroup_dirs else None
            limits = dict(self.limits)
            if "processes" in caps.call_limits:  # the cgroup stops a fork bomb first, and says so
                limits["nproc"] = self.max_processes + 8
            try:
                run = _run_launcher(
                    caps.command_prefix, self.interpreter, argument, timeout_s=self.timeout_s, limits=limits,
                    uid=uid, user_namespace=caps.user_namespace, max_output_chars=self.max_output_chars,
                    workdir_root=self.workdir_root, layout=caps.launch.get("layout"), disk_mb=self.disk_mb,
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

    def _result(self, run: _Run, caps: SandboxCapabilities, latency: float) -> ToolResult:
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
                note = f"Killed: the call's memory limit of {self.memory_mb} MiB was reached."
        else:
            error, note = "exit_status", f"Exited with status {run.returncode}."
        extra = []
        if "memory" in hit and "memory limit" not in note:
            extra.append(f"A process of this call was killed: the call's memory limit of {self.memory_mb} MiB "
                         "was reached.")
        if "processes" in hit:
            extra.append(f"The call's process limit ({self.max_processes}) was reached: a fork was refused.")
        if "disk" in hit:
            extra.append(f"The call's disk space ({self.disk_mb} MiB for the working directory, /tmp and /dev/shm "
                         "together) ran out.")
        note = "\n".join(n for n in (note, *extra) if n)
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
        if self.isolate_network and not caps.network_isolated:
            warnings.append("network not isolated: unshare --net is unavailable on this machine")
        if not caps.confined:
            warnings.append("code ran unconfined: no private root on this machine (sees the host's files)")
        if warnings:
            meta["warning"] = "; ".join(warnings)
        return ToolResult(text=text, ok=error is None, error=error, latency_s=latency, meta=meta)
