"""Python sandbox confinement (issue 15): what model code can see and touch on the host, what one call may
consume in all, and what survives a killed caller. Every test runs a real attack in real processes and first
checks that the target is really there for the test itself, so that a pass is not vacuous."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from capabilities import require

from aepo_core.tool_config import PythonToolConfig
from infra.tools.sandbox import tool as sandbox_tool
from infra.tools.sandbox.capabilities import SandboxCapabilities
from infra.tools.sandbox.tool import PythonSandbox

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data" / "arpo"
RUNNER_MARK = "Launcher that runs inside the sandbox process"
CALLER_UID = 4242  # an account that owns nothing on the machine: the unprivileged caller


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    cfg = PythonToolConfig(cpu_seconds=5, memory_mb=256, file_size_mb=4, disk_mb=32, max_processes=32,
                           max_output_chars=4000)
    return PythonSandbox(cfg, timeout_s=8.0)


@pytest.fixture(scope="module")
def caps(sandbox: PythonSandbox) -> SandboxCapabilities:
    caps = sandbox.capabilities
    require(caps.private_root, f"no private root on this machine: {caps.notes}")
    return caps


@pytest.fixture()
def host_files() -> Iterator[dict[str, Path]]:
    """Files the sandbox must not read: the gold answers, a runs dir, the checkout, $HOME (all outside /tmp)."""
    tag = uuid.uuid4().hex
    runs = REPO / "runs" / f"sandbox-test-{tag}"
    runs.mkdir(parents=True)
    (runs / "mlflow.db").write_text("runs")
    home = Path.home() / f".aepo-sandbox-test-{tag}"
    home.write_text("home")
    files = {"runs": runs / "mlflow.db", "checkout": REPO / "aepo_core" / "config.py", "home": home}
    gold = sorted(DATA.glob("eval/*/test.jsonl"))
    if gold:
        files["data"] = gold[0]
    try:
        for path in files.values():
            with open(path, "rb") as f:  # the test itself can read every target
                assert f.read(1)
        yield files
    finally:
        shutil.rmtree(runs, ignore_errors=True)
        home.unlink(missing_ok=True)


_READ_CODE = """
import os
for name, path in {targets!r}.items():
    try:
        print(name, 'READ', open(path, 'rb').read(20))
    except OSError as e:
        print(name, 'denied', type(e).__name__)
    try:
        listed = os.path.basename(path) in os.listdir(os.path.dirname(path))
    except OSError:
        listed = False
    print(name, 'LISTED' if listed else 'unlisted')
import numpy, sympy
print('numpy', numpy.arange(4).sum(), 'sympy', sympy.factor(sympy.Symbol('x') ** 2 - 1))
print('uid', os.getuid())
"""


def test_host_files_are_invisible_and_numpy_sympy_import(
    sandbox: PythonSandbox, caps: SandboxCapabilities, host_files: dict[str, Path]
) -> None:
    result = sandbox(_READ_CODE.format(targets={k: str(v) for k, v in host_files.items()}))
    assert result.ok, result.text
    assert "READ" not in result.text and "LISTED" not in result.text, result.text
    for name in host_files:
        assert f"{name} denied" in result.text and f"{name} unlisted" in result.text, result.text
    assert "numpy 6 sympy (x - 1)*(x + 1)" in result.text
    uid = int(result.text.rsplit("uid ", 1)[1].split()[0])
    assert uid != 0 and result.meta["isolation"]["uid"] == uid  # type: ignore[index]
    assert result.meta["isolation"]["private_root"] is True  # type: ignore[index]


_CALLER_SCRIPT = """
import json, os, sys
from aepo_core.tool_config import PythonToolConfig
from infra.tools.sandbox.tool import PythonSandbox
victim_dir, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
sandbox = PythonSandbox(PythonToolConfig(interpreter=sys.argv[3]), timeout_s=8.0)
code = '''
import os
victim = {victim!r}
for name, act in [('append', lambda: open(victim, 'a').write('x')), ('remove', lambda: os.remove(victim)),
                  ('chmod', lambda: os.chmod(victim, 0o777)), ('list', lambda: os.listdir({victim_dir!r}))]:
    try:
        act(); print(name, 'DONE')
    except OSError as e:
        print(name, 'denied', type(e).__name__)
print('uid', os.getuid())
'''.format(victim=os.path.join(victim_dir, 'precious.txt'), victim_dir=victim_dir)
result = sandbox(code)
print(json.dumps({"ok": result.ok, "text": result.text, "meta": result.meta,
                  "caps": sandbox.capabilities.as_dict()}))
"""


def test_non_root_caller_files_are_untouched() -> None:
    if os.geteuid() != 0:
        require(False, "needs root to become an unprivileged caller")
    interpreter = shutil.which("python3", path="/usr/bin:/bin")
    if interpreter is None:
        require(False, "no system python3 that an unprivileged user can run")
    victim_dir = REPO / f".aepo-caller-{uuid.uuid4().hex}"
    victim_dir.mkdir()
    try:
        victim = victim_dir / "precious.txt"
        victim.write_text("precious")
        for path in (victim_dir, victim):
            os.chown(path, CALLER_UID, CALLER_UID)
        victim_dir.chmod(0o700)
        victim.chmod(0o600)
        proc = subprocess.run(
            [sys.executable, "-c", _CALLER_SCRIPT, str(victim_dir), str(CALLER_UID), interpreter],
            capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        if not report["caps"]["private_root"]:
            require(False, f"no private root for an unprivileged caller: {report['caps']['notes']}")
        assert report["ok"], report
        assert "DONE" not in report["text"], report["text"]
        uid = int(report["text"].rsplit("uid ", 1)[1].split()[0])
        assert uid != 0 and report["meta"]["isolation"]["uid"] == uid
        assert victim.read_text() == "precious" and (victim.stat().st_mode & 0o777) == 0o600
        assert victim.stat().st_uid == CALLER_UID
    finally:
        shutil.rmtree(victim_dir, ignore_errors=True)


class _PeakRss(threading.Thread):
    """Largest summed unique memory (USS) of the sandbox's processes (the runner, the code's process and whatever it
    forks: each carries the runner's source, ``RUNNER_MARK``, in its command line) among this test process's
    descendants while the monitor runs.

    Named positively, not as "what started meanwhile": in the full suite this process has other children that come
    and go (the session's Prefect test server, ~400 MB, failed this test once; something started during the call,
    1.35 GB, failed CI on 2026-12-02 although the sandbox stayed in its budget)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()
        self.me = psutil.Process()

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for child in self.me.children(recursive=True):
                try:
                    if RUNNER_MARK not in " ".join(child.cmdline()):
                        continue
                    # USS, not RSS: a child forked from this test process counts the parent's resident pages in its
                    # RSS until it execs (1.7 GB once a worker had loaded models: failed the suite on 2026-12-02)
                    total += child.memory_full_info().uss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.01)


def test_the_memory_monitor_counts_the_sandbox_and_nothing_else_this_process_starts() -> None:
    """The instrument of the next test: a 300 MB process this test process starts during the window is not the
    sandbox's and must not count (it did, and failed CI)."""
    monitor = _PeakRss()
    monitor.start()
    try:
        other = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (300 << 20); time.sleep(1.5)"])
        other.wait(timeout=30)
    finally:
        monitor.stop.set()
        monitor.join()
    assert monitor.peak < 50 << 20, monitor.peak


def test_memory_budget_holds_for_the_whole_call(sandbox: PythonSandbox, caps: SandboxCapabilities) -> None:
    if "memory" not in caps.call_limits:
        require(False, f"no memory cgroup here: {caps.notes}")
    # Four children of 150 MB each: every one is under the per-process limit (256 MB), together 600 MB.
    code = textwrap.dedent("""
        import os, time
        pids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = b'x' * (150 << 20)
                time.sleep(1.5)
                os._exit(0)
            pids.append(pid)
        print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
    """)
    monitor = _PeakRss()
    monitor.start()
    try:
        result = sandbox(code)
    finally:
        monitor.stop.set()
        monitor.join()
    assert monitor.peak > 100 << 20  # the attack did run and allocate
    assert monitor.peak < (256 + 96) << 20, monitor.peak  # budget plus the interpreters' shared pages
    assert "memory" in result.meta["limits_hit"], result.meta  # type: ignore[operator]
    assert "memory limit" in result.text and "-9" in result.text, result.text


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def test_disk_budget_holds_for_the_whole_call(caps: SandboxCapabilities, tmp_path: Path) -> None:
    workdir_root = tmp_path / "work"
    workdir_root.mkdir()
    cfg = PythonToolConfig(memory_mb=256, file_size_mb=4, disk_mb=32, workdir_root=str(workdir_root))
    sandbox = PythonSandbox(cfg, timeout_s=8.0)
    # 30 files of 4 MB (each under the per-file limit), spread over every writable place: 120 MB in all.
    code = textwrap.dedent("""
        import os
        written = 0
        for i in range(30):
            path = ['.', '/tmp', '/dev/shm'][i % 3] + f'/fill{i}'
            try:
                with open(path, 'wb') as f:
                    f.write(b'x' * (4 << 20))
                written += 4 << 20
            except OSError as e:
                print('refused', e.errno)
                break
        print('written', written >> 20)
    """)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_bytes(workdir_root))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = sandbox(code)
    finally:
        stop.set()
        watcher.join()
    written = int(result.text.split("written ", 1)[1].split()[0])
    assert "refused 28" in result.text, result.text  # ENOSPC
    assert 16 <= written <= 32, result.text
    assert peak[0] < 1 << 20  # nothing reached the host's disk
    assert "disk" in result.meta["limits_hit"], result.meta  # type: ignore[operator]
    assert "disk space" in result.text


_TRAINER_SCRIPT = """
import sys
from aepo_core.tool_config import PythonToolConfig
from infra.tools.sandbox.tool import PythonSandbox
sandbox = PythonSandbox(PythonToolConfig(workdir_root=sys.argv[1]), timeout_s=60.0)
sandbox.capabilities
print('calling', flush=True)
sandbox('import time\\ntime.sleep(60)')
"""


def test_killed_caller_takes_the_call_with_it(caps: SandboxCapabilities, tmp_path: Path) -> None:
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "calling"
        deadline = time.time() + 15
        tree: list[psutil.Process] = []
        while time.time() < deadline:
            tree = psutil.Process(trainer.pid).children(recursive=True)
            if sum(RUNNER_MARK in " ".join(p.cmdline()) for p in tree if p.is_running()) >= 2:
                break  # the launcher and the code's own process are up
            time.sleep(0.05)
        assert tree, "the sandboxed call never started"
        time.sleep(0.3)
        tree = psutil.Process(trainer.pid).children(recursive=True)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(5)
        _gone, alive = psutil.wait_procs(tree, timeout=5)
        assert alive == [], [p.cmdline()[:3] for p in alive]
        assert list(tmp_path.iterdir()) == []  # no working directory left behind
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_code_cannot_forge_the_launcher_status(sandbox: PythonSandbox, caps: SandboxCapabilities) -> None:
    forged = json.dumps({"setup": True, "uid": 0, "private_root": False, "limits_hit": ["forged"]}) + "\n"
    code = textwrap.dedent(f"""
        import os
        hit = []
        for fd in range(3, 256):
            try:
                os.write(fd, {forged.encode()!r})
                hit.append(fd)
            except OSError:
                pass
        print('wrote to', hit)
    """)
    result = sandbox(code)
    assert result.ok, result.text
    isolation = result.meta["isolation"]
    assert isolation["uid"] not in (0, None) and isolation["private_root"] is True, result.meta  # type: ignore[index]
    assert "forged" not in result.meta["limits_hit"]  # type: ignore[operator]


def test_capabilities_say_what_holds(caps: SandboxCapabilities) -> None:
    report = caps.as_dict()
    assert report["private_root"] is True and report["drop_privileges"]
    assert set(report["call_limits"]) >= {"disk"} and isinstance(report["parent_death"], bool)
    binds = [Path(b) for b in report["root_binds"]]
    assert binds
    for hidden in (REPO, DATA, Path.home()):  # nothing that holds them is bound into the root
        assert not any(hidden == b or b in hidden.parents for b in binds), (hidden, binds)


def test_unconfined_machine_refuses_or_warns(
    caps: SandboxCapabilities, monkeypatch: pytest.MonkeyPatch, sandbox_launches: list[object]
) -> None:
    weak = dataclasses.replace(caps, private_root=False, private_tmp=False, launch={**caps.launch, "layout": None})
    monkeypatch.setattr(sandbox_tool, "sandbox_capabilities", lambda *args, **kwargs: weak)
    launched = sandbox_launches
    refused = PythonSandbox(PythonToolConfig(), timeout_s=8.0)("print('ran')")
    assert not refused.ok and refused.error == "sandbox_unavailable" and launched == []
    warned = PythonSandbox(PythonToolConfig(unconfined="warn"), timeout_s=8.0)("print('ran')")
    assert warned.ok and warned.text == "ran" and len(launched) == 1
    assert "unconfined" in str(warned.meta["warning"]) and warned.meta["isolation"]["private_root"] is False  # type: ignore[index]
