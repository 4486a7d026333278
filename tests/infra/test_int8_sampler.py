"""The int8 sampler copy (``model.sampler_dtype``): what it computes, when ``auto`` takes it, and that it samples
the training rollouts only — evaluation stays on the policy's numerics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from aepo_core.config import ConfigError
from aepo_core.correction import resolved_correction
from aepo_core.overrides import build_config
from infra.config_files import load_config
from infra.engines.int8 import KEEP_FLOAT, Int8Copy, Int8Linear
from infra.numerics import DeviceFacts, recorded_numerics, resolve_numerics
from infra.run.runtime import build_runtime

REPO = Path(__file__).resolve().parents[2]

ZEN4 = DeviceFacts("cpu", "AMD EPYC 9B14", "AVX512", native_bf16=True, cores=2, bf16_speedup=2.2)


def test_int8_linear_is_the_float_projection_to_int8_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[3].zero_()  # an all-zero row keeps a finite scale
    x = torch.randn(2, 5, 64)
    x[0, 0] *= 50  # an outlier token: per-token scales keep it from flattening the other rows
    exact, quantized = linear(x), Int8Linear(linear)(x)
    assert quantized.shape == exact.shape and torch.isfinite(quantized).all()
    rel = ((quantized - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
    assert rel < 0.02, rel  # ~0.01 measured: int8 rounding of both operands
    assert not torch.equal(quantized, exact)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    return LlamaForCausalLM(cfg).float().eval()


def test_the_copy_quantizes_all_linear_layers_but_the_down_projections_and_refreshes_in_place():
    source = _tiny_llama()
    copy8 = Int8Copy(source)
    kinds = {name.rpartition(".")[2]: type(m) for name, m in copy8.model.named_modules() if "proj" in name}
    assert kinds["down_proj"] is torch.nn.Linear and KEEP_FLOAT == ("down_proj",)
    assert kinds["q_proj"] is Int8Linear and kinds["up_proj"] is Int8Linear
    ids = torch.randint(0, source.config.vocab_size, (2, 7))
    before = copy8.model(ids).logits
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert torch.equal(copy8.model(ids).logits, before)  # a copy: the live weights moved, it did not
    copy8.refresh(source)
    assert torch.equal(copy8.model(ids).logits, Int8Copy(source).model(ids).logits)  # refreshed = built anew


@pytest.mark.parametrize(("overrides", "sampler", "correction"), [
    ([], "generation", "none"),  # the default: the matmuls are faster, the demo's rollouts were not
    (["model.sampler_dtype=int8"], "int8", "tis"),
    (["model.sampler_dtype=int8", "algorithm.rollout_correction=mask"], "int8", "mask"),
    (["model.sampler_dtype=int8", "algorithm.rollout_correction=none"], "int8", "none"),
    (["algorithm.rollout_correction=tis"], "generation", "tis"),
])
def test_the_int8_sampler_is_asked_for_and_calls_for_tis(overrides, sampler, correction):
    n = resolve_numerics(build_config({}, overrides), ZEN4)
    assert (n.sampler_dtype, n.rollout_correction) == (sampler, correction)
    assert n.params()["numerics.sampler_dtype"] == sampler and n.params()["numerics.rollout_correction"] == correction
    assert resolved_correction("auto", sampler) == ("tis" if sampler == "int8" else "none")
    assert ("rollouts int8 (tis)" in n.describe()) == (sampler == "int8" and correction == "tis")


def test_a_resumed_run_resolves_the_sampler_and_its_correction_as_it_started():
    params = {"numerics.compute_dtype": "bfloat16", "numerics.generation_dtype": "bfloat16"}
    old = recorded_numerics(build_config({}, []), params, ZEN4.tags(), "run-1")
    assert old is not None and old.sampler_dtype == "generation" and old.rollout_correction == "none"
    new = recorded_numerics(build_config({}, ["model.sampler_dtype=int8"]), params, ZEN4.tags(), "run-2")
    assert new is not None and new.sampler_dtype == "int8" and new.rollout_correction == "tis"


@pytest.mark.parametrize("override", ["rollout.engine=vllm", "model.device=cuda", "train.backend=deepspeed"])
def test_an_int8_sampler_outside_the_in_process_cpu_engine_is_refused(override):
    with pytest.raises(ConfigError, match=r"model\.sampler_dtype=int8"):
        build_config({}, ["model.sampler_dtype=int8", override])


def _runtime(model_cache: Path, tmp_path: Path, sampler: str, *overrides: str):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}",
                                                       f"model.sampler_dtype={sampler}", *overrides])
    return build_runtime(cfg, tmp_path / sampler)


def test_rollouts_come_from_the_int8_copy_and_evaluation_from_the_policy(model_cache: Path, tmp_path: Path):
    from infra.run.evaluation import evaluate_dataset

    int8, same = (_runtime(model_cache, tmp_path, s) for s in ("int8", "generation"))
    assert int8.sampler is not int8.engine and same.sampler is same.engine
    assert int8.sampler.model.model.embed_tokens.weight.dtype == torch.float32  # type: ignore[attr-defined]
    assert int8.numerics.sampler_dtype == "int8" and int8.numerics.rollout_correction == "tis"
    rows = int8.load_rows("synthetic:test")[:3]
    a, b = (rt.sample(rows, rt.cfg.rollout, seed=0) for rt in (int8, same))
    logprobs = [[x for t in r.trees for n in t.nodes for x in n.logprobs] for r in (a, b)]
    assert logprobs[0] != logprobs[1]  # the training rollouts: another sampler

    ev = int8.cfg.eval.model_copy(update={"n_samples": 2, "max_questions": 3})
    reports = [evaluate_dataset(rt, "synthetic:test", rows, ev, seed=0, batch_size=3, traces=3)
               for rt in (int8, same)]
    sampled = [[x for t in r.traced.trees for n in t.nodes for x in n.logprobs] for r in reports if r.traced]
    assert len(sampled) == 2 and sampled[0] and sampled[0] == sampled[1]  # the policy's own samples, token by token
    assert reports[0].per_question_pass1 == reports[1].per_question_pass1

    asked = int8.cfg.model_copy(update={"eval": ev.model_copy(update={"sampler": "rollout"})})
    assert dataclasses.replace(int8, cfg=asked).eval_engine is int8.sampler  # eval.sampler=rollout asks for it


def test_the_int8_copy_follows_every_weight_change(model_cache: Path, tmp_path: Path):
    from infra.engines.weights import PolicyWeights

    runtime = _runtime(model_cache, tmp_path, "int8")
    copy_model = runtime.sampler.model  # type: ignore[attr-defined]
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        for p in runtime.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    runtime.weights_changed(PolicyWeights(runtime.model, 1))
    assert torch.equal(copy_model(ids).logits, Int8Copy(runtime.model).model(ids).logits)
