"""Token and segment entropy (AEPO.md §2)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from aepo_core.entropy import (
    published_segment_entropy,
    published_token_entropy,
    segment_entropy,
    token_entropy,
    topk_entropy_estimate,
)
from aepo_core.rollout.budget import official_global_budget, official_tool_entropy


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


def _published_step_entropy(logprob_dicts: list[dict[int, float]], vocab_size: int) -> float:
    """The published code's step entropy, as it computes it: the values of the first ≤ 20 positions' log-prob
    dicts (vLLM's top-10 plus the sampled token when outside them) flattened, −Σ p·l, ÷ ln(vocab size)."""
    flat = [lp for d in logprob_dicts[:20] for lp in d.values()]
    return -sum(math.exp(lp) * lp for lp in flat) / math.log(vocab_size) if flat else 0.0


def _published_initial_rollouts(h_root: float, step_entropies: list[float], n: int) -> int:
    """The published code's m: int(n·σ(0.5·(H_root − mean step entropy))) + 1, within [1, n]."""
    avg = sum(step_entropies) / len(step_entropies) if step_entropies else h_root
    return max(1, min(int(n * (1 / (1 + math.exp(-0.5 * (h_root - avg))))) + 1, n))


def _recorded_positions(rng: random.Random, n: int) -> tuple[list[dict[int, float]], list[float]]:
    """Positions as vLLM reports them with logprobs=10: a dict of the top-10 ids → log-prob, plus the sampled token
    when it is outside them (11 entries), and the sampled token's log-prob."""
    dicts, sampled = [], []
    for _ in range(n):
        logits = [rng.gauss(0, rng.choice([0.5, 2.0, 5.0])) for _ in range(64)]
        lse = math.log(sum(math.exp(v) for v in logits))  # a 64-token support of the vocabulary
        logp = sorted(((v - lse, i) for i, v in enumerate(logits)), reverse=True)
        pick = rng.randrange(len(logp)) if rng.random() < 0.3 else rng.randrange(3)
        d = {i: lp for lp, i in logp[:10]}
        d[logp[pick][1]] = logp[pick][0]
        dicts.append(d)
        sampled.append(logp[pick][0])
    return dicts, sampled


@pytest.mark.parametrize("vocab", [49152, 151665])
def test_published_budget_matches_the_published_function_on_recorded_positions(vocab: int) -> None:
    """budget_rule official with entropy_scale official gives the published code's step entropies and m (issue 49
    §3), over 200 probes of a root sample and 0–3 post-tool steps of 5–60 tokens."""
    rng = random.Random(7)
    for _ in range(200):
        steps = [_recorded_positions(rng, rng.randint(5, 60)) for _ in range(rng.randint(1, 4))]
        root = _recorded_positions(rng, rng.randint(5, 50))
        ours = [published_segment_entropy([published_token_entropy(list(d.values()), s, vocab) for d, s in
                                           zip(ds, ss, strict=True)], 20) for ds, ss in [root, *steps]]
        theirs = [_published_step_entropy(ds, vocab) for ds, _ in [root, *steps]]
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
        k = rng.choice([8, 12, 16])
        m_ours = official_global_budget(k, ours[0], official_tool_entropy(ours[1], ours[2:]), beta=0.5)
        assert m_ours == _published_initial_rollouts(theirs[0], theirs[1:], k)
