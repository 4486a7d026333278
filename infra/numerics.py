"""Numerics chosen for the machine a run is on: bf16 where the device runs it natively, float32 elsewhere.

bf16 is the fast path only where the hardware has bf16 matrix units. On a 2-core Xeon with AMX (torch capability
``AVX512``, flags ``amx_bf16``) bf16 autocast trains SmolLM2-135M ~2× faster than float32; on an AMD EPYC with AVX2
only, a bf16 matmul ran at 1.2 GFLOP/s against 37.6 GFLOP/s in float32 (31× slower: 512×576 @ 576×1536, one
thread, torch 2.13), and a demo tuned for AMX did not finish. So ``auto`` (the default of ``model.compute_dtype``,
``model.generation_dtype`` and ``rollout.vllm.dtype``) decides from the device:

- CUDA: bf16 where ``torch.cuda.is_bf16_supported()``, else float32;
- CPU: bf16 where the CPU reports AMX-BF16 or AVX512-BF16 **and** a sub-second matmul probe measures bf16 no slower
  than float32 (flags can lie: a VM may advertise what it traps, and ``ONEDNN_MAX_CPU_ISA=AVX2`` hides AMX from
  the kernels while the flags still show it); float32 elsewhere.

Explicit dtypes still win (bf16 numerics on purpose); a warning names the slow path when they are one. The
decision is made once per process (:func:`device_facts` is cached) and recorded with every run
(:meth:`Numerics.params`, :meth:`Numerics.tags`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch

from aepo_core.config import ExperimentConfig

log = logging.getLogger(__name__)

__all__ = ["AUTOCAST_DTYPES", "GENERATION_DTYPES", "DeviceFacts", "Numerics", "auto_dtype", "autocast_dtype",
           "bf16_speedup", "device_facts", "numerics_for", "resolve_numerics", "vllm_device"]

AUTO = "auto"

PROBE_SHAPE = (128, 576, 1536)
"""(rows, in, out) of the probe's matmul: SmolLM2-135M's MLP projection on a short micro-batch, 0.23 GFLOP. Measured
(``bench/numerics.py``, 2 cores): ~1.6 ms in float32 and ~0.5 ms in bf16 on the AMX Xeon, 14 ms in bf16 with its
kernels held to AVX2; ~0.2 s for one bf16 call at the AMD EPYC's 1.2 GFLOP/s (the probe then stops after one)."""


@dataclass(frozen=True)
class DeviceFacts:
    """What decides the numerics on one device: its name, torch's capability, native bf16, the probe's speed-up."""

    device: str
    """``cpu`` or ``cuda`` (the device type of ``model.device``)."""
    name: str
    """The CPU model (``/proc/cpuinfo``) or the GPU's name."""
    capability: str
    """torch's kernel capability: ``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, …) on CPU,
    ``sm_XY`` on CUDA."""
    native_bf16: bool
    """The hardware reports bf16 matrix support: AMX-BF16 or AVX512-BF16 on CPU, ``is_bf16_supported`` on CUDA."""
    cores: int
    """CPU cores torch computes on (``torch.get_num_threads()``) or the GPU's multiprocessors."""
    bf16_speedup: float | None = None
    """float32 time ÷ bf16 time of the probe matmul (> 1: bf16 faster); None where no probe ran (CUDA, or a CPU
    without native bf16: nothing to confirm)."""

    @property
    def fast_bf16(self) -> bool:
        """bf16 is the fast path here: native, and not measured slower than float32."""
        return self.native_bf16 and (self.bf16_speedup is None or self.bf16_speedup >= 1.0)

    def describe(self) -> str:
        """``<name>, <capability>, native bf16 (3.1× float32)`` — what the dtypes were chosen for."""
        probe = f" ({self.bf16_speedup:.1f}× float32)" if self.bf16_speedup is not None else ""
        return f"{self.name}, {self.capability}, {'native bf16' if self.native_bf16 else 'no native bf16'}{probe}"


@dataclass(frozen=True)
class Numerics:
    """The dtypes a run computes in, resolved from ``auto`` for the device it is on."""

    compute_dtype: str
    """``model.compute_dtype`` resolved: the autocast dtype of forward passes (float32: no autocast)."""
    generation_dtype: str
    """``model.generation_dtype`` resolved: ``same`` or the dtype of the engine's own weight copy."""
    vllm_dtype: str
    """``rollout.vllm.dtype`` resolved: the managed vLLM server's ``--dtype``."""
    facts: DeviceFacts

    def params(self) -> dict[str, str]:
        """MLflow params of the resolved numerics (beside the config's own, which may say ``auto``)."""
        return {"numerics.compute_dtype": self.compute_dtype, "numerics.generation_dtype": self.generation_dtype,
                "numerics.vllm_dtype": self.vllm_dtype}

    def tags(self) -> dict[str, str]:
        """MLflow tags of the machine the numerics were chosen for."""
        f = self.facts
        return {"system.device": f.device, "system.cpu" if f.device == "cpu" else "system.gpu": f.name,
                "system.capability": f.capability, "system.native_bf16": str(f.native_bf16).lower(),
                "system.cores": str(f.cores),
                **({"system.bf16_speedup": f"{f.bf16_speedup:.2f}"} if f.bf16_speedup is not None else {})}

    def describe(self) -> str:
        """One line for a terminal: the dtypes and the machine they were chosen for."""
        return (f"numerics: compute {self.compute_dtype}, generation {self.generation_dtype}, vLLM {self.vllm_dtype}"
                f" — {self.facts.describe()}")


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""A resolved ``model.compute_dtype`` → its autocast dtype (float32: none)."""

GENERATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""A resolved ``model.generation_dtype`` (other than ``same``) → the dtype of the engine's own weight copy."""


def autocast_dtype(name: str) -> torch.dtype | None:
    """The autocast dtype of a resolved ``model.compute_dtype`` (None: plain float32 compute)."""
    if name == AUTO:
        raise ValueError("model.compute_dtype=auto is resolved for the device first (infra.numerics.numerics_for)")
    return AUTOCAST_DTYPES.get(name)


def auto_dtype(facts: DeviceFacts) -> str:
    """What ``auto`` computes in on a device with ``facts``: bfloat16 where it is the fast path, else float32."""
    return "bfloat16" if facts.fast_bf16 else "float32"


def resolve_numerics(cfg: ExperimentConfig, facts: DeviceFacts) -> Numerics:
    """The dtypes of ``cfg`` on a device with ``facts``: ``auto`` → bf16 where bf16 is the fast path (for generation:
    the engine's own bf16 copy), float32 elsewhere (for generation: ``same``, the training weights themselves). An
    explicit bf16 on a device where it is the slow path is kept, with a warning."""
    m, vllm = cfg.model, cfg.rollout.vllm
    auto = auto_dtype(facts)
    compute = auto if m.compute_dtype == AUTO else m.compute_dtype
    generation = ("bfloat16" if facts.fast_bf16 else "same") if m.generation_dtype == AUTO else m.generation_dtype
    vllm_dtype = auto if vllm.dtype == AUTO else vllm.dtype
    if not facts.fast_bf16:
        chosen = [("model.compute_dtype", m.compute_dtype), ("model.generation_dtype", m.generation_dtype)]
        if cfg.rollout.engine == "vllm":
            chosen.append(("rollout.vllm.dtype", vllm.dtype))
        slow = [f"{key}=bfloat16" for key, value in chosen if value == "bfloat16"]
        if slow:
            _warn_once(f"{', '.join(slow)}: bf16 is the slow path on {facts.describe()} (float32 is faster here); "
                       "`auto` would choose float32")
    return Numerics(compute, generation, vllm_dtype, facts)


@functools.cache
def _warn_once(message: str) -> None:
    """A warning logged once per process (the CLI and the flow it runs both resolve the same config)."""
    log.warning("%s", message)


def numerics_for(cfg: ExperimentConfig) -> Numerics:
    """The dtypes ``cfg`` resolves to on this process's device (the config itself keeps what was asked)."""
    return resolve_numerics(cfg, device_facts(torch.device(cfg.model.device).type))


def vllm_device() -> str:
    """The device type a managed vLLM server computes on: CUDA where present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def device_facts(device: str = "cpu") -> DeviceFacts:
    """The facts of this process's ``device`` type (cached: the probe runs once per process)."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return DeviceFacts("cuda", props.name, f"sm_{props.major}{props.minor}", torch.cuda.is_bf16_supported(),
                           props.multi_processor_count)
    native = _cpu_native_bf16()
    return DeviceFacts("cpu", cpu_model(), torch.backends.cpu.get_cpu_capability(), native, torch.get_num_threads(),
                       bf16_speedup() if native else None)


def _cpu_native_bf16() -> bool:
    """The CPU reports bf16 matrix instructions (AMX-BF16 or AVX512-BF16), per torch's cpuinfo."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE, reps: int = 5) -> float:
    """float32 time ÷ bf16 time of one ``shape`` matmul on one thread of this CPU (best of ``reps`` after a warm-up
    each), in well under a second: a bf16 rep slower than 4× the float32 best ends the probe early (the answer is
    already no)."""
    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)

    def best(dtype: torch.dtype, limit: float = float("inf")) -> float:
        xd, wd = x.to(dtype), w.to(dtype)
        torch.nn.functional.linear(xd, wd)  # warm-up: oneDNN builds its primitive on the first call
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            times.append(time.perf_counter() - t0)
            if times[-1] > limit:
                break
        return min(times)

    # One thread: beside another CPU-heavy process, two OpenMP threads that wait on each other time both dtypes
    # alike (read 0.9-1.4 on an AMX Xeon whose kernels run bf16 2.7-4x faster); one thread times the kernels.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            fp32 = best(torch.float32)
            bf16 = best(torch.bfloat16, limit=4 * fp32)
    finally:
        torch.set_num_threads(threads)
    speedup = fp32 / max(bf16, 1e-9)
    log.debug("bf16 probe %s on %s: float32 %.2f ms, bf16 %.2f ms (%s)", shape, cpu_model(), fp32 * 1e3,
              bf16 * 1e3, os.environ.get("ONEDNN_MAX_CPU_ISA", "all ISAs"))
    return speedup
