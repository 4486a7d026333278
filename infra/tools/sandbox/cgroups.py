"""Per-call cgroups for the Python sandbox (v2, or v1 per controller), nested under the caller's own cgroup.

``find_cgroup_roots`` finds, by creating one for real, where this process may create a call's cgroup;
``CallCgroup`` is one call's: memory (its processes and the tmpfs files they write, together), process count and
CPU bandwidth, and afterwards which of those limits the call reached. ``sweep_stale_cgroups`` removes the ones
left by callers that died mid-call.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

from infra.processes import pid_alive

logger = logging.getLogger(__name__)

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
class CgroupRoots:
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


def find_cgroup_roots() -> tuple[CgroupRoots | None, list[str]]:
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
                roots = CgroupRoots("v2", {c: base for c in available})
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
            if _try_cgroup(CgroupRoots("v1", {controller: base}), notes):
                usable[controller] = base
        except OSError as exc:
            notes.append(f"cgroup v1 {controller} unusable: {exc}")
    return (CgroupRoots("v1", usable) if usable else None), notes


def _try_cgroup(roots: CgroupRoots, notes: list[str]) -> bool:
    try:
        cgroup = CallCgroup(roots, memory_bytes=64 << 20, max_processes=8, cpu_cores=1.0)
    except OSError as exc:
        notes.append(f"cgroup {roots.version} {sorted(roots.dirs)}: {exc}")
        return False
    cgroup.close()
    return True


def sweep_stale_cgroups(roots: CgroupRoots) -> None:
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
            if pid_alive(int(parts[1])):
                continue
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


class CallCgroup:
    """One call's cgroup(s): memory (processes and tmpfs files together), process count, CPU bandwidth."""

    def __init__(self, roots: CgroupRoots, *, memory_bytes: int, max_processes: int, cpu_cores: float) -> None:
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
