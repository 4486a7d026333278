"""Golden values and gradients of every policy loss against closed forms (AEPO.md §6)."""

from __future__ import annotations

import math

import pytest
import torch

import aepo_core.losses as losses_mod
from aepo_core.config import AlgorithmConfig
from aepo_core.config_keys import ConfigError
from aepo_core.losses import (
    POLICY_LOSSES,
    Diagnostic,
    LossInputs,
    aggregate,
    combine_diagnostics,
    compute_policy_loss,
    high_entropy_threshold,
    kl_penalty,
    loss_normalizer,
    token_gradient_weights,
)
from aepo_core.overrides import build_config

EPS_L, EPS_H = 0.2, 0.2


def make_inputs(log_ratios, advantages, mask=None, old=None, entropy=None, ref=None, dtype=torch.float64):
    """Inputs whose ratio per token is exp(log_ratio); logprobs is a leaf so its .grad is ∂L/∂logπ."""
    lr = torch.tensor(log_ratios, dtype=dtype)
    old_lp = torch.tensor(old, dtype=dtype) if old is not None else torch.full_like(lr, -1.5)
    logprobs = (old_lp + lr).clone().requires_grad_(True)
    adv = torch.tensor(advantages, dtype=dtype)
    m = torch.tensor(mask, dtype=dtype) if mask is not None else torch.ones_like(lr)
    ent = torch.tensor(entropy, dtype=dtype) if entropy is not None else None
    ref_lp = torch.tensor(ref, dtype=dtype) if ref is not None else None
    return LossInputs(logprobs, old_lp, adv, m, ent, ref_lp)


def loss_and_grad(inp: LossInputs, **cfg):
    config = AlgorithmConfig(**{"clip_low": EPS_L, "clip_high": EPS_H, **cfg})
    loss, diag = compute_policy_loss(inp, config)
    loss.backward()
    return loss.item(), inp.logprobs.grad.clone(), diag


# Four tokens, one per region of the clip: (Â>0, r>1+ε_h), (Â>0, inside), (Â<0, r<1−ε_l), (Â<0, inside).
R = [1.5, 1.1, 0.5, 0.9]
A = [2.0, 1.0, -1.0, -3.0]
LOG_R = [[math.log(x) for x in R]]


def ppo_closed_form():
    n = len(R)
    value = sum(-min(r * a, min(max(r, 1 - EPS_L), 1 + EPS_H) * a) for r, a in zip(R, A)) / n
    grad = [0.0, -R[1] * A[1] / n, 0.0, -R[3] * A[3] / n]
    return value, grad


def test_registry_has_all_losses():
    assert set(POLICY_LOSSES) == {"ppo_clip", "dapo", "aepo", "gppo", "ce_gppo", "cispo", "gspo"}


def test_ppo_clip_value_and_gradient():
    value, grad = ppo_closed_form()
    loss, g, diag = loss_and_grad(make_inputs(LOG_R, [A]), loss="ppo_clip")
    assert loss == pytest.approx(value, abs=1e-12)
    torch.testing.assert_close(g[0], torch.tensor(grad, dtype=torch.float64))
    assert diag["clip_frac_high"].value == pytest.approx(0.25)
    assert diag["clip_frac_low"].value == pytest.approx(0.25)
    assert diag["clip_frac"].value == pytest.approx(0.5)


def test_aepo_forward_equals_ppo_and_keeps_clipped_positive_gradient():
    value, grad = ppo_closed_form()
    loss, g, _ = loss_and_grad(make_inputs(LOG_R, [A]), loss="aepo")
    assert loss == pytest.approx(value, abs=1e-12)  # forward unchanged
    # (Â>0, r>1+ε_h): (1+ε_h)·Â·∇logπ, i.e. ∂L/∂logπ = −(1+ε_h)·Â/N, where PPO-clip gives 0.
    expected = list(grad)
    expected[0] = -(1 + EPS_H) * A[0] / 4
    torch.testing.assert_close(g[0], torch.tensor(expected, dtype=torch.float64))
    # (Â<0, r<1−ε_l): both give exactly 0.
    assert g[0, 2] == 0.0


def test_aepo_negative_advantage_above_upper_bound_matches_ppo():
    # Â<0 and r>1+ε_h is unclipped in PPO (min picks r·Â); AEPO must agree in value and gradient.
    inp_ppo = make_inputs([[math.log(1.6)]], [[-1.0]])
    inp_aepo = make_inputs([[math.log(1.6)]], [[-1.0]])
    lp, gp, _ = loss_and_grad(inp_ppo, loss="ppo_clip")
    la, ga, _ = loss_and_grad(inp_aepo, loss="aepo")
    assert lp == pytest.approx(la) and lp == pytest.approx(1.6)
    torch.testing.assert_close(ga, gp)
    assert float(ga[0, 0]) == pytest.approx(1.6)


def test_aepo_high_entropy_gate():
    # Two clipped positive tokens; only the high-entropy one keeps the preserved gradient.
    log_r = [[math.log(1.5), math.log(1.5), 0.0, 0.0, 0.0]]
    adv = [[1.0, 1.0, 1.0, 1.0, 1.0]]
    ent = [[3.0, 0.1, 0.2, 0.3, 0.4]]  # top-20% of 5 tokens = the first one
    _, g_gate, diag = loss_and_grad(
        make_inputs(log_r, adv, entropy=ent), loss="aepo", clip_gate="high_entropy", high_entropy_quantile=0.2
    )
    assert float(g_gate[0, 0]) == pytest.approx(-(1 + EPS_H) / 5)
    assert float(g_gate[0, 1]) == 0.0
    _, g_all, _ = loss_and_grad(make_inputs(log_r, adv, entropy=ent), loss="aepo", clip_gate="all")
    assert float(g_all[0, 1]) == pytest.approx(-(1 + EPS_H) / 5)
    assert diag["clip_frac_high_entropy"].value == pytest.approx(1.0)
    assert diag["num_high_entropy_tokens"].value == 1.0


def test_high_entropy_gate_requires_entropy():
    with pytest.raises(ValueError, match="entropies"):
        loss_and_grad(make_inputs(LOG_R, [A]), loss="aepo", clip_gate="high_entropy")


def test_dapo_uses_clip_higher():
    # r = 1.25 is clipped by ε_h = 0.2 but not by DAPO's 0.28.
    inp = make_inputs([[math.log(1.25)]], [[1.0]])
    _, g_dapo, _ = loss_and_grad(inp, loss="dapo")
    assert float(g_dapo[0, 0]) == pytest.approx(-1.25)
    _, g_ppo, _ = loss_and_grad(make_inputs([[math.log(1.25)]], [[1.0]]), loss="ppo_clip")
    assert float(g_ppo[0, 0]) == 0.0
    _, g_dapo2, _ = loss_and_grad(make_inputs([[math.log(1.3)]], [[1.0]]), loss="dapo")
    assert float(g_dapo2[0, 0]) == 0.0


def test_gppo_preserves_both_sides():
    value, _ = ppo_closed_form()
    loss, g, _ = loss_and_grad(make_inputs(LOG_R, [A]), loss="gppo")
    assert loss == pytest.approx(value, abs=1e-12)
    expected = [-(1 + EPS_H) * A[0] / 4, -R[1] * A[1] / 4, -(1 - EPS_L) * A[2] / 4, -R[3] * A[3] / 4]
    torch.testing.assert_close(g[0], torch.tensor(expected, dtype=torch.float64))


def test_ce_gppo_weights_each_side():
    b1, b2 = 0.5, 0.25
    loss, g, _ = loss_and_grad(make_inputs(LOG_R, [A]), loss="ce_gppo", gppo_beta_low=b1, gppo_beta_high=b2)
    v = [-b2 * (1 + EPS_H) * A[0], -R[1] * A[1], -b1 * (1 - EPS_L) * A[2], -R[3] * A[3]]
    assert loss == pytest.approx(sum(v) / 4, abs=1e-12)
    expected = [-b2 * (1 + EPS_H) * A[0] / 4, -R[1] * A[1] / 4, -b1 * (1 - EPS_L) * A[2] / 4, -R[3] * A[3] / 4]
    torch.testing.assert_close(g[0], torch.tensor(expected, dtype=torch.float64))


def test_ce_gppo_with_unit_betas_is_gppo():
    lg, gg, _ = loss_and_grad(make_inputs(LOG_R, [A]), loss="gppo")
    lc, gc, _ = loss_and_grad(make_inputs(LOG_R, [A]), loss="ce_gppo", gppo_beta_low=1.0, gppo_beta_high=1.0)
    assert lg == pytest.approx(lc)
    torch.testing.assert_close(gg, gc)


def test_ce_gppo_defaults_are_its_papers():
    """CE-GPPO's scripts weight the low side β₁ = 0.5 (or 0.75) and keep β₂ = 1; β₁ = β₂ = 1 is plain GPPO."""
    cfg = AlgorithmConfig(loss="ce_gppo")
    assert (cfg.gppo_beta_low, cfg.gppo_beta_high) == (0.5, 1.0)


def test_each_loss_default_differs_from_every_other():
    """Every registered loss at its defaults (``AlgorithmConfig(loss=name)``, nothing else set) gives a different
    per-token loss or gradient from every other on a batch that visits every region: Â of both signs, ratios
    inside the clip range, between ε_h = 0.2 and DAPO's 0.28, past both bounds, and past dual-clip's c = 3.  Two
    losses that agree here are the same method under two names."""
    ratios = [0.5, 0.9, 1.1, 1.25, 1.5, 4.0, 0.5, 0.9, 1.1, 1.25, 1.5, 4.0]
    adv = [1.0] * 6 + [-1.0] * 6
    out = {}
    for name in losses_mod.POLICY_LOSSES:
        inp = make_inputs([[math.log(r) for r in ratios]], [adv], entropy=[[1.0] * len(ratios)])
        cfg = AlgorithmConfig(loss=name)
        per_token = losses_mod.POLICY_LOSSES[name](inp, cfg, torch.ones(1, len(ratios), dtype=torch.bool)).per_token
        per_token.sum().backward()
        out[name] = (per_token.detach(), inp.logprobs.grad.clone())
    same = [(a, b) for a in out for b in out if a < b
            and torch.allclose(out[a][0], out[b][0]) and torch.allclose(out[a][1], out[b][1])]
    assert same == []


def test_dapo_has_no_dual_clip_by_default():
    """DAPO clips higher (ε_h = 0.28) and has no dual-clip; the rest of the PPO family keeps verl's c = 3, and an
    explicit value (or null) is honoured for any loss."""
    assert AlgorithmConfig(loss="dapo").dual_clip is None
    assert AlgorithmConfig(loss="ppo_clip").dual_clip == 3.0
    assert AlgorithmConfig(loss="dapo", dual_clip=3.0).dual_clip == 3.0
    assert AlgorithmConfig(loss="aepo", dual_clip=None).dual_clip is None


def test_cispo_is_the_minimax_m1_form():
    # IS weight sg(min(r, 1+ε_high^IS)): no lower clip (r = 0.5 < 1−ε_l keeps 0.5), and only the large IS bound
    # caps it above (r = 1.5 is not clipped at 1+ε_h; r = 6 is capped at 1 + 3 = 4).
    eps_is = 3.0
    ratios, adv = [6.0, 1.5, 0.5, 0.9], [2.0, 1.0, -1.0, -3.0]
    old = [[-1.5, -1.0, -2.0, -0.5]]
    inp = make_inputs([[math.log(r) for r in ratios]], [adv], old=old)
    loss, g, diag = loss_and_grad(inp, loss="cispo", cispo_eps_high=eps_is)
    w = [4.0, 1.5, 0.5, 0.9]
    logp = [o + math.log(r) for o, r in zip(old[0], ratios)]
    assert loss == pytest.approx(sum(-wi * a * lp for wi, a, lp in zip(w, adv, logp)) / 4, abs=1e-12)
    # ∂/∂logπ of −sg(w)·Â·logπ is −w·Â: every token, clipped or not, keeps a gradient.
    torch.testing.assert_close(g[0], torch.tensor([-wi * a / 4 for wi, a in zip(w, adv)], dtype=torch.float64))
    assert diag["clip_frac_high"].value == pytest.approx(0.25)
    assert diag["clip_frac_low"].value == 0.0


def test_cispo_default_upper_bound():
    cfg = AlgorithmConfig()
    assert cfg.cispo_eps_high == 3.0
    inp = make_inputs([[math.log(10.0)]], [[1.0]])
    _, g, _ = loss_and_grad(inp, loss="cispo")
    assert float(g[0, 0]) == pytest.approx(-(1 + cfg.cispo_eps_high))


def test_gspo_one_ratio_per_sequence():
    log_r = [[0.001, -0.0005, 0.0002], [0.0, 0.0, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    inp = make_inputs(log_r, adv, mask=mask)
    cfg = AlgorithmConfig(loss="gspo", loss_agg="seq-mean-token-mean", gspo_clip_low=0.01, gspo_clip_high=0.01)
    loss, diag = compute_policy_loss(inp, cfg)
    loss.backward()
    s0 = math.exp(sum(log_r[0]) / 3)
    s1 = 1.0
    assert loss.item() == pytest.approx((-s0 * 1.0 + s1 * 1.0) / 2, abs=1e-12)
    # ∂L/∂logπ_t = −s·Â/(T·n_seq) on every token of a sequence: one ratio, shared.
    torch.testing.assert_close(inp.logprobs.grad[0], torch.full((3,), -s0 / 3 / 2, dtype=torch.float64))
    torch.testing.assert_close(inp.logprobs.grad[1], torch.tensor([1 / 2 / 2, 1 / 2 / 2, 0.0], dtype=torch.float64))
    assert diag["ratio_max"].value == pytest.approx(s0) and diag["ratio_min"].value == pytest.approx(s1)


def test_gspo_clips_the_sequence_ratio():
    log_r = [[0.3, 0.3]]  # s = e^0.3, far outside gspo's default 4e-4
    inp = make_inputs(log_r, [[1.0, 1.0]])
    _, g, diag = loss_and_grad(inp, loss="gspo")
    assert torch.all(g == 0)
    assert diag["clip_frac_high"].value == 1.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_tool_tokens_get_zero_gradient(name):
    log_r = [[0.3, -0.4, 0.1, 0.05]]
    adv = [[1.0, -2.0, 0.5, 1.5]]
    mask = [[1, 0, 1, 0]]
    _, g, diag = loss_and_grad(make_inputs(log_r, adv, mask=mask, entropy=[[1.0, 2.0, 3.0, 4.0]]), loss=name)
    assert g[0, 1] == 0.0 and g[0, 3] == 0.0
    assert diag["num_tokens"].value == 2.0


def test_dual_clip_caps_negative_advantage_loss():
    inp = make_inputs([[math.log(5.0)]], [[-1.0]])
    loss, g, _ = loss_and_grad(inp, loss="ppo_clip", dual_clip=3.0)
    assert loss == pytest.approx(3.0)
    assert float(g[0, 0]) == 0.0
    loss_nc, g_nc, _ = loss_and_grad(make_inputs([[math.log(5.0)]], [[-1.0]]), loss="ppo_clip", dual_clip=None)
    assert loss_nc == pytest.approx(5.0) and float(g_nc[0, 0]) == pytest.approx(5.0)
    loss_a, g_a, _ = loss_and_grad(make_inputs([[math.log(5.0)]], [[-1.0]]), loss="aepo", dual_clip=3.0)
    assert loss_a == pytest.approx(3.0) and float(g_a[0, 0]) == 0.0


@pytest.mark.parametrize("name", ["ppo_clip", "aepo", "gppo", "ce_gppo"])
def test_dual_clip_c3_is_the_default_of_the_ppo_family(name):
    # Â < 0: L = min(L_clip, −c·Â), c = 3.  r = 5 is capped (value 3·|Â|, gradient 0); r = 2 is below the cap
    # (value r·|Â|, gradient r·|Â|); Â > 0 is never dual-clipped.
    assert AlgorithmConfig().dual_clip == 3.0
    ratios, adv = [5.0, 2.0, 1.1], [-1.0, -2.0, 1.0]
    loss, g, _ = loss_and_grad(make_inputs([[math.log(r) for r in ratios]], [adv]), loss=name)
    assert loss == pytest.approx((3.0 * 1.0 + 2.0 * 2.0 - 1.1 * 1.0) / 3, abs=1e-12)
    torch.testing.assert_close(g[0], torch.tensor([0.0, 2.0 * 2.0 / 3, -1.1 / 3], dtype=torch.float64))


@pytest.mark.parametrize("name", ["cispo", "gspo"])
def test_dual_clip_leaves_cispo_and_gspo_alone(name):
    inp = make_inputs([[math.log(5.0)]], [[-1.0]])
    loss, g, _ = loss_and_grad(inp, loss=name, gspo_clip_low=0.9, gspo_clip_high=9.0)
    loss_nc, g_nc, _ = loss_and_grad(make_inputs([[math.log(5.0)]], [[-1.0]]), loss=name, dual_clip=None,
                                     gspo_clip_low=0.9, gspo_clip_high=9.0)
    assert loss == pytest.approx(loss_nc)
    torch.testing.assert_close(g, g_nc)


def test_aggregation_modes_differ_as_documented():
    per_token = torch.tensor([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(13 / 4)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx(
        (1 / 10 + 12 / 10) / 2
    )
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_micro_batches_add_up_to_the_mini_batch(agg, name):
    gen = torch.Generator().manual_seed(0)
    log_r = (torch.rand(4, 6, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).double()
    ent = torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    if name == "gspo" and agg != "seq-mean-token-mean":
        pytest.skip("gspo is GSPO only under seq-mean-token-mean (the config refuses the others)")
    cfg = AlgorithmConfig(loss=name, loss_agg=agg, loss_norm_len=6, clip_gate="high_entropy")

    full = make_inputs(log_r.tolist(), adv.tolist(), mask=mask.tolist(), entropy=ent.tolist())
    norm = loss_normalizer(full.mask, full.entropy, cfg)
    loss_full, _ = compute_policy_loss(full, cfg, norm)
    loss_full.backward()

    total = 0.0
    grads = []
    for rows in (slice(0, 1), slice(1, 4)):
        part = make_inputs(
            log_r[rows].tolist(), adv[rows].tolist(), mask=mask[rows].tolist(), entropy=ent[rows].tolist()
        )
        loss_part, _ = compute_policy_loss(part, cfg, norm)
        loss_part.backward()
        total += loss_part.item()
        grads.append(part.logprobs.grad)
    assert total == pytest.approx(loss_full.item(), abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), full.logprobs.grad)


def test_kl_estimators_and_coefficient():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    d = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", 10.0), d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2", 10.0), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", 10.0), torch.exp(-d) + d - 1)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(logp, ref, "k4", 10.0)

    inp = make_inputs([[0.0, 0.0]], [[0.0, 0.0]], old=logp.tolist(), ref=ref.tolist())
    loss, g, diag = loss_and_grad(inp, loss="ppo_clip", kl_coef=0.5, kl_estimator="k1")
    assert loss == pytest.approx(0.5 * float(d.mean()))
    torch.testing.assert_close(g, torch.full((1, 2), 0.25, dtype=torch.float64))
    assert diag["kl_ref"].value == pytest.approx(float(d.mean()))
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_and_grad(make_inputs([[0.0]], [[1.0]]), kl_coef=0.1)


def test_diagnostics_ratio_stats_and_approx_kl():
    _, _, diag = loss_and_grad(make_inputs(LOG_R, [A]), loss="ppo_clip")
    assert diag["ratio_max"].value == pytest.approx(1.5)
    assert diag["ratio_min"].value == pytest.approx(0.5)
    assert diag["ratio_mean"].value == pytest.approx(sum(R) / 4)
    expected_kl = sum(1 / r + math.log(r) - 1 for r in R) / 4
    assert diag["approx_kl"].value == pytest.approx(expected_kl)


def test_unknown_loss_name_is_a_clear_error():
    cfg = AlgorithmConfig()
    object.__setattr__(cfg, "loss", "nope")
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        compute_policy_loss(make_inputs(LOG_R, [A]), cfg)


def test_every_diagnostic_declares_how_it_combines():
    inp = make_inputs(LOG_R, [A], entropy=[[0.1, 2.0, 0.3, 4.0]], ref=[[-1.0, -1.2, -2.0, -1.4]])
    _, _, diag = loss_and_grad(inp, loss="ppo_clip", kl_coef=0.1, clip_gate="high_entropy")
    assert {name: (d.reduce, d.weight) for name, d in diag.items()} == {
        **{name: ("mean", 4.0) for name in ("clip_frac", "clip_frac_high", "clip_frac_low", "approx_kl",
                                           "ratio_mean", "entropy_mean", "kl_ref")},
        "clip_frac_high_entropy": ("mean", diag["num_high_entropy_tokens"].value),
        "high_entropy_share": ("mean", 4.0),
        # weighted by the tokens at or above 0.672 nats (2.0 and 4.0)
        "high_entropy_clip_frac_high": ("mean", 2.0), "high_entropy_clip_frac_low": ("mean", 2.0),
        "ratio_max": ("max", 0.0),
        "ratio_min": ("min", 0.0),
        "num_tokens": ("sum", 0.0),
        "num_high_entropy_tokens": ("sum", 0.0),
    }


def test_combine_diagnostics_folds_each_by_its_declared_reduction():
    parts = [
        {"n": Diagnostic(3.0, "sum"), "hi": Diagnostic(1.5, "max"), "lo": Diagnostic(0.5, "min"),
         "frac": Diagnostic(0.5, "mean", 2.0), "rare": Diagnostic(0.0, "mean", 0.0)},
        {"n": Diagnostic(4.0, "sum"), "hi": Diagnostic(2.5, "max"), "lo": Diagnostic(0.7, "min"),
         "frac": Diagnostic(0.25, "mean", 6.0), "rare": Diagnostic(1.0, "mean", 1.0), "late": Diagnostic(2.0, "sum")},
    ]
    combined = combine_diagnostics(parts)
    assert combined == {"n": 7.0, "hi": 2.5, "lo": 0.5, "frac": (0.5 * 2 + 0.25 * 6) / 8, "rare": 1.0, "late": 2.0}
    assert list(combined) == ["n", "hi", "lo", "frac", "rare", "late"]  # first-seen order


def test_combine_diagnostics_edge_cases():
    assert combine_diagnostics([]) == {}
    assert combine_diagnostics([{"m": Diagnostic(0.7, "mean", 0.0)}]) == {"m": 0.0}  # no weight anywhere: 0
    assert combine_diagnostics([{"x": Diagnostic(-2.0, "max")}]) == {"x": -2.0}  # not max(0, …)
    with pytest.raises(ValueError, match="unknown diagnostic reduction"):
        Diagnostic(1.0, "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="declared both"):
        combine_diagnostics([{"x": Diagnostic(1.0, "sum")}, {"x": Diagnostic(1.0, "mean", 1.0)}])


# --- r/sg(r) without 0/0: masked tokens whose ratio under/overflows (float32: e^−120 = 0, e^120 = inf) ---------

@pytest.mark.parametrize("extreme", [-120.0, 120.0])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_extreme_ratio_on_a_masked_token_leaves_the_loss_finite_and_unchanged(name, extreme):
    log_r, adv, mask = [[0.3, 0.0, -0.4, 0.1]], [[1.0, 0.0, -2.0, 1.5]], [[1, 0, 1, 1]]
    ent = [[1.0, 2.0, 3.0, 4.0]]
    cfg = {"loss": name, "clip_gate": "high_entropy", "high_entropy_quantile": 0.5, "gspo_clip_low": 0.2,
           "gspo_clip_high": 0.2, **({"loss_agg": "seq-mean-token-mean"} if name == "gspo" else {})}
    ref_loss, ref_g, _ = loss_and_grad(make_inputs(log_r, adv, mask=mask, entropy=ent, dtype=torch.float32), **cfg)
    bad = [[0.3, extreme, -0.4, 0.1]]
    loss, g, _ = loss_and_grad(make_inputs(bad, adv, mask=mask, entropy=ent, dtype=torch.float32), **cfg)
    assert math.isfinite(loss) and bool(torch.isfinite(g).all())
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    torch.testing.assert_close(g, ref_g)
    assert g[0, 1] == 0.0


def test_gppo_underflowed_ratio_on_a_model_token_keeps_its_bounded_gradient():
    # r = e^−120 = 0 in float32, Â < 0: GPPO's low bound (1−ε_l)·exp(logπ − sg(logπ)) has value 1−ε_l and
    # gradient (1−ε_l)·∇logπ, where (1−ε_l)·r/sg(r) gave 0/0.
    inp = make_inputs([[-120.0, 0.0]], [[-1.0, 1.0]], dtype=torch.float32)
    loss, g, _ = loss_and_grad(inp, loss="gppo")
    assert loss == pytest.approx(((1 - EPS_L) * 1.0 - 1.0) / 2, abs=1e-6)
    torch.testing.assert_close(g[0], torch.tensor([(1 - EPS_L) / 2, -1.0 / 2]))


# --- GSPO / Dr.GRPO aggregation --------------------------------------------------------------------------------

def test_gspo_forces_sequence_mean_aggregation():
    assert build_config({}, ["algorithm.loss=gspo"]).algorithm.loss_agg == "seq-mean-token-mean"
    assert AlgorithmConfig(loss="gspo").loss_agg == "seq-mean-token-mean"
    cfg = build_config({}, ["algorithm.loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"])
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean"
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ConfigError, match=r"algorithm\.loss=gspo.*algorithm\.loss_agg"):
            build_config({}, ["algorithm.loss=gspo", f"algorithm.loss_agg={agg}"])
    assert AlgorithmConfig().loss_agg == "token-mean"  # the other losses keep the default


# --- the high-entropy threshold: only when the gate needs it, and past torch.quantile's 16M-element limit -------

@pytest.mark.parametrize("n", [1, 2, 5, 11, 37, 1000])
@pytest.mark.parametrize("q", [0.05, 0.2, 0.25, 0.3, 0.5, 0.7, 1.0])
def test_high_entropy_threshold_equals_the_quantile(n, q):
    gen = torch.Generator().manual_seed(n)
    ent = torch.rand(2, n, generator=gen) * 4
    mask = torch.rand(2, n, generator=gen) > 0.3
    mask[0, 0] = True
    expected = torch.quantile(ent[mask], 1.0 - q, interpolation="higher")
    assert high_entropy_threshold(ent, mask, q) == float(expected)


def test_high_entropy_threshold_scales_past_torch_quantile():
    n = 20_000_000  # torch.quantile refuses more than 2^24 ≈ 16.8M elements
    ent = torch.rand(n, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(n, dtype=torch.bool)
    threshold = high_entropy_threshold(ent, mask, 0.2)
    rank = math.ceil(float(torch.tensor(0.8) * (n - 1)))  # 'higher': the value at this 0-based sorted index
    assert int((ent < threshold).sum()) <= rank < int((ent <= threshold).sum())
    assert threshold == pytest.approx(0.8, abs=1e-3)


def test_no_threshold_without_the_high_entropy_gate(monkeypatch: pytest.MonkeyPatch):
    def refuse(*args, **kwargs):
        raise AssertionError("threshold computed under clip_gate='all'")

    monkeypatch.setattr(losses_mod, "high_entropy_threshold", refuse)
    inp = make_inputs(LOG_R, [A], entropy=[[0.1, 2.0, 0.3, 4.0]])
    cfg = AlgorithmConfig(clip_gate="all")
    assert loss_normalizer(inp.mask, inp.entropy, cfg).entropy_threshold is None
    _, diag = compute_policy_loss(inp, cfg)
    assert "clip_frac_high_entropy" not in diag and "num_high_entropy_tokens" not in diag
    assert diag["entropy_mean"].value == pytest.approx((0.1 + 2.0 + 0.3 + 4.0) / 4)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_token_gradient_weights_are_the_gradient_of_the_loss_in_the_log_probs(name):
    inp = make_inputs(LOG_R, [A], entropy=[[0.1, 2.0, 0.3, 1.0]])
    _, grad, _ = loss_and_grad(inp, loss=name)
    cfg = AlgorithmConfig(clip_low=EPS_L, clip_high=EPS_H, loss=name)
    torch.testing.assert_close(token_gradient_weights(inp, cfg), grad)


def test_token_gradient_weights_zero_where_ppo_clips_and_not_where_aepo_keeps_the_gradient():
    inp = make_inputs(LOG_R, [A])
    ppo = token_gradient_weights(inp, AlgorithmConfig(clip_low=EPS_L, clip_high=EPS_H, loss="ppo_clip"))
    aepo = token_gradient_weights(inp, AlgorithmConfig(clip_low=EPS_L, clip_high=EPS_H, loss="aepo"))
    expected_ppo = torch.tensor([ppo_closed_form()[1]], dtype=torch.float64)
    torch.testing.assert_close(ppo, expected_ppo)
    assert float(ppo[0, 0]) == 0.0 and float(aepo[0, 0]) == pytest.approx(-(1 + EPS_H) * A[0] / 4)
    assert float(aepo[0, 2]) == 0.0  # the low side stays clipped under AEPO
    assert inp.logprobs.grad is None  # the caller's tensor is untouched


@pytest.mark.parametrize("loss", ["ppo_clip", "aepo", "dapo"])
def test_high_entropy_clipping_by_side_in_every_arm(loss: str):
    """Issue 53 §2: the tokens at or above 0.672 nats and the shares of them clipped, by side, whatever the loss and
    its gate. R = 1.5, 1.1, 0.5, 0.9 with Â = 2, 1, −1, −3 and ε = 0.2: token 0 is clipped high, token 2 low; the
    hot tokens are 0 and 2 (entropies 2.0 and 4.0)."""
    inp = make_inputs(LOG_R, [A], entropy=[[2.0, 0.1, 4.0, 0.3]])
    _, _, diag = loss_and_grad(inp, loss=loss)
    assert diag["high_entropy_share"].value == pytest.approx(0.5)
    assert diag["high_entropy_clip_frac_high"].value == pytest.approx(0.5)  # (dapo's ε_h 0.28: 1.5 > 1.28 too)
    assert diag["high_entropy_clip_frac_low"].value == pytest.approx(0.5)
    cold = make_inputs(LOG_R, [A], entropy=[[0.1, 0.1, 0.1, 0.1]])
    _, _, none = loss_and_grad(cold, loss=loss)
    assert none["high_entropy_share"].value == 0.0 and none["high_entropy_clip_frac_high"].value == 0.0
