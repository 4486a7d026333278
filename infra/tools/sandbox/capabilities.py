"""What confinement this machine gives the Python sandbox, measured once by running the launcher for real.

``sandbox_capabilities`` tries each launch prefix (``setpriv --pdeathsig`` in front of ``unshare`` with a network,
PID and mount namespace, then weaker ones, then none), each uid drop and, where this process may create them,
per-call cgroups; the first combination whose probe call succeeds is the one calls use. The result
(``SandboxCapabilities``) is cached per interpreter and network setting, logged, and says what does not hold.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from .cgroups import CallCgroup, find_cgroup_roots, sweep_stale_cgroups
from .launcher import NOBODY_UID, SANDBOX_UID_BASE, interpreter_layout, run_launcher

logger = logging.getLogger(__name__)

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
    launch: dict[str, Any] = field(default_factory=dict)  # interpreter and root layout (see interpreter_layout)

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
            layout: dict[str, Any] | None = interpreter_layout(interpreter)
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
            layout = None
            notes.append(f"cannot ask {interpreter} for its installation: {exc}")
        roots, cgroup_notes = find_cgroup_roots()
        notes += cgroup_notes
        if roots is not None:
            sweep_stale_cgroups(roots)
        chosen: SandboxCapabilities | None = None
        for prefix in _candidate_prefixes(isolate_network):
            with_root = "--mount-proc" in prefix and layout is not None
            for uid, drop_mode in _probe_uids(prefix):
                for use_cgroup in ([True, False] if roots is not None else [False]):
                    cgroup = CallCgroup(roots, memory_bytes=256 << 20, max_processes=16, cpu_cores=1.0) \
                        if use_cgroup and roots is not None else None
                    try:
                        run = run_launcher(
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
