"""``auto`` numerics: bf16 where the device runs it natively and fast, float32 elsewhere; explicit dtypes win."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aepo_core.overrides import build_config
from infra.numerics import DeviceFacts, Numerics, _warn_once, auto_dtype, device_facts, resolve_numerics

REPO = Path(__file__).resolve().parents[2]

AMX = DeviceFacts("cpu", "Intel(R) Xeon(R) Platinum 8480+", "AVX512", native_bf16=True, cores=2, bf16_speedup=3.1)
AVX2 = DeviceFacts("cpu", "AMD EPYC 7B13", "AVX2", native_bf16=False, cores=2)
FLAGS_LIE = DeviceFacts("cpu", "Intel(R) Xeon(R) Processor", "AVX2", native_bf16=True, cores=2, bf16_speedup=0.09)
CUDA_BF16 = DeviceFacts("cuda", "NVIDIA H100", "sm_90", native_bf16=True, cores=132)
CUDA_OLD = DeviceFacts("cuda", "Tesla V100", "sm_70", native_bf16=False, cores=80)


def _resolved(facts: DeviceFacts, *overrides: str) -> tuple[str, str, str]:
    n = resolve_numerics(build_config({}, list(overrides)), facts)
    return n.compute_dtype, n.generation_dtype, n.vllm_dtype


@pytest.mark.parametrize(("facts", "expected"), [
    (AMX, ("bfloat16", "bfloat16", "bfloat16")),
    (AVX2, ("float32", "same", "float32")),
    (FLAGS_LIE, ("float32", "same", "float32")),  # advertised bf16 that measures slower than float32: not taken
    (CUDA_BF16, ("bfloat16", "bfloat16", "bfloat16")),
    (CUDA_OLD, ("float32", "same", "float32")),
])
def test_auto_is_bf16_exactly_where_bf16_is_native_and_fast(facts: DeviceFacts, expected: tuple[str, str, str]):
    assert build_config({}, []).model.compute_dtype == "auto"  # the default
    assert _resolved(facts) == expected
    assert auto_dtype(facts) == expected[0]


def test_explicit_dtypes_win_with_a_warning_on_the_slow_path(caplog: pytest.LogCaptureFixture):
    explicit = ("model.compute_dtype=bfloat16", "model.generation_dtype=bfloat16", "rollout.vllm.dtype=bfloat16",
                "rollout.engine=vllm")
    with caplog.at_level(logging.WARNING, logger="infra.numerics"):
        assert _resolved(AMX, *explicit) == ("bfloat16", "bfloat16", "bfloat16")
    assert not caplog.records  # the fast path: nothing to say
    _warn_once.cache_clear()  # once per process: another test may have said it already
    with caplog.at_level(logging.WARNING, logger="infra.numerics"):
        assert _resolved(AVX2, *explicit) == ("bfloat16", "bfloat16", "bfloat16")
    (record,) = caplog.records
    for name in ("model.compute_dtype=bfloat16", "model.generation_dtype=bfloat16", "rollout.vllm.dtype=bfloat16",
                 "AMD EPYC 7B13", "AVX2", "slow path"):
        assert name in record.getMessage(), name
    assert _resolved(AMX, "model.compute_dtype=float32", "model.generation_dtype=same",
                     "rollout.vllm.dtype=float32") == ("float32", "same", "float32")


def test_params_and_tags_name_the_dtypes_and_the_machine():
    n = Numerics("bfloat16", "bfloat16", "bfloat16", AMX)
    assert n.params() == {"numerics.compute_dtype": "bfloat16", "numerics.generation_dtype": "bfloat16",
                          "numerics.vllm_dtype": "bfloat16", "numerics.sampler_dtype": "generation",
                          "numerics.rollout_correction": "none"}
    assert n.tags() == {"system.device": "cpu", "system.cpu": AMX.name, "system.capability": "AVX512",
                        "system.native_bf16": "true", "system.cores": "2", "system.bf16_speedup": "3.10"}
    line = n.describe()
    assert "compute bfloat16" in line and AMX.name in line and "3.1× float32" in line


_FACTS = "import json, dataclasses; from infra.numerics import device_facts; " \
         "print(json.dumps(dataclasses.asdict(device_facts('cpu'))))"


def _facts_in_child(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _FACTS], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kernels_restricted_to_avx2_make_auto_float32_on_any_cpu():
    """With oneDNN and ATen held to AVX2 (how an AMX machine imitates an AVX2-only one), bf16 is the slow path even
    where the flags still advertise AMX: the probe measures it (or, on an AVX2 CPU, the flags already say no)."""
    facts = _facts_in_child({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert facts["capability"] == "AVX2"
    assert not DeviceFacts(**facts).fast_bf16  # type: ignore[arg-type]
    if facts["native_bf16"]:
        assert facts["bf16_speedup"] is not None and facts["bf16_speedup"] < 1.0


def test_this_machine_is_described_consistently():
    facts = device_facts("cpu")
    assert facts.capability == torch.backends.cpu.get_cpu_capability()
    assert facts.cores == torch.get_num_threads() and facts.name
    assert (facts.bf16_speedup is not None) == facts.native_bf16  # the probe confirms exactly what the flags claim
    assert device_facts("cpu") is facts  # decided once per process


_HOG = "import torch\ntorch.set_num_threads(2)\na = torch.randn(768, 768)\nwhile True:\n    a @ a\n"


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="AMX: where bf16 is the fast path for certain")
def test_the_bf16_probe_answers_the_same_beside_another_cpu_heavy_process():
    """The probe decides the run's numerics once, at start: beside another CPU-heavy process (a test suite, a second
    run) it must still see what the CPU's kernels do. Measured with 2 threads beside such a process it read 0.9-1.4
    on an AMX Xeon whose bf16 is 2.7-4x float32 (OpenMP threads that wait on each other time both dtypes alike),
    and `auto` then chose float32: a demo 2-3x slower, on other numerics. One thread measures the kernels."""
    from infra.numerics import bf16_speedup

    hog = subprocess.Popen([sys.executable, "-c", _HOG])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        import time

        time.sleep(1.0)
        readings = [bf16_speedup() for _ in range(3)]
        assert torch.get_num_threads() == 2  # the probe leaves the process's threads as it found them
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(threads)
    assert min(readings) >= 1.5, readings


# ------------------------------------------------------------------------- the decision is the machine's, cached


class _Probe:
    """The probe as a loaded machine reads it: ``readings`` in turn (the last one repeats), each call counted."""

    def __init__(self, *readings: float) -> None:
        self.readings, self.calls = list(readings), 0

    def __call__(self, *args: object, **kwargs: object) -> float:
        self.calls += 1
        return self.readings[min(self.calls, len(self.readings)) - 1]


@pytest.fixture
def machine_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's numerics cache file, a CPU with native bf16 (the probe decides), and no facts cached in-process."""
    path = tmp_path / "cache" / "numerics.json"
    monkeypatch.setenv("AEPO_NUMERICS_CACHE", str(path))
    monkeypatch.setattr("infra.numerics._cpu_native_bf16", lambda: True)
    device_facts.cache_clear()
    yield path
    device_facts.cache_clear()


def test_the_decision_does_not_change_once_cached_whatever_the_load(machine_cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """Measured on idle cores bf16 is 2.3× float32 (a Zen 4 EPYC); beside another process the same probe reads 0.5×.
    The first start-up decides; a later one (another process: the in-process cache cleared) reads the cache and does
    not probe, so the same config keeps its numerics under load."""
    idle_then_loaded = _Probe(2.3, 2.2, 2.3, 2.25, 2.3, 0.5)
    monkeypatch.setattr("infra.numerics.bf16_speedup", idle_then_loaded)
    first = device_facts("cpu")
    assert first.fast_bf16 and auto_dtype(first) == "bfloat16"
    probes = idle_then_loaded.calls
    idle_then_loaded.readings = [0.5]  # from now on, the machine is busy
    device_facts.cache_clear()  # a new process
    again = device_facts("cpu")
    assert idle_then_loaded.calls == probes  # not probed again
    assert again == first and auto_dtype(again) == "bfloat16"
    assert again.source.startswith("cache ") and first.source == "measured"
    from infra.numerics import machine_key

    (key,) = json.loads(machine_cache.read_text())
    assert key == machine_key(first.name, first.capability)
    assert first.name in key and first.capability in key and torch.__version__ in key


def test_the_measurement_takes_the_best_of_several_probes(machine_cache: Path, monkeypatch: pytest.MonkeyPatch):
    """One probe read under a burst of load (0.5×) among idle ones (2.3×): the best counts."""
    monkeypatch.setattr("infra.numerics.bf16_speedup", _Probe(0.5, 2.3, 0.6, 0.7, 0.6))
    assert device_facts("cpu").bf16_speedup == 2.3
    (entry,) = json.loads(machine_cache.read_text()).values()
    assert entry["readings"] == [0.5, 2.3, 0.6, 0.7, 0.6] and "measured_at" in entry and "load_1min" in entry


@pytest.mark.parametrize("corrupt", ["{not json", "[]", '{"KEY": {"bf16_speedup": "fast"}}', ""])
def test_a_corrupt_cache_is_measured_again_with_a_warning(machine_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture, corrupt: str):
    from infra.numerics import cpu_model, machine_key

    machine_cache.parent.mkdir(parents=True)
    machine_cache.write_text(corrupt.replace("KEY", machine_key(cpu_model(), torch.backends.cpu.get_cpu_capability())
                                             .replace('"', '\\"')))
    probe = _Probe(1.7)
    monkeypatch.setattr("infra.numerics.bf16_speedup", probe)
    with caplog.at_level(logging.WARNING, logger="infra.numerics"):
        facts = device_facts("cpu")
    assert facts.bf16_speedup == 1.7 and probe.calls > 0
    if corrupt.startswith(("{not", "[")) or not corrupt:
        assert any("corrupt" in r.getMessage() for r in caplog.records)
    (entry,) = json.loads(machine_cache.read_text()).values()  # rewritten whole
    assert entry["bf16_speedup"] == 1.7


def test_an_unwritable_cache_measures_in_process_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AEPO_NUMERICS_CACHE", str(blocker / "numerics.json"))  # its parent is a file
    monkeypatch.setattr("infra.numerics._cpu_native_bf16", lambda: True)
    monkeypatch.setattr("infra.numerics.bf16_speedup", _Probe(1.9))
    device_facts.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="infra.numerics"):
            assert device_facts("cpu").bf16_speedup == 1.9
    finally:
        device_facts.cache_clear()
    assert any("cannot be used" in r.getMessage() for r in caplog.records)


def test_the_cache_lives_in_the_user_cache_dir_unless_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from infra.numerics import cache_path

    monkeypatch.delenv("AEPO_NUMERICS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "aepo" / "numerics.json"
    monkeypatch.setenv("AEPO_NUMERICS_CACHE", str(tmp_path / "x.json"))
    assert cache_path() == tmp_path / "x.json"


def test_a_resumed_run_computes_in_the_numerics_it_recorded_without_a_probe(monkeypatch: pytest.MonkeyPatch):
    """The run started in bf16 on an AMX machine; resumed where `auto` would choose float32, it still computes in
    bf16 (its params and tags), and nothing is probed. Explicit dtypes of the config are kept."""
    from infra.numerics import recorded_numerics

    def no_probe() -> float:
        raise AssertionError("a resumed run does not probe")

    monkeypatch.setattr("infra.numerics.bf16_speedup", no_probe)
    started = Numerics("bfloat16", "bfloat16", "bfloat16", AMX)
    cfg = build_config({}, [])
    n = recorded_numerics(cfg, started.params(), started.tags(), "run-1")
    assert n is not None and (n.compute_dtype, n.generation_dtype, n.vllm_dtype) == ("bfloat16",) * 3
    assert n.facts == AMX and n.facts.source == "run run-1" and n.tags()["system.numerics_source"] == "run run-1"
    explicit = recorded_numerics(build_config({}, ["model.compute_dtype=float32"]), started.params(), {}, "run-1")
    assert explicit is not None and explicit.compute_dtype == "float32" and explicit.generation_dtype == "bfloat16"
    assert recorded_numerics(cfg, {}, started.tags(), "run-0") is None  # a run that logged no numerics


def test_facts_round_trip_through_tags_and_a_flow_parameter():
    sourced = DeviceFacts(**{**AMX.as_dict(), "source": "sweep p1"})
    assert DeviceFacts.from_tags(sourced.tags()) == AMX and DeviceFacts.from_dict(sourced.as_dict()) == AMX
    assert DeviceFacts.from_tags(AVX2.tags()) == AVX2 and DeviceFacts.from_tags({"system.device": "cpu"}) is None
    with pytest.raises(ValueError, match="unknown"):
        DeviceFacts.from_dict({**AMX.as_dict(), "gpu": "x"})


def test_a_sweep_cell_computes_in_the_sweep_s_numerics_and_another_machine_kind_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    from infra.numerics import MachineMismatchError, numerics_for

    cfg = build_config({}, [])
    here = {"facts": AMX}
    monkeypatch.setattr("infra.numerics.facts_for", lambda cfg: here["facts"])
    with caplog.at_level(logging.WARNING, logger="infra.numerics"):
        same = numerics_for(cfg, decided=AMX)
    assert same.compute_dtype == "bfloat16" and not caplog.records
    # This AMX machine would choose bf16; the sweep decided float32 on an AVX2 one: float32, in one line.
    with caplog.at_level(logging.WARNING, logger="infra.numerics"):
        assert numerics_for(cfg, decided=AVX2).compute_dtype == "float32"
    (line,) = caplog.records
    assert AVX2.name in line.getMessage() and AMX.name in line.getMessage()
    # The sweep chose bf16; bf16 is the slow path here: refused, naming both machines.
    here["facts"] = AVX2
    with pytest.raises(MachineMismatchError, match="slow path") as err:
        numerics_for(cfg, decided=AMX)
    assert AVX2.name in str(err.value) and AMX.name in str(err.value)
    explicit = build_config({}, ["model.compute_dtype=float32", "model.generation_dtype=same"])
    assert numerics_for(explicit, decided=AMX).compute_dtype == "float32"  # nothing left to `auto`
