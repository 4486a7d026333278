"""The policy update: micro-batch invariance, components really used, masked tool tokens, KL reference."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from scripted_engine import EchoSearch, ScriptedEngine, tool_then_answer

import infra.training.update as update_mod
from aepo_core.config import RolloutConfig
from aepo_core.overrides import build_config
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.rollout.tree import Leaf
from aepo_core.scoring import LeafScore, StepScores
from infra.training.backends import FrozenBackend, TorchBackend
from infra.training.batching import TrainSample, plan_micro_batches, samples_from_trees, split_mini_batches
from infra.training.update import PolicyUpdater

VOCAB = 97


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).float().eval()


def make_samples(n_groups: int = 3, per_group: int = 4, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 7))]
        for _ in range(per_group):
            resp_len = rng.randint(4, 14)
            resp = [rng.randrange(1, VOCAB) for _ in range(resp_len)]
            mask = [0 if 3 <= j < 6 else 1 for j in range(resp_len)]  # a "tool result" span
            logp = [-rng.uniform(1.0, 5.0) if m else 0.0 for m in mask]
            out.append(TrainSample(prompt + resp, len(prompt), mask, logp, rng.uniform(-1.5, 1.5), g))
    return out


def run_update(overrides, samples=None, seed=0, ref=False):
    cfg = build_config({}, ["optim.lr=1e-2", "optim.grad_clip=100", "optim.mini_batch_size=2",
                            "model.generation_dtype=same", *overrides])  # the trainer samples (unless overridden)
    model = tiny_model(seed)
    backend = TorchBackend(model, cfg.optim, total_steps=10)
    ref_backend = FrozenBackend(copy.deepcopy(model)) if ref else None
    updater = PolicyUpdater(backend, cfg, pad_id=0, ref_backend=ref_backend)
    metrics = updater.update(samples or make_samples())
    return model, metrics


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_samples_from_trees_take_advantages_from_the_scores():
    cfg = RolloutConfig(mode="independent", k=3, initial_rollouts=1, max_response_tokens=500)
    trees = RolloutScheduler(ScriptedEngine(tool_then_answer(calls=1, h_first=1.0, h_after_tool=2.0)),
                             {"search": EchoSearch()}, cfg).run(
        [Question(f"q{i}", [ord(c) for c in f"Q{i}?"]) for i in range(3)], seed=0).trees
    trees[1].leaves.append(Leaf(3, [0], "global", "engine_error", 0))  # no model token: no sample
    scores = [tuple(LeafScore(1.0, "correct", 0.5 * ti - 0.25 * j, True) for j in range(len(t.leaves)))
              for ti, t in enumerate(trees)]
    samples = samples_from_trees(trees, scores)
    assert len(samples) == 9
    expected = [(ti, f"q{ti}", scores[ti][j].advantage, t.prompt_ids + t.response_ids(leaf), t.loss_mask(leaf))
                for ti, t in enumerate(trees) for j, leaf in enumerate(t.leaves[:3])]
    assert [(s.group, s.question_id, s.advantage, s.input_ids, s.loss_mask) for s in samples] == expected
    # The update's trees: uninformative groups dropped, groups renumbered within the kept trees.
    kept = StepScores(tuple(scores), {}, frozenset({"q0"})).kept(trees)
    assert [(s.group, s.advantage) for s in samples_from_trees(*kept)] == [(s.group - 1, s.advantage)
                                                                          for s in samples[3:]]
    nan_scores = [list(ts) for ts in scores]
    nan_scores[2][1] = LeafScore(0.0, "wrong", math.nan, False)
    with pytest.raises(ValueError, match="question q2 leaf 1 has a NaN advantage"):
        samples_from_trees(trees, nan_scores)
    with pytest.raises(ValueError, match=r"trees\[1\] \(question q1\) has 4 leaves but 3 scores"):
        samples_from_trees(trees, [scores[0], scores[1][:3], scores[2]])


def test_plan_micro_batches_respects_budget_and_covers_all():
    lengths = [5, 30, 12, 12, 7, 40, 3]
    batches = plan_micro_batches(lengths, token_budget=40)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 40


def test_mini_batches_keep_question_groups_whole():
    samples = make_samples(n_groups=5)
    minis = split_mini_batches(samples, 2)
    assert [sorted({samples[i].group for i in m}) for m in minis] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("loss", ["aepo", "ppo_clip", "gspo"])
def test_micro_batch_size_does_not_change_the_update(loss):
    m1, met1 = run_update([f"algorithm.loss={loss}", "optim.micro_batch_tokens=1"])
    m8, met8 = run_update([f"algorithm.loss={loss}", "optim.micro_batch_tokens=400"])
    assert met1["train/padding_waste"] == 0.0 and met8["train/padding_waste"] > 0.0
    # Adam amplifies fp32 noise (~1e-6 in the gradients) most where a gradient is near 0; GSPO's sequence-level
    # ratios do it most: max |Δθ| 9.9e-5 with the unchunked projection, 1.6e-4 with the chunked one (2 of 24800
    # parameters above 2e-5 either way); AEPO and PPO-clip stay under 2e-6.
    torch.testing.assert_close(params(m1), params(m8), rtol=1e-4, atol=2e-4 if loss == "gspo" else 2e-5)
    assert met1["train/loss"] == pytest.approx(met8["train/loss"], rel=1e-5, abs=1e-7)


def test_entropy_aware_advantage_is_really_used():
    base, _ = run_update(["algorithm.entropy_advantage=true"])
    off, _ = run_update(["algorithm.entropy_advantage=false"])
    assert not torch.allclose(params(base), params(off))


def test_aepo_loss_is_really_used_under_several_epochs():
    # With 3 PPO epochs at a large LR ratios leave the clip range, so AEPO's preserved gradient differs from PPO's.
    aepo, met = run_update(["algorithm.loss=aepo", "optim.ppo_epochs=3", "algorithm.entropy_advantage=false"])
    ppo, _ = run_update(["algorithm.loss=ppo_clip", "optim.ppo_epochs=3", "algorithm.entropy_advantage=false"])
    assert met["train/clip_frac_high"] > 0
    assert not torch.allclose(params(aepo), params(ppo))


def test_first_epoch_ratio_is_one_with_trainer_old_logprobs():
    _, met = run_update(["optim.ppo_epochs=1", "optim.mini_batch_size=8"])
    assert met["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert met["train/clip_frac"] == 0.0
    assert met["train/rollout_trainer_logprob_gap"] > 0  # the made-up rollout log-probs differ from the model's


def test_tool_tokens_get_no_gradient():
    """Changing the target tokens inside the masked span must not change the update."""
    samples = make_samples()
    changed = []
    for s in samples:
        ids = list(s.input_ids)
        for j, m in enumerate(s.loss_mask):
            if not m:
                ids[s.prompt_len + j] = (ids[s.prompt_len + j] % (VOCAB - 1)) + 1
        changed.append(TrainSample(ids, s.prompt_len, s.loss_mask, s.rollout_logprobs, s.advantage, s.group))
    # Tool tokens still condition later model tokens, so compare a setup where no model token follows them.
    tail = [TrainSample(s.input_ids, s.prompt_len, [1] * 3 + [0] * (s.response_len - 3), s.rollout_logprobs,
                        s.advantage, s.group) for s in samples]
    tail_changed = [TrainSample(c.input_ids, c.prompt_len, t.loss_mask, c.rollout_logprobs, c.advantage, c.group)
                    for c, t in zip(changed, tail)]
    a, _ = run_update([], samples=tail)
    b, _ = run_update([], samples=tail_changed)
    torch.testing.assert_close(params(a), params(b))


def test_kl_reference_model():
    with pytest.raises(ValueError, match="reference model"):
        run_update(["algorithm.kl_coef=0.1"])
    # One mini-batch: the reference equals the policy being differentiated, KL is 0.
    _, met = run_update(["algorithm.kl_coef=0.1", "optim.mini_batch_size=8"], ref=True)
    assert met["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    # Later mini-batches see a policy that has moved away from the frozen reference: KL > 0 and it pulls back.
    with_kl, met = run_update(["algorithm.kl_coef=1.0"], ref=True)
    without, _ = run_update([])
    assert met["train/kl_ref"] > 0
    assert not torch.allclose(params(with_kl), params(without))


def test_metrics_present():
    _, met = run_update([])
    for key in ("train/loss", "train/grad_norm", "train/entropy_mean", "train/clip_frac_high",
                "train/tokens_per_s", "train/peak_rss_mb", "train/approx_kl"):
        assert key in met, key
    # The high-entropy threshold (and its diagnostics) exist only under the high-entropy clip gate.
    assert "train/clip_frac_high_entropy" not in met
    _, gated = run_update(["algorithm.clip_gate=high_entropy"])
    assert "train/clip_frac_high_entropy" in gated and "train/num_high_entropy_tokens" in gated


def _with_exact_rollout_entropies(samples: list[TrainSample], seed: int = 0) -> list[TrainSample]:
    """The sampler's entropies as the in-process engine reports them: the model's own, at the rollout temperature."""
    cfg = build_config({}, [])
    updater = PolicyUpdater(TorchBackend(tiny_model(seed), cfg.optim, total_steps=1), cfg, pad_id=0)
    scored = updater.score(samples)
    return [dataclasses.replace(s, rollout_entropies=[e * m for e, m in zip(scored.entropy[i].tolist(), s.loss_mask,
                                                                           strict=True)])
            for i, s in enumerate(samples)]


@pytest.mark.parametrize("old", ["trainer", "rollout"])
def test_on_policy_update_skips_the_scoring_pass_without_changing_the_update(old):
    samples = _with_exact_rollout_entropies(make_samples())
    common = ["optim.mini_batch_size=8", "algorithm.entropy_advantage=true", "algorithm.clip_gate=high_entropy",
              f"optim.old_logprobs={old}"]
    skipped, met_skip = run_update([*common, "optim.scoring_pass=auto"], samples)
    scored, met_scored = run_update([*common, "optim.scoring_pass=always"], samples)
    assert met_skip["train/scoring_pass"] == 0.0 and met_scored["train/scoring_pass"] == 1.0
    torch.testing.assert_close(params(skipped), params(scored), rtol=1e-5, atol=1e-6)
    for key in ("train/loss", "train/entropy_mean", "train/rollout_trainer_logprob_gap", "train/clip_frac"):
        assert met_skip[key] == pytest.approx(met_scored[key], rel=1e-4, abs=1e-6), key


def _sampled_by_the_trainer(samples: list[TrainSample], seed: int = 0) -> list[TrainSample]:
    """Samples as the in-process engine on the training weights reports them: its log-probs and entropies are the
    trainer's own (π_old itself)."""
    cfg = build_config({}, [])
    scored = PolicyUpdater(TorchBackend(tiny_model(seed), cfg.optim, total_steps=1), cfg, pad_id=0).score(samples)
    return [dataclasses.replace(s, rollout_logprobs=[lp * m for lp, m in zip(scored.logprobs[i].tolist(), s.loss_mask,
                                                                            strict=True)],
                                rollout_entropies=[e * m for e, m in zip(scored.entropy[i].tolist(), s.loss_mask,
                                                                         strict=True)])
            for i, s in enumerate(samples)]


@pytest.mark.parametrize("regime", [["optim.mini_batch_size=1"], ["optim.ppo_epochs=2", "optim.mini_batch_size=8"]])
def test_when_the_sampler_is_the_trainer_an_off_policy_update_skips_the_scoring_pass_too(regime):
    """Several optimizer steps per rollout batch: π_old of every mini-batch is the pre-update policy, which is exactly
    what sampled (same weights, same precision, unfiltered): the sampler's log-probs are π_old and its entropies the
    trainer's, so the scoring pass (~30 s of a 4-minute step on an AVX2 CPU) cannot change the update."""
    samples = _sampled_by_the_trainer(make_samples())
    common = ["algorithm.entropy_advantage=true", "algorithm.clip_gate=high_entropy", *regime]
    skipped, met_skip = run_update([*common, "optim.scoring_pass=auto"], samples)
    scored, met_scored = run_update([*common, "optim.scoring_pass=always"], samples)
    assert met_skip["train/scoring_pass"] == 0.0 and met_scored["train/scoring_pass"] == 1.0
    assert met_skip["train/optimizer_steps"] > 1
    torch.testing.assert_close(params(skipped), params(scored), rtol=1e-4, atol=1e-6)
    for key in ("train/loss", "train/entropy_mean", "train/clip_frac", "train/ratio_max"):
        assert met_skip[key] == pytest.approx(met_scored[key], rel=1e-3, abs=1e-5), key
    # The gap is the pre-update one (float summation order only), not the policy's drift over the mini-batches.
    assert met_skip["train/rollout_trainer_logprob_gap"] < 1e-4


@pytest.mark.parametrize(
    ("overrides", "estimated"),
    [(["rollout.top_p=0.9"], False), (["optim.ppo_epochs=2"], True), ([], True)],
)
def test_scoring_pass_runs_whenever_it_can_change_the_update(overrides, estimated):
    samples = _with_exact_rollout_entropies(make_samples())
    if estimated:  # a remote engine's top-k + tail estimate is not the trainer's entropy
        samples = [dataclasses.replace(s, rollout_entropies=None) for s in samples]
    _, met = run_update(["optim.mini_batch_size=8", *overrides], samples)
    assert met["train/scoring_pass"] == 1.0


# Two PPO epochs over two mini-batches ({0, 1} and {2}), each split into several micro-batches by a small budget.
SPLIT = ["optim.ppo_epochs=2", "optim.micro_batch_tokens=20", "optim.lr=1e-3"]


def test_combined_diagnostics_are_pinned():
    """The update's loss diagnostics on a fixed example (values from before diagnostics declared their reduction)."""
    _, met = run_update([*SPLIT, "algorithm.entropy_source=old"])  # the entropies the values were pinned with
    pinned = {
        "clip_frac": 57 / 136, "clip_frac_high": 24 / 136, "clip_frac_low": 33 / 136,
        "approx_kl": 0.2360767496001619, "ratio_mean": 1.1249514088472898, "ratio_max": 17.262943267822266,
        "ratio_min": 0.07128968834877014, "num_tokens": 136.0,
        "entropy_mean": 3.2801619662958035,
    }
    assert {k: met[f"train/{k}"] for k in pinned} == pytest.approx(pinned, rel=1e-4)


def _combine_by_name(parts: list[dict[str, float]]) -> dict[str, float]:
    """How update() combined micro-batch diagnostics before they declared it, written out as a reference: counts
    summed, ratio extremes kept, clip_frac_high_entropy weighted by the high-entropy count, the rest by tokens."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for diag in parts:
        for key, value in diag.items():
            if key.startswith("num_"):
                sums[key] = sums.get(key, 0.0) + value
            elif key in ("ratio_max", "ratio_min"):
                sums[key] = (max if key == "ratio_max" else min)(sums.get(key, value), value)
            else:
                weight = diag["num_high_entropy_tokens" if key == "clip_frac_high_entropy" else "num_tokens"]
                sums[key] = sums.get(key, 0.0) + value * weight
                weights[key] = weights.get(key, 0.0) + weight
    return {k: (v / weights[k] if weights[k] else 0.0) if k in weights else v for k, v in sums.items()}


def test_update_combines_micro_batch_diagnostics_exactly(monkeypatch: pytest.MonkeyPatch):
    """Bit for bit the reference combination of what each micro-batch's loss reported, in the same order."""
    parts: list[dict[str, float]] = []
    real = update_mod.compute_policy_loss

    def recording(*args, **kwargs):
        loss, diag = real(*args, **kwargs)
        parts.append({name: d.value for name, d in diag.items()})
        return loss, diag

    monkeypatch.setattr(update_mod, "compute_policy_loss", recording)
    _, met = run_update([*SPLIT, "algorithm.kl_coef=0.1"], ref=True)
    assert len(parts) > 4  # several micro-batches in each of the 2 × 2 mini-batches
    expected = {f"train/{k}": v for k, v in _combine_by_name(parts).items()}
    assert "train/kl_ref" in expected and "train/entropy_mean" in expected
    assert {k: met[k] for k in expected} == expected
    # Same names in the order they first appeared; train/entropy_mean keeps its earlier place among the step's
    # own metrics, whose value the loss's token-weighted entropy mean overwrites.
    order = [k for k in expected if k != "train/entropy_mean"]
    assert [k for k in met if k in order] == order


# ---------------------------------------------------------------------------------------------- issue 11 (1, 3)
SWEEP = Path(__file__).resolve().parents[2] / "configs" / "sweeps" / "algorithms.yaml"


def _sweep_cell(cell: str):
    from infra.run.sweep_spec import load_sweep

    return next(r.config for r in load_sweep(SWEEP).runs if r.cell == cell and r.seed == 0)


@pytest.mark.slow
def test_under_the_sweep_settings_the_clipping_loss_acts(model_cache: Path, tmp_path: Path):
    """The sweep's update regime (one epoch, several mini-batches, its learning rate) on its model, SmolLM2-135M, is
    off-policy after the first optimizer step: ratios leave the clip range, tokens are clipped, and `aepo` and its
    `aepo-no-clip-balance` ablation (ppo_clip) move the weights differently. With one mini-batch per step (the first
    comparison's regime) every ratio was 1 and both arms gave the same weights, run for run. (A tiny random model
    at this learning rate stays inside the clip range: ratio_max 1.17, measured.)"""
    from bench.train_step import build_samples
    from infra.models import load_policy
    from infra.numerics import autocast_dtype, numerics_for

    moved = {}
    for cell in ("aepo", "aepo-no-clip-balance"):
        cfg = _sweep_cell(cell)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"cache_dir": str(model_cache)})})
        assert cfg.clip_active()
        model, tokenizer = load_policy(cfg.model)
        samples = build_samples(tokenizer, cfg.train.batch_size, cfg.rollout.k, 0, tmp_path / cell)
        # Shorter responses keep the test quick; the regime, not the transcript length, decides the drift.
        samples = [dataclasses.replace(s, input_ids=s.input_ids[: s.prompt_len + 48], loss_mask=s.loss_mask[:48],
                                       rollout_logprobs=s.rollout_logprobs[:48],
                                       rollout_entropies=s.rollout_entropies[:48]) for s in samples]
        numerics = numerics_for(cfg)  # the sweep's own dtypes, as a run on this machine resolves them
        backend = TorchBackend(model, cfg.optim, cfg.train.steps, compute_dtype=autocast_dtype(numerics.compute_dtype))
        metrics = PolicyUpdater(backend, cfg, pad_id=int(tokenizer.pad_token_id)).update(samples)
        assert metrics["train/optimizer_steps"] == cfg.train.batch_size // cfg.optim.mini_batch_size > 1
        moved[cell] = (params(model), metrics)
    aepo, ppo = moved["aepo"], moved["aepo-no-clip-balance"]
    assert aepo[1]["train/ratio_max"] > 1.0 + _sweep_cell("aepo").algorithm.clip_high
    assert aepo[1]["train/clip_frac_high"] > 0 and ppo[1]["train/clip_frac"] > 0
    assert not torch.equal(aepo[0], ppo[0])


def test_the_shipped_configs_let_the_clipping_loss_act():
    from infra.config_files import load_config

    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("demo.yaml", "paper/qwen3_14b_deepsearch.yaml"):
        assert load_config(root / name).clip_active(), name
    assert not build_config({}, ["train.batch_size=4", "optim.mini_batch_size=4"]).clip_active()


def _noisy_rollout_entropies(samples: list[TrainSample]) -> list[TrainSample]:
    """The sampler's entropies are the trainer's plus noise: what a bf16 copy or a vLLM server reports."""
    exact = _with_exact_rollout_entropies(samples)
    rng = random.Random(7)
    return [dataclasses.replace(s, rollout_entropies=[e + rng.uniform(0.0, 0.5) * m for e, m in
                                                      zip(s.rollout_entropies, s.loss_mask, strict=True)])
            for s in exact]


@pytest.mark.parametrize("overrides", [["model.generation_dtype=bfloat16"], ["rollout.engine=remote"]])
def test_a_sampler_that_is_not_the_trainer_never_skips_the_scoring_pass(overrides):
    """Skipping the scoring pass is exact only when the engine samples from the trainer's own weights at the same
    precision; otherwise z(H), the high-entropy gate and train/entropy_mean would come from the sampler."""
    samples = _noisy_rollout_entropies(make_samples())
    common = ["optim.mini_batch_size=8", "algorithm.entropy_advantage=true", "algorithm.clip_gate=high_entropy",
              "algorithm.entropy_source=old", *overrides]  # π_old's entropies drive the loss (current: the forward's)
    auto, met_auto = run_update([*common, "optim.scoring_pass=auto"], samples)
    always, met_always = run_update([*common, "optim.scoring_pass=always"], samples)
    assert met_auto["train/scoring_pass"] == 1.0
    torch.testing.assert_close(params(auto), params(always))
    assert met_auto["train/entropy_mean"] == met_always["train/entropy_mean"]
    # Same samples, the sampler declared to be the trainer: the skip path takes the (here noisy) sampler entropies.
    _, met_skip = run_update([*common[:-len(overrides)], "optim.scoring_pass=auto"], samples)
    assert met_skip["train/scoring_pass"] == 0.0 and met_skip["train/entropy_mean"] != met_always["train/entropy_mean"]


def test_gap_statistics_are_logged():
    _, met = run_update(["optim.scoring_pass=always"])
    gap, p99, top = (met[f"train/rollout_trainer_logprob_gap{s}"] for s in ("", "_p99", "_max"))
    assert 0 < gap <= p99 <= top


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_rollout_correction_reweights_the_policy_term(mode):
    """The made-up rollout log-probs are far from the model's: truncated IS (or masking) changes the update, and
    reports how many tokens it truncated."""
    base, met_none = run_update(["algorithm.rollout_correction=none"])
    corrected, met = run_update([f"algorithm.rollout_correction={mode}", "algorithm.rollout_correction_cap=2.0"])
    assert met_none["train/rollout_is_weight_mean"] == 1.0 and met_none["train/rollout_is_truncated_frac"] > 0
    assert met["train/rollout_is_truncated_frac"] == met_none["train/rollout_is_truncated_frac"]
    assert met["train/rollout_is_weight_mean"] != 1.0
    assert not torch.allclose(params(base), params(corrected))


@pytest.mark.parametrize("loss", ["aepo", "gspo"])
def test_activation_checkpointing_does_not_change_the_update(loss):
    """Recomputing the decoder layers in the backward gives the same step as keeping their activations."""
    on, _ = run_update([f"algorithm.loss={loss}", "optim.activation_checkpointing=true", "optim.ppo_epochs=2"])
    off, _ = run_update([f"algorithm.loss={loss}", "optim.activation_checkpointing=false", "optim.ppo_epochs=2"])
    assert torch.allclose(params(on), params(off), atol=1e-6, rtol=0)
    assert not torch.equal(params(on), params(tiny_model()))  # the step moved the weights: not vacuous


def _saved_bytes(model: torch.nn.Module, checkpointed: bool, tokens: int = 48) -> int:
    """Bytes autograd keeps for the backward of one forward of ``model`` (saved-tensor hooks count them)."""
    from infra.training.backends import decoder_hidden
    from infra.training.memory import checkpoint_decoder_layers

    checkpoint_decoder_layers(model, checkpointed)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    ids = torch.randint(1, VOCAB, (2, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder_hidden(model, ids, torch.ones_like(ids), torch.bfloat16).sum().backward()
    return sum(saved)


def test_activation_checkpointing_keeps_only_the_layer_inputs():
    """The point of the option: per token the decoder keeps a few hidden vectors instead of every layer's
    activations (saved tensors counted by autograd's hooks; the checkpointed layers save their inputs only)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    full, checkpointed = _saved_bytes(model, False), _saved_bytes(model, True)
    assert checkpointed < full / 4, (checkpointed, full)
    assert _saved_bytes(model, False) == full  # switched off again: the plain forward is back
    assert not model.training  # the update's eval mode is kept (transformers' own checkpointing needs train())


def test_the_micro_batch_cap_follows_the_checkpointed_estimate():
    from infra.training.memory import activation_bytes_per_token, micro_batch_token_cap

    model = tiny_model()
    layers, hidden, inter = 2, 32, 64
    for on in (False, True):
        cfg = build_config({}, ["optim.memory_budget_gb=0.001", "optim.micro_batch_tokens=100000",
                                f"optim.activation_checkpointing={str(on).lower()}"])
        per_token = activation_bytes_per_token(layers, hidden, inter, checkpointed=on)
        assert micro_batch_token_cap(cfg.optim, model, torch.device("cpu")) == int(1e6 // per_token)
    # SmolLM2-135M (30 layers, 576, 1536): 1.38 MB a token kept, 0.12 MB checkpointed.
    assert activation_bytes_per_token(30, 576, 1536) == 1_382_400
    assert activation_bytes_per_token(30, 576, 1536, checkpointed=True) == 115_200


def test_a_checkpointed_model_still_trains_through_its_own_forward_with_a_kv_cache():
    """A caller's forward with the model's default use_cache=True (HF's `model(ids, labels=…)`) under autograd: the
    layers keep a KV cache that a recompute would fill twice, so they run plainly there (same loss and gradients)."""
    from infra.training.memory import checkpoint_decoder_layers

    ids = torch.randint(1, VOCAB, (2, 12))
    grads = []
    for on in (False, True):
        model = tiny_model()
        checkpoint_decoder_layers(model, on)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # padded, as a batch is: the attention mask is a tensor of the keys' length
        out = model.train()(input_ids=ids, attention_mask=mask, labels=ids)  # use_cache defaults to True
        out.loss.backward()
        grads.append((out.loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_scoring_pass_never_takes_pi_old_and_the_entropies_from_a_sampler_that_is_not_the_trainer():
    """A bf16 generation copy with π_old from the sampler (optim.old_logprobs=rollout): the scoring pass would only
    replace the sampler's entropies by the trainer's. `never` skips it and reads the sampler's: with entropies equal
    to the trainer's the update is the scored one; with the copy's own (noisy) entropies it differs, and only in
    what the entropies drive."""
    common = ["model.generation_dtype=bfloat16", "optim.old_logprobs=rollout", "algorithm.entropy_advantage=true",
              "algorithm.clip_gate=high_entropy", "algorithm.entropy_source=old"]  # π_old's entropies drive the loss
    exact = _with_exact_rollout_entropies(make_samples())
    auto, met_auto = run_update([*common, "optim.scoring_pass=auto"], exact)
    never, met_never = run_update([*common, "optim.scoring_pass=never"], exact)
    assert met_auto["train/scoring_pass"] == 1.0 and met_never["train/scoring_pass"] == 0.0
    torch.testing.assert_close(params(never), params(auto), rtol=1e-4, atol=1e-6)
    assert met_never["train/loss"] == pytest.approx(met_auto["train/loss"], rel=1e-4, abs=1e-6)
    noisy = _noisy_rollout_entropies(make_samples())
    scored, met_scored = run_update([*common, "optim.scoring_pass=auto"], noisy)
    skipped, met_skipped = run_update([*common, "optim.scoring_pass=never"], noisy)
    assert met_scored["train/entropy_mean"] == pytest.approx(met_auto["train/entropy_mean"], rel=1e-5)
    assert met_skipped["train/entropy_mean"] > met_scored["train/entropy_mean"] + 0.1  # the sampler's, +U(0, 0.5)
    assert not torch.allclose(params(skipped), params(scored))


def test_scoring_pass_never_refuses_estimated_entropies_and_a_trainer_pi_old():
    estimated = [dataclasses.replace(s, rollout_entropies=None) for s in make_samples()]
    with pytest.raises(ValueError, match="exact_entropy"):
        run_update(["optim.old_logprobs=rollout", "optim.scoring_pass=never"], estimated)
    with pytest.raises(ValueError, match="old_logprobs=rollout"):
        build_config({}, ["optim.scoring_pass=never"])
    with pytest.raises(ValueError, match="exact_entropy=true"):
        build_config({}, ["optim.scoring_pass=never", "optim.old_logprobs=rollout", "rollout.engine=vllm",
                          "rollout.exact_entropy=false"])
    build_config({}, ["optim.scoring_pass=never", "optim.old_logprobs=rollout", "rollout.engine=vllm"])


class _EntropyRecorder:
    """At each micro-batch's loss (after its gradient forward, before its backward, so the policy is the one being
    differentiated): the entropies and advantages the loss got, and what the policy itself gives there now."""

    def __init__(self, samples: list[TrainSample], cfg) -> None:
        self.samples, self.cfg, self.updater = samples, cfg, None
        self.seen: list[dict[str, object]] = []

    def _current(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        batch = update_mod.collate([self.samples[i] for i in indices], 0, torch.device("cpu"))
        _, ent = update_mod.response_logprobs_and_entropy(self.updater.backend, batch, 1.0, with_grad=False)
        return ent, batch.loss_mask

    def micro_batch(self, samples, inputs, norm, norm_len) -> None:
        current, mask = self._current(samples)
        mini = next(m for m in split_mini_batches(self.samples, self.cfg.optim.mini_batch_size) if samples[0] in m)
        mini_ent, mini_mask = self._current(mini)
        stats = update_mod.entropy_stats(mini_ent, mini_mask)
        expected_adv = update_mod.entropy_aware_advantage(
            torch.tensor([self.samples[i].advantage for i in samples])[:, None] * mask, current, mask,
            self.cfg.algorithm.entropy_advantage_alpha, stats, self.cfg.algorithm.entropy_eps)
        self.seen.append({"entropy": inputs.entropy * inputs.mask, "current": current * mask,
                          "advantages": inputs.advantages, "expected_adv": expected_adv,
                          "grad": inputs.entropy.requires_grad or inputs.advantages.requires_grad})


def _record_entropies(source: str) -> list[dict[str, object]]:
    samples = make_samples()
    cfg = build_config({}, ["optim.lr=1e-2", "optim.grad_clip=100", "optim.mini_batch_size=1",
                            "optim.micro_batch_tokens=400", "model.generation_dtype=same",
                            "algorithm.entropy_advantage=true", f"algorithm.entropy_source={source}"])
    recorder = _EntropyRecorder(samples, cfg)
    updater = PolicyUpdater(TorchBackend(tiny_model(), cfg.optim, total_steps=10), cfg, pad_id=0, observer=recorder)
    recorder.updater = updater
    updater.update(samples)
    return recorder.seen


def test_entropy_source_current_reads_the_gradient_forwards_entropies():
    """Issue 49 §7c: AEPO.md §5's H_t is the current policy's, from the training forward (detached), z over the
    mini-batch. `current` (the default) gives every micro-batch the entropies of the policy it differentiates, and
    the advantage standardized with that policy's mini-batch statistics; `old` keeps π_old's (the scoring pass's)
    all step, which agree on the first mini-batch (no optimizer step yet) and differ on every later one."""
    assert build_config({}).algorithm.entropy_source == "current"
    current, old = _record_entropies("current"), _record_entropies("old")
    assert len(current) == len(old) == 3  # one micro-batch per mini-batch (one question each)
    for seen in current:
        assert not seen["grad"]  # detached: no gradient through the entropies or the scaled advantages
        torch.testing.assert_close(seen["entropy"], seen["current"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(seen["advantages"], seen["expected_adv"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old[0]["entropy"], current[0]["entropy"], rtol=1e-5, atol=1e-5)
    for seen in old[1:]:
        assert not seen["grad"]
        assert (seen["entropy"] - seen["current"]).abs().max() > 1e-3  # π_old's, not the policy being trained
        assert (seen["advantages"] - seen["expected_adv"]).abs().max() > 1e-4


def test_auto_runs_the_scoring_pass_under_bf16_autocast():
    """Issue 49 §7b: under bf16 autocast the in-process sampler on the training weights (generation_dtype same) is
    not the trainer to float precision (its KV-cached decode and the trainer's full forward round differently: a
    log-prob gap up to 2.3e-2 on a tiny Llama, 4.3e-6 in float32), so `auto` skips the scoring pass only under
    float32 compute; the step then logs the gap from the scoring pass."""
    cfg = build_config({}, ["model.generation_dtype=same", "optim.mini_batch_size=2"])
    samples = _with_exact_rollout_entropies(make_samples())
    for compute, scored in ((None, False), (torch.bfloat16, True)):
        backend = TorchBackend(tiny_model(), cfg.optim, total_steps=10, compute_dtype=compute)
        assert PolicyUpdater(backend, cfg, pad_id=0).needs_scoring_pass(samples) is scored, compute
