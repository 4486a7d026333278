"""infra.run.lock: one live process per run and per sweep. Real processes and the kernel's flock: a second process
is refused with the holder's pid; the holder's death (SIGKILL included) frees the claim, so a killed run resumes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.run.lock import BusyError, Claims

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from infra.run.lock import Claims
with Claims(sys.argv[1], run_id="r1", sweep="s1"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(runs: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(runs)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_until_the_holder_dies(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(BusyError, match=rf"MLflow run r1 is in progress in another process \(pid {holder.pid};"):
            with Claims(tmp_path, run_id="r1"):
                pass
        with Claims(tmp_path) as claims, pytest.raises(BusyError, match=rf"sweep 's1' .*pid {holder.pid}"):
            claims.sweep("s1")
        with Claims(tmp_path, run_id="r2") as claims:  # another run is free
            claims.run("r2")  # claimed already: nothing to do
    finally:
        holder.kill()  # SIGKILL: no finally, no atexit in the holder
        holder.wait()
    with Claims(tmp_path, run_id="r1", sweep="s1"):  # the kernel released both
        pass


def test_claims_are_released_on_exit_and_a_rank_without_runs_dir_claims_nothing(tmp_path: Path) -> None:
    with Claims(tmp_path, run_id="r1"):
        with pytest.raises(BusyError):  # a second claim from this process too (another open file)
            with Claims(tmp_path, run_id="r1"):
                pass
        with Claims(None, run_id="r1", sweep="s1") as rank1:
            rank1.run("r1")
    with Claims(tmp_path, run_id="r1"):  # released
        pass
