"""Advantage estimators and the entropy-aware advantage (AEPO.md §5)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from aepo_core.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    entropy_aware_advantage,
    entropy_stats,
    informative_groups,
    soft_overlong_penalty,
)
from aepo_core.config import AlgorithmConfig
from aepo_core.config_keys import ConfigError
from aepo_core.losses import LossInputs, compute_policy_loss, loss_normalizer
from aepo_core.overrides import build_config

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 7.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2])


def test_registry_contents():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}


def test_grpo_matches_closed_form():
    adv = compute_advantages("grpo", REWARDS, GROUPS, 1e-6)
    g0 = [1.0, 0.0, 0.5]
    m, s = statistics.mean(g0), statistics.stdev(g0)
    assert adv[:3].tolist() == pytest.approx([(x - m) / (s + 1e-6) for x in g0])
    g1 = [0.0, 2.0, 2.0]
    m, s = statistics.mean(g1), statistics.stdev(g1)
    assert adv[3:6].tolist() == pytest.approx([(x - m) / (s + 1e-6) for x in g1])
    assert adv[6] == 0.0  # a group of one has no baseline


def test_dr_grpo_has_no_std():
    adv = compute_advantages("dr_grpo", REWARDS, GROUPS, 1e-6)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, -4 / 3, 2 / 3, 2 / 3, 0.0])


def test_rloo_is_leave_one_out():
    adv = compute_advantages("rloo", REWARDS, GROUPS, 1e-6)
    r = REWARDS.tolist()
    expected = []
    for i, g in enumerate(GROUPS.tolist()):
        others = [r[j] for j, h in enumerate(GROUPS.tolist()) if h == g and j != i]
        expected.append(r[i] - sum(others) / len(others) if others else 0.0)
    assert adv.tolist() == pytest.approx(expected)


def test_reinforce_pp_baseline_whitens_the_batch():
    adv = compute_advantages("reinforce_pp_baseline", REWARDS, GROUPS, 1e-6)
    assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.std()) == pytest.approx(1.0, abs=1e-4)
    centred = compute_advantages("dr_grpo", REWARDS, GROUPS, 1e-6)
    assert torch.corrcoef(torch.stack([adv, centred]))[0, 1] == pytest.approx(1.0, abs=1e-6)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", REWARDS, GROUPS, 1e-6)


def test_broadcast_masks_tool_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 1, 1]]))
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, -1.0]]


def test_entropy_aware_scaling_closed_form():
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    ent = torch.tensor([[0.5, 2.0, 3.5, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = entropy_aware_advantage(adv, ent, mask, alpha=0.2)
    vals = [0.5, 2.0, 3.5]
    mu = sum(vals) / 3
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 3)
    expected = [a * max(0.0, 1 + 0.2 * (h - mu) / (sd + 1e-6)) for a, h in zip([1.0, 1.0, -1.0], vals)]
    assert out[0, :3].tolist() == pytest.approx(expected, rel=1e-5)
    assert out[0, 3] == 0.0


def test_entropy_aware_sign_never_flips():
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(8, 16, generator=gen)
    ent = torch.rand(8, 16, generator=gen) ** 4 * 10  # skewed: very negative z for many tokens
    mask = torch.ones(8, 16)
    out = entropy_aware_advantage(adv, ent, mask, alpha=5.0)
    assert torch.all(out * adv >= 0)
    assert torch.any(out == 0)  # the clamp was exercised


def test_entropy_aware_is_invariant_to_micro_batch_split():
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(6, 10, generator=gen)
    ent = torch.rand(6, 10, generator=gen) * 4
    mask = (torch.rand(6, 10, generator=gen) > 0.2).float()
    stats = entropy_stats(ent, mask)
    full = entropy_aware_advantage(adv, ent, mask, 0.2, stats)
    splits = (slice(0, 2), slice(2, 6))
    parts = torch.cat([entropy_aware_advantage(adv[s], ent[s], mask[s], 0.2, stats) for s in splits])
    torch.testing.assert_close(parts, full)
    # Without the shared mini-batch statistics the split would change the result: the stats matter.
    naive = torch.cat([entropy_aware_advantage(adv[s], ent[s], mask[s], 0.2) for s in (slice(0, 2), slice(2, 6))])
    assert not torch.allclose(naive, full)


def test_entropy_aware_advantage_changes_loss_and_gradients_in_the_documented_direction():
    """Turning the term on scales the gradient up on high-entropy tokens and down on low-entropy ones."""
    adv_seq = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    ent = torch.tensor([[0.1, 0.2, 3.0, 4.0], [0.1, 0.3, 2.5, 5.0]])
    adv_tok = broadcast_to_tokens(adv_seq, mask)
    cfg = AlgorithmConfig(loss="aepo")

    def run(advantages):
        old = torch.full((2, 4), -2.0, dtype=torch.float64)
        logp = (old + 0.05).clone().requires_grad_(True)
        inp = LossInputs(logp, old, advantages.double(), mask.double(), ent.double())
        loss, _ = compute_policy_loss(inp, cfg, loss_normalizer(inp.mask, inp.entropy, cfg))
        loss.backward()
        return loss.item(), logp.grad

    loss_off, g_off = run(adv_tok)
    loss_on, g_on = run(entropy_aware_advantage(adv_tok, ent, mask, cfg.entropy_advantage_alpha))
    assert loss_on != pytest.approx(loss_off)
    ratio = (g_on / g_off).float()
    high = ent > ent.mean()
    assert torch.all(ratio[high] > 1.0)
    assert torch.all(ratio[~high] < 1.0)
    assert torch.all(ratio >= 0.0)  # direction (sign) of every token's gradient is kept


def test_informative_groups_and_overlong_penalty():
    keep = informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [False, False, True, True]
    pen = soft_overlong_penalty(torch.tensor([10, 90, 95, 100, 120]), max_len=100, buffer=10, factor=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert soft_overlong_penalty(torch.tensor([200]), 100, 0, 1.0).tolist() == [0.0]


# --- GSPO: the entropy-aware advantage per sequence ------------------------------------------------------------

def test_sequence_entropy_aware_advantage_closed_form():
    # Ã_i = Â_i · max(0, 1 + α·z(H̄_i)), H̄_i the mean entropy of sequence i's model tokens, z over the sequences.
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0, -2.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    ent = torch.tensor([[0.5, 2.0, 3.5, 9.0], [1.0, 3.0, 7.0, 7.0], [0.2, 0.2, 0.4, 0.4], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    alpha = 0.5
    stats = entropy_stats(ent, mask, per_sequence=True)
    out = entropy_aware_advantage(adv, ent, mask, alpha, stats)
    means = [2.0, 2.0, 0.3]  # the empty 4th sequence takes no part in the statistics
    mu = sum(means) / 3
    sd = math.sqrt(sum((m - mu) ** 2 for m in means) / 3)
    assert (stats.mean, stats.std) == (pytest.approx(mu), pytest.approx(sd))
    scale = [max(0.0, 1 + alpha * (m - mu) / (sd + 1e-6)) for m in means]
    expected = [[a * scale[i] for a in row] for i, row in enumerate(adv[:3].tolist())]
    assert out[:3].tolist() == [pytest.approx(row, rel=1e-5) for row in expected]
    assert out[3].tolist() == [0.0] * 4
    # one scale per sequence: Ã/Â is constant over each sequence's model tokens
    assert out[0, :3].tolist() == pytest.approx([scale[0]] * 3, rel=1e-5)
    # the stats say which level they are of; without them the level is asked for
    torch.testing.assert_close(entropy_aware_advantage(adv, ent, mask, alpha, per_sequence=True), out)
    assert not torch.allclose(entropy_aware_advantage(adv, ent, mask, alpha), out)


def test_sequence_entropy_aware_advantage_is_invariant_to_micro_batch_split():
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(6, 1, generator=gen).expand(6, 10).clone()
    ent = torch.rand(6, 10, generator=gen) * 4
    mask = (torch.rand(6, 10, generator=gen) > 0.2).float()
    stats = entropy_stats(ent, mask, per_sequence=True)
    full = entropy_aware_advantage(adv, ent, mask, 0.2, stats)
    parts = torch.cat([entropy_aware_advantage(adv[s], ent[s], mask[s], 0.2, stats) for s in (slice(0, 2),
                                                                                               slice(2, 6))])
    torch.testing.assert_close(parts, full)


# --- Dr.GRPO: the constant normalizer --------------------------------------------------------------------------

def test_dr_grpo_forces_the_constant_normalizer():
    cfg = build_config({}, ["algorithm.advantage=dr_grpo"])
    assert cfg.algorithm.loss_agg == "seq-mean-token-sum-norm"
    assert AlgorithmConfig(advantage="dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    for agg in ("token-mean", "seq-mean-token-mean"):
        with pytest.raises(ConfigError, match=r"algorithm\.advantage=dr_grpo.*algorithm\.loss_agg"):
            build_config({}, ["algorithm.advantage=dr_grpo", f"algorithm.loss_agg={agg}"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss=gspo.*algorithm\.advantage=dr_grpo"):
        build_config({}, ["algorithm.advantage=dr_grpo", "algorithm.loss=gspo"])
    # The loss is Σ_t L / L_max per sequence (mean over sequences): a sequence's weight does not depend on its
    # own length.  Two sequences of 1 and 3 tokens, L_max = rollout.max_response_tokens.
    norm_len = cfg.rollout.max_response_tokens
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    loss, _ = compute_policy_loss(LossInputs(logp, old, adv, mask), cfg.algorithm, norm_len=norm_len)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 / norm_len - 3.0 / norm_len) / 2)
    torch.testing.assert_close(logp.grad, -adv / norm_len / 2)


def test_the_entropy_advantage_factor_and_its_spread():
    """Issue 53 §2: the factor max(0, 1 + α·z(H)) the entropy-aware advantage multiplies by, and its spread over the
    update's tokens (mean token-weighted, min, max): H = 0, 1, 2 on three model tokens (mean 1, population sd √⅔),
    α = 0.5: z = −1.2247, 0, +1.2247 → factors 0.388, 1, 1.612; the masked token counts nowhere."""
    from aepo_core.losses import spread_diagnostics

    entropy = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    factor = entropy_aware_advantage(torch.ones_like(entropy), entropy, mask, 0.5)  # what a unit advantage gets
    z = 1 / math.sqrt(2 / 3)
    assert factor[0, :3].tolist() == pytest.approx([1 - 0.5 * z, 1.0, 1 + 0.5 * z], abs=1e-5)
    adv = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    assert entropy_aware_advantage(adv, entropy, mask, 0.5)[0].tolist() == pytest.approx(
        [2 * (1 - 0.5 * z), 2.0, 2 * (1 + 0.5 * z), 0.0], abs=1e-5)
    d = spread_diagnostics("f", factor, mask)
    assert (d["f_min"].value, d["f_max"].value) == (pytest.approx(1 - 0.5 * z, abs=1e-5),
                                                    pytest.approx(1 + 0.5 * z, abs=1e-5))
    assert d["f_mean"].value == pytest.approx(1.0, abs=1e-5) and d["f_mean"].weight == 3.0
    assert spread_diagnostics("f", factor, torch.zeros_like(mask)) == {}
