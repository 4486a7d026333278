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

Explicit dtypes still win (bf16 numerics on purpose); a warning names the slow path when they are one.

The training rollouts' sampler (``model.sampler_dtype``: the generation engine, or an int8 copy asked for
explicitly) is not chosen by a probe: on a 2-core Zen 4 EPYC the int8 projection measured 1.4-1.8× the bf16 path's
and the demo's rollouts still ran at the bf16 copy's speed (84 tokens/s both; bench/README.md, "The int8 sampler"),
so a matmul probe would choose a copy further from the policy for nothing. It is resolved here only for the rollout
correction it calls for (:func:`aepo_core.correction.resolved_correction`).

The decision is the machine's, not its momentary load's. The probe read 0.61-0.66x float32 idle and 0.16x beside
one other process on a 2-core Xeon with AVX512-BF16 (no AMX): a 4x swing, enough to flip a CPU nearer the threshold
(a Zen 4 EPYC measured 2.2-2.4x idle), so the same config trained under other numerics by the hour, and two arms of
one sweep could differ in numerics. So the speed-up is measured once per machine, as the best of
:data:`PROBE_ROUNDS` probes, and cached on disk (:func:`cache_path`: ``$AEPO_NUMERICS_CACHE``, else
``$XDG_CACHE_HOME/aepo/numerics.json``, else ``~/.cache/aepo/numerics.json``), keyed by the CPU model, torch's
capability, the torch version and ``ONEDNN_MAX_CPU_ISA`` (:func:`machine_key`). The cache is per machine, not per
runs dir: one machine's runs dirs then agree, and a runs dir shared by several machines holds none of it. Written
atomically under a lock (workers starting together measure once, not under each other's load); a corrupt file is
measured again with a warning. A measurement taken on a busy machine says so, with the file to delete.

Every run records the decision (:meth:`Numerics.params`, :meth:`Numerics.tags`, ``system.numerics_source``); a
resumed run computes in the numerics it started with (:func:`recorded_numerics`, from its params and tags, no
probe); a sweep decides once for all its cells (:func:`numerics_for` with the sweep's ``decided`` facts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from aepo_core.config import ExperimentConfig
from aepo_core.correction import resolved_correction
from infra.atomic import atomic_file

log = logging.getLogger(__name__)

__all__ = ["AUTOCAST_DTYPES", "GENERATION_DTYPES", "DeviceFacts", "MachineMismatchError", "Numerics", "auto_dtype",
           "autocast_dtype", "bf16_speedup", "cache_path", "device_facts", "facts_for", "machine_key",
           "numerics_for", "recorded_numerics", "resolve_numerics", "vllm_device"]

CACHE_ENV = "AEPO_NUMERICS_CACHE"
"""The cache file's path (default: see :func:`cache_path`)."""
PROBE_ROUNDS = 5
"""Probes per measurement: the best speed-up counts (load slows the bf16 rep more than the float32 one, never less)."""
SOURCE_TAG = "system.numerics_source"

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
    source: str = field(default="", compare=False)
    """Where the speed-up comes from: ``measured``, ``cache <file>``, ``run <id>`` (a resumed run's record),
    ``sweep <parent run id>`` (the sweep's decision); empty: not said."""

    @property
    def fast_bf16(self) -> bool:
        """bf16 is the fast path here: native, and not measured slower than float32."""
        return self.native_bf16 and (self.bf16_speedup is None or self.bf16_speedup >= 1.0)

    def describe(self) -> str:
        """``<name>, <capability>, native bf16 (3.1× float32)`` — what the dtypes were chosen for."""
        probe = f" ({self.bf16_speedup:.1f}× float32)" if self.bf16_speedup is not None else ""
        return f"{self.name}, {self.capability}, {'native bf16' if self.native_bf16 else 'no native bf16'}{probe}"

    def same_kind(self, other: DeviceFacts) -> bool:
        """Another machine of the same kind: device type, CPU or GPU model and kernel capability."""
        return (self.device, self.name, self.capability) == (other.device, other.name, other.capability)

    def tags(self) -> dict[str, str]:
        """MLflow tags of the machine (``system.*``): :meth:`from_tags` reads them back."""
        return {"system.device": self.device, "system.cpu" if self.device == "cpu" else "system.gpu": self.name,
                "system.capability": self.capability, "system.native_bf16": str(self.native_bf16).lower(),
                "system.cores": str(self.cores),
                **({"system.bf16_speedup": f"{self.bf16_speedup:.2f}"} if self.bf16_speedup is not None else {}),
                **({SOURCE_TAG: self.source} if self.source else {})}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str], source: str = "") -> DeviceFacts | None:
        """The facts a run recorded in its ``system.*`` tags (None: it recorded none, or not all)."""
        device = tags.get("system.device")
        name = tags.get("system.cpu" if device == "cpu" else "system.gpu")
        try:
            if device is None or name is None:
                return None
            speedup = tags.get("system.bf16_speedup")
            return cls(device, name, tags["system.capability"], tags["system.native_bf16"] == "true",
                       int(tags["system.cores"]), float(speedup) if speedup is not None else None, source)
        except (KeyError, ValueError):
            return None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (a flow parameter): :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceFacts:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"device facts: unknown keys {unknown}")
        return cls(**data)


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
    sampler_dtype: str = "generation"
    """``model.sampler_dtype``: ``generation`` (the rollouts are sampled by the generation engine) or ``int8`` (by
    the int8 copy)."""
    rollout_correction: str = "none"
    """``algorithm.rollout_correction`` resolved for the sampler (:func:`aepo_core.correction.resolved_correction`)."""

    def params(self) -> dict[str, str]:
        """MLflow params of the resolved numerics (beside the config's own, which may say ``auto``)."""
        return {"numerics.compute_dtype": self.compute_dtype, "numerics.generation_dtype": self.generation_dtype,
                "numerics.vllm_dtype": self.vllm_dtype, "numerics.sampler_dtype": self.sampler_dtype,
                "numerics.rollout_correction": self.rollout_correction}

    def tags(self) -> dict[str, str]:
        """MLflow tags of the machine the numerics were chosen for, and where the decision came from."""
        return self.facts.tags()

    def describe(self) -> str:
        """One line for a terminal: the dtypes and the machine they were chosen for."""
        source = f" [{self.facts.source}]" if self.facts.source else ""
        sampler = f", rollouts int8 ({self.rollout_correction})" if self.sampler_dtype == "int8" else ""
        return (f"numerics: compute {self.compute_dtype}, generation {self.generation_dtype}, vLLM {self.vllm_dtype}"
                f"{sampler} — {self.facts.describe()}{source}")


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
    return Numerics(compute, generation, vllm_dtype, facts, m.sampler_dtype,
                    resolved_correction(cfg.algorithm.rollout_correction, m.sampler_dtype,
                                        cfg.train.max_staleness))


@functools.cache
def _warn_once(message: str) -> None:
    """A warning logged once per process (the CLI and the flow it runs both resolve the same config)."""
    log.warning("%s", message)


class MachineMismatchError(RuntimeError):
    """A sweep cell on a machine where the sweep's ``auto`` numerics (bf16) are the slow path."""


def facts_for(cfg: ExperimentConfig) -> DeviceFacts:
    """The facts of the device ``cfg`` computes on (``model.device``) in this process."""
    return device_facts(torch.device(cfg.model.device).type)


def numerics_for(cfg: ExperimentConfig, decided: DeviceFacts | None = None) -> Numerics:
    """The dtypes ``cfg`` resolves to on this process's device (the config itself keeps what was asked).

    ``decided``: the facts a sweep decided its numerics from, once for all its cells: the cell resolves ``cfg`` with
    them, so every arm computes alike. On a machine of another kind it says so in one warning line, and it refuses
    (:class:`MachineMismatchError`) where the sweep's ``auto`` is bf16 and bf16 is the slow path here (up to 31×)."""
    if decided is None:
        return resolve_numerics(cfg, facts_for(cfg))
    here = facts_for(cfg)
    if not here.same_kind(decided):
        if auto_dtype(decided) != auto_dtype(here) and decided.fast_bf16 and _asks_auto(cfg):
            raise MachineMismatchError(
                f"the sweep chose bf16 numerics on {decided.describe()}; bf16 is the slow path on this machine "
                f"({here.describe()}): run its cells on the sweep's machine kind, or set model.compute_dtype / "
                "model.generation_dtype explicitly in the sweep")
        log.warning("this cell runs on %s, the sweep decided its numerics on %s: it computes in the sweep's (%s)",
                    here.describe(), decided.describe(), auto_dtype(decided))
    return resolve_numerics(cfg, dataclasses.replace(decided, cores=here.cores))


def _asks_auto(cfg: ExperimentConfig) -> bool:
    """Whether any dtype ``cfg`` computes in is left to ``auto``."""
    asked = [cfg.model.compute_dtype, cfg.model.generation_dtype]
    if cfg.rollout.engine == "vllm":
        asked.append(cfg.rollout.vllm.dtype)
    return AUTO in asked


def recorded_numerics(cfg: ExperimentConfig, params: Mapping[str, str], tags: Mapping[str, str], run_id: str
                      ) -> Numerics | None:
    """The numerics a run started with, from its ``numerics.*`` params and ``system.*`` tags (None: it logged none):
    what its resume computes in, without a probe, whatever ``auto`` would choose on this machine today. A dtype
    ``cfg`` sets explicitly is kept (the tracker then records the changed param)."""
    if "numerics.compute_dtype" not in params:
        return None
    source = f"run {run_id}"
    facts = DeviceFacts.from_tags(tags, source) or dataclasses.replace(
        _local_facts(torch.device(cfg.model.device).type, probe=False), source=source)
    m = cfg.model
    compute = params["numerics.compute_dtype"] if m.compute_dtype == AUTO else m.compute_dtype
    generation = params.get("numerics.generation_dtype", "same") if m.generation_dtype == AUTO else m.generation_dtype
    vllm_dtype = (params.get("numerics.vllm_dtype", auto_dtype(facts)) if cfg.rollout.vllm.dtype == AUTO
                  else cfg.rollout.vllm.dtype)
    return Numerics(compute, generation, vllm_dtype, facts, m.sampler_dtype,
                    resolved_correction(cfg.algorithm.rollout_correction, m.sampler_dtype,
                                        cfg.train.max_staleness))


def vllm_device() -> str:
    """The device type a managed vLLM server computes on: CUDA where present, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def device_facts(device: str = "cpu") -> DeviceFacts:
    """The facts of this process's ``device`` type (cached per process; a CPU's probe once per machine, on disk)."""
    return _local_facts(device, probe=True)


def _local_facts(device: str, probe: bool) -> DeviceFacts:
    """This machine's facts; ``probe``: the CPU's bf16 speed-up from the cache, measured when not cached."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return DeviceFacts("cuda", props.name, f"sm_{props.major}{props.minor}", torch.cuda.is_bf16_supported(),
                           props.multi_processor_count)
    native = _cpu_native_bf16()
    name, capability = cpu_model(), torch.backends.cpu.get_cpu_capability()
    speedup, source = cached_speedup(machine_key(name, capability)) if native and probe else (None, "")
    return DeviceFacts("cpu", name, capability, native, torch.get_num_threads(), speedup, source)


def cache_path() -> Path:
    """The per-machine numerics cache: ``$AEPO_NUMERICS_CACHE``, else ``<user cache dir>/aepo/numerics.json``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "aepo" / "numerics.json"


def machine_key(name: str, capability: str) -> str:
    """What a cached speed-up holds for: the CPU model, torch's kernel capability, the torch version and the oneDNN
    ISA limit (``ONEDNN_MAX_CPU_ISA`` holds bf16 kernels back while the flags still advertise them)."""
    return f"{name} | {capability} | torch {torch.__version__} | oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA', 'all')}"


def cached_speedup(key: str) -> tuple[float, str]:
    """The bf16 speed-up of the machine ``key`` from the cache, else measured (best of :data:`PROBE_ROUNDS`) and
    written there; with where it came from (``cache <file>`` / ``measured``). The read-measure-write holds a lock:
    processes starting together measure once. A corrupt cache is measured again with a warning; an unwritable one
    leaves the measurement to this process, with a warning."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f".{path.name}.lock"), "a+b")  # held across the measurement
    except OSError as exc:
        log.warning("numerics cache %s cannot be used (%s): measuring the bf16 speed-up in this process", path, exc)
        return _measure()[0], "measured"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_cache(path)
        entry = entries.get(key)
        if isinstance(entry, dict) and _valid_speedup(entry.get("bf16_speedup")):
            return float(entry["bf16_speedup"]), f"cache {path}"
        speedup, readings = _measure()
        load = os.getloadavg()[0]
        entries[key] = {"bf16_speedup": speedup, "readings": readings, "load_1min": round(load, 2),
                        "cpus": os.cpu_count(), "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            with atomic_file(path, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
        except OSError as exc:
            log.warning("numerics cache %s not written (%s): the next process measures again", path, exc)
        if load >= 0.5 * (os.cpu_count() or 1):
            log.warning("bf16 speed-up %.2f measured on a busy machine (load %.1f on %s CPUs) and cached in %s: "
                        "delete it to measure again on idle cores", speedup, load, os.cpu_count(), path)
        return speedup, "measured"


def _valid_speedup(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries ({} when there is no file yet; a corrupt one is reported and measured over)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("numerics cache %s unreadable (%s): measuring again", path, exc)
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("numerics cache %s is corrupt (not a JSON object): measuring again and rewriting it", path)
        return {}
    return data


def _measure() -> tuple[float, list[float]]:
    """The best of :data:`PROBE_ROUNDS` probes (another process's load only lowers a reading) and all readings."""
    readings = [round(bf16_speedup(), 3) for _ in range(PROBE_ROUNDS)]
    return max(readings), readings


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
