"""What the managed vLLM server refuses before it starts, and what its errors quote (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aepo_core.config import VLLMConfig
from infra.engines.vllm_server import CPU_HEAD_SIZES, VLLMServer, VLLMServerError, cpu_refusal, quoted_lines
from infra.models import TINY_RANDOM_SHAPE
from infra.numerics import device_facts


def _model_dir(tmp_path: Path, **shape: int) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **shape}))
    return d


def test_a_head_size_without_a_cpu_kernel_is_refused_in_one_line_before_any_process(tmp_path: Path):
    tiny = _model_dir(tmp_path, hidden_size=TINY_RANDOM_SHAPE["hidden_size"],
                      num_attention_heads=TINY_RANDOM_SHAPE["num_attention_heads"])
    server = VLLMServer(tiny, VLLMConfig(python=sys.executable))
    with pytest.raises(VLLMServerError) as err:
        server.start()
    message = str(err.value)
    assert "\n" not in message and "head_dim=16" in message and device_facts("cpu").capability in message
    assert "rollout.engine=hf" in message
    assert server.pid is None  # nothing was started


@pytest.mark.parametrize(("shape", "refused"), [
    ({"hidden_size": 576, "num_attention_heads": 9}, False),  # SmolLM2-135M: head_dim 64
    ({"hidden_size": 64, "num_attention_heads": 4}, True),
    ({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}, False),  # an explicit head_dim wins
    ({"hidden_size": 5120, "num_attention_heads": 40}, False),  # Qwen3-14B: 128
])
def test_cpu_refusal_reads_the_head_size_from_the_model_config(tmp_path: Path, shape: dict[str, int],
                                                               refused: bool):
    assert (cpu_refusal(_model_dir(tmp_path, **shape)) is not None) == refused
    assert 64 in CPU_HEAD_SIZES and 16 not in CPU_HEAD_SIZES
    assert cpu_refusal(tmp_path / "no-such-model") is None  # vLLM's own loader names a missing directory


def test_errors_quote_the_servers_real_error_not_its_shutdown_noise():
    lines = ["INFO starting", "ERROR RuntimeError: Unsupported CPU attention configuration: head_dim=16",
             *[f"INFO teardown {i}" for i in range(20)],
             "nanobind: leaked 3 instances!", " - leaked type \"vllm._C.Foo\"",
             "nanobind: this is likely caused by a reference counting issue in the binding code."]
    quoted = "\n".join(quoted_lines(lines))
    assert quoted.splitlines()[0].endswith("Unsupported CPU attention configuration: head_dim=16")
    assert "nanobind" not in quoted and "leaked" not in quoted and "INFO teardown 19" in quoted


def test_the_ipc_directory_of_a_server_whose_trainer_was_killed_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """A trainer SIGKILLed before it could stop its server leaves its directory of vLLM IPC sockets; the next start
    removes every such directory whose starting process is gone, and no live process's."""
    from infra.engines.vllm_server import RPC_PREFIX, remove_orphaned_rpc_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"{RPC_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{RPC_PREFIX}{os.getpid()}-def"
    for d in (orphan, live):
        d.mkdir()
        (d / "socket").touch()
    other = tmp_path / "someone-else"
    other.mkdir()
    assert remove_orphaned_rpc_dirs(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and other.exists()
