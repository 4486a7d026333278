"""The policy update of one RL step: scoring pass, PPO mini-batches, token-budget micro-batches, one loss.

1. A no-grad *scoring pass* over all samples with the pre-update policy gives, per response token, the
   trainer's log-prob (π_old of the ratio, and the rollout-vs-trainer gap) and its entropy (detached). It is
   skipped when it cannot change the update (``optim.scoring_pass: auto``): when the sampler is the trainer
   itself (same weights, float32 compute, unfiltered sampling) its log-probs are π_old and its entropies the
   trainer's; on-policy (one epoch over one mini-batch) π_old is the gradient pass's own detached log-prob.
   Under bf16 autocast the sampler's KV-cached decode and the trainer's full forward round differently (gap up to
   2.3e-2 nats on a tiny Llama, 4.3e-6 in float32), so the pass runs and the gap is logged.
2. For each PPO epoch and mini-batch (whole question groups): the entropy statistics and the high-entropy
   threshold are taken over the mini-batch's model tokens, so the entropy-aware advantage and the clip gate do
   not depend on how the mini-batch is split; micro-batches are length-sorted buckets under a token budget, and
   their losses use mini-batch normalizers so gradient accumulation gives the same update for any split.
   ``algorithm.entropy_source: current`` (AEPO.md §5) gives each micro-batch the entropies of its own gradient
   forward (detached) and, once the step has taken an optimizer step, the statistics of a no-grad forward of the
   mini-batch at the same weights; ``old`` reads the scoring pass's (π_old's) throughout.
3. Grad clipping, optimizer and LR-schedule step through the backend (torch or DeepSpeed).

Under data-parallel ranks (``backend.ranks``) every rank gets the same global samples: the scoring pass is split
by sample and all-gathered; each mini-batch's question groups are split across ranks, while its normalisers and
entropy statistics are those of the global mini-batch, so the ranks' summed gradients are the one-process
gradient. Every rank runs as many micro-batches as the busiest one (zero-weight fillers), because DeepSpeed's
forwards and backwards are collectives.

The in-process engine holds the same model object, so it samples from the new weights without a copy.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from aepo_core.advantages import EntropyStats, entropy_aware_advantage, entropy_stats
from aepo_core.config import ExperimentConfig
from aepo_core.correction import resolved_correction, rollout_is_weights
from aepo_core.losses import (
    SEQUENCE_LEVEL_LOSSES,
    Diagnostic,
    LossInputs,
    LossNormalizer,
    combine_diagnostics,
    compute_policy_loss,
    loss_normalizer,
    spread_diagnostics,
)
from infra.numerics import Numerics
from infra.training.backend import TrainBackend
from infra.training.batching import (
    PaddedBatch,
    TrainSample,
    collate,
    plan_micro_batches,
    plan_tree_micro_batches,
    split_mini_batches,
)
from infra.training.logprobs import response_logprobs_and_entropy
from infra.training.memory import checkpoint_decoder_layers, micro_batch_token_cap, release_memory

log = logging.getLogger(__name__)


class MicroBatchObserver(Protocol):
    """Sees each micro-batch's loss inputs as the update computes its loss (the update-rule comparison records every
    token's gradient weight from them: :func:`aepo_core.losses.token_gradient_weights`)."""

    def micro_batch(self, samples: Sequence[int], inputs: LossInputs, norm: LossNormalizer, norm_len: int) -> None:
        """``samples``: the update's sample indices of the batch's rows, in row order (fillers are not shown)."""
        ...


def sampler_is_trainer(cfg: ExperimentConfig, generation_dtype: str, compute_dtype: torch.dtype | None,
                       sampler_dtype: str = "generation") -> bool:
    """Whether rollouts are sampled from the trainer's own weights at the trainer's precision: the in-process engine
    on the training model itself (``model.generation_dtype: same``) under the torch backend, computing in float32
    (``compute_dtype`` None: no autocast). Anything else — a low-precision copy, a remote server, DeepSpeed's own
    bf16 path, bf16 autocast (whose KV-cached decode rounds otherwise than the trainer's full forward) — samples
    from a numerically different policy, so its entropies and log-probs cannot stand in for the trainer's.
    ``generation_dtype`` is the resolved ``model.generation_dtype`` (an unresolved ``auto`` counts as a copy: the
    scoring pass runs), ``sampler_dtype`` the resolved ``model.sampler_dtype`` (int8: a copy). Under
    ``train.max_staleness`` > 0 the sampler holds older weights than the trainer's: never the trainer."""
    return (cfg.rollout.engine == "hf" and generation_dtype == "same" and sampler_dtype == "generation"
            and cfg.train.backend == "torch" and compute_dtype is None and cfg.train.max_staleness == 0)


@dataclass
class _Scored:
    logprobs: list[torch.Tensor]  # per sample, [response_len]
    entropy: list[torch.Tensor]
    ref_logprobs: list[torch.Tensor] | None


class PolicyUpdater:
    def __init__(self, backend: TrainBackend, cfg: ExperimentConfig, pad_id: int,
                 ref_backend: TrainBackend | None = None, numerics: Numerics | None = None,
                 observer: MicroBatchObserver | None = None) -> None:
        """``numerics``: the run's resolved numerics (which engine sampled the rollouts, and the rollout correction
        that calls for; None: the config's own, an unresolved ``auto`` generation dtype counting as a copy);
        ``observer``:
        shown every micro-batch's loss inputs."""
        if cfg.algorithm.kl_coef > 0 and ref_backend is None:
            raise ValueError("algorithm.kl_coef > 0 needs a reference model")
        self.backend = backend
        self.ref_backend = ref_backend
        self.cfg = cfg
        self.generation_dtype = numerics.generation_dtype if numerics else cfg.model.generation_dtype
        self.sampler_dtype = numerics.sampler_dtype if numerics else cfg.model.sampler_dtype
        self.correction = resolved_correction(cfg.algorithm.rollout_correction, self.sampler_dtype,
                                              cfg.train.max_staleness)
        self.pad_id = pad_id
        self.device = backend.device
        self.micro_batch_tokens = micro_batch_token_cap(cfg.optim, backend.module, backend.device)
        checkpoint_decoder_layers(backend.module, cfg.optim.activation_checkpointing)
        self.ranks = backend.ranks
        self.observer = observer

    # ------------------------------------------------------------------
    def _micro_batches(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> list[list[int]]:
        if self.cfg.optim.share_prefix == "tree":
            plan = plan_tree_micro_batches([samples[i].input_ids for i in indices], self.micro_batch_tokens)
        else:
            plan = plan_micro_batches([len(samples[i].input_ids) for i in indices], self.micro_batch_tokens)
        return [[indices[j] for j in mb] for mb in plan]

    def _lockstep(self, samples: Sequence[TrainSample], share: Sequence[Sequence[int]]) -> list[list[int] | None]:
        """This rank's micro-batches of ``share[rank]``, padded with None to the most any rank has.

        Every rank knows every share (the samples are global), so the count needs no collective. The padding is
        there because the ranks' forwards and backwards are collectives under DeepSpeed (ZeRO-3 gathers each
        module's partitions in its forward; ZeRO-2 reduces full gradient buckets inside the backward): a rank
        with fewer micro-batches runs a zero-weight one per missing one (see :meth:`_filler`).
        """
        mine = self._micro_batches(samples, share[self.ranks.rank])
        most = max(len(self._micro_batches(samples, s)) for s in share) if self.ranks.distributed else len(mine)
        return [*mine, *([None] * (most - len(mine)))]

    def _group_share(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> list[list[int]]:
        """Per rank, its contiguous share of the question groups of ``indices`` (whole groups, in order)."""
        groups = sorted({samples[i].group for i in indices})
        return [[i for i in indices if samples[i].group in set(self.ranks.shard(groups, r))]
                for r in range(self.ranks.world_size)]

    @torch.no_grad()
    def score(self, samples: Sequence[TrainSample], policy: bool = True, reference: bool = True) -> _Scored:
        """The no-grad pass with the policy (when ``policy``) and the reference policy (when KL is on and
        ``reference``)."""
        temp = self.cfg.rollout.temperature
        n = len(samples)
        logprobs: list[torch.Tensor] = [torch.empty(0)] * n
        entropy: list[torch.Tensor] = [torch.empty(0)] * n
        ref_backend = self.ref_backend if reference else None
        ref: list[torch.Tensor] | None = [torch.empty(0)] * n if ref_backend is not None else None
        self.backend.module.eval()
        share = [self.ranks.shard(range(n), r) for r in range(self.ranks.world_size)]
        for planned in self._lockstep(samples, share):
            mb = planned if planned is not None else [0]  # a filler forward: computed, then dropped
            batch = collate([samples[i] for i in mb], self.pad_id, self.device)
            lp = ent = ref_lp = None
            if policy:
                lp, ent = response_logprobs_and_entropy(self.backend, batch, temp, with_grad=False)
            if ref_backend is not None:
                ref_lp, _ = response_logprobs_and_entropy(ref_backend, batch, temp, with_grad=False,
                                                          with_entropy=False)
            for row, i in enumerate(planned or []):
                r = samples[i].response_len
                if lp is not None and ent is not None:
                    logprobs[i] = lp[row, :r].cpu()
                    entropy[i] = ent[row, :r].cpu()
                if ref is not None and ref_lp is not None:
                    ref[i] = ref_lp[row, :r].cpu()
        if self.ranks.distributed:  # each rank scored its share: every rank gets all of them
            mine = share[self.ranks.rank]
            parts = self.ranks.all_gather([(logprobs[i], entropy[i], ref[i] if ref is not None else None)
                                           for i in mine])
            for indices, part in zip(share, parts, strict=True):
                for i, (lp_i, ent_i, ref_i) in zip(indices, part, strict=True):
                    logprobs[i], entropy[i] = lp_i, ent_i
                    if ref is not None:
                        ref[i] = ref_i
        return _Scored(logprobs, entropy, ref)

    def needs_scoring_pass(self, samples: Sequence[TrainSample]) -> bool:
        """False when the pre-update forward could not change the update (see ``optim.scoring_pass``): the sampler
        is the trainer itself, unfiltered, so its log-probs are π_old (for every mini-batch and epoch: π_old is the
        pre-update policy, which is what sampled) and its entropies the trainer's, exactly (float32 compute; under
        bf16 autocast the gap reaches 2.3e-2 nats, and the pass runs). Measured on an AVX2 CPU
        in float32: 29–35 s of a 4.3-minute demo step. ``never``: False whatever the sampler, by the user's choice
        (π_old and the entropies are the sampler's)."""
        cfg = self.cfg
        if cfg.optim.scoring_pass == "always":
            return True
        if cfg.optim.scoring_pass == "never":  # π_old and the entropies are the sampler's (config-checked)
            if missing := sum(s.rollout_entropies is None for s in samples):
                raise ValueError(f"optim.scoring_pass=never: {missing} of {len(samples)} samples carry no exact "
                                 "sampler entropies (top-k estimates); set rollout.exact_entropy=true or "
                                 "optim.scoring_pass=auto")
            return False
        exact = (sampler_is_trainer(cfg, self.generation_dtype, self.backend.compute_dtype, self.sampler_dtype)
                 and cfg.rollout.top_p >= 1.0
                 and cfg.rollout.top_k == 0 and all(s.rollout_entropies is not None for s in samples))
        return not exact

    def _stack(self, rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
        out = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, row in enumerate(rows):
            out[i, : row.numel()] = row
        return out.to(self.device)

    # ------------------------------------------------------------------
    def update(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One RL step's update over ``samples``; returns the step's training metrics."""
        if not samples:
            return {"train/skipped": 1.0}
        t0 = time.perf_counter()
        scoring = self.needs_scoring_pass(samples)
        scored = self.score(samples, policy=scoring) if scoring or self.ref_backend is not None else None
        t_score = time.perf_counter() - t0
        if scoring and scored is not None:
            entropies, tally = scored.entropy, _Tally()
            for i, s in enumerate(samples):
                tally.add_gap(scored.logprobs[i], torch.tensor(s.rollout_logprobs), torch.tensor(s.loss_mask))
        else:  # on-policy: the sampler's exact entropies of the same distribution; the gap is taken per micro-batch
            entropies, tally = [torch.tensor(s.rollout_entropies, dtype=torch.float32) for s in samples], _Tally()
        on_policy = self.cfg.optim.ppo_epochs == 1 and len(split_mini_batches(samples,
                                                                          self.cfg.optim.mini_batch_size)) == 1
        step = _Step(samples, entropies, scored, scoring, on_policy)
        self.backend.module.eval()  # as the scoring pass: dropout would make the gradient pass another policy
        for _epoch in range(self.cfg.optim.ppo_epochs):
            for mini in split_mini_batches(samples, self.cfg.optim.mini_batch_size):
                self._mini_batch(step, mini, tally)
        release_memory()  # the activations' heap pages back to the OS before the next rollout (see memory.py)
        return self._metrics(step, tally, wall=time.perf_counter() - t0, t_score=t_score)

    @property
    def _current_entropies(self) -> bool:
        """Whether the loss reads the differentiated policy's entropies (``algorithm.entropy_source: current``) and
        anything reads them at all (the entropy-aware advantage, the high-entropy gate)."""
        alg = self.cfg.algorithm
        return alg.entropy_source == "current" and (alg.entropy_advantage or alg.clip_gate == "high_entropy")

    def _mini_batch(self, step: _Step, mini: list[int], tally: _Tally) -> None:
        """One optimizer step: the mini-batch's entropy statistics and normalizers, then its micro-batches."""
        samples, alg = step.samples, self.cfg.algorithm
        mini_mask = self._stack([torch.tensor(samples[i].loss_mask, dtype=torch.float32) for i in mini],
                                max(samples[i].response_len for i in mini))
        entropies = step.entropies  # π_old's: the policy as it is until the step's first optimizer step
        if self._current_entropies and tally.grad_norms:  # the policy has moved: its own, at these weights
            entropies = list(entropies)
            for i, ent in zip(mini, self.score([samples[i] for i in mini], reference=False).entropy, strict=True):
                entropies[i] = ent
        mini_ent = self._stack([entropies[i] for i in mini], mini_mask.shape[1])
        stats = entropy_stats(mini_ent, mini_mask, per_sequence=alg.loss in SEQUENCE_LEVEL_LOSSES)
        norm = loss_normalizer(mini_mask, mini_ent, alg)
        mini_loss = 0.0
        for mb in self._lockstep(samples, self._group_share(samples, mini)):
            if mb is None:
                self._filler(step, mini, stats, norm)
            else:
                mini_loss += self._micro_batch(step, mb, stats, norm, tally)
        tally.grad_norms.append(self.backend.step())
        tally.losses.append(mini_loss)

    def _filler(self, step: _Step, mini: list[int], stats: EntropyStats, norm: LossNormalizer) -> None:
        """A zero-weight micro-batch (the mini-batch's first sample, loss × 0) for a rank with fewer micro-batches
        than another: same collectives, no gradient, no metrics."""
        self._micro_batch(step, mini[:1], stats, norm, _Tally(), weight=0.0)

    def _micro_batch(self, step: _Step, mb: list[int], stats: EntropyStats, norm: LossNormalizer,
                     tally: _Tally, weight: float = 1.0) -> float:
        """Forward, loss and backward of one micro-batch (gradients accumulate); returns its loss. ``weight``
        scales the loss (0: a filler, see :meth:`_filler`)."""
        cfg, alg = self.cfg, self.cfg.algorithm
        batch = collate([step.samples[i] for i in mb], self.pad_id, self.device)
        tally.real_tokens += batch.real_tokens
        tally.padded_tokens += batch.padded_tokens
        width = batch.targets.shape[1]
        ref_logprobs = step.scored.ref_logprobs if step.scored is not None else None
        ref = self._stack([ref_logprobs[i] for i in mb], width) if ref_logprobs else None
        current = self._current_entropies
        logprobs, forward_ent = response_logprobs_and_entropy(self.backend, batch, cfg.rollout.temperature, True,
                                                              with_entropy=current)
        # H_t: this forward's own (algorithm.entropy_source=current; never differentiable), else π_old's
        ent = forward_ent if current and forward_ent is not None else self._stack(
            [step.entropies[i] for i in mb], width)
        adv = batch.advantages
        if alg.entropy_advantage:
            adv = entropy_aware_advantage(adv, ent, batch.loss_mask, alg.entropy_advantage_alpha, stats,
                                          alg.entropy_eps)
        old = self._old_logprobs(step, mb, batch, logprobs)
        if not step.scoring and not tally.grad_norms:  # before the first optimizer step: the sampler–trainer gap
            tally.add_gap(logprobs.detach(), batch.rollout_logprobs, batch.loss_mask)
        weights, correction = rollout_is_weights(old, batch.rollout_logprobs, batch.loss_mask,
                                                 self.correction if cfg.optim.old_logprobs == "trainer"
                                                 else "none", alg.rollout_correction_cap)
        inputs = LossInputs(logprobs, old, adv * weights, batch.loss_mask, ent, ref)
        loss, diag = compute_policy_loss(inputs, alg, norm, norm_len=cfg.rollout.max_response_tokens)
        if alg.entropy_advantage:  # how far it reweighted the tokens (issue 53 §2): the factor a unit advantage gets
            factor = entropy_aware_advantage(torch.ones_like(batch.advantages), ent, batch.loss_mask,
                                             alg.entropy_advantage_alpha, stats, alg.entropy_eps)
            diag.update(spread_diagnostics("entropy_advantage_factor", factor, batch.loss_mask))
        if self.observer is not None and weight == 1.0:
            self.observer.micro_batch(mb, inputs, norm, cfg.rollout.max_response_tokens)
        self.backend.backward(loss * weight if weight != 1.0 else loss)
        tally.diagnostics.append({**diag, **correction})
        return float(loss.detach()) * weight

    def _old_logprobs(self, step: _Step, mb: list[int], batch: PaddedBatch, logprobs: torch.Tensor) -> torch.Tensor:
        """π_old of the ratio: the rollout's, the scoring pass's, or without a scoring pass (the sampler is the
        trainer) this very forward detached when on-policy (ratio ≡ 1), else the sampler's log-probs (the
        pre-update policy's; they differ from a full forward by float summation order only, as
        ``train/rollout_trainer_logprob_gap`` shows)."""
        if self.cfg.optim.old_logprobs == "rollout":
            return batch.rollout_logprobs
        if step.scoring and step.scored is not None:
            return self._stack([step.scored.logprobs[i] for i in mb], batch.targets.shape[1])
        return logprobs.detach() if step.on_policy else batch.rollout_logprobs

    def _metrics(self, step: _Step, tally: _Tally, wall: float, t_score: float) -> dict[str, float]:
        """The step's training metrics; the loss diagnostics combined as each declares (``train/<name>``)."""
        samples = step.samples
        # Each rank's loss is its share of the mini-batch's (global normalisers): the mini-batch loss is their sum.
        losses = [sum(parts) for parts in zip(*self.ranks.all_gather(tally.losses), strict=True)]
        metrics = {
            "train/loss": sum(losses) / len(losses),
            "train/grad_norm": sum(tally.grad_norms) / len(tally.grad_norms),
            "train/grad_norm_max": max(tally.grad_norms),
            "train/lr": self.backend.current_lr(),
            "train/optimizer_steps": float(len(tally.grad_norms)),
            "train/entropy_mean": float(torch.cat([e[torch.tensor(s.loss_mask, dtype=torch.bool)]
                                                   for e, s in zip(step.entropies, samples, strict=True)]).mean()),
            **tally.gap_metrics(),
            "train/tokens_per_s": tally.real_tokens / max(wall, 1e-9),
            "train/padding_waste": 1.0 - tally.real_tokens / max(1, tally.padded_tokens),
            "train/micro_batch_tokens": float(self.micro_batch_tokens),  # after optim.memory_budget_gb's cap
            "train/scoring_pass_s": t_score,
            "train/scoring_pass": float(step.scoring),
            "train/update_s": wall,
            "train/samples": float(len(samples)),
            "train/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }
        if torch.cuda.is_available():
            metrics["train/peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
        metrics.update({f"train/{name}": value for name, value in combine_diagnostics(tally.diagnostics).items()})
        return metrics


@dataclass(frozen=True)
class _Step:
    """What every micro-batch of one update reads: the samples, their token entropies (the scoring pass's, or the
    sampler's when it was skipped), the scoring/reference pass, and whether the policy was scored."""

    samples: Sequence[TrainSample]
    entropies: list[torch.Tensor]
    scored: _Scored | None
    scoring: bool
    on_policy: bool
    """One epoch over one mini-batch: a single optimizer step, taken at the sampling policy."""


@dataclass
class _Tally:
    """What an update accumulates for its metrics, in the order its micro-batches run."""

    gap_sum: float = 0.0  # Σ |trainer − rollout log-prob| over model tokens
    gap_n: int = 0
    gaps: list[torch.Tensor] = field(default_factory=list)  # the per-token |gaps|, for the tail statistics
    real_tokens: int = 0
    padded_tokens: int = 0
    grad_norms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # per mini-batch
    diagnostics: list[dict[str, Diagnostic]] = field(default_factory=list)  # per micro-batch

    def add_gap(self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        """|trainer − rollout log-prob| of the model tokens of one sample or micro-batch."""
        gap = (trainer - rollout).abs()[mask > 0].float().cpu()
        self.gap_sum += float(gap.sum())
        self.gap_n += int(gap.numel())
        self.gaps.append(gap)

    def gap_metrics(self) -> dict[str, float]:
        """The sampler–trainer log-prob gap over the step's model tokens: mean, 99th percentile and max (nats)."""
        gaps = torch.cat(self.gaps) if self.gaps else torch.zeros(0)
        p99 = float(torch.kthvalue(gaps, max(1, math.ceil(0.99 * gaps.numel()))).values) if gaps.numel() else 0.0
        return {"train/rollout_trainer_logprob_gap": self.gap_sum / max(1, self.gap_n),
                "train/rollout_trainer_logprob_gap_p99": p99,
                "train/rollout_trainer_logprob_gap_max": float(gaps.max()) if gaps.numel() else 0.0}
