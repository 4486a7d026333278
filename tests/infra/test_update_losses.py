"""The update's side of the losses: eval-mode gradient pass, GSPO's per-sequence entropy-aware advantage."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_update import VOCAB, make_samples, run_update

import infra.training.update as update_mod
from aepo_core.overrides import build_config
from infra.training.backends import TorchBackend
from infra.training.update import PolicyUpdater


def test_gradient_pass_runs_in_eval_mode():
    """With dropout in the model, a train-mode gradient pass would see another policy than the (eval-mode)
    scoring pass: on-policy, the ratio must be exactly 1 and the update deterministic."""
    cfg = build_config({}, ["optim.lr=1e-2", "optim.mini_batch_size=8", "optim.scoring_pass=always"])

    def update_once() -> tuple[dict[str, float], torch.Tensor]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, attention_dropout=0.5,
            attn_implementation="eager")).float().eval()
        met = PolicyUpdater(TorchBackend(model, cfg.optim, total_steps=1), cfg, pad_id=0).update(make_samples())
        assert not model.training
        return met, torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.manual_seed(1)
    met, first = update_once()
    assert met["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert met["train/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert met["train/clip_frac"] == 0.0
    torch.manual_seed(2)  # another dropout stream would give other masks in train mode
    _, second = update_once()
    torch.testing.assert_close(first, second, rtol=0, atol=0)


@pytest.mark.parametrize(("loss", "per_sequence"), [("gspo", True), ("aepo", False)])
def test_entropy_aware_advantage_is_per_sequence_for_gspo(monkeypatch: pytest.MonkeyPatch, loss: str,
                                                          per_sequence: bool):
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = update_mod.compute_policy_loss

    def recording(inp, *args, **kwargs):
        seen.append((inp.advantages.detach().clone(), inp.mask.bool()))
        return real(inp, *args, **kwargs)

    monkeypatch.setattr(update_mod, "compute_policy_loss", recording)
    samples = make_samples()
    run_update([f"algorithm.loss={loss}", "algorithm.entropy_advantage=true", "algorithm.entropy_advantage_alpha=0.5",
                "optim.micro_batch_tokens=1"], samples)  # one sample per micro-batch
    assert len(seen) == len(samples)
    raw = sorted(s.advantage for s in samples)
    scaled = []
    for adv, mask in seen:
        values = adv[0][mask[0]]
        assert bool((values == values[0]).all()) == per_sequence
        scaled.extend(values.tolist())
    assert not set(scaled) <= set(raw)  # the entropy-aware scaling did act
