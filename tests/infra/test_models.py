"""Policy loading: tiny-random determinism, the built-in SmolLM2 conversion cache, dtype and local paths."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aepo_core.config import ModelConfig
from infra.engines.hf import HFEngine
from infra.models import (
    BUILTIN_SMOLLM2,
    ModelLoadError,
    build_tiny_random,
    ensure_gguf_converted,
    load_policy,
    load_tokenizer,
)


def _same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_random_is_small_fast_and_seeded(tiny_cfg: ModelConfig, tiny_policy: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_policy
    again, _ = load_policy(tiny_cfg)
    assert _same_weights(model, again)
    other, _ = load_policy(tiny_cfg.model_copy(update={"init_seed": 1}))
    assert not _same_weights(model, other)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 5_000_000
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert model.get_input_embeddings().num_embeddings == len(tokenizer) == 49152
    assert model.dtype == torch.float32 and not model.training


def test_tiny_random_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_random(1000, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_is_ready_for_chat_and_batching(tiny_cfg: ModelConfig) -> None:
    tok = load_tokenizer(tiny_cfg)
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_dtype_is_configurable(tiny_cfg: ModelConfig) -> None:
    bf16, _ = load_policy(tiny_cfg.model_copy(update={"dtype": "bfloat16"}))
    assert bf16.dtype == torch.bfloat16
    auto, _ = load_policy(tiny_cfg.model_copy(update={"dtype": "auto"}))
    assert auto.dtype == torch.float32  # auto keeps the checkpoint's dtype


def test_loads_any_local_causal_lm_directory(tiny_policy: tuple[Any, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny_policy
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_policy(ModelConfig(name=str(tmp_path), dtype="float32"))
    assert _same_weights(model, loaded)
    assert tok.padding_side == "left" and tok.chat_template


def test_bad_sources_fail_clearly_and_leave_no_partial_cache(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_policy(ModelConfig(name=str(tmp_path / "missing.gguf")))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        ensure_gguf_converted(fake, cache, "fake")
    assert list(cache.iterdir()) == []  # the temporary directory was removed, nothing was renamed in


def test_builtin_smollm2_converts_once_then_reloads_from_cache(model_cache: Path) -> None:
    cfg = ModelConfig(name=BUILTIN_SMOLLM2, cache_dir=str(model_cache), dtype="bfloat16")
    t0 = time.perf_counter()
    model, tokenizer = load_policy(cfg)
    first_s = time.perf_counter() - t0
    dirs = [p for p in model_cache.iterdir() if p.name.startswith(BUILTIN_SMOLLM2) and "tokenizer" not in p.name]
    assert len(dirs) == 1, dirs
    cached = dirs[0]
    assert not [p for p in model_cache.iterdir() if p.name.startswith(".tmp-")]
    weights = cached / "model.safetensors"
    assert weights.is_file() and (cached / "tokenizer.json").is_file()
    assert json.loads((cached / "aepo_conversion.json").read_text())["tokenizer_only"] is False
    mtime = weights.stat().st_mtime_ns

    t0 = time.perf_counter()
    again, _ = load_policy(cfg)
    reload_s = time.perf_counter() - t0
    print(f"smollm2: first load (conversion) {first_s:.1f} s, reload {reload_s:.2f} s")
    assert weights.stat().st_mtime_ns == mtime  # not converted again
    assert again.dtype == torch.bfloat16
    assert 130e6 < sum(p.numel() for p in again.parameters()) < 140e6
    assert _same_weights(model, again)

    # The converted weights are the real instruct model, not noise: one teacher-forced forward pass.
    engine = HFEngine(again, tokenizer)
    ids = engine.apply_chat_template("What is the capital of France?") + engine.encode("The capital of France is")
    with torch.no_grad():
        logits = again(input_ids=torch.tensor([ids])).logits[0, -1]
    assert engine.decode([int(logits.argmax())]).strip() == "Paris"
