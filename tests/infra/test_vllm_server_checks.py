"""What the managed vLLM server refuses before it starts, and what its errors quote (no vLLM needed)."""

from __future__ import annotations

import json
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
