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

import copy
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from aepo_core.config import ExperimentConfig, RolloutConfig, StorageConfig
from aepo_core.interfaces import RewardFn, SamplingParams, Tool
from aepo_core.protocol import AgentProtocol
from aepo_core.rewards import make_reward_fn
from aepo_core.rollout.scheduler import Question, RolloutResult, RolloutScheduler
from aepo_core.scoring import StepScores, score_trees
from infra.data.loaders import is_synthetic, load_dataset_rows
from infra.data.rows import QuestionRow
from infra.data.synthetic import SyntheticTask
from infra.engines.weights import PolicyEngine, PolicyWeights, WeightSource
from infra.fs import StorageError, storage_options
from infra.models import chat_prompt_ids, load_policy
from infra.numerics import Numerics, numerics_for
from infra.ranks import Ranks
from infra.tools.registry import build_tools
from infra.training.backends import autocast_dtype
from infra.training.checkpoint import (
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    load_model_weights,
    read_checkpoint_state,
)
from infra.training.checkpoint_store import CheckpointStore, open_checkpoint
from infra.training.memory import release_memory

if TYPE_CHECKING:
    from infra.engines.remote import WeightReceiver
    from infra.engines.vllm_server import VLLMServer

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointStore", "PolicyRuntime", "StorageError", "build_runtime", "checkpoint_config",
           "checkpoint_root", "checkpoint_store", "find_checkpoint", "open_checkpoints",
           "seed_everything"]


GENERATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.generation_dtype`` → the dtype of the engine's own weight copy."""


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
    protocol: AgentProtocol = field(default_factory=AgentProtocol)
    _prompts: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        """Stop what the runtime started (the managed vLLM server); idempotent."""
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> PolicyRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        pad = self.tokenizer.pad_token_id  # type: ignore[attr-defined]
        return int(pad) if pad is not None else 0

    def sample(self, rows: Sequence[QuestionRow], rollout: RolloutConfig, seed: int,
               sampling: SamplingParams | None = None) -> RolloutResult:
        """Rollout trees of ``rows`` under ``rollout`` (training: the configured AEPO/ARPO/independent sampling;
        evaluation: n independent samples), with the configured tools."""
        scheduler = RolloutScheduler(self.engine, self.tools, rollout, tool_timeout_s=self.cfg.tools.timeout_s,
                                     tool_workers=self.cfg.tools.workers)
        try:
            result = scheduler.run([Question(row.id, self.prompt_ids(row.question)) for row in rows], seed=seed,
                                   sampling=sampling)
        finally:
            self.engine.release()  # retained KV of this rollout is never asked for again: free it now
            release_memory()  # and its heap pages, or the update stacks on them
        self._check_weight_versions(result)
        return result

    def _check_weight_versions(self, result: RolloutResult) -> None:
        """Count model segments sampled by weights other than the last ones loaded (``rollout/stale_segments``);
        under ``rollout.vllm.strict_weight_version`` a stale segment fails the rollout."""
        expected = self.engine.weight_version
        versions = result.weight_versions()
        if expected is None or set(versions) <= {None}:
            return
        stale = {v: n for v, n in versions.items() if v is not None and v != expected}
        result.stats["stale_segments"] = float(sum(stale.values()))
        if expected.isdigit():
            result.stats["weight_version"] = float(expected)
        if stale and self.cfg.rollout.vllm.strict_weight_version:
            raise StaleWeightsError(f"{sum(stale.values())} model segments were sampled by weight versions "
                                    f"{sorted(stale)} while the trainer's weights are version {expected} "
                                    "(rollout.vllm.strict_weight_version)")

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
        """Hand new weights to the engine (after SFT, an update, a resume or a loaded checkpoint)."""
        self.engine.load_weights(source)

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


CHECKPOINT_CACHE = Path("cache") / "checkpoints"
"""Under the runs dir: the staging folder of remote saves and the verified local copies of remote checkpoints."""


def _checkpoint_cache(runs_dir: str | os.PathLike[str] | None) -> Path | None:
    """``<runs_dir>/cache/checkpoints``, one folder per data-parallel rank (each rank reads a resume's checkpoint)."""
    if runs_dir is None:
        return None
    rank = Ranks.current().rank
    return Path(runs_dir) / (CHECKPOINT_CACHE if rank == 0 else Path(f"{CHECKPOINT_CACHE}-rank{rank}"))


def checkpoint_root(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str) -> str:
    """The folder of a run name's checkpoints: ``checkpoint.dir``, else ``<storage.checkpoints_uri>/<run name>``, else
    ``<runs_dir>/checkpoints/<run name>``; local or remote (``s3://``). One subfolder per MLflow run id under it."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    if cfg.storage.checkpoints_uri:
        return f"{cfg.storage.checkpoints_uri.rstrip('/')}/{run_name}"
    return str(Path(runs_dir) / "checkpoints" / run_name)


def checkpoint_store(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str,
                     run_id: str) -> CheckpointStore:
    """One run's checkpoints: ``<checkpoint_root>/<MLflow run id>``. Keyed by the id, not the name (a label that the
    common "same config, ``--set algorithm.loss=…``" pattern shares between runs), so that a new run never replaces
    another run's checkpoints. The endpoint of an ``s3://`` root comes from ``storage.s3_endpoint_url``."""
    return open_checkpoints(cfg, runs_dir, f"{checkpoint_root(cfg, runs_dir, run_name).rstrip('/')}/{run_id}")


def open_checkpoints(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], location: str) -> CheckpointStore:
    """The checkpoints at ``location``, local or remote (the endpoint of ``storage.s3_endpoint_url``; verified copies
    under ``<runs_dir>/cache/checkpoints``)."""
    return CheckpointStore(location, storage_options(cfg.storage, location), cache_dir=_checkpoint_cache(runs_dir))


def find_checkpoint(path: str | os.PathLike[str], storage: StorageConfig | None = None,
                    runs_dir: str | os.PathLike[str] | None = None) -> Path:
    """A checkpoint directory (``step-NNNNNN``) or a run's checkpoint root (its newest complete checkpoint), local or
    remote (``s3://…``: copied into ``<runs_dir>/cache/checkpoints`` and verified there, the endpoint from
    ``storage``); a local directory either way."""
    options = storage_options(storage, str(path)) if storage is not None else None
    return open_checkpoint(path, options, cache_dir=_checkpoint_cache(runs_dir))


def build_runtime(cfg: ExperimentConfig, runs_dir: str | os.PathLike[str], run_name: str | None = None
                  ) -> PolicyRuntime:
    """Seed, load the policy, build its engine, tools and reward function.

    ``runs_dir`` holds the tools' caches and (remote engines) the weight exports ``weights/<run name>/``. ``auto``
    dtypes are resolved for this device (:mod:`infra.numerics`): the runtime's ``numerics``.
    """
    numerics = numerics_for(cfg)
    runs = Path(runs_dir)
    seed_everything(cfg.seed)
    task = SyntheticTask.from_config(cfg.data) if uses_synthetic(cfg) else None
    model, tokenizer = load_policy(cfg.model)
    weights_dir = runs / "weights" / (run_name or cfg.name)
    tools = build_tools(cfg.tools, runs, documents=task.documents() if task else None)
    if cfg.rollout.engine == "vllm":
        server = _start_vllm(cfg, model, tokenizer, weights_dir)
        engine = _remote_engine(server.url, server.served_name, tokenizer, cfg.rollout.vllm.top_logprobs,
                                receiver=server.control, weights_dir=weights_dir, loaded_version=INITIAL_VERSION)
        return PolicyRuntime(cfg, model, tokenizer, engine, tools, make_reward_fn(cfg.reward), task, numerics, server)
    engine = _build_engine(cfg, numerics, model, tokenizer, weights_dir)
    return PolicyRuntime(cfg, model, tokenizer, engine, tools, make_reward_fn(cfg.reward), task, numerics)


INITIAL_VERSION = "0"
"""The weight version of the policy as loaded, before any update (PolicyWeights.version counts updates)."""


def _start_vllm(cfg: ExperimentConfig, model: torch.nn.Module, tokenizer: object, weights_dir: Path) -> VLLMServer:
    """The run's own vLLM server, serving the policy as loaded (exported once to ``weights_dir/initial``)."""
    from infra.engines.remote import export_hf_checkpoint
    from infra.engines.vllm_server import VLLMServer

    initial = export_hf_checkpoint(model, tokenizer, weights_dir / "initial")
    server = VLLMServer(initial, cfg.rollout.vllm, log_path=weights_dir / "vllm-server.log").start()
    try:
        server.control.label(INITIAL_VERSION)
    except BaseException:
        server.close()
        raise
    return server


def _remote_engine(url: str, model_name: str, tokenizer: object, top_logprobs: int, *,
                   receiver: WeightReceiver | None, weights_dir: Path, loaded_version: str | None = None
                   ) -> PolicyEngine:
    from infra.engines.remote import RemoteEngine

    return RemoteEngine(url, model_name, tokenizer, top_logprobs=top_logprobs, receiver=receiver,
                        weights_dir=weights_dir, loaded_version=loaded_version)


def _build_engine(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
                  weights_dir: Path) -> PolicyEngine:
    r = cfg.rollout
    if r.engine == "remote":
        from infra.engines.remote import ReloadEndpoint
        from infra.engines.vllm_server import VLLMControl

        if not r.remote.url:
            raise ValueError("rollout.engine=remote needs rollout.remote.url")
        receiver: WeightReceiver | None = None
        if r.remote.weight_sync == "vllm":
            receiver = VLLMControl(r.remote.url)
        elif r.remote.reload_url:
            receiver = ReloadEndpoint(r.remote.reload_url)
        return _remote_engine(r.remote.url, r.remote.model or cfg.model.name, tokenizer, r.remote.top_logprobs,
                              receiver=receiver, weights_dir=weights_dir)
    from infra.engines.hf import HFEngine

    gen_dtype = numerics.generation_dtype
    kv_mb = r.kv_reuse_max_mb if r.kv_reuse else 0.0
    if gen_dtype == "same" or cfg.train.backend == "deepspeed":
        if gen_dtype != "same":
            log.warning("model.generation_dtype=%s ignored under DeepSpeed (partitioned weights): the engine shares "
                        "the training model", gen_dtype)
        return HFEngine(model, tokenizer, seed=cfg.seed, autocast_dtype=autocast_dtype(numerics.compute_dtype),
                        kv_reuse_mb=kv_mb)
    generation_model = copy.deepcopy(model).to(GENERATION_DTYPES[gen_dtype]).eval()
    generation_model.requires_grad_(False)
    return HFEngine(generation_model, tokenizer, seed=cfg.seed, kv_reuse_mb=kv_mb)


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """The resolved config a checkpoint was written with, as a plain tree (empty when it has none)."""
    return read_checkpoint_state(path).config or {}
