"""DeepSpeed backend, single process on CPU (gloo): same update as the torch backend, ZeRO-3, bf16, resume.

Every test runs ``PolicyUpdater.update`` with a token budget that gives mini-batches different numbers of
micro-batches, so a wrong gradient-accumulation scaling would show up as a parameter mismatch.
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from capabilities import require
from test_update import VOCAB, make_samples, params, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from aepo_core.config import ExperimentConfig, TrainConfig
from aepo_core.overrides import build_config
from infra.models import model_dir
from infra.training.backends import TorchBackend
from infra.training.batching import split_mini_batches
from infra.training.checkpoint import save_checkpoint
from infra.training.deepspeed_backend import (
    DeepSpeedBackend,
    init_single_process_distributed,
    shutdown_distributed,
)
from infra.training.optim import lr_factor
from infra.training.update import PolicyUpdater

require(importlib.util.find_spec("deepspeed") is not None,
        "deepspeed is not installed (pip install -e '.[distributed]')")

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.distributed.*` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# share_prefix off: the DeepSpeed engine runs every row, so the torch reference must too (its default, `auto`, would
# share the tree: the same gradients only to float rounding, and micro-batches planned by the tree).
OVERRIDES = ["optim.lr=1e-2", "optim.grad_clip=1.0", "optim.mini_batch_size=2", "optim.micro_batch_tokens=40",
             "optim.lr_schedule=cosine", "optim.warmup_steps=1", "optim.share_prefix=off"]
TOTAL_STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def single_process_dist() -> Iterator[None]:
    """One gloo process group for the module; env vars and the group are gone afterwards."""
    if torch.distributed.is_initialized():
        pytest.fail("a process group is already initialised: another test leaked one")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(key, raising=False)
        init_single_process_distributed()
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.setenv(key, os.environ[key])  # registers them for removal at teardown
        yield
        shutdown_distributed()
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def cfg() -> ExperimentConfig:
    return build_config({}, OVERRIDES)


def tied_model(seed: int = 0) -> LlamaForCausalLM:
    """Like ``tiny_model`` but with the input embedding reused as the vocabulary projection (as SmolLM2)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.3, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float().eval()


def torch_reference(cfg: ExperimentConfig, model: torch.nn.Module, steps: int = 1) -> tuple[torch.nn.Module, list]:
    backend = TorchBackend(model, cfg.optim, total_steps=TOTAL_STEPS)
    updater = PolicyUpdater(backend, cfg, pad_id=0)
    return model, [updater.update(make_samples(seed=s)) for s in range(steps)]


def ds_params(backend: DeepSpeedBackend, like: torch.nn.Module) -> torch.Tensor:
    full = backend.consolidated_state_dict()
    return torch.cat([full[name].float().flatten() for name, _ in like.named_parameters()])


def test_setup_has_a_variable_number_of_micro_batches(cfg):
    updater = PolicyUpdater(TorchBackend(tiny_model(), cfg.optim, TOTAL_STEPS), cfg, pad_id=0)
    samples = make_samples()
    counts = {len(updater._micro_batches(samples, mini)) for mini in split_mini_batches(samples, 2)}
    assert len(counts) > 1, counts


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_torch_backend(cfg, stage):
    """Two RL steps (4 optimizer steps, clipping active, warmup + cosine LR) give the torch backend's weights."""
    ref, ref_metrics = torch_reference(cfg, tiny_model(), steps=2)
    backend = DeepSpeedBackend(tiny_model(), cfg.optim, TOTAL_STEPS, zero_stage=stage)
    updater = PolicyUpdater(backend, cfg, pad_id=0)
    metrics = [updater.update(make_samples(seed=s)) for s in range(2)]
    # ZeRO 1–3 reduce flattened gradient partitions in other orders: a few ulps of fp32 noise, amplified by Adam
    # (deepspeed 0.19.8, ZeRO-1/2: 1 of 24,800 weights off by 1.35e-6 after 4 steps; stage 0 is exact to 1e-6).
    tol = {"rtol": 1e-4, "atol": 2e-5} if stage > 0 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ds_params(backend, ref), params(ref), **tol)
    assert not torch.allclose(params(ref), params(tiny_model()))  # it did move
    for got, want in zip(metrics, ref_metrics):
        assert got["train/optimizer_steps"] == want["train/optimizer_steps"] == 2
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)
        assert want["train/grad_norm_max"] > cfg.optim.grad_clip  # clipping was exercised
        assert got["train/lr"] == pytest.approx(want["train/lr"], rel=1e-9)
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_embeddings_and_consolidated_state_dict(cfg, stage, tmp_path):
    """Under ZeRO-3 the projection is called outside the engine's forward, on a weight shared with the input."""
    ref, _ = torch_reference(cfg, tied_model())
    model = tied_model()
    train = TrainConfig(backend="deepspeed", zero_stage=stage)
    backend = DeepSpeedBackend.from_config(model, cfg.optim, train, TOTAL_STEPS)
    assert (model.get_output_embeddings().weight.numel() == 0) == (stage == 3)  # really partitioned under ZeRO-3
    PolicyUpdater(backend, cfg, pad_id=0).update(make_samples())
    full = backend.consolidated_state_dict()
    assert set(full) == set(ref.state_dict())
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]  # still tied, as save_pretrained wants
    fresh = tied_model(seed=1)
    fresh.load_state_dict(full)
    torch.testing.assert_close(params(fresh), params(ref), rtol=1e-4, atol=2e-5)
    # The HF export of a checkpoint: full weights even though the live parameters are ZeRO-3 partitions.
    saved = save_checkpoint(tmp_path, 1, model=model, tokenizer=None, config=cfg, state_dict=full, keep=1)
    exported = LlamaForCausalLM.from_pretrained(model_dir(saved)).float()
    torch.testing.assert_close(params(exported), params(ref), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_moves_like_fp32(cfg, stage):
    """bf16 weights (fp32 master weights under ZeRO 1–3): the update points the way the fp32 update does."""
    start = params(tiny_model())
    ref, _ = torch_reference(cfg, tiny_model())
    model = tiny_model()
    backend = DeepSpeedBackend(model, cfg.optim, TOTAL_STEPS, zero_stage=stage, bf16=True)
    metrics = PolicyUpdater(backend, cfg, pad_id=0).update(make_samples())
    full = backend.consolidated_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in full.values())
    delta = ds_params(backend, ref) - start.to(torch.bfloat16).float()
    cos = torch.nn.functional.cosine_similarity(delta, params(ref) - start, dim=0)
    assert cos > 0.9, float(cos)
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)  # as infra/training/checkpoint.py reads it


@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (2, True), (3, False)])
def test_resume_from_saved_state_is_exact(cfg, stage, bf16):
    """Weights + optimizer/scheduler state saved after step 1 and loaded into a new backend continue bit for bit."""
    backend = DeepSpeedBackend(tiny_model(), cfg.optim, TOTAL_STEPS, zero_stage=stage, bf16=bf16)
    updater = PolicyUpdater(backend, cfg, pad_id=0)
    updater.update(make_samples(seed=0))
    lr_after_first = backend.current_lr()
    weights = {k: v.clone() for k, v in backend.consolidated_state_dict().items()}
    state = _roundtrip(backend.checkpoint_state()[0].state_dict())
    updater.update(make_samples(seed=1))
    straight = backend.consolidated_state_dict()

    model = tiny_model(seed=1)
    model.load_state_dict(weights)  # bf16 values into the fp32 model: DeepSpeed casts back to the same bf16
    resumed_backend = DeepSpeedBackend(model, cfg.optim, TOTAL_STEPS, zero_stage=stage, bf16=bf16)
    resumed_backend.checkpoint_state()[0].load_state_dict(state)
    assert resumed_backend.current_lr() == lr_after_first
    resumed = PolicyUpdater(resumed_backend, cfg, pad_id=0)
    resumed.update(make_samples(seed=1))
    again = resumed_backend.consolidated_state_dict()
    assert resumed_backend.current_lr() == backend.current_lr()
    for name, value in straight.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_matches_torch_backend(cfg, stage):
    """Optimizer (and under ZeRO-3 parameter) offload, with the optimizer built by DeepSpeed from its config.

    torch's AdamW stands in for DeepSpeed's CPU Adam, which ``offload_optimizer`` uses by default but whose op
    takes minutes to compile here (checked by hand: same weights within 4e-6).
    """
    ref, _ = torch_reference(cfg, tiny_model())
    o = cfg.optim
    torch_adamw = {"optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                             "weight_decay": o.weight_decay, "torch_adam": True}},
                   "zero_force_ds_cpu_optimizer": False}
    backend = DeepSpeedBackend(tiny_model(), o, TOTAL_STEPS, zero_stage=stage, offload_optimizer=True,
                               offload_params=stage == 3, extra_config=torch_adamw)
    assert backend.engine.zero_cpu_offload()
    assert (backend.engine.zero_offload_param() is not None) == (stage == 3)
    assert type(backend.engine.basic_optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in backend.engine.basic_optimizer.param_groups] == [o.weight_decay, 0.0]
    PolicyUpdater(backend, cfg, pad_id=0).update(make_samples())
    torch.testing.assert_close(ds_params(backend, ref), params(ref), rtol=1e-4, atol=2e-5)
    assert backend.current_lr() == pytest.approx(o.lr * lr_factor(2, TOTAL_STEPS, o))


def test_dtype_follows_the_model(cfg):
    backend = DeepSpeedBackend(tiny_model().to(torch.bfloat16), cfg.optim, TOTAL_STEPS, zero_stage=1)
    assert backend.engine.bfloat16_enabled()
    with pytest.raises(ValueError, match="fp16"):
        DeepSpeedBackend(tiny_model().half(), cfg.optim, TOTAL_STEPS)


def test_bad_arguments(cfg):
    with pytest.raises(ValueError, match="stage 3"):
        DeepSpeedBackend(tiny_model(), cfg.optim, TOTAL_STEPS, zero_stage=2, offload_params=True)
    with pytest.raises(ValueError, match=r"0\.\.3"):
        DeepSpeedBackend(tiny_model(), cfg.optim, TOTAL_STEPS, zero_stage=4)
    with pytest.raises(ValueError, match="zero_stage=3"):
        build_config({}, ["train.backend=deepspeed", "train.zero_stage=2", "train.offload_params=true"])
