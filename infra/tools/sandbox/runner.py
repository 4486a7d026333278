"""Launcher that runs inside the sandbox process: set up, confine, then run the model's code once.

Executed as ``python -I -c <this source> <json settings>`` (stdlib only; it imports nothing from this package, so
it works in any interpreter). Two processes:

- the **supervisor** (this process; PID 1 of the call's PID namespace when there is one). It never runs model
  code and never changes its credentials, so the parent-death signal it sets (SIGKILL when its parent, the
  ``unshare`` that the caller's death kills, dies) holds, and when it exits the kernel kills every process of
  the namespace. In order it: sets that signal; joins the call's cgroups (``cgroups``: the ``cgroup.procs``
  files the caller created, so that everything the code starts is bounded together); reads the code from
  stdin; builds the private root when asked (``root``, see ``_build_root``) and pivots into it; forks the code's
  process; waits for it; then writes the only trusted report, one JSON line on the status descriptor: the
  setup, the uid, the code process's exit (status or signal), the disk use of the call's tmpfs, and the
  ``exception`` / ``last_repr`` / ``setup_error`` values that the code's process handed over (these keys
  only: the code can write anything on that pipe, but it reaches only its own result).
- the **code's process**, forked: closes the status descriptor (the code cannot write to it, nor reopen it:
  ``/proc/1/fd`` belongs to a more privileged process); sets hard resource limits (CPU, address space, file
  size, processes, open files, core dumps) while still privileged; drops to an unprivileged uid — a per-call
  uid when the caller is root, or, under a user namespace (caller not root), ``nested_uid`` in a
  nested user namespace without capabilities; sets ``no_new_privs``; adds the interpreter's site directories
  (``site_dirs``); then runs the code REPL-style: every statement, and if the last one is an expression its
  value is evaluated and its ``repr`` reported (the caller shows it only if nothing was printed). Runs once.

Exit codes: the code process's (0 success, 1 exception in the code, ``SystemExit`` codes as given,
``exit_codes["cpu_limit"]`` on SIGXCPU), ``exit_codes["setup_failed"]`` on a setup failure, 128 + n
when it was killed by signal n (also in the report). The exit codes and ``nested_uid`` come in the settings: the
caller (``launcher.py``) defines them once, and this file keeps no copy.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import errno
import fcntl
import json
import linecache
import os
import resource
import signal
import sys
import traceback
from typing import Any

CODE_FILENAME = "<code>"
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MNT_DETACH = 2
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWUSER = 0x10000000
_SYS_PIVOT_ROOT = 155  # x86_64
_SYS_CAPSET = 126
_SYS_PIVOT_ROOT_AARCH64 = 41
_SYS_CAPSET_AARCH64 = 91
_RESULT_KEYS = ("exception", "last_repr", "setup_error")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _syscall_no(x86: int, arm: int) -> int:
    return arm if os.uname().machine in ("aarch64", "arm64") else x86


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _bind(source: str, target: str, writable: bool = False) -> None:
    """Bind ``source`` at ``target``: read-only, no setuid, no devices, unless it is a device node."""
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "a"):
            pass
    _mount(source, target, None, _MS_BIND | _MS_REC)
    if not writable:
        try:
            _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        except OSError as exc:  # a mount flag locked by a user namespace (e.g. noexec) must be kept: add them all
            if exc.errno != errno.EPERM:
                raise
            _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | 8)


def _build_root(spec: dict[str, Any], uid: int | None, nested_uid: int) -> str:
    """Build a minimal root on a tmpfs and pivot into it (in this process's own mount namespace).

    It holds, read-only: the system's programs and libraries (``binds``: /usr, /bin, /lib…, or the symlinks a
    merged /usr has), the interpreter's installation and site-packages directories (bound at their own paths,
    and nothing else of the directories above them: a venv inside the checkout shows its site-packages only);
    a generated /etc (passwd, group, hosts, nsswitch.conf, plus ``etc_files`` such as ld.so.cache); device nodes
    null, zero, full, random, urandom; this PID namespace's /proc. Writable: one size-capped tmpfs (``disk_mb``,
    ``inodes``) at /tmp, holding the working directory, with /var/tmp and /dev/shm pointing into it, so all the
    call's files share one budget and vanish with the namespace. The code's user in /etc/passwd is ``uid``, or
    ``nested_uid`` in a nested user namespace. Returns the working directory's path.
    """
    stage = spec["stage"]
    _mount("tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,nr_inodes=4096,mode=0755")
    for name, target in spec["symlinks"].items():
        os.symlink(target, stage + name)
    bound: list[str] = []
    for path in sorted(spec["binds"]):
        if os.path.exists(path) and not any(path == b or path.startswith(b + "/") for b in bound):
            _bind(path, stage + path)
            bound.append(path)
    etc = stage + "/etc"
    os.makedirs(etc, mode=0o755, exist_ok=True)
    for path in spec["etc_files"]:
        if os.path.islink(path):
            os.symlink(os.readlink(path), stage + path)
        elif os.path.isfile(path):
            _bind(path, stage + path)
    user = uid if uid is not None else nested_uid
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/false\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        f"sandbox:x:{user}:{user}:sandbox:{spec['workdir']}:/bin/sh\n",
        "group": f"root:x:0:\nnogroup:x:65534:\nsandbox:x:{user}:\n",
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }
    for name, text in files.items():
        if not os.path.exists(f"{etc}/{name}"):
            with open(f"{etc}/{name}", "w") as f:
                f.write(text)
    dev = stage + "/dev"
    os.makedirs(dev, mode=0o755)
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", f"{dev}/{name}", writable=True)
    for name, target in {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                         "stderr": "/proc/self/fd/2", "shm": "/tmp"}.items():
        os.symlink(target, f"{dev}/{name}")
    os.makedirs(stage + "/proc", mode=0o555)
    _mount("/proc", stage + "/proc", None, _MS_BIND | _MS_REC)
    os.makedirs(stage + "/var", mode=0o755, exist_ok=True)
    os.symlink("../tmp", stage + "/var/tmp")
    os.makedirs(stage + "/tmp", mode=0o1777)
    _mount("tmpfs", stage + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={int(spec['disk_mb'])}m,nr_inodes={int(spec['inodes'])},mode=1777")
    workdir = spec["workdir"]
    os.mkdir(stage + workdir, 0o700)
    if uid is not None:
        os.chown(stage + workdir, uid, uid)
    _mount(None, stage, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(stage)
    _check(_libc.syscall(_syscall_no(_SYS_PIVOT_ROOT, _SYS_PIVOT_ROOT_AARCH64), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount old root")
    os.chdir(workdir)
    return workdir


def _set_limits(limits: dict[str, int]) -> None:
    table = {
        "cpu": resource.RLIMIT_CPU,
        "as": resource.RLIMIT_AS,
        "fsize": resource.RLIMIT_FSIZE,
        "nproc": resource.RLIMIT_NPROC,
        "nofile": resource.RLIMIT_NOFILE,
        "core": resource.RLIMIT_CORE,
    }
    for name, value in limits.items():
        # CPU: soft limit raises SIGXCPU (reported), the hard one a second later kills.
        hard = value + 1 if name == "cpu" else value
        resource.setrlimit(table[name], (value, hard))


def _drop_capabilities() -> None:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.syscall(_syscall_no(_SYS_CAPSET, _SYS_CAPSET_AARCH64), header, data), "capset")


def _drop_privileges(uid: int | None, user_namespace: bool, nested_uid: int) -> int:
    """Become unprivileged for good: the given uid (caller root) or ``nested_uid`` of a nested user namespace."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif user_namespace:  # we are "root" of the caller's user namespace: the caller's own uid outside
        _check(_libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{nested_uid} 0 1"), ("gid_map", f"{nested_uid} 0 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        _drop_capabilities()
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None and (os.getuid() != uid or os.geteuid() != uid):
        raise OSError(f"still uid {os.geteuid()} after dropping to {uid}")
    if os.geteuid() == 0:
        raise OSError("the code would run as root")
    return os.getuid()


def _exit_on_cpu_limit(exit_code: int) -> None:
    """On SIGXCPU (the soft CPU rlimit): say so and exit with ``exit_code``, which the caller reports."""

    def handler(signum: int, frame: object) -> None:
        os.write(2, b"\nCPU time limit exceeded\n")
        os._exit(exit_code)

    signal.signal(signal.SIGXCPU, handler)


def _report(fd: int, record: dict[str, Any]) -> None:
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def _run_code(source: str, result_fd: int, max_repr_chars: int) -> int:
    """Run all statements; evaluate a trailing expression and report its repr. Returns the exit code."""
    linecache.cache[CODE_FILENAME] = (len(source), None, source.splitlines(True), CODE_FILENAME)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    try:
        tree = ast.parse(source, CODE_FILENAME)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, CODE_FILENAME, "exec"), namespace)
        value = None
        if last is not None:
            value = eval(compile(ast.Expression(last.value), CODE_FILENAME, "eval"), namespace)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        namespace.clear()  # free what the code allocated (a memory bomb) before formatting the traceback
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != CODE_FILENAME:
            tb = tb.tb_next  # hide this launcher's frames
        try:
            sys.stdout.flush()
            traceback.print_exception(type(exc), exc, tb)
        except BaseException:
            os.write(2, f"{type(exc).__name__} (traceback unavailable)\n".encode())
        _report(result_fd, {"exception": type(exc).__name__})
        return 1
    if value is not None:
        try:
            text = repr(value)
        except Exception as exc:
            text = f"<repr failed: {type(exc).__name__}: {exc}>"
        _report(result_fd, {"last_repr": text[:max_repr_chars]})
    return 0


def _code_process(settings: dict[str, Any], source: str, status_fd: int, result_fd: int) -> None:
    """The forked child: confine, drop privileges, run the code. Never returns."""
    os.close(status_fd)
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        _set_limits({k: int(v) for k, v in settings["limits"].items()})
        _exit_on_cpu_limit(int(settings["exit_codes"]["cpu_limit"]))
        uid = settings.get("uid")
        _drop_privileges(int(uid) if uid is not None else None, bool(settings.get("user_namespace")),
                         int(settings["nested_uid"]))
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # for the case without a PID namespace
        if settings.get("site_dirs"):
            import site

            for path in settings["site_dirs"]:
                site.addsitedir(path)
    except Exception as exc:
        _report(result_fd, {"setup_error": f"{type(exc).__name__}: {exc}"})
        os._exit(int(settings["exit_codes"]["setup_failed"]))
    # stdout and stderr share one pipe: line buffering keeps prints and tracebacks in order.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    code = _run_code(source, result_fd, int(settings.get("max_repr_chars", 4000)))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # _exit: do not wait for threads the code left running (the caller's wall timeout would do it otherwise).
    os._exit(code if 0 <= code < 256 else 1)


def _read_results(fd: int, limit: int) -> dict[str, Any]:
    """What the code's process reported, read without blocking (its children may hold the pipe open)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    data = b""
    try:
        while len(data) < limit and (chunk := os.read(fd, 65536)):
            data += chunk
    except OSError:
        pass
    found: dict[str, Any] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.update({k: str(v) for k, v in record.items() if k in _RESULT_KEYS})
    return found


def main() -> None:
    settings = json.loads(sys.argv[1])
    status_fd = int(settings["status_fd"])
    exit_setup_failed = int(settings["exit_codes"]["setup_failed"])
    os.set_inheritable(status_fd, False)
    report: dict[str, Any] = {"setup": True, "private_root": False}
    try:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for procs in settings.get("cgroups") or []:
            with open(procs, "w") as f:
                f.write("0")
        source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        if settings.get("root"):
            _build_root(settings["root"], settings.get("uid"), int(settings["nested_uid"]))
            report["private_root"] = True
        else:
            os.chdir(settings["workdir"])
        report["workdir"] = os.getcwd()
        result_r, result_w = os.pipe()
        pid = os.fork()
    except Exception as exc:
        report["setup_error"] = f"{type(exc).__name__}: {exc}"
        _report(status_fd, report)
        os._exit(exit_setup_failed)
    if pid == 0:
        os.close(result_r)
        _code_process(settings, source, status_fd, result_w)
    os.close(result_w)
    for fd in (0, 1, 2):  # the code's output pipe must close when the code's processes are gone
        os.close(fd)
    while True:  # as PID 1, also reap the code's orphans
        try:
            waited, status = os.wait()
        except ChildProcessError:
            status = 0
            break
        if waited == pid:
            break
    report.update(_read_results(result_r, 1 << 20))
    report["uid"] = settings.get("uid") if settings.get("uid") is not None else (
        settings["nested_uid"] if settings.get("user_namespace") else os.getuid())
    if report.get("setup_error"):
        report["uid"] = None
    if report["private_root"]:
        fs = os.statvfs("/tmp")
        report["disk_used"] = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        report["disk_free"] = fs.f_bavail * fs.f_frsize
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
        code = 128 + os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
    _report(status_fd, report)
    os._exit(code)


if __name__ == "__main__":
    main()
