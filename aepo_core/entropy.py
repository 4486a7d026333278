"""Token and segment entropy (AEPO.md §2).

Entropy is always over the full vocabulary of the temperature-scaled distribution that a token was sampled
from, computed in float32 (a bf16 softmax loses the tail mass and an exp of bf16 logits overflows).  Engines that
only expose top-k log-probs use :func:`topk_entropy_estimate`, which spreads the missing tail mass uniformly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

DEFAULT_CHUNK_ROWS = 1024


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """H = −Σ p·log p with p = softmax(logits / T), per position, in float32 (log p from log_softmax).

    ``logits`` has shape [..., V]; the result has shape [...].  Rows are processed in chunks so a long
    sequence over a 150k vocabulary never materializes a second full float32 copy.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        z = flat[start : start + chunk_rows].float() / temperature
        logp = torch.log_softmax(z, dim=-1)
        out[start : start + chunk_rows] = -(logp.exp() * logp).sum(-1)
    return out.reshape(lead)


def segment_entropy(entropies: Sequence[float] | torch.Tensor, window: int) -> float:
    """Mean entropy of the first ``window`` tokens of a segment (nats); NaN for an empty segment."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    values = entropies[:window]
    n = len(values)
    if n == 0:
        return math.nan
    if isinstance(values, torch.Tensor):
        return float(values.float().mean())
    return float(sum(values) / n)


def topk_entropy_estimate(topk_logprobs: Sequence[float], vocab_size: int) -> float:
    """Entropy from the top-k log-probs plus the tail mass 1 − Σp spread uniformly over the other V − k tokens.

    Exact when the tail is empty or truly uniform; otherwise an upper bound on the tail's contribution, which
    is the safe side for an uncertainty signal.  Callers must record that the value is an estimate.
    """
    k = len(topk_logprobs)
    if k == 0:
        return math.log(vocab_size)
    if vocab_size < k:
        raise ValueError(f"vocab_size ({vocab_size}) smaller than the number of top-k entries ({k})")
    head = 0.0
    mass = 0.0
    for lp in topk_logprobs:
        p = math.exp(lp)
        mass += p
        if p > 0.0:
            head -= p * lp
    tail = 1.0 - mass
    rest = vocab_size - k
    if tail <= 0.0 or rest == 0:
        return head
    return head - tail * math.log(tail / rest)



PUBLISHED_TOP_K = 10
"""Log-probs per position that the published AEPO/ARPO code asks vLLM for (``logprobs=10``)."""


def published_token_entropy(top_logprobs: Sequence[float], sampled_logprob: float, vocab_size: int,
                            k: int = PUBLISHED_TOP_K) -> float:
    """The published code's per-position entropy term: −Σ p·log p over the ``k`` largest log-probs at the position
    plus the sampled token's when it is not among them (vLLM returns both: ``k`` or ``k + 1`` entries), ÷ ln|V|.
    A truncation, not the entropy: the tail is dropped (AEPO.md §9)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    top = sorted(top_logprobs, reverse=True)[:k]
    if not top or sampled_logprob < top[-1]:
        top.append(sampled_logprob)
    return -sum(math.exp(lp) * lp for lp in top) / math.log(vocab_size)


def published_segment_entropy(token_terms: Sequence[float], window: int) -> float:
    """Segment entropy on the published code's scale (``rollout.entropy_scale: official``): the sum, not the mean,
    of the first ``window`` per-position terms (:func:`published_token_entropy`); 0 for an empty segment, as
    there.  At W = 20 it is ≈ 1.68× the mean-nats scale for Qwen's vocabulary, so β and γ act on another scale."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return float(sum(token_terms[:window]))
