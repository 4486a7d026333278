"""One config tree for an experiment: the schema.

Every constant of the algorithm is a named field here, with the paper's default (AEPO.md §8, Qwen3-14B deep
search).  Small configs in ``configs/`` override what they need.  The schema alone lives here: ``overrides.py``
builds it from YAML text or a tree with dotted ``key=value`` overrides on top; ``config_keys.py`` holds
:class:`ConfigError`, the dotted keys and the renamed keys (translated here too, for trees validated directly);
``described_yaml.py`` writes ``to_yaml(describe=True)``; ``config_section.py`` holds the sections' base and
``tool_config.py`` the ``tools:`` sections.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from aepo_core.config_keys import ConfigError, flatten, migrate_renamed_keys
from aepo_core.config_rollout import (  # noqa: F401 (re-exported: one config tree)
    ModelConfig,
    RemoteEngineConfig,
    RolloutConfig,
    VLLMConfig,
    default_initial_rollouts,
)
from aepo_core.config_section import Section
from aepo_core.described_yaml import described_lines
from aepo_core.tool_config import ToolsConfig

SharePrefix = Literal["off", "common", "tree"]
"""``optim.share_prefix`` resolved: which tokens the rows of a micro-batch share run through the decoder once."""

TREE_ATTENTION = (None, "sdpa", "eager")
"""``model.attn_implementation`` values that take the token tree's arbitrary 4-D mask (None: transformers' default,
sdpa)."""


def resolved_share_prefix(requested: str, backend: str, device: str, attn_implementation: str | None) -> SharePrefix:
    """``optim.share_prefix`` for the torch/DeepSpeed ``backend`` on ``device`` with ``attn_implementation``:
    ``auto`` → ``tree`` where it is the same computation and was measured faster — the torch backend, a CPU device,
    sdpa or eager attention (the update 1.86× faster than ``common`` and 2.3× than ``off`` on a 2-core AMX Xeon,
    bench/README "The token tree"; to float rounding the same log-probs and gradients) — and ``off`` elsewhere:
    DeepSpeed's forward is not split, flash attention takes no 4-D mask, and on an accelerator it was never measured
    (its mask is dense, micro_batch_tokens² per micro-batch). An explicit mode is returned as it is."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    on_cpu = device.split(":")[0] == "cpu"
    return "tree" if backend == "torch" and on_cpu and attn_implementation in TREE_ATTENTION else "off"


LossName = Literal["ppo_clip", "dapo", "aepo", "gppo", "ce_gppo", "cispo", "gspo"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


LOSS_DEFAULTED_FIELDS: tuple[str, ...] = ("dual_clip", "loss_agg")
"""AlgorithmConfig fields whose unset value depends on the loss (see its validators): a config that switches to
another loss at that loss's paper defaults drops them before validating again."""


class AlgorithmConfig(Section):
    """Entropy-balanced policy optimization and its baselines (AEPO.md §5–6)."""

    loss: LossName = Field(
        "aepo",
        description="Policy loss (AEPO.md §6): aepo (entropy clipping-balanced), ppo_clip (PPO/GRPO), dapo, gppo, "
        "ce_gppo, cispo, gspo.",
    )
    rollout_correction: Literal["auto", "none", "tis", "mask"] = Field(
        "auto",
        description="Sampler–trainer mismatch correction (AEPO.md §6): per model token ρ = π_old(trainer) / "
        "π_rollout; 'tis' weights the policy term by min(ρ, C), 'mask' drops tokens with ρ > C, 'none' ignores the "
        "gap (which is logged either way). auto: tis where the rollouts' sampler is a quantized copy "
        "(model.sampler_dtype int8: KL ~0.03 nats a token from the policy), none elsewhere (a bf16 copy: ~0.001); "
        "the resolved mode is logged as numerics.rollout_correction. Only with "
        "optim.old_logprobs=trainer (else π_old is the sampler's).",
    )
    rollout_correction_cap: float = Field(
        2.0, gt=1.0, description="C of rollout_correction: the truncation (tis) or masking (mask) threshold of ρ."
    )
    advantage: AdvantageName = Field(
        "grpo",
        description="Group advantage (AEPO.md §5): grpo (mean and std), dr_grpo (no std), rloo (leave-one-out "
        "mean), reinforce_pp_baseline (group mean, then batch whitening).",
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="Added to the group std in GRPO normalization.")
    entropy_advantage: bool = Field(True, description="Scale Â by max(0, 1 + α·z(H_t)) per token.")
    entropy_advantage_alpha: float = Field(0.2, ge=0.0, description="α of the entropy-aware advantage.")
    entropy_eps: float = Field(1e-6, gt=0.0, description="Added to the entropy std when standardizing.")
    entropy_source: Literal["current", "old"] = Field(
        "current",
        description="Whose token entropies the entropy-aware advantage and the high-entropy gate read. current "
        "(AEPO.md §5, the paper's): the policy being differentiated, H_t from the gradient forward (detached), "
        "standardized (and the gate's quantile taken) over the mini-batch at the same weights, which after the "
        "step's first optimizer step costs one more no-grad forward of each mini-batch. old: π_old's (the scoring "
        "pass's, or the sampler's when it is skipped) for every mini-batch of the step, no extra forward.",
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ε_l.")
    clip_high: float = Field(0.2, ge=0.0, description="ε_h (DAPO clip-higher uses 0.28).")
    clip_gate: Literal["all", "high_entropy"] = Field(
        "all", description="AEPO: which tokens keep the stop-gradient upper-bound gradient."
    )
    high_entropy_quantile: float = Field(
        0.2, gt=0.0, le=1.0, description="Top fraction of tokens by entropy that count as high-entropy."
    )
    dapo_clip_high: float = Field(0.28, ge=0.0, description="ε_h of the dapo loss (clip-higher).")
    gspo_clip_low: float = Field(3e-4, ge=0.0, lt=1.0, description="ε_l of the gspo loss (sequence ratios).")
    gspo_clip_high: float = Field(4e-4, ge=0.0, description="ε_h of the gspo loss (sequence ratios).")
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        description="Dual-clip c of the PPO-family losses (ppo_clip, dapo, aepo, gppo, ce_gppo): for Â < 0 the "
        "per-token loss is capped at −c·Â (verl's clip_ratio_c = 3, which the published AEPO scripts use). "
        "null: off. Unset: 3, except null for loss dapo (DAPO has no dual-clip). cispo (its IS weight is already "
        "capped) and gspo (sequence ratios) ignore it.",
    )
    cispo_eps_high: float = Field(
        3.0,
        gt=0.0,
        description="ε_high^IS of the cispo loss: the IS weight is min(r, 1+ε), no lower bound (MiniMax-M1 tunes "
        "only this upper bound and does not publish it; 3 caps the weight at 4, ScaleRL's / Tinker's default).",
    )
    gppo_beta_low: float = Field(
        0.5, ge=0.0, description="CE-GPPO β₁, the weight of the low clipped side (its scripts use 0.5 or 0.75; "
        "β₁ = β₂ = 1 is plain gppo)."
    )
    gppo_beta_high: float = Field(1.0, ge=0.0, description="CE-GPPO β₂, the weight of the high clipped side.")
    kl_coef: float = Field(0.0, ge=0.0, description="0: no reference model is loaded.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Estimator of the KL to the reference policy (used only when kl_coef > 0)."
    )
    kl_clamp: float = Field(10.0, gt=0.0, description="Log-ratio clamp inside the k3 estimator (numerical safety).")
    loss_agg: LossAgg = Field(
        "token-mean",
        description="Per-token losses → scalar: token-mean (over the mini-batch's tokens), seq-mean-token-mean "
        "(every sequence weighs the same), seq-mean-token-sum-norm (token sum / loss_norm_len, Dr.GRPO). "
        "Unset: seq-mean-token-mean for loss gspo, seq-mean-token-sum-norm for advantage dr_grpo (the only "
        "aggregations under which they are what their papers say; another choice is an error), else token-mean.",
    )
    loss_norm_len: int | None = Field(
        None, ge=1, description="Constant of seq-mean-token-sum-norm (default: rollout.max_response_tokens)."
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose leaves are all correct or all incorrect, and refill the step "
        "with the next questions until train.batch_size informative groups (or dynamic_sampling_max_tries rounds).",
    )
    dynamic_sampling_max_tries: int = Field(
        3, ge=1, description="DAPO: most sampling rounds per step (the first included); the update then uses the "
        "informative groups found, at most train.batch_size.",
    )
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (0: off).")
    overlong_penalty: float = Field(
        1.0, ge=0.0, description="DAPO: reward subtracted at max length, linear over the last overlong_buffer tokens."
    )

    @model_validator(mode="before")
    @classmethod
    def _dual_clip_of_the_method(cls, data: Any) -> Any:
        """An unset ``dual_clip`` is off for loss dapo (the DAPO paper has no dual-clip) and c = 3 otherwise."""
        if isinstance(data, dict) and "dual_clip" not in data and data.get("loss") == "dapo":
            return {**data, "dual_clip": None}
        return data

    @model_validator(mode="before")
    @classmethod
    def _aggregation_of_the_method(cls, data: Any) -> Any:
        """GSPO's gradient is the paper's only under seq-mean-token-mean (one clipped ratio per sequence, every
        sequence weighing the same); Dr.GRPO needs the constant normalizer seq-mean-token-sum-norm (Σ_t L / L_max,
        no per-sequence length).  An unset ``loss_agg`` becomes the one required; another one is an error.

        (On assignment pydantic passes every field, so there ``loss_agg`` always counts as set.)"""
        if not isinstance(data, dict):
            return data
        required = {key: agg for key, value, agg in (("algorithm.loss", "gspo", "seq-mean-token-mean"),
                                                     ("algorithm.advantage", "dr_grpo", "seq-mean-token-sum-norm"))
                    if data.get(key.split(".")[1]) == value}
        if len(set(required.values())) > 1:
            raise ValueError("algorithm.loss=gspo needs algorithm.loss_agg=seq-mean-token-mean but "
                             "algorithm.advantage=dr_grpo needs seq-mean-token-sum-norm: choose one of them")
        if not required:
            return data
        ((key, agg),) = required.items()
        if data.get("loss_agg") is None:
            return {**data, "loss_agg": agg}
        if data["loss_agg"] != agg:
            raise ValueError(f"{key}={data[key.split('.')[1]]} needs algorithm.loss_agg={agg}, got "
                             f"{data['loss_agg']!r} (leave algorithm.loss_agg unset to get it)")
        return data


class OptimConfig(Section):
    """AdamW and the PPO update regime of RL."""

    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate of RL updates (paper 1e-6).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warm-up: constant, or decayed to 0 over the run linearly or by cosine."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear LR warm-up (0: none).")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW decoupled weight decay (paper 0.01).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β₁, β₂).")
    eps: float = Field(1e-8, gt=0.0, description="AdamW ε (added to the second-moment root).")
    grad_clip: float = Field(1.0, gt=0.0, description="Max L2 norm of the whole gradient per optimizer step.")
    ppo_epochs: int = Field(1, ge=1, description="Passes of PPO updates over each rollout batch (paper 1).")
    mini_batch_size: int = Field(8, ge=1, description="Questions per PPO mini-batch.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one forward/backward micro-batch.")
    memory_budget_gb: float | Literal["auto"] | None = Field(
        "auto",
        description="Activation memory of one forward/backward micro-batch (GB, 1e9 bytes): caps the micro-batch "
        "at budget / (bytes per token) tokens when that is below micro_batch_tokens, with bytes per token estimated "
        "from the model as layers × (48·hidden + 12·intermediate) (SmolLM2-135M: 1.38 MB; 1.29 MB measured under "
        "bf16 autocast). 'auto': 2 GB on a CPU device (on 2 cores 1024–2048-token micro-batches train as fast as "
        "8192-token ones at a third of the peak memory; with activation_checkpointing, the default, the estimate is "
        "0.12 MB a token and the cap rarely binds), "
        "no cap on an accelerator; null: micro_batch_tokens alone.",
    )
    activation_checkpointing: bool = Field(
        True,
        description="Recompute each decoder layer's activations in the backward instead of keeping them (as "
        "verl's enable_gradient_checkpointing, on by default there too): activation memory per token falls from "
        "layers × (48·hidden + 12·intermediate) bytes to layers × 4·hidden plus one layer's (SmolLM2-135M: 1.38 → "
        "0.12 MB), for one more forward of the decoder per micro-batch.",
    )
    share_prefix: Literal["auto", "off", "common", "tree"] = Field(
        "auto",
        description="Run the tokens the rows of a micro-batch share through the decoder once: the same log-probs "
        "and gradients up to float rounding (a causal decoder's state at a position does not depend on what "
        "follows). 'common': the leading tokens every row shares (the system prompt, a quarter of an RL sample) as "
        "one row all attend to; needs activation_checkpointing off. 'tree': every distinct prefix once (a question's "
        "leaves share their prompt and their parent's segments), the rows packed as a trie under a 4-D attention "
        "mask, micro-batches filled question by question up to micro_batch_tokens distinct tokens; needs sdpa or "
        "eager attention (the demo's update 1.86x faster than 'common'). true/false: 'common'/'off'. Torch only. "
        "'auto': 'tree' on the torch backend on a CPU with sdpa or eager attention, 'off' elsewhere (DeepSpeed, "
        "flash attention, an accelerator: not measured there); the config then records the mode it resolved to.",
    )

    @field_validator("share_prefix", mode="before")
    @classmethod
    def _share_prefix_bool(cls, value: object) -> object:  # the values before 'tree' existed
        return {True: "common", False: "off"}[value] if isinstance(value, bool) else value

    old_logprobs: Literal["trainer", "rollout"] = Field(
        "trainer",
        description="π_old of the PPO ratio: the trainer's own no-grad forward before the update (exact under "
        "PPO epochs > 1, remote engines and top-p sampling), or the sampler's log-probs (rollout: needs unfiltered "
        "sampling, rollout.top_p 1 and top_k 0; every ratio then starts at the sampler–trainer gap, up to 2.3e-2 "
        "nats under bf16 autocast even for the in-process engine on the training weights). The gap is logged.",
    )
    scoring_pass: Literal["auto", "always", "never"] = Field(
        "auto",
        description="The no-grad forward before the update. 'auto' skips it when it cannot change the update: "
        "the sampler is the trainer itself (the in-process engine on the training weights, generation_dtype "
        "same, torch backend, float32 compute: under bf16 autocast the KV-cached decode and the full forward "
        "differ by up to 2.3e-2 nats) sampling the unfiltered distribution (top_p 1, top_k 0), so its log-probs are "
        "π_old (on-policy: the gradient pass's own, detached) and its entropies the trainer's, for any number of "
        "mini-batches and epochs (a KL term still runs the reference model's pass). 'never' (needs "
        "old_logprobs=rollout): π_old and the token entropies (entropy-aware advantage, the high-entropy gate, "
        "train/entropy_mean) are the sampler's, the distribution π_old is, as verl's bypass mode and NeMo RL's "
        "skipped prev-logprobs do: a bf16 generation copy saves its scoring pass (10-11 s of a 45 s update on a "
        "2-core Zen 4 EPYC); the samples must carry exact entropies (an error otherwise).",
    )

    @model_validator(mode="after")
    def _budget_positive(self) -> OptimConfig:
        if isinstance(self.memory_budget_gb, float) and not self.memory_budget_gb > 0:
            raise ValueError("optim.memory_budget_gb must be > 0, 'auto' or null")
        if self.scoring_pass == "never" and self.old_logprobs != "rollout":
            raise ValueError("optim.scoring_pass=never needs optim.old_logprobs=rollout (without the scoring pass "
                             "π_old can only be the sampler's)")
        if self.share_prefix == "common" and self.activation_checkpointing:
            raise ValueError("optim.share_prefix=common needs optim.activation_checkpointing=false (a recomputed "
                             "decoder layer would extend the shared keys and values a second time)")
        return self


class SFTConfig(Section):
    """Cold-start SFT on oracle transcripts of the synthetic task, before RL."""

    enabled: bool = Field(False, description="Run cold-start SFT first (needs data.train=synthetic and both tools).")
    epochs: int = Field(1, ge=1, description="Passes over the SFT transcripts.")
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate of SFT, constant after warmup_steps.")
    warmup_steps: int = Field(0, ge=0, description="SFT optimizer steps of linear LR warm-up (0: none); optim's "
                              "warm-up and schedule are RL's.")
    batch_size: int = Field(8, ge=1, description="Transcripts per SFT optimizer step.")
    seed: int | None = Field(
        None, description="Seed of SFT's batch order (its only randomness); None: the run's seed. Fixed, runs of "
        "several seeds start RL from one SFT (the order alone moved the demo's SFT Pass@1 from 0.486 to 0.806)."
    )
    max_examples: int | None = Field(
        None, ge=1, description="Transcripts of the first N training questions only; None: every question."
    )
    varied: bool = Field(
        False, description="Oracle transcripts in varied words: each transcript picks its thoughts' openings, its "
        "queries' and its answer's phrasing and its fact summaries from several (seeded by the question id), and a "
        "fact already in an earlier result is searched for again in half of them (a second valid strategy); false: "
        "one template each, which SFT memorises (issue 53 §3: post-tool windows of 0.07 nats at the RL start)."
    )

    def order_seed(self, run_seed: int) -> int:
        """The seed of SFT's batch order: this section's, else the run's."""
        return run_seed if self.seed is None else self.seed

    def optimizer(self, rl: OptimConfig) -> OptimConfig:
        """SFT's AdamW: RL's β, ε, weight decay and gradient clipping, at this section's LR, constant after this
        section's warm-up (RL's warm-up and decay count RL steps: they are not SFT's)."""
        return rl.model_copy(update={"lr": self.lr, "warmup_steps": self.warmup_steps, "lr_schedule": "constant"})


class TrainConfig(Section):
    """The RL run: its length, batch, training backend and Prefect timeouts."""

    steps: int | None = Field(None, ge=1, description="RL steps to run (None: epochs × batches per epoch).")
    epochs: int = Field(5, ge=1, description="Passes over the training questions when steps is None (paper 5).")
    batch_size: int = Field(64, ge=1, description="Questions per RL step (paper 64).")
    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch: plain PyTorch in one process; deepspeed: DeepSpeed ZeRO (zero_stage)."
    )
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (backend deepspeed only).")
    deterministic: bool = Field(
        False,
        description="Deterministic kernels: torch.use_deterministic_algorithms (warning on an op that has none) and "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, set before CUDA initializes. Bit-identical replay and resume are tested "
        "on CPU in float32, where kernels are deterministic anyway; on CUDA several backward kernels are not by "
        "default. Costs speed where a deterministic kernel replaces atomics, and 32 MiB of cuBLAS workspace per "
        "stream. Not in the published scripts (false).",
    )
    offload_optimizer: bool = Field(
        False, description="DeepSpeed ZeRO 1–3: optimizer state and step on CPU (DeepSpeed's CPU Adam; its first "
        "use compiles an op, minutes on a small CPU)."
    )
    offload_params: bool = Field(False, description="DeepSpeed ZeRO-3: parameters live on CPU between uses.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Cold-start SFT before RL.")
    rollout_timeout_s: float = Field(3600.0, gt=0.0, description="Prefect timeout of one rollout task.")
    update_timeout_s: float = Field(3600.0, gt=0.0, description="Prefect timeout of one update task.")
    eval_timeout_s: float = Field(7200.0, gt=0.0, description="Prefect timeout of one evaluation task.")
    task_retries: int = Field(2, ge=0, description="Retries of rollout/score/evaluate on transient errors.")
    max_staleness: int = Field(
        0, ge=0, description="Bounded-staleness overlap of rollout and update (the name TRL's AsyncGRPOTrainer "
        "uses; verl's one-step-off-policy recipe is 1): 0 samples every step's rollouts from the weights it updates "
        "(on-policy, today's loop); s > 0 samples the rollouts of step j from the weights after update "
        "max(c, j-1-s), c the last checkpoint step before j, so the next batches are sampled while the current "
        "update trains and every segment is at most s updates old. A checkpoint drains the overlap (the s rollouts "
        "after it run alone), so resume stays exact. The segments carry their weight version; "
        "rollout/staleness_* and rollout/version_spread are logged; algorithm.rollout_correction auto turns tis "
        "on. One sampler runs one rollout at a time, so s > 1 adds staleness without adding overlap (it is for "
        "rollouts whose length varies a lot). Not under train.backend deepspeed or several ranks.",
    )

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> TrainConfig:
        if self.backend == "deepspeed" and self.offload_params and self.zero_stage != 3:
            raise ValueError("train.offload_params needs train.zero_stage=3")
        if self.backend == "deepspeed" and self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage >= 1")
        if self.backend == "deepspeed" and self.max_staleness:
            raise ValueError("train.max_staleness > 0 needs train.backend torch: under DeepSpeed the engine shares "
                             "the (partitioned) training model, which the overlapped update changes while it samples")
        return self


class CheckpointConfig(Section):
    """Checkpoints of the RL run (HF weights plus optimizer, RNG and data cursor)."""

    every: int = Field(10, ge=1, description="Save a checkpoint every N RL steps (and at the end).")
    keep: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    dir: str | None = Field(
        None, description="This run name's checkpoint folder (local or s3://bucket/prefix), one subfolder per MLflow "
        "run id under it. Default: <storage.checkpoints_uri or runs_dir/checkpoints>/<run name>.",
    )


class EvalConfig(Section):
    """Evaluation: n samples per question, unbiased Pass@1 / Pass@k with bootstrap confidence intervals."""

    every: int = Field(10, ge=0, description="Evaluate every M RL steps (0: only at the end).")
    datasets: list[str] = Field(
        default_factory=list,
        description="Dataset specs to evaluate (names, paths, synthetic:test); empty: data.validation, else "
        "synthetic:test when the synthetic task is in use.",
    )
    n_samples: int = Field(5, ge=1, description="Independent samples per question (paper 5).")
    pass_k: int = Field(5, ge=1, description="k of Pass@k, at most n_samples (paper 5).")
    temperature: float = Field(0.6, gt=0.0, description="Sampling temperature of evaluation (paper 0.6).")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus-sampling mass of evaluation (paper 0.95).")
    max_questions: int | None = Field(None, ge=1, description="First N questions of each dataset only; None: all.")
    batch_size: int | None = Field(
        None, ge=1, description="Questions per evaluation rollout batch (None: train.batch_size). Larger decode "
        "batches are faster on CPU and GPU; memory grows with questions × n_samples.",
    )
    at_start: bool = Field(False, description="Also evaluate before training (and after cold-start SFT).")
    sampler: Literal["policy", "rollout"] = Field(
        "policy", description="The engine evaluation samples from. policy: the policy's own numerics "
        "(model.generation_dtype), so Pass@1 is the trained policy's. rollout: the training rollouts' sampler "
        "(model.sampler_dtype, e.g. the int8 copy): faster where that is a quantized copy, but the score is then "
        "the copy's, not the policy's.",
    )
    before_sft: bool = Field(
        True, description="With at_start and cold-start SFT: also evaluate the base model before SFT. False keeps "
        "the evaluation after SFT (the baseline of RL's gain) and drops this one (the demo's SmolLM2-135M scores "
        "0.000 there, not yet knowing the tag protocol; ~90 s of the demo on 2 AMX cores).",
    )
    bootstrap_samples: int = Field(1000, ge=10, description="Bootstrap resamples behind the confidence intervals.")
    reuse_start: bool = Field(
        True, description="Reuse a stored evaluation of the same starting weights under the same settings: the "
        "start and post-SFT evaluations of runs sharing a runs dir (a sweep's cells) are keyed by the weights' "
        "digest and every setting that changes the result (datasets and questions, samples, sampling, seed, "
        "rollout limits, tools, reward, prompt, numerics, device), computed once, logged into each run as if "
        "fresh (tagged start_eval/<stage>/<dataset>/reused_from). The code version is not in the key: clear "
        "<runs_dir>/cache/start_eval after a change to sampling or scoring code. false: every run evaluates itself.",
    )
    judge_url: str | None = Field(
        None, description="OpenAI-compatible endpoint of an LLM judge that also grades the answers; None: no judge."
    )
    judge_model: str | None = Field(None, description="Model name sent to the judge; None: 'judge'.")

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalConfig:
        if self.pass_k > self.n_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must not exceed n_samples ({self.n_samples})")
        return self


SyntheticFamily = Literal["single_hop", "two_hop", "compute"]


class SyntheticDataConfig(Section):
    """The generated offline deep-search task (``infra/data/synthetic.py``), used by the ``synthetic`` specs."""

    seed: int = Field(0, description="Seed of the generated world: the same seed and fields give the same task.")
    entities: int = Field(60, ge=4, description="Number of companies, each with its own founder.")
    cities: int = Field(12, ge=1, description="Number of cities (shared by companies).")
    countries: int = Field(4, ge=1, description="Number of countries.")
    families: list[SyntheticFamily] = Field(
        default_factory=lambda: ["single_hop", "two_hop", "compute"],
        min_length=1,
        description="Question families: one lookup, a chained lookup, lookups plus Python arithmetic.",
    )
    relations: list[str] | None = Field(
        None, description="Relations to ask (e.g. founded_year, founder_birth_year); None: all in families."
    )
    questions_per_company: int | None = Field(
        None, ge=1, description="A seeded sample of this many relations per company; None: all."
    )
    validation_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of companies in validation.")
    test_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of companies in test (held out).")
    templates_per_fact: int = Field(
        3, ge=1, le=3, description="Difficulty: phrasings in use per fact kind (1 = one fixed wording)."
    )
    mentions_per_fact: int = Field(1, ge=1, le=3, description="Passages stating each fact (each in its own phrasing).")
    facts_per_document: int = Field(
        1, ge=1, description="Fact sentences per passage (1 spreads each entity over several passages)."
    )
    near_name_distractors: int = Field(
        1, ge=0, le=9, description="Difficulty: namesake passages per company and per founder."
    )
    comparison_distractors: int = Field(
        1, ge=0, description="Difficulty: passages per company that name it next to a rival's fact."
    )


class DataConfig(Section):
    """Training and validation data."""

    train: str = Field("synthetic", description="'synthetic', or a verl/ARPO Parquet, JSONL or HF datasets path.")
    validation: str | None = Field(
        None, description="Dataset evaluated when eval.datasets is empty; None: synthetic:test if synthetic is used."
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail", description="A malformed dataset row fails the load, or is skipped and counted."
    )
    max_questions: int | None = Field(None, ge=1, description="Train on the first N questions only; None: all.")
    shuffle: bool = Field(True, description="Shuffle the training questions every epoch (seeded by seed).")
    data_root: str | None = Field(
        None,
        description="Where shorthand dataset names (gaia, math500, hard_search_1k…) are found; default: env "
        "AEPO_DATA_ROOT, else the ARPO/AEPO data shipped in the package (infra/data/arpo).",
    )
    synthetic: SyntheticDataConfig = Field(
        default_factory=SyntheticDataConfig, description="The generated synthetic task's world and questions."
    )


class RewardConfig(Section):
    """Deep-search reward (AEPO.md §7): format check, token F1, tool-use bonus."""

    kind: Literal["deepsearch", "f1", "em", "math"] = Field(
        "deepsearch",
        description="deepsearch: format check + token F1 + tool bonus (paper); f1: token F1; em: exact match; "
        "math: symbolic equivalence (math-verify).",
    )
    format_penalty: float = Field(-1.0, description="Reward when the format check fails.")
    tool_bonus: float = Field(0.1, description="Added when F1 > 0 and every required tool was used.")
    required_tools: list[str] = Field(
        default_factory=lambda: ["search", "python"], description="Tools that must all have been used for the bonus."
    )
    math_timeout_s: float = Field(
        5.0, gt=0.0, description="math: wall-clock bound of one answer's math-verify comparison, in any thread "
        "(it runs in a verifier process that is killed on timeout; the answer then scores 0, reason timeout).",
    )


class TrackingConfig(Section):
    """MLflow tracking."""

    tracking_uri: str | None = Field(None, description="Default: sqlite:///<runs_dir>/mlflow.db.")
    artifact_location: str | None = Field(None, description="Default: <runs_dir>/mlartifacts.")
    experiment: str = Field("aepo", description="MLflow experiment name.")
    run_name: str | None = Field(None, description="MLflow run name (and checkpoint folder); None: name.")
    system_metrics: bool = Field(True, description="Also log CPU, memory and GPU use (MLflow's system metrics).")
    log_model: bool = Field(True, description="Log the final policy as an MLflow transformers model.")
    traces_per_step: int = Field(
        2, ge=0, description="Questions of each RL step whose rollout trees are logged as MLflow traces (the first "
        "ones of the step; one trace per question: a span per leaf, model segment and tool call); 0: none."
    )
    eval_traces: int = Field(
        2, ge=0, description="Questions of each evaluation (the first ones of each dataset) whose samples are "
        "logged as MLflow traces; 0: none."
    )
    registered_model: str | None = Field(
        "aepo-policy", description="Model-registry name of the final policy (logged with tracking.log_model): every "
        "completed training run adds a version, tagged with its final evaluation metrics and carrying the agent's "
        "system prompt and tag protocol; `aepo eval --checkpoint models:/<name>/<version>` evaluates it. None: not "
        "registered.",
    )


RUNS_DIR_ENV = "AEPO_RUNS_DIR"
"""The environment variable naming the runs dir where no ``--runs-dir`` / ``runs_dir`` parameter does (it beats
``storage.runs_dir``): the CLI's, and a deployed flow run's, so its outputs land in the store ``aepo ui`` shows."""


class StorageConfig(Section):
    """Where run outputs go."""

    runs_dir: str = Field(
        "runs", description="Root of run outputs: tracking db, checkpoints, trajectories, caches, evaluations."
    )
    trajectories_uri: str | None = Field(None, description="Where the trajectory store's two tables go, as "
                                         "<uri>/trajectories and <uri>/nodes. Default: the runs dir; "
                                         "s3://bucket/prefix ok.")
    checkpoints_uri: str | None = Field(
        None, description="Root of the checkpoints, <root>/<run name>/<MLflow run id>/ (checkpoint.dir, when set, "
        "replaces <root>/<run name>). Default: <runs_dir>/checkpoints; s3://bucket/prefix ok: committed by uploading "
        "manifest.json last, read back through a verified local copy under <runs_dir>/cache/checkpoints.",
    )
    evaluations_uri: str | None = Field(
        None, description="Root of the per-question evaluation Parquet of `aepo eval`, <root>/<eval run name>/"
        "<dataset>.parquet. Default: <runs_dir>/eval; s3://bucket/prefix ok.",
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, moto…) for every s3:// URI of this section; None: AWS's "
        "default."
    )

    @field_validator("trajectories_uri", "checkpoints_uri", "evaluations_uri")
    @classmethod
    def _uri_names_a_place(cls, value: str | None) -> str | None:
        """A local path or ``scheme://bucket[/prefix]``: an empty value or a URI without a bucket is a typo."""
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must not be empty (leave it unset for the default under storage.runs_dir)")
        scheme, sep, rest = value.partition("://")
        if sep and not rest.strip("/"):
            raise ValueError(f"{value!r} names no bucket: use {scheme}://bucket/prefix")
        return value


class ExperimentConfig(Section):
    """The whole experiment."""

    name: str = Field("aepo", description="Experiment name: the default run name (tracking.run_name).")
    seed: int = Field(
        42, description="Seed of the run: Python/numpy/torch RNGs, data order, rollout and evaluation sampling, CIs."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout generation (AEPO.md §1–4).")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="The agent's tools.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantages and policy loss (AEPO.md §5–6)."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and PPO update regime.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The RL run.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training and validation data.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function (AEPO.md §7).")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where outputs are stored.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """A tree validated directly (a flow's typed parameter, a saved config) is translated like build_config's
        (which already did it, before its overrides, and leaves nothing to do here)."""
        return migrate_renamed_keys(copy.deepcopy(data)) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        r = self.rollout
        if r.initial_rollouts is not None and r.initial_rollouts > r.k:
            raise ValueError(f"rollout.initial_rollouts ({r.initial_rollouts}) must not exceed rollout.k ({r.k})")
        if self.optim.scoring_pass == "never" and r.engine != "hf" and not r.exact_entropy:
            raise ValueError("optim.scoring_pass=never takes the token entropies from the sampler: with "
                             f"rollout.engine={r.engine} that needs rollout.exact_entropy=true (the top-k estimate "
                             "overstates them)")
        if self.optim.old_logprobs == "rollout" and (r.top_p < 1.0 or r.top_k > 0):
            raise ValueError(f"optim.old_logprobs=rollout needs unfiltered sampling, got rollout.top_p={r.top_p} "
                             f"rollout.top_k={r.top_k}: the sampler's log-prob is of the renormalized filtered "
                             "distribution, so every ratio would start at the kept mass, not 1 (set "
                             "optim.old_logprobs=trainer)")
        if self.model.sampler_dtype == "int8" and (r.engine != "hf" or self.train.backend != "torch"
                                                   or not self.model.device.startswith("cpu")):
            raise ValueError("model.sampler_dtype=int8 is the in-process engine's CPU copy: it needs "
                             f"rollout.engine=hf, train.backend=torch and model.device=cpu (got {r.engine}, "
                             f"{self.train.backend}, {self.model.device})")
        if r.inflight_requests and r.scheduling != "per_path":
            raise ValueError(f"rollout.inflight_requests > 0 sends each path's segment as soon as the path is ready: "
                             f"it needs rollout.scheduling per_path (got {r.scheduling})")
        if self.train.max_staleness and (self.optim.old_logprobs == "rollout" or self.optim.scoring_pass == "never"):
            raise ValueError("train.max_staleness > 0 needs optim.old_logprobs=trainer and optim.scoring_pass "
                             "auto or always: the sampler's log-probs are of weights up to max_staleness updates "
                             "old, not π_old (the trainer's, which the scoring pass computes and TIS corrects to)")
        self.optim.share_prefix = resolved_share_prefix(self.optim.share_prefix, self.train.backend,
                                                        self.model.device, self.model.attn_implementation)
        if self.optim.share_prefix != "off" and self.train.backend != "torch":
            raise ValueError("optim.share_prefix runs on train.backend=torch only (the DeepSpeed engine's decoder "
                             "forward is not split)")
        if self.optim.share_prefix == "tree" and self.model.attn_implementation not in TREE_ATTENTION:
            raise ValueError("optim.share_prefix=tree needs model.attn_implementation sdpa or eager (an arbitrary "
                             f"4-D mask), not {self.model.attn_implementation}")
        return self

    def clip_active(self) -> bool:
        """Whether a clipping loss can clip at all: π_old differs from the policy being differentiated only with
        several PPO epochs, several mini-batches per step, or the sampler's log-probs as π_old. With one epoch over
        one mini-batch every ratio is exactly 1 and every loss gives the same gradient −Â∇logπ (AEPO.md §6)."""
        o = self.optim
        return o.ppo_epochs > 1 or o.mini_batch_size < self.train.batch_size or o.old_logprobs == "rollout"

    def check_trainable(self, world_size: int = 1) -> None:
        """What a training run needs beyond a valid config, on ``world_size`` data-parallel ranks (the launcher's);
        raises :class:`ConfigError` naming the key."""
        self.check_ranks(world_size)
        remote = self.rollout.remote
        if self.rollout.engine == "remote" and remote.weight_sync == "reload_url" and not remote.reload_url:
            raise ConfigError("rollout.engine=remote needs rollout.remote.reload_url (or rollout.remote.weight_sync="
                              "vllm) to train: without a weight reload hook the server would sample every step "
                              "from the initial weights")
        if self.train.sft.enabled and not is_synthetic(self.data.train):
            raise ConfigError(f"train.sft.enabled needs data.train=synthetic (oracle transcripts); got "
                              f"data.train={self.data.train!r}: run SFT beforehand and point model.name at it")

    def check_ranks(self, world_size: int) -> None:
        """Under ZeRO-3 on several ranks every forward of the training model gathers its partitions from all ranks
        (a collective), while the ranks roll out different shards of the batch with different numbers of engine
        calls: nothing in the rollout may run that forward, or the run hangs."""
        r, t = self.rollout, self.train
        if world_size > 1 and t.max_staleness:
            raise ConfigError(f"train.max_staleness > 0 runs in one process, not on {world_size} ranks: the "
                              "overlapped rollout's collectives would interleave with the update's")
        if world_size < 2 or t.backend != "deepspeed" or t.zero_stage != 3:
            return
        if r.engine == "hf":
            raise ConfigError(f"train.zero_stage=3 on {world_size} ranks needs rollout.engine=remote or vllm: the "
                              "in-process engine would generate on partitioned weights, whose every forward is a "
                              "collective that the ranks' different rollouts cannot keep in step")
        if r.engine == "vllm":
            raise ConfigError(f"rollout.engine=vllm under train.zero_stage=3 on {world_size} ranks: each rank's own "
                              "managed server needs the full weights, which ZeRO-3 gathers to rank 0 alone; use "
                              "rollout.engine=remote (one server all ranks share, reloaded by rank 0) or "
                              "train.zero_stage=2")
        if r.exact_entropy:
            raise ConfigError(f"rollout.exact_entropy=true with rollout.engine={r.engine} under train.zero_stage=3 "
                              f"on {world_size} ranks would hang (each rollout call scores with a forward of the "
                              "partitioned training model, a collective the ranks' different rollouts cannot keep "
                              "in step): set rollout.exact_entropy=false (the server's top-k entropy estimate, "
                              "flagged on every segment) or train.zero_stage=2")

    def run_name_for(self, given: str | None = None) -> str:
        """The run's name — its MLflow run name, Prefect flow run name and checkpoint folder: the given one (the
        CLI's ``--run-name``, the flow's ``run_name``), else ``tracking.run_name``, else ``name``."""
        return given or self.tracking.run_name or self.name

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self, describe: bool = False) -> str:
        """The resolved config as YAML; ``describe``: every key preceded by its field description as a comment
        (``aepo config show --describe``; loads back to the same config)."""
        if not describe:
            return yaml.safe_dump(self.to_dict(), sort_keys=False)
        return "\n".join(described_lines(self, 0)) + "\n"

    def flat(self) -> dict[str, Any]:
        """Dotted key → value, e.g. for tracking params."""
        return flatten(self.to_dict())

    def config_hash(self) -> str:
        """Stable short hash of the resolved config."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_synthetic(spec: str) -> bool:
    """True for the dataset specs ``synthetic`` and ``synthetic:<split>``: the offline generated task, not a file."""
    return spec == "synthetic" or spec.startswith("synthetic:")
