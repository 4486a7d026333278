"""Token and segment entropy (AEPO.md §2)."""

from __future__ import annotations

import math

import pytest
import torch

from aepo_core.entropy import segment_entropy, token_entropy, topk_entropy_estimate


def test_uniform_and_one_hot():
    v = 1000
    assert float(token_entropy(torch.zeros(v))) == pytest.approx(math.log(v), rel=1e-6)
    one_hot = torch.full((v,), -1e9)
    one_hot[3] = 0.0
    assert float(token_entropy(one_hot)) == pytest.approx(0.0, abs=1e-6)


def test_matches_definition_and_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen, dtype=torch.float64) * 3
    for t in (0.6, 1.0, 1.7):
        p = torch.softmax(logits / t, dim=-1)
        expected = -(p * p.log()).sum(-1)
        torch.testing.assert_close(token_entropy(logits, t).double(), expected, rtol=1e-5, atol=1e-5)
    assert token_entropy(logits, 2.0).mean() > token_entropy(logits, 0.5).mean()
    with pytest.raises(ValueError):
        token_entropy(logits, 0.0)


def test_bf16_large_logits_do_not_overflow():
    logits = torch.tensor([[3.0e4, 2.99e4, -3.0e4, 0.0]], dtype=torch.bfloat16)
    h = token_entropy(logits)
    assert h.dtype == torch.float32 and torch.isfinite(h).all()
    ref = token_entropy(logits.float())
    torch.testing.assert_close(h, ref)


def test_chunking_does_not_change_the_result():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 11, 64, generator=gen)
    torch.testing.assert_close(token_entropy(logits, chunk_rows=5), token_entropy(logits, chunk_rows=10_000))


def test_segment_entropy_window():
    assert segment_entropy([1.0, 2.0, 3.0, 100.0], window=3) == pytest.approx(2.0)
    assert segment_entropy(torch.tensor([4.0, 2.0]), window=20) == pytest.approx(3.0)
    assert math.isnan(segment_entropy([], window=20))
    with pytest.raises(ValueError):
        segment_entropy([1.0], window=0)


def test_topk_estimate_exact_cases():
    v = 100
    # Uniform distribution: any top-k plus a uniform tail is exact.
    lp = [math.log(1 / v)] * 5
    assert topk_entropy_estimate(lp, v) == pytest.approx(math.log(v))
    # All mass in the top-k: the tail adds nothing.
    probs = [0.5, 0.25, 0.25]
    assert topk_entropy_estimate([math.log(p) for p in probs], v) == pytest.approx(-sum(p * math.log(p) for p in probs))


def test_topk_estimate_bounds_the_true_entropy():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(200, generator=gen, dtype=torch.float64) * 2
    logp = torch.log_softmax(logits, -1)
    true = float(-(logp.exp() * logp).sum())
    top = torch.topk(logp, 20).values.tolist()
    est = topk_entropy_estimate(top, 200)
    truncated = -sum(math.exp(x) * x for x in top)  # what the published code effectively used
    assert truncated < true <= est + 1e-9
    assert abs(est - true) < abs(truncated - true)
