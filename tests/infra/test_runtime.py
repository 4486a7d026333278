"""The policy runtime and the trainer: the engine's own low-precision weight copy follows every weight change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from infra.config_files import load_config
from infra.run.resume import latest_point
from infra.run.runtime import PolicyRuntime, build_runtime
from infra.run.sft import run_sft
from infra.run.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def _copy_matches(runtime: PolicyRuntime) -> bool:
    gen = runtime.engine.model  # type: ignore[attr-defined]
    return all(torch.equal(g, p.to(g.dtype)) for g, p in zip(gen.state_dict().values(),
                                                              runtime.model.state_dict().values(), strict=True))


@pytest.mark.slow  # trains
def test_bf16_generation_copy_is_refreshed_after_sft_update_and_resume(model_cache: Path, tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"model.cache_dir={model_cache}", "model.generation_dtype=bfloat16", "train.sft.enabled=true",
        "train.sft.max_examples=4", "train.sft.lr=1e-2", "optim.lr=1e-2"])
    runtime = build_runtime(cfg, tmp_path)
    gen = runtime.engine.model  # type: ignore[attr-defined]
    assert gen is not runtime.model and gen.dtype == torch.bfloat16 and runtime.model.dtype == torch.float32
    assert _copy_matches(runtime)
    before = {k: v.clone() for k, v in gen.state_dict().items()}
    rows = runtime.load_rows(cfg.data.train)

    run_sft(runtime, rows)
    assert _copy_matches(runtime) and any(not torch.equal(before[k], v) for k, v in gen.state_dict().items())

    trainer = Trainer(runtime, rows, checkpoint_dir=tmp_path / "ckpt", run_id="run-1")
    batch = trainer.next_batch()
    result = runtime.sample(batch, cfg.rollout, seed=0)
    assert all(n.token_ids for t in result.trees for n in t.nodes)
    trainer.update(*runtime.score(result, batch).kept(result.trees))
    assert trainer.step == 1 and _copy_matches(runtime)
    saved = trainer.save()
    assert Path(saved).is_dir()

    for p in runtime.model.parameters():  # scribble over the live weights; resume must bring both back
        torch.nn.init.normal_(p.data)
    point = latest_point(tmp_path / "ckpt", cfg)
    assert point is not None and point.run_id == "run-1" and point.step == 1 and point.path is not None
    assert trainer.resume(point.path) == 1
    assert _copy_matches(runtime)


def test_prompt_is_built_once_per_question(model_cache: Path, tmp_path: Path) -> None:
    """The one rollout prompt: system prompt + question through the chat template, cached per question."""
    from aepo_core.protocol import SYSTEM_PROMPT

    runtime = build_runtime(load_config(REPO / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}"]),
                            tmp_path)
    ids = runtime.prompt_ids("What is 2+2?")
    assert runtime.prompt_ids("What is 2+2?") is ids
    text = runtime.tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert SYSTEM_PROMPT in text and text.index(SYSTEM_PROMPT) < text.index("What is 2+2?")


def test_the_demo_config_runs_at_the_dtypes_resolved_for_this_machine(model_cache: Path, tmp_path: Path) -> None:
    """configs/demo.yaml leaves the numerics to ``auto``: on this CPU the engine samples and the trainer computes in
    the resolved dtypes (bf16 only where it is native and fast), and a step runs. Shrunk to the tiny model."""
    from infra.numerics import autocast_dtype, device_facts, resolve_numerics

    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"model.cache_dir={model_cache}", "model.name=tiny-random", "train.batch_size=2", "optim.mini_batch_size=1",
        "rollout.max_response_tokens=48", "rollout.max_segment_tokens=24"])
    assert (cfg.model.compute_dtype, cfg.model.generation_dtype) == ("auto", "auto")
    runtime = build_runtime(cfg, tmp_path)
    assert runtime.numerics == resolve_numerics(cfg, device_facts("cpu"))
    fast = device_facts("cpu").fast_bf16
    gen = runtime.engine.model  # type: ignore[attr-defined]
    assert (gen is not runtime.model and gen.dtype == torch.bfloat16) if fast else gen is runtime.model
    trainer = Trainer(runtime, runtime.load_rows(cfg.data.train), checkpoint_dir=tmp_path / "ckpt", run_id="demo")
    assert trainer.backend.compute_dtype == autocast_dtype(runtime.numerics.compute_dtype)
    assert trainer.backend.compute_dtype == (torch.bfloat16 if fast else None)
    batch = trainer.next_batch()
    result = runtime.sample(batch, cfg.rollout, seed=0)
    metrics = trainer.update(*runtime.score(result, batch).kept(result.trees))
    assert trainer.step == 1 and metrics["train/optimizer_steps"] == 2


def _sft_weights(model_cache: Path, runs: Path, *sets: str) -> dict[str, torch.Tensor]:
    """The tiny model's weights after 4 SFT steps (8 transcripts in batches of 2) under ``sets``."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"model.cache_dir={model_cache}", "train.sft.enabled=true", "train.sft.max_examples=8",
        "train.sft.batch_size=2", "train.sft.lr=1e-2", *sets])
    with build_runtime(cfg, runs / "-".join(sets or ("plain",))) as runtime:
        report = run_sft(runtime, runtime.load_rows(cfg.data.train))
        assert report.steps == 4
        return {k: v.clone() for k, v in runtime.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # trains
def test_the_rl_schedule_does_not_reach_cold_start_sft(model_cache: Path, tmp_path: Path) -> None:
    """``optim`` is RL's: its warm-up and decay count RL optimizer steps. A demo regime with RL warm-up once ran its
    12-step SFT at half the LR for 6 steps, so two regimes differing only in RL settings had different SFT starts.
    SFT keeps AdamW's other settings (β, ε, weight decay, clipping) and its own LR and warm-up (``train.sft``)."""
    plain = _sft_weights(model_cache, tmp_path)
    for rl in (["optim.warmup_steps=3"], ["optim.lr_schedule=linear"], ["optim.lr=1e-6"]):
        assert _same(plain, _sft_weights(model_cache, tmp_path, *rl)), f"{rl} changed the SFT weights"
    assert not _same(plain, _sft_weights(model_cache, tmp_path, "train.sft.warmup_steps=3")), \
        "SFT's own warm-up did nothing"


@pytest.mark.slow  # trains
def test_a_fixed_sft_seed_gives_every_run_seed_the_same_start(model_cache: Path, tmp_path: Path) -> None:
    """The run's seed orders SFT's batches unless ``train.sft.seed`` fixes the order: then runs of several seeds
    differ in RL only (the demo's SFT Pass@1 moved from 0.486 to 0.806 with the order alone, bench/README)."""
    seed0 = _sft_weights(model_cache, tmp_path, "seed=0")
    assert not _same(seed0, _sft_weights(model_cache, tmp_path, "seed=1")), "the run seed did not order SFT"
    assert _same(seed0, _sft_weights(model_cache, tmp_path, "seed=1", "train.sft.seed=0"))
    assert not _same(seed0, _sft_weights(model_cache, tmp_path, "seed=0", "train.sft.seed=1"))


class _Node:
    """A cyclic object: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_while_a_runtime_lives_the_collector_skips_what_existed_before_it(model_cache: Path, tmp_path: Path) -> None:
    """Every phase boundary collects garbage (``release_memory``); walking the libraries' ~650k objects each time
    cost 0.6–2.4 s on a 2-core Xeon VM. Inside a runtime the objects that existed at its start are frozen out of
    the walk; leaving it thaws them, so garbage among them is collected again (no leak for a process that goes on,
    e.g. a test session)."""
    import gc
    import weakref

    from infra.training.memory import release_memory

    gc.collect()
    frozen_before = gc.get_freeze_count()
    old = _Node()
    gone = weakref.ref(old)
    with build_runtime(load_config(REPO / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}"]),
                       tmp_path):
        assert gc.get_freeze_count() > frozen_before + 1000  # the libraries, the policy, ``old``
        del old
        young = _Node()
        young_gone = weakref.ref(young)
        del young
        release_memory()
        assert young_gone() is None  # what the run made is collected
        assert gone() is not None  # what was frozen is skipped
    assert gc.get_freeze_count() == frozen_before
    gc.collect()
    assert gone() is None


def test_a_deterministic_run_switches_on_deterministic_algorithms(model_cache: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49 §7d: CUDA backward kernels are not deterministic by default, so bit-identical replay is tested on
    CPU only; `train.deterministic: true` makes the runtime switch on torch's deterministic algorithms and cuBLAS's
    fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when CUDA initializes) before the policy loads. Off by default."""
    from aepo_core.config import ExperimentConfig

    assert ExperimentConfig().train.deterministic is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    tiny = [f"model.cache_dir={model_cache}"]
    try:
        build_runtime(load_config(REPO / "configs" / "tiny.yaml", tiny), tmp_path / "default").close()
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        build_runtime(load_config(REPO / "configs" / "tiny.yaml", [*tiny, "train.deterministic=true"]),
                      tmp_path / "deterministic").close()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_each_rank_exports_its_weights_into_its_own_folder(model_cache: Path, tmp_path: Path, monkeypatch) -> None:
    """Under a launcher every rank builds its runtime with the same runs dir: rank 0 exports the weights its
    server loads into ``weights/<run>/``, a rank > 0 into ``weights/<run>-rank<r>/`` (two managed vLLM servers
    under ZeRO-2 would otherwise write ``initial`` and every ``step-NNNNNN`` into one folder at once)."""
    sets = [f"model.cache_dir={model_cache}", "rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:9",
            "rollout.exact_entropy=false"]
    cfg = load_config(REPO / "configs" / "tiny.yaml", sets)
    folders = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with build_runtime(cfg, tmp_path, run_name="r") as runtime:
            folders[rank] = runtime.engine.weights_dir
    assert folders == {0: tmp_path / "weights" / "r", 1: tmp_path / "weights" / "r-rank1"}


@pytest.mark.parametrize("sets", [[], ["train.max_staleness=1"]])
def test_a_runs_engine_samples_its_first_step_as_weight_version_0(model_cache: Path, tmp_path: Path,
                                                                  sets: list[str]) -> None:
    """The policy as loaded is version 0 (as the managed vLLM server is labelled): step 1's segments carry it, so the
    per-step rollout/weight_version and rollout/stale_segments are there from step 1 (found by the service-outage
    test, whose run has no SFT to load weights before step 1). Shared model and own copy alike."""
    from aepo_core.interfaces import GenerationRequest, SamplingParams

    runtime = build_runtime(load_config(REPO / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}", *sets]),
                            tmp_path)
    assert runtime.engine.weight_version == "0"
    (res,) = runtime.engine.generate([GenerationRequest(runtime.prompt_ids("Hi"), 2, seed=0)], SamplingParams())
    assert res.weight_version == "0"
