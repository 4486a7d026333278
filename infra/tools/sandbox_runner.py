"""Launcher that runs inside the sandbox process: set up, confine, then run the model's code once.

Executed as ``python -I -c <this source> <json settings>`` (stdlib only; it imports nothing from this package, so
it works under a dropped uid and in any interpreter). Steps, in order:

1. enter the working directory; if in a private mount namespace, mount a fresh tmpfs over /tmp, /var/tmp and
   /dev/shm (the working directory is bind-mounted back in place) so the code sees no shared temp files, and
   make the interpreter reachable for the unprivileged uid (see ``_private_mounts``);
2. set hard resource limits (CPU, address space, file size, processes, open files, core dumps) while still
   privileged, so the code cannot raise them again;
3. drop to an unprivileged uid/gid when asked (the parent runs as root): root ignores RLIMIT_NPROC and can
   write anywhere;
4. read the code from stdin, run it REPL-style: every statement, and if the last one is an expression its value
   is evaluated and its ``repr`` is reported (the parent shows it only if nothing was printed). Runs once.

A report (JSON lines) goes to the status file descriptor: setup results first, then the exception type or the
last value. Exit codes: 0 success, 1 exception in the code, ``SystemExit`` codes as given, 125 setup failure,
152 CPU limit (SIGXCPU).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import json
import linecache
import os
import resource
import signal
import sys
import traceback
from typing import Any

EXIT_SETUP_FAILED = 125
EXIT_CPU_LIMIT = 152
CODE_FILENAME = "<code>"
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 16384


def _report(fd: int, record: dict[str, Any]) -> None:
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError:
        pass


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _private_mounts(workdir: str, size_mb: int, reveal: dict[str, list[str]]) -> None:
    """Private mounts, in the launcher's own mount namespace (nothing changes for the host).

    ``reveal`` maps a directory the unprivileged uid cannot traverse (e.g. /root holding a pyenv Python) to the
    paths under it the interpreter needs: the directory is covered by an empty tmpfs and only those paths are
    bound back, so the code can import the standard library without seeing the rest of it. Then a fresh tmpfs
    covers /tmp, /var/tmp and /dev/shm, and the (already entered) working directory is bound back in place.
    """
    for hidden, keep in reveal.items():
        fds = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keep]
        _mount("tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
        for path, fd in zip(keep, fds, strict=True):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC, None)
            os.close(fd)
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_mb}m,mode=1777")
    # The cwd still points at the real working directory even if a tmpfs now hides its path.
    os.makedirs(workdir, exist_ok=True)
    _mount(".", workdir, None, _MS_BIND, None)
    os.chdir(workdir)


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


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"still uid {os.geteuid()} after dropping to {uid}")


def _on_cpu_limit(signum: int, frame: object) -> None:
    os.write(2, b"\nCPU time limit exceeded\n")
    os._exit(EXIT_CPU_LIMIT)


def _run_code(source: str, status_fd: int, max_repr_chars: int) -> int:
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
        _report(status_fd, {"exception": type(exc).__name__})
        return 1
    if value is not None:
        try:
            text = repr(value)
        except Exception as exc:
            text = f"<repr failed: {type(exc).__name__}: {exc}>"
        _report(status_fd, {"last_repr": text[:max_repr_chars]})
    return 0


def main() -> None:
    settings = json.loads(sys.argv[1])
    status_fd = int(settings["status_fd"])
    workdir = settings["workdir"]
    setup: dict[str, Any] = {"setup": True, "private_tmp": False, "pid": os.getpid()}
    try:
        os.chdir(workdir)
        if settings.get("private_tmp"):
            try:
                _private_mounts(workdir, int(settings.get("tmp_size_mb", 64)), settings.get("reveal") or {})
                setup["private_tmp"] = True
            except OSError as exc:
                setup["private_tmp_error"] = str(exc)
        _set_limits({k: int(v) for k, v in settings["limits"].items()})
        signal.signal(signal.SIGXCPU, _on_cpu_limit)
        if settings.get("uid") is not None:
            _drop_privileges(int(settings["uid"]), int(settings["gid"]))
        setup["uid"] = os.getuid()
        source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.set_inheritable(status_fd, False)
    except Exception as exc:
        setup["setup_error"] = f"{type(exc).__name__}: {exc}"
        _report(status_fd, setup)
        os._exit(EXIT_SETUP_FAILED)
    _report(status_fd, setup)
    # stdout and stderr share one pipe: line buffering keeps prints and tracebacks in order.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    code = _run_code(source, status_fd, int(settings.get("max_repr_chars", 4000)))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # _exit: do not wait for threads the code left running (the parent's wall timeout would do it otherwise).
    os._exit(code if 0 <= code < 256 else 1)


if __name__ == "__main__":
    main()
