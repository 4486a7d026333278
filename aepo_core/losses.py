"""Policy losses (a registry, like verl's ``core_algos``), aggregation modes and KL estimators (AEPO.md §6).

Each registered loss maps per-token log-probs, advantages and a mask to a per-token loss (what is minimized)
plus which tokens were clipped on each side.  :func:`compute_policy_loss` adds the optional KL term,
aggregates, and returns the scalar with its diagnostics: each a :class:`Diagnostic` that declares how it
combines over micro-batches (:func:`combine_diagnostics`), so a new diagnostic cannot be silently averaged.

Conventions: r = exp(logπ_θ − logπ_old) per token; Â already includes the entropy-aware scaling when that is
on; tool-result and padding tokens have mask 0 and get exactly zero gradient.  For micro-batching, pass a
:class:`LossNormalizer` built over the whole mini-batch: the sum of micro-batch losses then equals the
mini-batch loss, whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch

from aepo_core.config import AlgorithmConfig
from aepo_core.token_classes import HIGH_ENTROPY_NATS


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor  # [B, T] current policy, carries the gradient
    old_logprobs: torch.Tensor  # [B, T] behaviour policy
    advantages: torch.Tensor  # [B, T] per token
    mask: torch.Tensor  # [B, T] 1 on model tokens
    entropy: torch.Tensor | None = None  # [B, T] token entropy (detached): algorithm.entropy_source, current by default
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference policy (only when kl_coef > 0)


@dataclass(frozen=True)
class LossNormalizer:
    """Mini-batch constants, so that micro-batch losses add up to the mini-batch loss."""

    num_tokens: float
    num_seqs: float
    entropy_threshold: float | None = None


@dataclass(frozen=True)
class TokenLoss:
    per_token: torch.Tensor  # [B, T]
    clipped_high: torch.Tensor  # [B, T] bool: the upper bound was active
    clipped_low: torch.Tensor  # [B, T] bool: the lower bound was active
    ratio: torch.Tensor  # [B, T] the ratio that was clipped (per token, or the sequence ratio for GSPO)


PolicyLossFn = Callable[[LossInputs, AlgorithmConfig, torch.Tensor], TokenLoss]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def _ratio(inp: LossInputs) -> torch.Tensor:
    """r = exp(logπ_θ − logπ_old) on model tokens, exactly 1 on masked ones (whose log-ratio may be anything: a
    tool or padding token's e^±120 would be 0 or inf in float32, and inf·0 a NaN loss)."""
    log_ratio = inp.logprobs - inp.old_logprobs.detach()
    return torch.exp(torch.where(inp.mask.bool(), log_ratio, torch.zeros_like(log_ratio)))


def _unit(inp: LossInputs) -> torch.Tensor:
    """exp(logπ − sg(logπ)): value exactly 1, gradient ∇logπ.  It is the r/sg(r) of the stop-gradient bounds
    without its 0/0 (a NaN gradient) where r underflows."""
    return torch.exp(inp.logprobs - inp.logprobs.detach())


def _regions(r: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where PPO's clip is active: (Â > 0, r > 1+ε_h) and (Â < 0, r < 1−ε_l)."""
    with torch.no_grad():
        return (adv > 0) & (r > 1 + eps_high), (adv < 0) & (r < 1 - eps_low)


def _dual_clip(per_token: torch.Tensor, adv: torch.Tensor, c: float | None) -> torch.Tensor:
    """Dual-clip: for Â < 0, L = min(L_clip, −c·Â) = min(L_clip, c·|Â|), so a huge ratio cannot blow up the update
    (value c·|Â| and gradient 0 where r > c); Â ≥ 0 is untouched; ``c=None``: off.

    ``algorithm.dual_clip`` defaults to c = 3 (verl's ``clip_ratio_c``, on in the published AEPO scripts) for the
    PPO family: ppo_clip, dapo, aepo, gppo, ce_gppo.  CISPO's IS weight is already capped and GSPO's sequence
    ratios stay near 1, so they do not apply it (neither do their references).
    """
    if c is None:
        return per_token
    return torch.where(adv < 0, torch.minimum(per_token, -c * adv), per_token)


def _ppo_clip(inp: LossInputs, eps_low: float, eps_high: float, dual_clip: float | None) -> TokenLoss:
    r = _ratio(inp)
    adv = inp.advantages
    per_token = -torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    high, low = _regions(r, adv, eps_low, eps_high)
    return TokenLoss(_dual_clip(per_token, adv, dual_clip), high, low, r.detach())


@register_policy_loss("ppo_clip")
def ppo_clip_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """PPO-clip / GRPO: −min(r·Â, clip(r, 1−ε_l, 1+ε_h)·Â); clipped tokens get no gradient."""
    return _ppo_clip(inp, cfg.clip_low, cfg.clip_high, cfg.dual_clip)


@register_policy_loss("dapo")
def dapo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """DAPO: PPO-clip with a decoupled, higher upper bound ε_h = ``dapo_clip_high`` (clip-higher).

    Its other parts live elsewhere: token-mean aggregation (``loss_agg``), dynamic sampling and the soft
    overlong penalty (``advantages.informative_groups`` / ``soft_overlong_penalty``).
    """
    return _ppo_clip(inp, cfg.clip_low, cfg.dapo_clip_high, cfg.dual_clip)


@register_policy_loss("aepo")
def aepo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """AEPO entropy clipping-balanced loss: the upper clip bound becomes (1+ε_h)·r/sg(r) = (1+ε_h)·exp(logπ − sg(logπ)).

    The forward value equals PPO-clip; for Â > 0 and r > 1+ε_h the gradient is (1+ε_h)·Â·∇logπ instead of 0,
    so clipped (often high-entropy, exploratory) tokens keep a bounded learning signal.  The lower side is
    unchanged (Â < 0, r < 1−ε_l still gets 0).  ``clip_gate='high_entropy'`` keeps the preserved gradient
    only for tokens in the mini-batch's top entropy quantile.  Dual-clip c for Â < 0 (default 3): min(L, −c·Â).
    """
    r = _ratio(inp)
    adv = inp.advantages
    eps_low, eps_high = cfg.clip_low, cfg.clip_high
    upper_const = torch.full_like(r, 1 + eps_high)
    upper_sg = (1 + eps_high) * _unit(inp)
    upper = upper_sg if cfg.clip_gate == "all" else torch.where(high_entropy, upper_sg, upper_const)
    clipped = torch.where(r > 1 + eps_high, upper, torch.where(r < 1 - eps_low, 1 - eps_low, r))
    per_token = -torch.minimum(r * adv, clipped * adv)
    high, low = _regions(r, adv, eps_low, eps_high)
    return TokenLoss(_dual_clip(per_token, adv, cfg.dual_clip), high, low, r.detach())


def _gradient_preserving(inp: LossInputs, cfg: AlgorithmConfig, beta_low: float, beta_high: float) -> TokenLoss:
    r = _ratio(inp)
    adv = inp.advantages
    high, low = _regions(r, adv, cfg.clip_low, cfg.clip_high)
    unit = _unit(inp)
    coef = torch.where(
        high, beta_high * (1 + cfg.clip_high) * unit, torch.where(low, beta_low * (1 - cfg.clip_low) * unit, r)
    )
    return TokenLoss(_dual_clip(-coef * adv, adv, cfg.dual_clip), high, low, r.detach())


@register_policy_loss("gppo")
def gppo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """GPPO: stop-gradient bounds on both sides, clip(r, (1−ε_l)·r/sg(r), (1+ε_h)·r/sg(r)); r/sg(r) is computed as
    exp(logπ − sg(logπ)).  Dual-clip c for Â < 0 (default 3): min(L, −c·Â)."""
    return _gradient_preserving(inp, cfg, 1.0, 1.0)


@register_policy_loss("ce_gppo")
def ce_gppo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """CE-GPPO: GPPO with the clipped regions weighted by β₁ (low side) and β₂ (high side)."""
    return _gradient_preserving(inp, cfg, cfg.gppo_beta_low, cfg.gppo_beta_high)


@register_policy_loss("cispo")
def cispo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """CISPO (MiniMax-M1): −sg(min(r, 1+ε_high^IS))·Â·logπ_θ, ε_high^IS = ``cispo_eps_high``.

    Every token keeps a gradient, −w·Â·∇logπ; only its IS weight w is truncated, from above only (MiniMax-M1
    sets ε_low^IS large enough never to act, so ``clip_low`` plays no part).  No dual-clip.
    """
    r = _ratio(inp)
    weight = torch.clamp(r, max=1 + cfg.cispo_eps_high).detach()
    per_token = -weight * inp.advantages * inp.logprobs
    with torch.no_grad():
        high = r > 1 + cfg.cispo_eps_high
    return TokenLoss(per_token, high, torch.zeros_like(high), r.detach())


@register_policy_loss("gspo")
def gspo_loss(inp: LossInputs, cfg: AlgorithmConfig, high_entropy: torch.Tensor) -> TokenLoss:
    """GSPO: one ratio per sequence, s = exp(mean_t(logπ_θ − logπ_old)), clipped per sequence.

    Written in the GSPO-token form s_t = sg(s)·π_θ(y_t)/sg(π_θ(y_t)): its value is s on every token and, with
    a constant advantage per sequence and seq-mean-token-mean aggregation, its gradient is exactly GSPO's
    (∇s = s·mean_t ∇logπ_t).  Both hold by construction: the config forces that aggregation, and the update
    applies the entropy-aware advantage per sequence for the losses in :data:`SEQUENCE_LEVEL_LOSSES`.  Clip
    ranges are ``gspo_clip_low/high`` (sequence ratios are close to 1).  No dual-clip.
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    log_ratio = (inp.logprobs - inp.old_logprobs.detach()) * mask
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    s_t = torch.exp(seq_log_ratio.detach()[:, None] + inp.logprobs - inp.logprobs.detach())
    adv = inp.advantages
    eps_low, eps_high = cfg.gspo_clip_low, cfg.gspo_clip_high
    per_token = -torch.minimum(s_t * adv, torch.clamp(s_t, 1 - eps_low, 1 + eps_high) * adv)
    high, low = _regions(s_t, adv, eps_low, eps_high)
    return TokenLoss(per_token, high, low, s_t.detach())


SEQUENCE_LEVEL_LOSSES: frozenset[str] = frozenset({"gspo"})
"""Losses whose advantage must be one per sequence (the entropy-aware scaling is then per sequence too)."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimators (Schulman): k1 = log r, k2 = ½(log r)², k3 = e^{−log r} + log r − 1."""
    log_r = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        neg = (-log_r).clamp(-clamp, clamp)
        return torch.exp(neg) - neg - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean``: Σ_tokens L / N_tokens — every token weighs the same (DAPO's choice; long answers count more).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean — every sequence weighs the same.
    - ``seq-mean-token-sum-norm``: Σ_t L per sequence divided by a constant ``norm_len``, mean over sequences
      (Dr.GRPO; no length bias in either direction).

    ``num_tokens`` / ``num_seqs`` default to this batch's counts; pass the mini-batch's for micro-batching.
    """
    m = mask.to(per_token.dtype)
    masked = per_token * m
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else m.sum().clamp(min=1)
        return masked.sum() / denom
    seq_len = m.sum(-1)
    seqs = num_seqs if num_seqs is not None else (seq_len > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / seq_len.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            raise ValueError("seq-mean-token-sum-norm needs norm_len (algorithm.loss_norm_len)")
        return (masked.sum(-1) / norm_len).sum() / seqs
    raise ValueError(f"unknown loss aggregation {mode!r}")


def high_entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> float:
    """Entropy value at or above which a model token is in the top ``quantile`` fraction of the batch.

    The n model-token entropies' order statistic of 0-based rank ⌈(1−q)·(n−1)⌉ (the rank computed in float32):
    exactly ``torch.quantile(values, 1−q, interpolation='higher')``, by ``torch.kthvalue`` (a selection, O(n)),
    since torch.quantile refuses inputs of more than 2^24 ≈ 16.8M elements.
    """
    values = entropy.detach().float()[mask.bool()]
    if values.numel() == 0:
        return float("inf")
    rank = int(torch.ceil(torch.tensor(1.0 - quantile, dtype=torch.float32) * (values.numel() - 1)))
    return float(torch.kthvalue(values, rank + 1).values)


def loss_normalizer(mask: torch.Tensor, entropy: torch.Tensor | None, cfg: AlgorithmConfig) -> LossNormalizer:
    """The mini-batch constants for :func:`compute_policy_loss` over its micro-batches; the high-entropy threshold
    only under ``clip_gate='high_entropy'`` (the only thing that reads it, besides its diagnostics)."""
    m = mask.bool()
    threshold = (high_entropy_threshold(entropy, mask, cfg.high_entropy_quantile)
                 if entropy is not None and cfg.clip_gate == "high_entropy" else None)
    return LossNormalizer(float(m.sum()), float((m.sum(-1) > 0).sum()), threshold)


def compute_policy_loss(
    inp: LossInputs,
    cfg: AlgorithmConfig,
    norm: LossNormalizer | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, Diagnostic]]:
    """The configured loss, aggregated, with the KL term when ``kl_coef`` > 0, and its diagnostics."""
    try:
        loss_fn = POLICY_LOSSES[cfg.loss]
    except KeyError:
        raise ValueError(f"unknown policy loss {cfg.loss!r}; known: {sorted(POLICY_LOSSES)}") from None
    norm = norm if norm is not None else loss_normalizer(inp.mask, inp.entropy, cfg)
    mask = inp.mask.bool()
    high_entropy = None  # the top-quantile tokens, known only under clip_gate='high_entropy'
    if cfg.clip_gate == "high_entropy" and inp.entropy is not None:
        if norm.entropy_threshold is None:
            raise ValueError("clip_gate='high_entropy' needs LossNormalizer.entropy_threshold (loss_normalizer)")
        high_entropy = (inp.entropy.detach() >= norm.entropy_threshold) & mask
    elif cfg.clip_gate == "high_entropy" and cfg.loss == "aepo":
        raise ValueError("clip_gate='high_entropy' needs token entropies in LossInputs.entropy")

    out = loss_fn(inp, cfg, high_entropy if high_entropy is not None else torch.zeros_like(mask))
    per_token = out.per_token
    kl = None
    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(inp.logprobs, inp.ref_logprobs, cfg.kl_estimator, cfg.kl_clamp)
        per_token = per_token + cfg.kl_coef * kl
    norm_len = cfg.loss_norm_len or norm_len
    loss = aggregate(
        per_token, inp.mask, cfg.loss_agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs, norm_len=norm_len
    )
    return loss, _diagnostics(inp, out, mask, high_entropy, kl, cfg)


def token_gradient_weights(
    inp: LossInputs,
    cfg: AlgorithmConfig,
    norm: LossNormalizer | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """w_t = ∂L/∂logπ_θ(y_t) per token [B, T], for :func:`compute_policy_loss` on ``inp`` (detached here).

    The loss reaches the weights only through the sampled tokens' log-probs, so ∇_θ L = Σ_t w_t·∇_θ logπ_θ(y_t):
    w_t is the weight a rule gives each token's gradient.  w_t = 0 where the rule drops the token (PPO's clip region
    in the advantage's direction, the dual-clip cap, a zero mask); unclipped, w_t = −r_t·Â_t / N under token-mean.
    Computed on a copy of the log-probs, so it costs no pass through the model.
    """
    logprobs = inp.logprobs.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss, _ = compute_policy_loss(replace(inp, logprobs=logprobs), cfg, norm, norm_len)
        (weights,) = torch.autograd.grad(loss, logprobs, allow_unused=True)
    return weights if weights is not None else torch.zeros_like(logprobs)


Reduce = Literal["sum", "max", "min", "mean"]


@dataclass(frozen=True)
class Diagnostic:
    """One micro-batch's value of a diagnostic and how it combines with the other micro-batches' values.

    ``reduce``: ``sum`` (counts), ``max`` / ``min`` (extremes) or ``mean``: a weighted mean whose ``weight`` is the
    number of tokens the value is a mean over (model tokens, or another count such as high-entropy tokens).
    """

    value: float
    reduce: Reduce
    weight: float = 0.0

    def __post_init__(self) -> None:
        if self.reduce not in get_args(Reduce):
            raise ValueError(f"unknown diagnostic reduction {self.reduce!r}; known: {get_args(Reduce)}")


@dataclass(frozen=True)
class Combined:
    """A diagnostic folded over some micro-batches: the running total and, for a mean, the running weight."""

    reduce: Reduce
    total: float
    weight: float = 0.0


DiagnosticFold = Callable[[Combined | None, Diagnostic], Combined]


def _fold_sum(acc: Combined | None, d: Diagnostic) -> Combined:
    """Σ_micro value."""
    return Combined("sum", (acc.total if acc is not None else 0.0) + d.value)


def _fold_max(acc: Combined | None, d: Diagnostic) -> Combined:
    """max_micro value."""
    return Combined("max", max(acc.total if acc is not None else d.value, d.value))


def _fold_min(acc: Combined | None, d: Diagnostic) -> Combined:
    """min_micro value."""
    return Combined("min", min(acc.total if acc is not None else d.value, d.value))


def _fold_mean(acc: Combined | None, d: Diagnostic) -> Combined:
    """Σ_micro value·weight, and Σ_micro weight to divide by at the end (:func:`combined_value`)."""
    total, weight = (acc.total, acc.weight) if acc is not None else (0.0, 0.0)
    return Combined("mean", total + d.value * d.weight, weight + d.weight)


DIAGNOSTIC_FOLDS: dict[Reduce, DiagnosticFold] = {"sum": _fold_sum, "max": _fold_max, "min": _fold_min,
                                                  "mean": _fold_mean}


def combined_value(acc: Combined) -> float:
    """The folded total; for a mean Σ value·weight / Σ weight, 0 when no micro-batch had any weight."""
    if acc.reduce != "mean":
        return acc.total
    return acc.total / acc.weight if acc.weight else 0.0


def combine_diagnostics(parts: Iterable[Mapping[str, Diagnostic]]) -> dict[str, float]:
    """Each diagnostic folded over the micro-batches in order, by the reduction it declares, in first-seen order.

    A diagnostic that declares different reductions in different micro-batches is an error.
    """
    acc: dict[str, Combined] = {}
    for part in parts:
        for name, d in part.items():
            prev = acc.get(name)
            if prev is not None and prev.reduce != d.reduce:
                raise ValueError(f"diagnostic {name!r} declared both {prev.reduce!r} and {d.reduce!r}")
            acc[name] = DIAGNOSTIC_FOLDS[d.reduce](prev, d)
    return {name: combined_value(a) for name, a in acc.items()}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> Diagnostic:
    """Mean of ``x`` over ``mask`` (0 when empty), weighted by the number of masked tokens when combined."""
    n = int(mask.sum())
    return Diagnostic(float(x.float()[mask].sum() / n) if n else 0.0, "mean", float(mask.sum()))


def spread_diagnostics(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, Diagnostic]:
    """``<name>_mean`` (token-weighted), ``<name>_min`` and ``<name>_max`` of ``values`` over ``mask``: how far a
    per-token weight (the entropy-aware advantage's factor) spread over the update's tokens."""
    m = mask.bool()
    picked = values.detach().float()[m]
    if picked.numel() == 0:
        return {}
    return {f"{name}_mean": _masked_mean(values.detach(), m), f"{name}_min": Diagnostic(float(picked.min()), "min"),
            f"{name}_max": Diagnostic(float(picked.max()), "max")}


def _count(mask: torch.Tensor) -> Diagnostic:
    """The number of tokens in ``mask``, summed when combined."""
    return Diagnostic(float(mask.sum()), "sum")


@torch.no_grad()
def _diagnostics(
    inp: LossInputs,
    out: TokenLoss,
    mask: torch.Tensor,
    high_entropy: torch.Tensor | None,
    kl: torch.Tensor | None,
    cfg: AlgorithmConfig,
) -> dict[str, Diagnostic]:
    clipped = out.clipped_high | out.clipped_low
    log_r = (inp.logprobs.detach() - inp.old_logprobs.detach()).float()
    ratio = out.ratio.float()[mask]  # its statistics are 1 when there are no model tokens
    some = ratio.numel() > 0
    num_tokens = _count(mask)
    diag = {
        "clip_frac": _masked_mean(clipped, mask),
        "clip_frac_high": _masked_mean(out.clipped_high, mask),
        "clip_frac_low": _masked_mean(out.clipped_low, mask),
        "approx_kl": _masked_mean(torch.exp(-log_r) + log_r - 1, mask),  # k3 of π_θ vs π_old
        "ratio_mean": Diagnostic(float(ratio.mean()) if some else 1.0, "mean", num_tokens.value),
        "ratio_max": Diagnostic(float(ratio.max()) if some else 1.0, "max"),
        "ratio_min": Diagnostic(float(ratio.min()) if some else 1.0, "min"),
        "num_tokens": num_tokens,
    }
    if high_entropy is not None:  # only under clip_gate='high_entropy'
        diag["clip_frac_high_entropy"] = _masked_mean(clipped, high_entropy)  # weighted by the high-entropy count
        diag["num_high_entropy_tokens"] = _count(high_entropy)
    if inp.entropy is not None:
        diag["entropy_mean"] = _masked_mean(inp.entropy, mask)
        # How much a clipping rule had to act on, in every arm and on one absolute scale (issue 53 §2): the update's
        # tokens at or above HIGH_ENTROPY_NATS and the shares of them whose ratio was clipped, by side (the
        # clip_gate's own threshold is a quantile of each mini-batch, so it always finds its top fraction).
        hot = (inp.entropy.detach() >= HIGH_ENTROPY_NATS) & mask
        diag["high_entropy_share"] = _masked_mean(hot, mask)
        diag["high_entropy_clip_frac_high"] = _masked_mean(out.clipped_high, hot)
        diag["high_entropy_clip_frac_low"] = _masked_mean(out.clipped_low, hot)
    if kl is not None:
        diag["kl_ref"] = _masked_mean(kl.detach(), mask)
    return diag
