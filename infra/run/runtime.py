"""The policy runtime: what every job that runs the policy needs, and nothing a training run adds.

One :class:`PolicyRuntime` per flow run holds the model, its tokenizer, the engine that samples from it, the
tools, the reward function and the synthetic task when a dataset names it.  Evaluation, cold-start SFT and the
rollouts of training all run on it; only the train flow adds a :class:`~infra.run.trainer.Trainer` on top (backend,
optimizer, data order, checkpoints).  So ``aepo eval`` neither reads the training data nor starts a training
backend: under ``train.backend: deepspeed`` it never imports DeepSpeed.

The rollout prompt (:meth:`PolicyRuntime.prompt_ids`) is part of the algorithm: it is built here, once, from
:func:`aepo_core.protocol.chat_messages`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from aepo_core.config import ExperimentConfig, RolloutConfig
from aepo_core.interfaces import RewardFn, SamplingParams, Tool
from aepo_core.protocol import AgentProtocol
from aepo_core.rewards import make_reward_fn
from aepo_core.rollout.overlap import scheduler_class
from aepo_core.rollout.scheduler import EngineFailure, Question, RolloutResult
from aepo_core.scoring import StepScores, score_trees
from aepo_core.token_classes import tally_trees
from infra.data.loaders import is_synthetic, load_dataset_rows
from infra.data.rows import QuestionRow
from infra.data.synthetic import SyntheticTask
from infra.determinism import use_deterministic_algorithms
from infra.engines.registry import build_engine
from infra.engines.weights import PolicyEngine, PolicyWeights, WeightSource
from infra.models import chat_prompt_ids, load_model_weights, load_policy, pad_token_id
from infra.numerics import DeviceFacts, Numerics, numerics_for
from infra.processes import cpu_seconds
from infra.ranks import Ranks
from infra.tools.registry import build_tools
from infra.training.checkpoint import CheckpointState, load_checkpoint
from infra.training.memory import freeze_live_objects, release_memory, thaw_live_objects

if TYPE_CHECKING:
    from infra.engines.vllm_server import VLLMServer

log = logging.getLogger(__name__)

__all__ = ["PolicyRuntime", "StaleWeightsError", "build_runtime", "seed_everything"]


class StaleWeightsError(RuntimeError):
    """A rollout sampled by weights other than the trainer's current ones (strict mode)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def uses_synthetic(cfg: ExperimentConfig) -> bool:
    """Whether any dataset the config names (training or evaluation) is the synthetic task."""
    return is_synthetic(cfg.data.train) or any(is_synthetic(d) for d in cfg.eval.datasets)


@dataclass
class PolicyRuntime:
    """The policy and everything that samples, calls tools and scores around it (see the module docstring)."""

    cfg: ExperimentConfig
    model: torch.nn.Module
    tokenizer: object
    engine: PolicyEngine
    tools: dict[str, Tool]
    reward_fn: RewardFn
    task: SyntheticTask | None
    numerics: Numerics
    """The dtypes the run computes in on this device (``cfg`` keeps what was asked, maybe ``auto``) and why."""
    server: VLLMServer | None = None
    rollout_engine: PolicyEngine | None = None
    """The engine of the training rollouts where it is not ``engine`` (the int8 copy of ``model.sampler_dtype``)."""
    protocol: AgentProtocol = field(default_factory=AgentProtocol)
    _prompts: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        """Close the engine (removing its weight exports) and stop what the runtime started (the managed vLLM
        server); idempotent."""
        self.engine.close()
        if self.rollout_engine is not None:
            self.rollout_engine.close()
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> PolicyRuntime:
        freeze_live_objects()  # each phase boundary's collection then walks only what the run made (memory.py)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            thaw_live_objects()

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by this process, its finished children (sandboxed code) and the managed vLLM
        server's processes; a phase's are the difference of two readings (:func:`infra.processes.cpu_seconds`)."""
        server = self.server.pid if self.server is not None else None
        return cpu_seconds([server] if server is not None else [])

    @property
    def gpus(self) -> int:
        """GPUs this process computes on (1 when the policy lives on CUDA, else 0): the common budget's GPU-seconds
        are a phase's wall seconds times this, summed over ranks. A managed vLLM server on its own GPU is not
        counted (every run here samples on the trainer's device or on CPU)."""
        return int(next(self.model.parameters()).device.type == "cuda")

    def prompt_ids(self, question: str) -> list[int]:
        """The rollout prompt of ``question``: the chat template is applied once per question; the transcript then
        only grows by token ids."""
        if question not in self._prompts:
            self._prompts[question] = chat_prompt_ids(self.tokenizer, question, self.protocol.system_prompt)
        return self._prompts[question]

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of transcript text (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    @property
    def sampler(self) -> PolicyEngine:
        """The engine of the training rollouts: the int8 copy where ``model.sampler_dtype`` resolved to int8, else
        ``engine``."""
        return self.rollout_engine or self.engine

    @property
    def eval_engine(self) -> PolicyEngine:
        """The engine evaluation samples from: the policy's (``engine``), or the rollouts' with ``eval.sampler:
        rollout``."""
        return self.sampler if self.cfg.eval.sampler == "rollout" else self.engine

    def sample(self, rows: Sequence[QuestionRow], rollout: RolloutConfig, seed: int,
               sampling: SamplingParams | None = None, *, engine: PolicyEngine | None = None) -> RolloutResult:
        """Rollout trees of ``rows`` under ``rollout`` (training: the configured AEPO/ARPO/independent sampling;
        evaluation: n independent samples), with the configured tools, sampled by ``engine`` (default: the training
        rollouts' :attr:`sampler`; evaluation passes :attr:`eval_engine`). Requests the engine could not answer
        after its own retries raise :class:`~aepo_core.rollout.scheduler.EngineFailure` naming ``rollout.engine``
        (the task's retry, then the run, takes over): a failed leaf is never scored, stored or trained on."""
        engine = engine or self.sampler
        scheduler = scheduler_class(rollout.scheduling)(engine, self.tools, rollout,
                                                        tool_timeout_s=self.cfg.tools.timeout_s,
                                                        tool_workers=self.cfg.tools.workers)
        try:
            result = scheduler.run([Question(row.id, self.prompt_ids(row.question)) for row in rows], seed=seed,
                                   sampling=sampling)
        except EngineFailure as e:
            raise e.on(f"rollout.engine={self.cfg.rollout.engine}") from None
        finally:
            engine.release()  # retained KV of this rollout is never asked for again: free it now
            release_memory()  # and its heap pages, or the update stacks on them
        return dataclasses.replace(result, stats={**result.stats, **self._weight_version_stats(result, engine),
                                                  **self._entropy_map(result, rollout)})

    def _entropy_map(self, result: RolloutResult, rollout: RolloutConfig) -> dict[str, float]:
        """Where the sampled responses' entropy lives (:mod:`aepo_core.token_classes`): mean entropy by token class
        and window, each class's share of model tokens, the share at or above 0.672 nats (``rollout/entropy_*``,
        ``rollout/share_*``, ``rollout/high_entropy_share``). Entropies an engine only estimated (top-k) are
        tallied as they are."""
        decode = functools.lru_cache(maxsize=None)(lambda t: self.tokenizer.decode([t]))
        return tally_trees(result.trees, decode, rollout.entropy_window).metrics()

    def _weight_version_stats(self, result: RolloutResult, engine: PolicyEngine) -> dict[str, float]:
        """Model segments sampled by weights other than the last ones loaded (``rollout/stale_segments``) and the
        version expected; under ``rollout.vllm.strict_weight_version`` a stale segment fails the rollout."""
        expected = engine.weight_version
        versions = result.weight_versions()
        if expected is None or set(versions) <= {None}:
            return {}
        stale = {v: n for v, n in versions.items() if v is not None and v != expected}
        stats = {"stale_segments": float(sum(stale.values()))}
        if expected.isdigit():
            stats["weight_version"] = float(expected)
        if stale and self.cfg.rollout.vllm.strict_weight_version:
            raise StaleWeightsError(f"{sum(stale.values())} model segments were sampled by weight versions "
                                    f"{sorted(stale)} while the trainer's weights are version {expected} "
                                    "(rollout.vllm.strict_weight_version)")
        return stats

    def score(self, result: RolloutResult, rows: Sequence[QuestionRow]) -> StepScores:
        """Rewards and group advantages of a training rollout (the trees are not modified)."""
        golds = {row.id: list(row.golds) for row in rows}
        return score_trees(result.trees, golds, self.reward_fn, self.cfg.algorithm,
                           self.cfg.rollout.max_response_tokens)

    def load_rows(self, spec: str) -> list[QuestionRow]:
        """The validated rows of a dataset spec (bad rows fail or are skipped, as ``data.on_bad_row`` says)."""
        d = self.cfg.data
        return load_dataset_rows(spec, d.on_bad_row, data_root=d.data_root, synthetic=self.task)

    def eval_datasets(self) -> list[str]:
        """``eval.datasets``, else ``data.validation``, else the synthetic test split when the task is synthetic."""
        if self.cfg.eval.datasets:
            return list(self.cfg.eval.datasets)
        if self.cfg.data.validation:
            return [self.cfg.data.validation]
        return ["synthetic:test"] if self.task is not None else []

    def weights_changed(self, source: WeightSource) -> None:
        """Hand new weights to the engines (after SFT, an update, a resume or a loaded checkpoint)."""
        self.engine.load_weights(source)
        if self.rollout_engine is not None:
            self.rollout_engine.load_weights(source)

    def load_checkpoint_weights(self, path: Path) -> CheckpointState:
        """The policy weights of a checkpoint (no optimizer, no RNG state), also into the engine."""
        state = load_checkpoint(path, model=self.model, restore_rng=False)
        self.weights_changed(PolicyWeights(self.model, state.step))
        return state

    def load_policy_weights(self, model_dir: Path, step: int, protocol: AgentProtocol) -> None:
        """The weights of an HF model directory (a registered policy's ``model/``), also into the engine, and the
        agent protocol it was trained with (its system prompt starts every rollout from now on)."""
        load_model_weights(self.model, model_dir)
        self.weights_changed(PolicyWeights(self.model, step))
        self.protocol = protocol
        self._prompts.clear()


def planned_numerics(cfg: ExperimentConfig, machine: DeviceFacts | None = None) -> Numerics:
    """The dtypes a runtime built from ``cfg`` computes in: ``auto`` resolved for ``machine`` (a sweep's) or this one
    (:func:`~infra.numerics.numerics_for`). With ``train.deterministic`` the deterministic kernels are switched on
    first (:mod:`infra.determinism`: before anything, the probe included, initializes CUDA)."""
    use_deterministic_algorithms(cfg.train.deterministic)
    return numerics_for(cfg, machine)


def build_runtime(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str | None = None,
                  numerics: Numerics | None = None) -> PolicyRuntime:
    """Seed, load the policy, build its engine, tools and reward function.

    ``runs_dir`` holds the tools' caches and (remote engines) the weight exports ``weights/<run name>/`` (a
    launcher's rank r > 0: ``weights/<run name>-rank<r>/``). ``auto``
    dtypes are resolved for this device (:mod:`infra.numerics`) unless ``numerics`` are given (a resumed run's
    recorded ones, a sweep cell's): the runtime's ``numerics``. With ``train.deterministic`` the deterministic
    kernels are switched on first (:mod:`infra.determinism`).
    """
    numerics = numerics or planned_numerics(cfg)
    runs = Path(runs_dir)
    seed_everything(cfg.seed)
    task = SyntheticTask.from_config(cfg.data) if uses_synthetic(cfg) else None
    model, tokenizer = load_policy(cfg.model)
    rank = Ranks.current().rank  # each rank's own export folder (a managed server per rank reads its own)
    weights_dir = runs / "weights" / f"{run_name or cfg.name}{f'-rank{rank}' if rank else ''}"
    tools = build_tools(cfg.tools, runs, documents=task.documents() if task else None)
    built = build_engine(cfg, numerics, model, tokenizer, weights_dir)
    return PolicyRuntime(cfg, model, tokenizer, built.engine, tools, make_reward_fn(cfg.reward), task, numerics,
                         built.server, built.sampler)
