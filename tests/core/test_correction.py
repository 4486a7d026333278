"""Rollout correction (truncated importance sampling / masking) against its closed form."""

from __future__ import annotations

import math

import pytest
import torch

from aepo_core.correction import rollout_is_weights

OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -2.0, -200.0]])  # ρ = e^0.5, e^-1, e^1.5, e^197 (would overflow float32)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_tis_truncates_at_the_cap_on_model_tokens_only():
    w, diag = rollout_is_weights(OLD, ROLLOUT, MASK, "tis", cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0, 1.0]])
    torch.testing.assert_close(w, expected)
    assert torch.isfinite(w).all()
    assert diag["rollout_is_truncated_frac"].value == pytest.approx(1 / 3)
    assert diag["rollout_is_weight_mean"].value == pytest.approx((math.exp(0.5) + math.exp(-1.0) + 2.0) / 3)
    assert diag["rollout_is_weight_mean"].reduce == "mean" and diag["rollout_is_weight_mean"].weight == 3


def test_mask_drops_tokens_beyond_the_cap():
    w, _ = rollout_is_weights(OLD, ROLLOUT, MASK, "mask", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def test_none_is_the_identity_but_still_counts():
    w, diag = rollout_is_weights(OLD, ROLLOUT, MASK, "none", cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and diag["rollout_is_truncated_frac"].value == pytest.approx(1 / 3)


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    w, _ = rollout_is_weights(old, ROLLOUT, MASK, "tis", cap=2.0)
    assert not w.requires_grad
