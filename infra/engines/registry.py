"""The rollout engine a config names, built in one place: ``rollout.engine`` picks a builder by name (as verl's
``workers/rollout/base.py`` registry picks a rollout class).

- ``hf``: :class:`~infra.engines.hf.HFEngine` in this process, on the training model or on its own copy in
  ``model.generation_dtype``; with ``model.sampler_dtype`` resolved to int8 the training rollouts get a second
  ``HFEngine`` on an int8 copy (:mod:`infra.engines.int8`), evaluation keeps the first;
- ``vllm``: a vLLM server the run starts (:class:`~infra.engines.vllm_server.VLLMServer`, serving the policy as
  loaded) behind a :class:`~infra.engines.remote.RemoteEngine`; the caller stops the server
  (:attr:`BuiltEngine.server`);
- ``remote``: a completions server someone else runs (``rollout.remote``), behind a ``RemoteEngine``.

Both server engines are wrapped in an :class:`~infra.engines.exact_entropy.ExactEntropyEngine` unless
``rollout.exact_entropy`` is off.

The remote and vLLM modules are imported only by the builders that need them (as the runtime did before).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from aepo_core.config import ExperimentConfig, RemoteEngineConfig
from infra.engines.weights import PolicyEngine
from infra.numerics import GENERATION_DTYPES, Numerics, autocast_dtype
from infra.ranks import Ranks

if TYPE_CHECKING:
    from infra.engines.remote import WeightReceiver
    from infra.engines.vllm_server import VLLMServer

log = logging.getLogger(__name__)

INITIAL_VERSION = "0"
"""The weight version of the policy as loaded, before any update (PolicyWeights.version counts updates)."""


@dataclass(frozen=True)
class BuiltEngine:
    """An engine, the server the run started for it (None: nothing to stop) and the engine of the training rollouts
    when it is another (the int8 copy of ``model.sampler_dtype``; None: ``engine`` samples them too)."""

    engine: PolicyEngine
    server: VLLMServer | None = None
    sampler: PolicyEngine | None = None


EngineBuilder = Callable[[ExperimentConfig, Numerics, torch.nn.Module, object, Path], BuiltEngine]
"""(config, resolved numerics, policy model, tokenizer, weight-export folder) → the engine."""


def build_engine(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
                 weights_dir: Path) -> BuiltEngine:
    """The engine of ``rollout.engine`` for ``model``, and the int8 sampler of the training rollouts where the
    numerics say so; ``weights_dir`` receives the weight exports a server loads (``initial/``, ``step-NNNNNN/``)."""
    built = ENGINES[cfg.rollout.engine](cfg, numerics, model, tokenizer, weights_dir)
    if numerics.sampler_dtype != "int8":
        return built
    from infra.engines.hf import HFEngine
    from infra.engines.int8 import Int8Copy

    copy8 = Int8Copy(model, GENERATION_DTYPES.get(numerics.generation_dtype, torch.float32))
    kv_mb = cfg.rollout.kv_reuse_max_mb if cfg.rollout.kv_reuse else 0.0
    sampler = HFEngine(copy8.model, tokenizer, seed=cfg.seed, kv_reuse_mb=kv_mb, refresh=copy8.refresh,
                       version=INITIAL_VERSION)
    return dataclasses.replace(built, sampler=sampler)


def _hf(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
        weights_dir: Path) -> BuiltEngine:
    from infra.engines.hf import HFEngine

    r = cfg.rollout
    gen_dtype = numerics.generation_dtype
    kv_mb = r.kv_reuse_max_mb if r.kv_reuse else 0.0
    if cfg.train.backend == "deepspeed" or (gen_dtype == "same" and not cfg.train.max_staleness):
        if gen_dtype != "same":
            log.warning("model.generation_dtype=%s ignored under DeepSpeed (partitioned weights): the engine shares "
                        "the training model", gen_dtype)
        return BuiltEngine(HFEngine(model, tokenizer, seed=cfg.seed, kv_reuse_mb=kv_mb, version=INITIAL_VERSION,
                                    autocast_dtype=autocast_dtype(numerics.compute_dtype)))
    # An own copy (in the training dtype where generation_dtype is same): the overlapped update of
    # train.max_staleness changes the training weights while this engine samples from older ones.
    dtype = next(model.parameters()).dtype if gen_dtype == "same" else GENERATION_DTYPES[gen_dtype]
    generation_model = copy.deepcopy(model).to(dtype).eval()
    generation_model.requires_grad_(False)
    return BuiltEngine(HFEngine(generation_model, tokenizer, seed=cfg.seed, kv_reuse_mb=kv_mb, version=INITIAL_VERSION))


def _vllm(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
          weights_dir: Path) -> BuiltEngine:
    """The run's own vLLM server, serving the policy as loaded (exported once to ``weights_dir/initial``), reloaded
    in place after every update."""
    from infra.engines.remote import RemoteEngine, export_hf_checkpoint
    from infra.engines.restarting import RestartingEngine
    from infra.engines.vllm_server import VLLMServer

    initial = export_hf_checkpoint(model, tokenizer, weights_dir / "initial")
    server = VLLMServer(initial, cfg.rollout.vllm, log_path=weights_dir / "vllm-server.log").start()
    try:
        server.control.label(INITIAL_VERSION)
    except BaseException:
        server.close()
        raise
    served = RemoteEngineConfig(url=server.url, model=server.served_name, weight_sync="vllm",
                                top_logprobs=cfg.rollout.vllm.top_logprobs)
    remote = RemoteEngine(served, tokenizer, receiver=server.control, weights_dir=weights_dir,
                          loaded_version=INITIAL_VERSION, served_export=initial)
    engine = RestartingEngine(remote, server, cfg.rollout.vllm.max_restarts)
    return BuiltEngine(_exact_entropies(cfg, numerics, model, tokenizer, engine), server)


def _remote(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
            weights_dir: Path) -> BuiltEngine:
    from infra.engines.remote import ReloadEndpoint, RemoteEngine
    from infra.engines.vllm_server import VLLMControl

    r = cfg.rollout.remote
    if not r.url:
        raise ValueError("rollout.engine=remote needs rollout.remote.url")
    receiver: WeightReceiver | None = None
    if r.weight_sync == "vllm":
        receiver = VLLMControl(r.url)
    elif r.reload_url:
        receiver = ReloadEndpoint(r.reload_url)
    section = r.model_copy(update={"model": r.model or cfg.model.name})
    engine = RemoteEngine(section, tokenizer, receiver=receiver, weights_dir=weights_dir, shared_by=Ranks.current())
    return BuiltEngine(_exact_entropies(cfg, numerics, model, tokenizer, engine))


def _exact_entropies(cfg: ExperimentConfig, numerics: Numerics, model: torch.nn.Module, tokenizer: object,
                     engine: PolicyEngine) -> PolicyEngine:
    """``engine`` with exact entropies from the policy in this process (``rollout.exact_entropy``), or as it is."""
    if not cfg.rollout.exact_entropy:
        return engine
    from infra.engines.exact_entropy import ExactEntropyEngine
    from infra.engines.hf import HFEngine

    # Under train.max_staleness the scorer needs the weights that sampled, not the live ones: its own copy, which
    # takes every weight load the server takes.
    scorer_model = copy.deepcopy(model).eval() if cfg.train.max_staleness else model
    scorer = HFEngine(scorer_model, tokenizer, seed=cfg.seed, autocast_dtype=autocast_dtype(numerics.compute_dtype),
                      kv_reuse_mb=cfg.rollout.kv_reuse_max_mb)
    return ExactEntropyEngine(engine, scorer)


ENGINES: dict[str, EngineBuilder] = {"hf": _hf, "vllm": _vllm, "remote": _remote}
"""``rollout.engine`` → its builder."""
