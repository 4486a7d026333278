"""One config tree for an experiment.

Every constant of the algorithm is a named field here, with the paper's default (AEPO.md §8, Qwen3-14B deep
search).  Small configs in ``configs/`` override what they need.  The tree is loaded from YAML and then
overridden with dotted ``key=value`` strings (CLI ``--set`` and Prefect parameters use the same path).
Unknown keys and wrong types fail with a :class:`ConfigError` that names the dotted key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config problem, with the dotted key (or file) it is about in the message."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(
        "smollm2-135m-instruct",
        description="HF id or local path of any causal LM, or a built-in: smollm2-135m-instruct, tiny-random.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the weights (and the optimizer's master copy). bf16 weights lose AdamW updates "
        "smaller than half an ulp (lr 1e-6 on weights ~0.05): keep float32 and set compute_dtype instead.",
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Autocast dtype of forward passes (generation and training); float32: no autocast."
    )
    generation_dtype: Literal["same", "float32", "bfloat16", "float16"] = Field(
        "same",
        description="Weights of the in-process generation engine. 'same': the training model itself (no copy; "
        "autocast per compute_dtype). A dtype: the engine keeps its own copy in that dtype, refreshed after every "
        "weight change (SFT, update, resume) — autocast re-casts every weight at every decode step, so on CPU a "
        "bf16 copy decodes ~1.5× and prefills ~4× faster than bf16 autocast over float32 weights.",
    )
    device: str = Field("cpu", description="torch device for the policy (cpu, cuda, cuda:0).")
    cache_dir: str | None = Field(None, description="Where converted built-in models are cached.")
    trust_remote_code: bool = False
    init_seed: int = Field(0, description="Seed of tiny-random's weights: the same seed gives identical weights.")
    attn_implementation: str | None = Field(
        None, description="transformers attention backend (sdpa, eager, flash_attention_2); None: its default."
    )


class RolloutConfig(Section):
    """Dynamic entropy-balanced rollout (AEPO.md §1–4)."""

    mode: Literal["aepo", "arpo", "independent"] = "aepo"
    engine: Literal["hf", "remote"] = "hf"
    remote_url: str | None = Field(None, description="Base URL of an OpenAI-compatible completions server.")
    remote_model: str | None = None
    remote_reload_url: str | None = Field(
        None, description="After each update the weights are saved (HF format) and their path POSTed here as "
        '{"path": …} so the server reloads them; None: the server keeps its weights (evaluation-only use).',
    )
    k: int = Field(12, ge=1, description="Rollouts (leaves) per question: the group size.")
    initial_rollouts: int = Field(
        6, ge=1, description="Global samples per question when pre-monitoring is off (arpo mode, or aepo without it)."
    )
    premonitor: bool = Field(True, description="Entropy pre-monitoring decides the global/branch split.")
    beta: float = Field(0.5, description="β of m = clamp(round(k·σ(β(H_root − H̄_tool))), 1, k).")
    entropy_window: int = Field(20, ge=1, description="W: tokens at the start of a segment whose entropy is averaged.")
    gamma: float = Field(0.2, description="γ: weight of ΔH in the branch score.")
    tau: float = Field(0.5, description="τ: branch iff score ≥ τ.")
    branch_penalty: float = Field(
        0.05, ge=0.0, description="λ of the consecutive-branch penalty max(0, 1 − λ·l); 0 gives ARPO's rule."
    )
    beam_size: int = Field(2, ge=2, description="A branch forks beam_size − 1 new trajectories.")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering.")
    max_tool_calls: int = Field(6, ge=0)
    max_response_tokens: int = Field(6192, ge=1, description="Counts tool-result tokens too.")
    max_result_chars: int = Field(4000, ge=1, description="Tool result text is cut to this many characters.")
    max_segment_tokens: int | None = Field(
        None, ge=1, description="Cap on one generated segment (None: remaining budget)."
    )


class SearchToolConfig(Section):
    enabled: bool = True
    backend: Literal["bm25", "replay", "http"] = "bm25"
    corpus: str | None = Field(None, description="Documents for bm25 (JSONL/Parquet path) or a replay cache JSON.")
    index_dir: str | None = Field(None, description="Where the BM25 index is cached (default: under the runs dir).")
    top_k: int = Field(3, ge=1)
    snippet_chars: int = Field(400, ge=1)
    http_url: str | None = None
    http_api_key_env: str = Field("AEPO_SEARCH_API_KEY", description="Environment variable holding the API key.")
    http_request_timeout_s: float = Field(
        10.0, gt=0.0, description="Socket timeout of one HTTP search request (the tool's wall timeout still applies)."
    )
    retry_backoff_s: float = Field(
        0.5, ge=0.0, description="First retry delay for transient search errors; doubles each retry (with jitter)."
    )


class PythonToolConfig(Section):
    enabled: bool = True
    cpu_seconds: int = Field(10, ge=1)
    memory_mb: int = Field(1024, ge=16)
    file_size_mb: int = Field(16, ge=1)
    max_processes: int = Field(64, ge=1)
    max_output_chars: int = Field(4000, ge=1)
    isolate_network: bool = Field(True, description="Run under `unshare -n` when the OS allows it.")
    interpreter: str | None = Field(None, description="Python executable for model code (default: the running one).")
    workdir_root: str | None = Field(
        None, description="Parent of the per-call temporary working directories (default: the system temp dir)."
    )


class ToolsConfig(Section):
    search: SearchToolConfig = Field(default_factory=SearchToolConfig)
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    timeout_s: float = Field(30.0, gt=0.0, description="Wall timeout of one tool call.")
    max_retries: int = Field(2, ge=0, description="Retries for transient tool errors only.")
    workers: int = Field(8, ge=1, description="Thread pool size for parallel tool calls.")
    cache: bool = True
    cache_path: str | None = Field(None, description="SQLite tool-result cache (default: under the runs dir).")
    cache_python: bool = Field(
        False, description="Also cache Python results; off because model code may be non-deterministic (time, random)."
    )


LossName = Literal["ppo_clip", "dapo", "aepo", "gppo", "ce_gppo", "cispo", "gspo"]
AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class AlgorithmConfig(Section):
    """Entropy-balanced policy optimization and its baselines (AEPO.md §5–6)."""

    loss: LossName = "aepo"
    advantage: AdvantageName = "grpo"
    adv_eps: float = Field(1e-6, gt=0.0, description="Added to the group std in GRPO normalization.")
    entropy_advantage: bool = Field(True, description="Scale Â by max(0, 1 + α·z(H_t)) per token.")
    entropy_advantage_alpha: float = Field(0.2, ge=0.0, description="α of the entropy-aware advantage.")
    entropy_eps: float = Field(1e-6, gt=0.0, description="Added to the entropy std when standardizing.")
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
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip c for Â < 0 (paper option: 3.0).")
    gppo_beta_low: float = Field(1.0, ge=0.0, description="CE-GPPO β₁ (low side weight).")
    gppo_beta_high: float = Field(1.0, ge=0.0, description="CE-GPPO β₂ (high side weight).")
    kl_coef: float = Field(0.0, ge=0.0, description="0: no reference model is loaded.")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float = Field(10.0, gt=0.0, description="Log-ratio clamp inside the k3 estimator (numerical safety).")
    loss_agg: LossAgg = "token-mean"
    loss_norm_len: int | None = Field(
        None, ge=1, description="Constant of seq-mean-token-sum-norm (default: rollout.max_response_tokens)."
    )
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (0: off).")
    overlong_penalty: float = Field(1.0, ge=0.0)


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    ppo_epochs: int = Field(1, ge=1)
    mini_batch_size: int = Field(8, ge=1, description="Questions per PPO mini-batch.")
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one forward/backward micro-batch.")
    old_logprobs: Literal["trainer", "rollout"] = Field(
        "trainer",
        description="π_old of the PPO ratio: the trainer's own no-grad forward before the update (exact under "
        "PPO epochs > 1, remote engines and top-p sampling), or the sampler's log-probs. The gap is logged.",
    )
    scoring_pass: Literal["auto", "always"] = Field(
        "auto",
        description="The no-grad forward before the update. 'auto' skips it when it cannot change the update: "
        "one PPO epoch over one mini-batch (on-policy: π_old is the gradient pass's own detached log-prob), no KL "
        "term, and exact rollout entropies of the unfiltered sampling distribution (top_p 1, top_k 0).",
    )


class SFTConfig(Section):
    enabled: bool = False
    epochs: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0.0)
    batch_size: int = Field(8, ge=1)
    max_examples: int | None = Field(None, ge=1)


class TrainConfig(Section):
    steps: int | None = Field(None, ge=1, description="RL steps to run (None: epochs × batches per epoch).")
    epochs: int = Field(5, ge=1)
    batch_size: int = Field(64, ge=1, description="Questions per RL step.")
    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (backend deepspeed only).")
    offload_optimizer: bool = Field(
        False, description="DeepSpeed ZeRO 1–3: optimizer state and step on CPU (DeepSpeed's CPU Adam; its first "
        "use compiles an op, minutes on a small CPU)."
    )
    offload_params: bool = Field(False, description="DeepSpeed ZeRO-3: parameters live on CPU between uses.")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout_timeout_s: float = Field(3600.0, gt=0.0, description="Prefect timeout of one rollout task.")
    update_timeout_s: float = Field(3600.0, gt=0.0, description="Prefect timeout of one update task.")
    eval_timeout_s: float = Field(7200.0, gt=0.0, description="Prefect timeout of one evaluation task.")
    task_retries: int = Field(2, ge=0, description="Retries of rollout/score/evaluate on transient errors.")

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> TrainConfig:
        if self.backend == "deepspeed" and self.offload_params and self.zero_stage != 3:
            raise ValueError("train.offload_params needs train.zero_stage=3")
        if self.backend == "deepspeed" and self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage >= 1")
        return self


class CheckpointConfig(Section):
    every: int = Field(10, ge=1, description="Save a checkpoint every N RL steps (and at the end).")
    keep: int = Field(3, ge=1)
    dir: str | None = Field(None, description="Default: <runs_dir>/checkpoints/<run name>.")


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate every M RL steps (0: only at the end).")
    datasets: list[str] = Field(default_factory=list)
    n_samples: int = Field(5, ge=1)
    pass_k: int = Field(5, ge=1)
    temperature: float = Field(0.6, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_questions: int | None = Field(None, ge=1)
    batch_size: int | None = Field(
        None, ge=1, description="Questions per evaluation rollout batch (None: train.batch_size). Larger decode "
        "batches are faster on CPU and GPU; memory grows with questions × n_samples.",
    )
    at_start: bool = Field(False, description="Also evaluate before training (and after cold-start SFT).")
    bootstrap_samples: int = Field(1000, ge=10)
    judge_url: str | None = None
    judge_model: str | None = None

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalConfig:
        if self.pass_k > self.n_samples:
            raise ValueError(f"pass_k ({self.pass_k}) must not exceed n_samples ({self.n_samples})")
        return self


class DataConfig(Section):
    train: str = Field("synthetic", description="'synthetic', or a verl/ARPO Parquet, JSONL or HF datasets path.")
    validation: str | None = None
    on_bad_row: Literal["fail", "skip"] = "fail"
    max_questions: int | None = Field(None, ge=1)
    shuffle: bool = True
    synthetic_seed: int = 0
    synthetic_entities: int = Field(60, ge=4)
    data_root: str | None = Field(
        None,
        description="Where shorthand dataset names (gaia, math500, hard_search_1k…) are found; default: env "
        "AEPO_DATA_ROOT, else the repo's ../shared/data/arpo.",
    )
    synthetic_cities: int = Field(12, ge=1, description="Synthetic task: number of cities (shared by companies).")
    synthetic_countries: int = Field(4, ge=1, description="Synthetic task: number of countries.")
    synthetic_families: list[Literal["single_hop", "two_hop", "compute"]] = Field(
        default_factory=lambda: ["single_hop", "two_hop", "compute"],
        min_length=1,
        description="Synthetic question families: one lookup, a chained lookup, lookups plus Python arithmetic.",
    )
    synthetic_relations: list[str] | None = Field(
        None, description="Synthetic relations to ask (e.g. founded_year, founder_birth_year); None: all in families."
    )
    synthetic_questions_per_company: int | None = Field(
        None, ge=1, description="Synthetic: a seeded sample of this many relations per company; None: all."
    )
    synthetic_validation_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of companies in validation.")
    synthetic_test_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of companies in test (held out).")
    synthetic_templates_per_fact: int = Field(
        3, ge=1, le=3, description="Synthetic difficulty: phrasings in use per fact kind (1 = one fixed wording)."
    )
    synthetic_mentions_per_fact: int = Field(
        1, ge=1, le=3, description="Synthetic: passages stating each fact (each in its own phrasing)."
    )
    synthetic_facts_per_document: int = Field(
        1, ge=1, description="Synthetic: fact sentences per passage (1 spreads each entity over several passages)."
    )
    synthetic_near_name_distractors: int = Field(
        1, ge=0, le=9, description="Synthetic difficulty: namesake passages per company and per founder."
    )
    synthetic_comparison_distractors: int = Field(
        1, ge=0, description="Synthetic difficulty: passages per company that name it next to a rival's fact."
    )


class RewardConfig(Section):
    """Deep-search reward (AEPO.md §7): format check, token F1, tool-use bonus."""

    kind: Literal["deepsearch", "f1", "em", "math"] = "deepsearch"
    format_penalty: float = Field(-1.0, description="Reward when the format check fails.")
    tool_bonus: float = Field(0.1, description="Added when F1 > 0 and every required tool was used.")
    required_tools: list[str] = Field(default_factory=lambda: ["search", "python"])


class TrackingConfig(Section):
    tracking_uri: str | None = Field(None, description="Default: sqlite:///<runs_dir>/mlflow.db.")
    artifact_location: str | None = Field(None, description="Default: <runs_dir>/mlartifacts.")
    experiment: str = "aepo"
    run_name: str | None = None
    system_metrics: bool = True
    log_model: bool = True


class StorageConfig(Section):
    runs_dir: str = "runs"
    trajectories_uri: str | None = Field(None, description="Default: <runs_dir>/trajectories; s3://bucket/prefix ok.")
    s3_endpoint_url: str | None = None


class ExperimentConfig(Section):
    """The whole experiment."""

    name: str = "aepo"
    seed: int = 42
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        r = self.rollout
        if r.initial_rollouts > r.k:
            raise ValueError(f"rollout.initial_rollouts ({r.initial_rollouts}) must not exceed rollout.k ({r.k})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted key → value, e.g. for tracking params."""
        return flatten(self.to_dict())

    def config_hash(self) -> str:
        """Stable short hash of the resolved config."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` → ("a.b", parsed value); the value is read as a YAML scalar/flow collection."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    return key, value


def apply_overrides(tree: dict[str, Any], overrides: Mapping[str, Any] | Iterable[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict; unknown keys are caught later by validation, naming the key."""
    pairs = overrides.items() if isinstance(overrides, Mapping) else (parse_override(o) for o in overrides)
    for key, value in pairs:
        node = tree
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return tree


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
        else:
            lines.append(f"'{loc}': {err['msg']} (got {err.get('input')!r})")
    return f"invalid config{source}: " + "; ".join(lines)


def build_config(tree: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | Iterable[str] = (),
                 source: str = "") -> ExperimentConfig:
    data = json.loads(json.dumps(dict(tree or {})))  # deep copy of plain data
    apply_overrides(data, overrides)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, f" ({source})" if source else "")) from None


def config_from_yaml(
    text: str, overrides: Mapping[str, Any] | Iterable[str] = (), source: str = ""
) -> ExperimentConfig:
    """Parse YAML text (no file I/O here: infra reads files) and apply overrides."""
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse YAML{f' in {source}' if source else ''}: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config{f' {source}' if source else ''} must be a mapping at the top level")
    return build_config(tree, overrides, source)
