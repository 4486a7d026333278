"""The int8 sampler copy: the policy with its linear layers in int8, for the in-process engine's training rollouts.

**What is quantized, and how.** Every ``torch.nn.Linear`` but the MLP down projections (:data:`KEEP_FLOAT`) becomes
an :class:`Int8Linear`: its weight in int8, symmetric **per output channel**,

    s_o = max_i |W_oi| / 127,        Q_oi = round(W_oi / s_o) ∈ [−127, 127],

its input quantized **per token** at every call (s_t = max_i |x_ti| / 127), the product on the CPU's int8
dot-product instructions (``torch._int_mm``, int32 accumulation: AVX-512 VNNI on Zen 4 and the Xeons), rescaled by
s_t·s_o. Embeddings, norms, attention and its KV cache and the down projections compute in the generation path's
dtype (bf16 where that is the fast path, else float32); the sampler's log-probs and entropies come from float32
logits as always.

**Why these choices** (SmolLM2-135M, KL(π_float32 ‖ π_copy) per token over 4 sampled 80-token answers, full
sequences): torch's own dynamic quantization (activations per *tensor*) 0.24, because a few tokens (the first) carry
activations ~60× the mean and set the scale of every row; per token 0.048. The down projections' inputs have a few
channels ~120× their mean (the outlier features of small LMs), which no per-token scale absorbs: in float32 the KL
falls to 0.032 (a bf16 copy: 0.001). SmoothQuant-style migration of the outliers into the weights (α = 0.5)
reached 0.022 with the down projections in int8 and was left out (a calibration set, and norms that differ from
the policy's).

**Speed.** The matmuls are faster: on a 2-core AMD EPYC (Zen 4, avx512_bf16 and VNNI, no AMX; one thread, torch 2.13)
a 16-row 576 → 1536 projection took 0.37 ms in float32, 0.19 ms in bf16, 0.13 ms here (quantizing the input
included); the 576 → 49152 LM head 27.4 / 11.3 / 7.6 ms. The demo's rollouts are not: 84 tokens/s from this copy
(its other layers in bf16) and from the bf16 copy alike, 75 with its other layers in float32 (bench/README.md,
"The int8 sampler"), so it is asked for (``model.sampler_dtype: int8``), never chosen by default.

**What it costs.** The sampler is another policy than the trainer: its log-probs differ (the sampler–trainer gap,
``train/rollout_trainer_logprob_gap``), so the trainer's scoring pass gives π_old and ``algorithm.rollout_correction:
auto`` weights the policy term by min(π_old / π_int8, C) (TIS). Evaluation does not sample from this copy unless
``eval.sampler: rollout`` asks it to (Pass@1 stays the trained policy's).

**Refreshing.** After every weight change (SFT, an optimizer step, a resume) :meth:`Int8Copy.refresh` quantizes the
live weights again into the same layers and copies the float parameters in place.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["KEEP_FLOAT", "Int8Copy", "Int8Linear"]

KEEP_FLOAT = ("down_proj",)
"""Linear layers (by the last part of their name) the copy keeps in float32: the MLP down projections of
Llama-family models, whose input has outlier channels (see the module docstring)."""


class Int8Linear(torch.nn.Module):
    """y = (Q(x) · Qᵀ) ⊙ s_x s_w + b: int8 weights per output channel, activations quantized per row (token) at
    every call, s_x = max_j |x_j| / 127, the product on ``torch._int_mm`` (int32 accumulation)."""

    weight_t: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", torch.empty(0, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(0))
        self.register_buffer("bias", None)
        self.load(linear)

    @torch.no_grad()
    def load(self, linear: torch.nn.Linear) -> None:
        """Quantize ``linear``'s weight (s_o = max_i |W_oi| / 127; an all-zero row keeps a tiny scale) and bias."""
        w = linear.weight.detach().float().cpu()
        scale = w.abs().amax(dim=1).div_(127.0).clamp_(min=1e-12)
        self.weight_t = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).t().contiguous()
        self.weight_scale = scale
        self.bias = linear.bias.detach().float().cpu().clone() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=1e-12)
        q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
        y = torch._int_mm(q, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def _quantized(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] not in KEEP_FLOAT


class Int8Copy:
    """An int8 copy of a float policy (see the module docstring), refreshed from the live weights in place."""

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
        """Copy ``source`` (a float model on the CPU) and quantize its linear layers; everything else (embeddings,
        norms, attention and its KV cache, the float layers) computes in ``dtype`` (the generation path's: a bf16
        base sampled 84 tokens/s of the demo's rollouts on the Zen 4 EPYC, a float32 one 75)."""
        if next(source.parameters()).device.type != "cpu":
            raise ValueError("the int8 sampler copy runs on the CPU (model.sampler_dtype=int8 needs model.device=cpu)")
        model = copy.deepcopy(source).to(dtype).eval()
        model.requires_grad_(False)
        self.names = [name for name, m in source.named_modules() if _quantized(name, m)]
        for name in self.names:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Int8Linear(source.get_submodule(name)))
        self.model = model

    @torch.no_grad()
    def refresh(self, source: torch.nn.Module) -> None:
        """Quantize ``source``'s linear weights again into this copy and copy its other parameters and buffers
        (embeddings, norms, the float layers) in place: the copy then samples from ``source``'s weights."""
        for name in self.names:
            layer = self.model.get_submodule(name)
            assert isinstance(layer, Int8Linear)
            layer.load(source.get_submodule(name))  # type: ignore[arg-type]
        own = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name, tensor in [*source.named_parameters(), *source.named_buffers()]:
            if name in own:
                own[name].copy_(tensor)
