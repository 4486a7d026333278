"""Replay one stored RL step's policy update (issue 29): the samples the update saw, read back from the trajectory
store, applied to the weights and optimizer state of the checkpoint before the step, and compared with the run's
own checkpoint after it.

What makes the replay exact: the store keeps, per trajectory, the advantage the update used (``update_advantage``)
and its group's position in the update (``update_group``), so the samples come back in the update's order (the
mini-batches split them in that order); token ids, loss masks and the sampler's log-probs and entropies are stored
as the tree held them (float32, which is what the in-process engine produces: lossless there); the checkpoint holds
weights, AdamW moments, the LR schedule and the RNG streams. What can make it inexact: another numerics (``auto``
resolves per CPU: the replay reports the dtypes it used), another torch or thread count (float sums in another
order), a remote engine's log-probs (float64 on the wire, float32 in the store), data-parallel ranks (each rank
updated its own share).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from aepo_core.config import AlgorithmConfig, ExperimentConfig
from aepo_core.losses import LossInputs, LossNormalizer, token_gradient_weights
from aepo_core.overrides import build_config
from aepo_core.protocol import tool_call_spans
from aepo_core.update_comparison import SampleTokens, entropy_threshold, rule_algorithm, token_classes
from infra.determinism import use_deterministic_algorithms
from infra.models import load_policy, model_dir, pad_token_id
from infra.numerics import Numerics, autocast_dtype, device_facts, numerics_for
from infra.run.checkpoints import CheckpointError, CheckpointStore, checkpoint_store
from infra.run.trainer import build_backend, build_updater, data_order, total_steps
from infra.store import StoreError, TrajectoryStore
from infra.tracking.run import Tracker
from infra.training.backend import TrainBackend
from infra.training.backends import FrozenBackend
from infra.training.batching import TrainSample
from infra.training.checkpoint import load_checkpoint
from infra.training.logprobs import token_divergence
from infra.training.update import MicroBatchObserver


class ReplayError(ValueError):
    """A step that cannot be replayed: not stored, stored before the update's order was kept, no checkpoint."""


REPLAY_ERRORS = (ReplayError, CheckpointError)
"""What a replay raises for a step that cannot be replayed (a damaged or missing checkpoint included)."""


COMPARED_METRICS = ("train/loss", "train/grad_norm", "train/clip_frac", "train/entropy_mean")
"""The step's logged update metrics set beside the replay's."""


def find_run(tracker: Tracker, run: str) -> tuple[str, str]:
    """(run id, run name) of a run id or, else, the newest run of that name."""
    from mlflow.exceptions import MlflowException

    try:
        info = tracker.client.get_run(run).info
        return info.run_id, info.run_name
    except MlflowException:
        named = tracker.runs_named(run)
        if not named:
            raise ReplayError(f"no MLflow run with id or name {run!r} in experiment {tracker.experiment!r} at "
                              f"{tracker.tracking_uri}") from None
        return named[0].run_id, run


def run_numerics(params: dict[str, str], fallback: Numerics) -> Numerics:
    """The dtypes the run computed in (its ``numerics.*`` params); this machine's resolution where it logged none."""
    if "numerics.compute_dtype" not in params:
        return fallback
    return Numerics(params["numerics.compute_dtype"], params["numerics.generation_dtype"],
                    params.get("numerics.vllm_dtype", fallback.vllm_dtype), device_facts(),
                    params.get("numerics.sampler_dtype", "generation"),
                    params.get("numerics.rollout_correction", "none"))


@dataclass(frozen=True)
class LoggedRun:
    """A run as its MLflow run recorded it: id, name and config (the ``config.yaml`` artifact)."""

    run_id: str
    name: str
    cfg: ExperimentConfig


def logged_run(tracker: Tracker, run: str) -> LoggedRun:
    """The run ``run`` (id or name, :func:`find_run`) with its logged config."""
    run_id, name = find_run(tracker, run)
    return LoggedRun(run_id, name, tracker.logged_config(run_id))


@dataclass(frozen=True)
class StoredRun:
    """What replaying a run's steps reads: its tracker, config, numerics, store, checkpoints and LR-schedule
    length."""

    tracker: Tracker
    run_id: str
    name: str
    cfg: ExperimentConfig
    numerics: Numerics
    store: TrajectoryStore
    checkpoints: CheckpointStore
    total_steps: int

    def check_replayable(self, step: int, after: bool = True) -> None:
        """Refuse a step without the checkpoint of step N − 1 (and of step N, when ``after``)."""
        stored = self.checkpoints.steps()
        needed = [step - 1, step] if after else [step - 1]
        if any(s not in stored for s in needed):
            raise ReplayError(f"run {self.name} ({self.run_id}): replaying step {step} needs the checkpoint"
                              f"{'s of steps' if after else ' of step'} {' and '.join(map(str, needed))}; "
                              f"{self.checkpoints} holds {stored or 'none'} (checkpoint.every: 1 keeps every step)")

    def logged_update_metrics(self, step: int) -> dict[str, float | None]:
        """Of :data:`COMPARED_METRICS`, what the run logged at ``step`` (None: not logged)."""
        history = self.tracker.metric_history(list(COMPARED_METRICS), run_id=self.run_id)
        return {k: next((v for s, v in history[k] if s == step), None) for k in COMPARED_METRICS}

    @property
    def numerics_text(self) -> str:
        """The dtypes replayed in: compute, generation."""
        return f"{self.numerics.compute_dtype}, {self.numerics.generation_dtype}"


def stored_run(tracker: Tracker, logged: LoggedRun, runs: Path, training_rows: int) -> StoredRun:
    """The logged run as :class:`StoredRun` (``training_rows``: how many rows it trained on, which with its config
    give its LR schedule's length)."""
    cfg = logged.cfg
    params = tracker.client.get_run(logged.run_id).data.params
    return StoredRun(tracker, logged.run_id, logged.name, cfg, run_numerics(params, numerics_for(cfg)),
                     TrajectoryStore.from_config(cfg.storage, runs_dir=runs),
                     checkpoint_store(cfg, runs, logged.name, logged.run_id),
                     total_steps(cfg, data_order(cfg, training_rows)))


def update_samples(store: TrajectoryStore, run_id: str, step: int) -> list[TrainSample]:
    """The samples of step ``step``'s update, in its order, from the store (see the module docstring)."""
    try:
        traj = store.read_trajectories(run_id=run_id, step=step)
        nodes = store.read_nodes(run_id=run_id, step=step, columns=["question_id", "node_id", "kind",
                                                                    "entropy_is_estimate"])
    except StoreError as exc:
        raise ReplayError(f"run {run_id} step {step}: {exc}") from None
    if traj.empty:
        raise ReplayError(f"run {run_id} step {step}: no stored trajectories in {store.uri} "
                          f"(stored steps: {store.steps(run_id) or 'none'})")
    used = traj[traj["update_group"].notna()]
    if used.empty:
        raise ReplayError(f"run {run_id} step {step}: no trajectory is marked as in the update (update_group): the "
                          "step was stored before schema version 4, or its update had no group")
    estimated = {(r.question_id, int(r.node_id)) for r in nodes.itertuples()
                 if r.kind == "model" and r.entropy_is_estimate}
    samples = []
    for r in used.sort_values(["update_group", "leaf_id"], kind="stable").itertuples():
        mask = [int(m) for m in r.loss_mask]
        if not any(mask):  # as samples_from_trees: a trajectory without a model token trains nothing
            continue
        if math.isnan(r.update_advantage):
            raise ReplayError(f"run {run_id} step {step}: question {r.question_id} leaf {r.leaf_id} is in the update "
                              "without an advantage")
        prompt = [int(t) for t in r.prompt_tokens]
        samples.append(TrainSample(
            input_ids=prompt + [int(t) for t in r.response_tokens], prompt_len=len(prompt), loss_mask=mask,
            rollout_logprobs=[float(x) for x in r.logprobs], advantage=float(r.update_advantage),
            group=int(r.update_group),
            rollout_entropies=None if any((r.question_id, int(n)) in estimated for n in r.path)
            else [float(x) for x in r.entropies], question_id=str(r.question_id)))
    return samples


@dataclass(frozen=True)
class WeightComparison:
    """The replayed weights against a checkpoint's, tensor by tensor."""

    tensors: int
    identical: int
    max_abs_diff: float
    first_different: str | None
    """The first tensor (in the checkpoint's order) whose values differ; None when all are bit-identical."""

    @property
    def bit_identical(self) -> bool:
        return self.identical == self.tensors


def compare_weights(weights: Mapping[str, torch.Tensor], checkpoint: Path) -> WeightComparison:
    """Every tensor of the checkpoint's model (its safetensors files) against ``weights`` of the same name."""
    files = sorted(model_dir(checkpoint).glob("*.safetensors"))
    if not files:
        raise ReplayError(f"checkpoint {checkpoint} has no safetensors weights")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(str(f)))
    missing = sorted(set(saved) - set(weights))
    if missing:
        raise ReplayError(f"the replayed model has no tensor {missing[0]!r} of checkpoint {checkpoint}")
    identical, worst, first = 0, 0.0, None
    for name, want in saved.items():
        got = weights[name].detach().to(want.dtype).cpu()
        if torch.equal(got, want):
            identical += 1
            continue
        first = first or name
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    return WeightComparison(len(saved), identical, worst, first)


@dataclass(frozen=True)
class ReplayedUpdate:
    """The weights after the replayed update, and the update's metrics (the ``train/…`` the step logged)."""

    weights: dict[str, torch.Tensor]
    metrics: dict[str, float]


def _update_from(cfg: ExperimentConfig, run_cfg: ExperimentConfig, numerics: Numerics, before: Path,
                 samples: list[TrainSample], steps: int, observer: MicroBatchObserver | None = None
                 ) -> tuple[TrainBackend, dict[str, float], int]:
    """(backend, metrics, micro-batch token cap): ``cfg``'s update on ``samples`` from checkpoint ``before``
    (weights, optimizer, schedule, RNG; checked against the run's config ``run_cfg``), with the trainer's backend
    and updater, without an engine or tools."""
    use_deterministic_algorithms(cfg.train.deterministic)  # the run's kernels (CUDA: before its first use here)
    model, tokenizer = load_policy(cfg.model)
    backend = build_backend(cfg, model, numerics, steps)
    updater = build_updater(cfg, backend, numerics, pad_token_id(tokenizer), observer=observer)
    optimizer, scheduler = backend.checkpoint_state()
    load_checkpoint(before, model=model, optimizer=optimizer, scheduler=scheduler, config=run_cfg)
    return backend, updater.update(samples), updater.micro_batch_tokens


def replay_update(cfg: ExperimentConfig, numerics: Numerics, before: Path, samples: list[TrainSample],
                  steps: int) -> ReplayedUpdate:
    """The run's update on ``samples``, starting from checkpoint ``before`` (weights, optimizer, schedule, RNG), with
    the backend and updater the trainer builds (``steps``: the run's RL steps, which shape the LR schedule), without
    an engine or tools."""
    backend, metrics, _ = _update_from(cfg, cfg, numerics, before, samples, steps)
    return ReplayedUpdate({k: v.detach().clone() for k, v in backend.module.state_dict().items()}, metrics)


class GradientRecorder:
    """A :class:`~infra.training.update.MicroBatchObserver` that keeps, per sample and response token, the optimizer
    steps that saw it with Â ≠ 0, those among them whose gradient weight w_t = ∂L/∂logπ_t was exactly 0, and Σ|w_t|.
    (With a KL term in the loss, w_t includes it: a clipped token then keeps the KL's weight.)"""

    def __init__(self, algorithm: AlgorithmConfig, samples: list[TrainSample]) -> None:
        self.algorithm = algorithm
        self.active = [np.zeros(s.response_len, dtype=np.int64) for s in samples]
        self.zeroed = [np.zeros(s.response_len, dtype=np.int64) for s in samples]
        self.abs_weight = [np.zeros(s.response_len) for s in samples]

    def micro_batch(self, samples: Sequence[int], inputs: LossInputs, norm: LossNormalizer, norm_len: int) -> None:
        weights = token_gradient_weights(inputs, self.algorithm, norm, norm_len).double().cpu().numpy()
        active = ((inputs.advantages.detach() != 0) & (inputs.mask > 0)).cpu().numpy()
        for row, i in enumerate(samples):
            n = self.active[i].size
            self.active[i] += active[row, :n]
            self.zeroed[i] += active[row, :n] & (weights[row, :n] == 0.0)
            self.abs_weight[i] += np.abs(weights[row, :n])


def tool_call_tokens(tokenizer: PreTrainedTokenizerBase, sample: TrainSample) -> np.ndarray:
    """Per response token of ``sample``: whether any of its characters lie inside a tool call (opening tag through
    closing tag, :func:`aepo_core.protocol.tool_call_spans`) of the decoded response."""
    response = sample.input_ids[sample.prompt_len:]
    text = tokenizer.decode(response)
    # Character ends of each token's text: the decoded prefix's length (non-decreasing: a partial UTF-8 character
    # decodes to a replacement character that the next byte may merge away).
    ends = np.maximum.accumulate([len(tokenizer.decode(response[: i + 1])) for i in range(len(response))])
    starts = np.concatenate([[0], ends[:-1]])
    inside = np.zeros(len(response), dtype=bool)
    for start, end, _call in tool_call_spans(text):
        inside |= (starts < end) & (ends > start)
    return inside


def rule_configs(run_cfg: ExperimentConfig, rules: Sequence[str], overrides: Sequence[str] = ()
                 ) -> dict[str, ExperimentConfig]:
    """Per update rule ``<loss>[@key=value,…]`` its config: the run's, then ``overrides`` (``KEY=VALUE``, for every
    rule), then the rule's algorithm (:func:`aepo_core.update_comparison.rule_algorithm`). All are validated here,
    before any update runs; a bad rule or override is a :class:`ConfigError`."""
    base = build_config(run_cfg.model_dump(mode="json"), overrides, "replay --set")
    configs = {}
    for rule in rules:
        tree = base.model_dump(mode="json")
        tree["algorithm"] = rule_algorithm(base.algorithm, rule).model_dump(mode="json")
        configs[rule] = build_config(tree, (), f"update rule {rule!r}")
    return configs


def compare_update_rules(run_cfg: ExperimentConfig, configs: Mapping[str, ExperimentConfig], numerics: Numerics,
                         before: Path, samples: list[TrainSample], steps: int
                         ) -> tuple[list[dict[str, SampleTokens]], dict[str, dict[str, float]]]:
    """Each rule's config (:func:`rule_configs`) updating on the same ``samples`` from the same checkpoint ``before``
    in the run's order: (per sample, per rule its :class:`SampleTokens`; per rule the update's ``train/…``
    metrics).  Token classes use the start policy's exact entropies (a forward at the run's compute dtype, as the
    update's scoring pass) and the run's ``algorithm.high_entropy_quantile`` over all the step's model tokens."""
    start_model, tokenizer = load_policy(run_cfg.model)
    load_checkpoint(before, model=start_model, restore_rng=False)
    start = FrozenBackend(start_model, autocast_dtype(numerics.compute_dtype))
    pad = pad_token_id(tokenizer)
    tool = [tool_call_tokens(tokenizer, s) for s in samples]
    masks = [np.asarray(s.loss_mask) for s in samples]
    per_sample: list[dict[str, SampleTokens]] = [{} for _ in samples]
    metrics: dict[str, dict[str, float]] = {}
    threshold: float | None = None
    start_states: dict[tuple[int, ...], torch.Tensor] = {}  # the start policy's forward, once for every rule
    for rule, cfg in configs.items():
        recorder = GradientRecorder(cfg.algorithm, samples)
        backend, metrics[rule], cap = _update_from(cfg, run_cfg, numerics, before, samples, steps, recorder)
        divergence = token_divergence(backend, start, samples, pad, cfg.rollout.temperature, cap,
                                      start_states=start_states)
        if threshold is None:  # the start policy's entropies: the same under every rule
            threshold = entropy_threshold([d.entropy_start for d in divergence], masks,
                                          run_cfg.algorithm.high_entropy_quantile)
        for i, d in enumerate(divergence):
            per_sample[i][rule] = SampleTokens(
                token_classes(masks[i], d.entropy_start, tool[i], threshold), recorder.active[i],
                recorder.zeroed[i], recorder.abs_weight[i], d.logprob_after - d.logprob_start, d.kl,
                d.entropy_start, d.entropy_after)
        del backend
    return per_sample, metrics
