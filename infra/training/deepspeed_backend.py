"""DeepSpeed ZeRO (stage 0–3) behind the same small interface as ``TorchBackend``.

Why these choices:

- The policy is wrapped in a module whose forward returns the decoder's last hidden states, and that wrapper
  is what ``deepspeed.initialize`` gets. So ``forward_hidden`` goes through the engine's forward (its
  backward prologue, ZeRO-3 parameter gathering) and the updater still applies the vocabulary projection
  only at response positions. Under ZeRO-3 DeepSpeed hooks every submodule, so calling
  ``module.get_output_embeddings()`` outside that forward gathers the projection's partitioned weight by itself.
- Gradient accumulation is owned by the caller (``managed_gradient_accumulation: false``,
  ``gradient_accumulation_steps: 1``, ``backward(..., scale_wrt_gas=False)``): the updater's micro-batch losses
  already carry the mini-batch normalizers and a mini-batch has a variable number of micro-batches, so
  gradients are summed as they are and every ``step()`` is the boundary.
- The optimizer is the same torch AdamW (same parameter groups) and the same LambdaLR as ``TorchBackend``,
  handed to DeepSpeed as client objects, so both backends make the same update. With optimizer offload the
  optimizer is DeepSpeed's CPU Adam in AdamW mode (the fast path offload exists for) with the same groups and
  the same schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import socket
from collections import OrderedDict
from enum import Enum
from typing import Any

import torch

from aepo_core.config import OptimConfig, TrainConfig
from infra.ranks import Ranks
from infra.training.backends import last_hidden_state
from infra.training.optim import build_optimizer, build_scheduler, lr_factor

log = logging.getLogger(__name__)

_SHM_COMM_OP = "deepspeed_shm_comm"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_single_process_distributed(backend: str | None = None, skip_shm_op: bool = True) -> None:
    """Initialise ``deepspeed.comm`` for one process when no launcher did (tests, laptop runs on CPU).

    Sets ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=<free>`` where missing (a launcher's
    values are kept, so under ``torchrun`` this joins the launcher's ranks). Building DeepSpeed's shared-memory
    all-reduce kernel costs minutes on a small CPU and one rank never uses it; ``skip_shm_op`` marks it unavailable
    so it is not compiled (several CPU ranks then all-reduce through gloo: milliseconds for the test models).
    """
    import deepspeed

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if skip_shm_op:
        deepspeed.ops.__compatible_ops__[_SHM_COMM_OP] = False
    if backend is None and not torch.cuda.is_available():
        backend = "gloo"
    if not torch.distributed.is_initialized():
        log.info("initialising deepspeed.comm (backend %s, world size %s)", backend, os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend=backend)


def shutdown_distributed() -> None:
    """Destroy the process group and forget DeepSpeed's comm backend, so a later init starts clean."""
    import deepspeed.comm.comm as ds_comm

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    ds_comm.cdb = None


class _HiddenStates(torch.nn.Module):
    """The engine's module: the policy's decoder only, so the vocabulary projection stays with the caller."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return last_hidden_state(self.lm, input_ids, attention_mask)


def _param_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """The parameter groups of ``build_optimizer`` (no weight decay on biases and norms)."""
    groups = build_optimizer(model, cfg).param_groups
    return [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]


class _TrainingState:
    """``state_dict``/``load_state_dict`` over the backend's optimizer + scheduler state, for checkpoint code
    written against torch optimizers (ZeRO optimizers' own methods take and give other shapes).

    Under several ranks each rank holds its own ZeRO partition of the optimizer: ``state_dict()`` is then a
    collective (every rank calls it) that gathers ``{"world_size": n, "ranks": [state of rank 0, …]}`` to rank 0
    (an empty dict elsewhere), so the single writer on rank 0 saves one ``optimizer.pt``; ``load_state_dict``
    on every rank takes its own part and refuses another world size (ZeRO partitions depend on it).
    """

    def __init__(self, backend: DeepSpeedBackend) -> None:
        self._backend = backend

    def state_dict(self) -> dict[str, Any]:
        ranks = self._backend.ranks
        own = self._backend.state_dict_for_checkpoint()
        if not ranks.distributed:
            return own
        parts = ranks.gather_to_main(own)
        return {"world_size": ranks.world_size, "ranks": parts} if parts is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = self._backend.ranks
        saved_world = int(state.get("world_size", 1))
        if saved_world != ranks.world_size:
            raise ValueError(f"optimizer state was saved by {saved_world} rank(s), this run has {ranks.world_size}: "
                             "ZeRO partitions depend on the world size")
        self._backend.load_state(state["ranks"][ranks.rank] if ranks.distributed else state,
                                 all_ranks=state["ranks"] if ranks.distributed else None)


class DeepSpeedBackend:
    """Training through ``deepspeed.initialize``: ZeRO stage 0–3, optional bf16 and CPU offload.

    ``module`` is the policy itself (the in-process engine shares it and sees every step's weights; under ZeRO-3
    its modules gather their partitions on each forward). Read full weights with ``consolidated_state_dict()``.

    ``bf16=None`` follows the model's dtype; with bf16 DeepSpeed keeps fp32 master weights in the optimizer
    (ZeRO 1–3; ZeRO-0 accumulates gradients in bf16). ``offload_optimizer`` (ZeRO 1–3) steps DeepSpeed's CPU
    Adam in AdamW mode, whose first use compiles an op (~3 min on 2 cores, cached in ~/.cache/torch_extensions);
    ``offload_params`` needs ZeRO-3. ``extra_config`` is merged last into the DeepSpeed config (an
    ``"optimizer"`` entry there makes DeepSpeed build the optimizer, still with our groups and LR schedule).
    """

    @classmethod
    def from_config(cls, model: torch.nn.Module, optim: OptimConfig, train: TrainConfig, total_steps: int,
                    lr: float | None = None) -> DeepSpeedBackend:
        """The backend ``train.backend == "deepspeed"`` asks for (stage and offload from ``TrainConfig``)."""
        return cls(model, optim, total_steps, zero_stage=train.zero_stage, lr=lr,
                   offload_optimizer=train.offload_optimizer, offload_params=train.offload_params)

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        total_steps: int,
        zero_stage: int = 2,
        bf16: bool | None = None,
        lr: float | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        import deepspeed

        dtype = next(model.parameters()).dtype
        if bf16 is None:
            bf16 = dtype == torch.bfloat16
        if dtype == torch.float16 or (dtype == torch.bfloat16 and not bf16):
            raise ValueError(f"a {dtype} model needs bf16=True (bfloat16) or float32 weights; fp16 is not supported")
        if not 0 <= zero_stage <= 3:
            raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
        if offload_params and zero_stage != 3:
            raise ValueError("offload_params needs ZeRO stage 3")
        if offload_optimizer and zero_stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1–3")
        if not torch.distributed.is_initialized():
            init_single_process_distributed()
        self.model = model
        self.zero_stage = zero_stage
        self.grad_clip = cfg.grad_clip
        self._ranks = Ranks.current()
        base_lr = lr if lr is not None else cfg.lr
        plain = zero_stage == 0 and not bf16
        zero: dict[str, Any] = {"stage": zero_stage}
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if offload_params:
            zero["offload_param"] = {"device": "cpu"}
        if zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the updater sizes micro-batches by tokens
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            # ZeRO-0 in fp32 uses the client optimizer as is and keeps no gradient norm: clipped in _clip_plain.
            "gradient_clipping": 0.0 if plain else cfg.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if offload_optimizer:
            ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": base_lr, "betas": list(cfg.betas),
                                                                  "eps": cfg.eps, "weight_decay": cfg.weight_decay}}
        if extra_config:
            ds_config.update(extra_config)
        wrapper = _HiddenStates(model)
        if "optimizer" in ds_config:  # DeepSpeed builds it (CPU Adam under offload), with our groups and schedule
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=wrapper, model_parameters=_param_groups(model, cfg), config=ds_config,
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda step: lr_factor(step, total_steps, cfg)),
            )
        else:
            client = build_optimizer(model, cfg, lr)
            engine, optimizer, _, scheduler = deepspeed.initialize(
                model=wrapper, optimizer=client, lr_scheduler=build_scheduler(client, cfg, total_steps),
                config=ds_config,
            )
        self.engine = engine
        self.optimizer = optimizer
        self._plain_norm: float | None = None
        self._plain = plain
        if plain:
            if optimizer is not engine.basic_optimizer:
                raise RuntimeError(f"expected DeepSpeed to use the client optimizer as is, got {type(optimizer)}")
            # Inside optimizer.step() the gradients are already all-reduced: clip as TorchBackend does.
            optimizer.register_step_pre_hook(self._clip_plain)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR = scheduler
        log.info("DeepSpeed backend: ZeRO-%d, bf16=%s, optimizer %s, offload optimizer=%s params=%s",
                 zero_stage, bf16, type(optimizer).__name__, offload_optimizer, offload_params)

    def _clip_plain(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self._plain_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip)) if params else 0.0

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        """Where inputs go (under ZeRO-3 parameter offload the parameters themselves report the CPU)."""
        return torch.device(self.engine.device)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """None: DeepSpeed's own bf16 mode decides the precision of the forward, not autocast."""
        return None

    @property
    def chunked_projection(self) -> bool:
        """False: ZeRO reduces a parameter's gradient once per backward, and the chunked projection's backward would
        accumulate a tied embedding twice (measured: ZeRO-2 asserts "Gradient computed twice for this partition")."""
        return False

    @property
    def shares_tree(self) -> bool:
        """False: the engine's forward runs every row (``optim.share_prefix`` is the torch backend's)."""
        return False

    @property
    def ranks(self) -> Ranks:
        """The launcher's data-parallel ranks (the default process group); ``Ranks(0, 1)`` single-process."""
        return self._ranks

    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Decoder hidden states through the engine (gathers ZeRO-3 partitions, arms the backward hooks)."""
        return self.engine(input_ids, attention_mask)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients by plain summation: the loss already carries its mini-batch normalizer.

        Each rank's loss is its share of the global mini-batch loss, so the update wants the ranks' gradients
        summed; DeepSpeed averages them over the data-parallel group, hence the loss × world size.
        """
        world = self._ranks.world_size
        self.engine.backward(loss * world if world > 1 else loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip, optimizer and LR-schedule step; returns the pre-clipping global gradient norm."""
        self.engine.step()
        norm = self._plain_norm if self._plain else self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def current_lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # ------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full state dict on CPU (keys as ``model.state_dict()``), for HF checkpoints.

        Under ZeRO-3 every rank must call this (the partitions are gathered collectively); ranks other than 0
        get an empty dict. Tied weights stay the same tensor, as ``save_pretrained`` expects.
        """
        if self.zero_stage == 3:
            gathered = self.engine._zero3_consolidated_16bit_state_dict()
            if gathered is None:
                return {}
            full = {k.removeprefix("lm."): v for k, v in gathered.items()}
        else:
            full = self.model.state_dict()
        out: dict[str, torch.Tensor] = {}
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        for name, value in full.items():
            same = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype)
            if same not in copies:  # tied weights share storage: copy once, keep them one tensor
                copies[same] = value.detach().to("cpu", copy=True)
            out[name] = copies[same]
        return out

    def checkpoint_state(self) -> tuple[_TrainingState, None]:
        """Optimizer and scheduler state as one object with ``state_dict()`` / ``load_state_dict()``."""
        return _TrainingState(self), None

    @property
    def weights_from_optimizer_state(self) -> bool:
        """True under ZeRO-3: the live parameters are partitions that a full state dict cannot be copied into, and
        loading the optimizer state restores them from its fp32 master weights."""
        return self.zero_stage == 3

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gathered weights under ZeRO-3 (a collective: every rank calls it); None at stages 0–2, whose model
        holds its full weights."""
        return self.consolidated_state_dict() if self.zero_stage == 3 else None

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Optimizer (this rank's ZeRO partition, fp32 master weights included) and LR-scheduler state.

        Plain containers, tensors and numbers only, so ``torch.load(..., weights_only=True)`` reads it back:
        DeepSpeed's loss-scaler object becomes a dict of its fields and its ZeRO-stage enum an int.
        """
        opt = dict(self.optimizer.state_dict())
        scaler = opt.get("loss_scaler")
        if scaler is not None and not isinstance(scaler, dict):
            opt["loss_scaler"] = dict(vars(scaler))
        if isinstance(opt.get("zero_stage"), Enum):
            opt["zero_stage"] = int(opt["zero_stage"])
        if "param_slice_mappings" in opt:  # for DeepSpeed's universal-checkpoint converter; dataclasses → dicts
            opt["param_slice_mappings"] = [{name: dataclasses.asdict(addr) for name, addr in group.items()}
                                           for group in opt["param_slice_mappings"]]
        return {"optimizer": opt, "scheduler": self.scheduler.state_dict(),
                "global_steps": self.engine.global_steps, "zero_stage": self.zero_stage}

    def load_state(self, state: dict[str, Any], all_ranks: list[dict[str, Any]] | None = None) -> None:
        """Restore what ``state_dict_for_checkpoint`` returned (same ZeRO stage, world size and groups).

        ``all_ranks``: under several ranks, every rank's saved state in rank order (``state`` is this rank's):
        DeepSpeed's ZeRO optimizers take the whole list and pick their data-parallel rank's entry.
        Load the model weights first (not under ZeRO-3, see ``weights_from_optimizer_state``): under ZeRO the fp32
        master weights are then taken from this state, so a bf16 run resumes without the precision loss of
        rebuilding them from 16-bit weights.
        """
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        if state.get("zero_stage", self.zero_stage) != self.zero_stage:
            raise ValueError(f"checkpoint was written under ZeRO-{state['zero_stage']}, this is ZeRO-{self.zero_stage}")
        if isinstance(self.optimizer, ZeROOptimizer):
            opts = [self._optimizer_state(s["optimizer"]) for s in (all_ranks or [state])]
            self.optimizer.load_state_dict(opts, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            self.optimizer.load_state_dict(self._optimizer_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.engine.global_steps = int(state.get("global_steps", 0))

    def _optimizer_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A saved optimizer state with DeepSpeed's objects rebuilt (the inverse of ``state_dict_for_checkpoint``)."""
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        opt = dict(saved)
        if isinstance(opt.get("loss_scaler"), dict):
            scaler = copy.copy(self.optimizer.loss_scaler)
            scaler.__dict__.update(opt["loss_scaler"])
            opt["loss_scaler"] = scaler
        if "zero_stage" in opt:
            opt["zero_stage"] = ZeroStageEnum(int(opt["zero_stage"]))
        if "param_slice_mappings" in opt:
            opt["param_slice_mappings"] = [
                OrderedDict((name, fragment_address(**addr)) for name, addr in group.items())
                for group in opt["param_slice_mappings"]
            ]
        return opt
