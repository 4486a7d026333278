"""HFEngine on the tiny random model (float32): seeds, stops, lengths, log-probs/entropies, batching, errors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from aepo_core.config import ModelConfig
from aepo_core.entropy import published_token_entropy, token_entropy
from aepo_core.interfaces import Engine, GenerationRequest, GenerationResult, SamplingParams
from infra.engines.hf import HFEngine, sample_next, sampling_distribution
from infra.engines.weights import PolicyWeights
from infra.models import load_policy

HOT = SamplingParams(temperature=0.7)
HOT_BIG = SamplingParams(temperature=0.6)


def _prompts(engine: HFEngine) -> list[list[int]]:
    """Prompts of different lengths, so batches need left padding."""
    return [
        engine.apply_chat_template("What is the capital of France?"),
        engine.encode("Once upon a time"),
        engine.apply_chat_template("Search for the tallest building.", system_prompt="Use tools."),
        engine.encode("x"),
    ]


def _recompute(model: Any, prompt: Sequence[int], result: GenerationResult, sampling: SamplingParams
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the chosen tokens and entropies by one plain forward pass over prompt + generated ids."""
    ids = torch.tensor([list(prompt) + result.token_ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    logp, entropy = sampling_distribution(logits, sampling)
    chosen = logp.gather(-1, torch.tensor(result.token_ids)[:, None]).squeeze(-1)
    return chosen, entropy


def test_implements_the_engine_protocol(tiny_engine: HFEngine) -> None:
    assert isinstance(tiny_engine, Engine)
    ids = tiny_engine.encode("hello <search>x</search>")
    assert tiny_engine.decode(ids) == "hello <search>x</search>"
    assert tiny_engine.eos_token_id == 2 and 2 in tiny_engine.eos_token_ids
    assert tiny_engine.weight_version is None  # a property: no live weights were handed to it yet
    prompt = tiny_engine.apply_chat_template("Hi", system_prompt="Be brief.")
    assert tiny_engine.decode(prompt) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_same_seed_same_tokens_different_seed_different_tokens(tiny_engine: HFEngine) -> None:
    """Seeds decide the samples: the same batch twice is identical, to the bit; another seed samples other tokens.

    (Two copies of one request inside one batch are not compared bit for bit: with 2 torch threads the CPU kernels
    split the batch rows between threads, and identical rows then differ by ~1e-6 in log-prob — measured on torch
    2.13 — which can flip a token whose uniform draw falls that close to a CDF boundary.)"""
    prompt = _prompts(tiny_engine)[0]
    requests = [GenerationRequest(prompt, 24, seed=11), GenerationRequest(prompt, 24, seed=12)]
    a, c = tiny_engine.generate(requests, HOT)
    again_a, again_c = tiny_engine.generate(requests, HOT)
    assert (a.token_ids, a.logprobs, c.token_ids) == (again_a.token_ids, again_a.logprobs, again_c.token_ids)
    assert a.token_ids != c.token_ids


def test_unseeded_rows_follow_the_engine_seed(tiny_policy: tuple[Any, Any]) -> None:
    model, tok = tiny_policy
    req = [GenerationRequest([1, 2, 3, 4], 12)]
    first = [HFEngine(model, tok, seed=5).generate(req, HOT)[0].token_ids for _ in range(2)]
    assert first[0] == first[1]
    assert HFEngine(model, tok, seed=6).generate(req, HOT)[0].token_ids != first[0]


def test_max_tokens_per_row(tiny_engine: HFEngine) -> None:
    prompts = _prompts(tiny_engine)
    caps = [5, 17, 1, 0]
    results = tiny_engine.generate([GenerationRequest(p, m, seed=i) for i, (p, m) in enumerate(zip(prompts, caps))],
                                   HOT)
    assert [len(r.token_ids) for r in results] == caps
    assert all(r.finish_reason == "length" for r in results)
    assert all(len(r.logprobs) == len(r.entropies) == len(r.token_ids) for r in results)
    stats = tiny_engine.last_stats
    # finished rows leave the batch: one row-step per generated token, passes = the longest row
    assert stats.row_steps == stats.new_tokens == sum(caps)
    assert stats.forward_passes == max(caps)


def test_stop_string_ends_ids_at_the_completing_token(tiny_engine: HFEngine) -> None:
    prompt = _prompts(tiny_engine)[1]
    (free,) = tiny_engine.generate([GenerationRequest(prompt, 30, seed=3)], HOT)
    stop = tiny_engine.decode(free.token_ids[10:12]).strip()[:6]
    assert stop
    # expected: the shortest prefix of the free run whose text contains the stop string
    cut = next(n for n in range(1, 31) if stop in tiny_engine.decode(free.token_ids[:n]))
    (res,) = tiny_engine.generate([GenerationRequest(prompt, 30, stop=("@@never@@", stop), seed=3)], HOT)
    assert res.finish_reason == "stop" and res.stop_string == stop
    assert res.token_ids == free.token_ids[:cut]
    assert stop in tiny_engine.decode(res.token_ids)
    assert stop not in tiny_engine.decode(res.token_ids[:-1])
    assert res.logprobs == free.logprobs[:cut]


def test_eos_ends_the_row_and_is_included(tiny_policy: tuple[Any, Any]) -> None:
    model, tok = tiny_policy
    prompt = [1, 9690, 198]
    (free,) = HFEngine(model, tok).generate([GenerationRequest(prompt, 20, seed=4)], HOT)
    eos = free.token_ids[6]
    engine = HFEngine(model, tok, stop_token_ids=[eos])
    (res,) = engine.generate([GenerationRequest(prompt, 20, seed=4)], HOT)
    first = free.token_ids.index(eos)
    assert res.finish_reason == "eos" and res.token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=40),
                                      SamplingParams(temperature=1.3, top_p=0.9)], ids=["temp", "top_k", "top_p"])
def test_logprobs_and_entropies_match_a_plain_forward_pass(tiny_engine: HFEngine, sampling: SamplingParams) -> None:
    prompts = _prompts(tiny_engine)[:3]
    results = tiny_engine.generate([GenerationRequest(p, 12, seed=20 + i) for i, p in enumerate(prompts)], sampling)
    for prompt, res in zip(prompts, results):
        chosen, entropy = _recompute(tiny_engine.model, prompt, res, sampling)
        assert torch.allclose(torch.tensor(res.logprobs), chosen, atol=1e-4)
        assert torch.allclose(torch.tensor(res.entropies), entropy, atol=1e-4)
        assert torch.isfinite(chosen).all()  # every sampled token survived the filter
        if sampling.top_k:
            assert max(res.entropies) <= math.log(sampling.top_k) + 1e-4
        if sampling.top_k == 0 and sampling.top_p == 1.0:  # same quantity as the training-side entropy
            ids = torch.tensor([prompt + res.token_ids[:-1]])
            with torch.no_grad():
                logits = tiny_engine.model(input_ids=ids).logits[0, len(prompt) - 1:]
            core = token_entropy(logits, temperature=sampling.temperature)
            assert torch.allclose(torch.tensor(res.entropies), core, atol=1e-4)


def test_batched_rows_equal_their_unbatched_runs(tiny_engine: HFEngine) -> None:
    prompts = _prompts(tiny_engine)
    requests = [GenerationRequest(p, 8 + 3 * i, seed=100 + i) for i, p in enumerate(prompts)]
    batched = tiny_engine.generate(requests, HOT)
    for req, row in zip(requests, batched):
        (solo,) = tiny_engine.generate([req], HOT)
        assert row.token_ids == solo.token_ids
        assert torch.allclose(torch.tensor(row.logprobs), torch.tensor(solo.logprobs), atol=1e-4)
        assert torch.allclose(torch.tensor(row.entropies), torch.tensor(solo.entropies), atol=1e-4)


def test_max_batch_size_splits_without_changing_results(tiny_policy: tuple[Any, Any]) -> None:
    model, tok = tiny_policy
    whole, split = HFEngine(model, tok), HFEngine(model, tok, max_batch_size=2)
    requests = [GenerationRequest(p, 6, seed=50 + i) for i, p in enumerate(_prompts(whole))]
    assert [r.token_ids for r in whole.generate(requests, HOT)] == [r.token_ids for r in split.generate(requests, HOT)]
    assert split.last_stats.forward_passes == 12  # two sequential batches of 6 steps


def test_bf16_model_gives_finite_consistent_entropies(tiny_cfg: ModelConfig) -> None:
    model, tok = load_policy(tiny_cfg.model_copy(update={"dtype": "bfloat16"}))
    engine = HFEngine(model, tok)
    prompts = _prompts(engine)[:2]
    results = engine.generate([GenerationRequest(p, 10, seed=i) for i, p in enumerate(prompts)], HOT)
    for prompt, res in zip(prompts, results, strict=True):
        chosen, entropy = _recompute(model, prompt, res, HOT)
        assert all(math.isfinite(h) and 0 <= h <= math.log(49152) + 1e-3 for h in res.entropies)
        # bf16 forward passes with and without a KV cache differ slightly; the float32 math on top does not
        assert torch.allclose(torch.tensor(res.entropies), entropy, atol=0.05)
        assert torch.allclose(torch.tensor(res.logprobs), chosen, atol=0.1)


def test_sample_next_matches_the_reference_distribution() -> None:
    logits = (torch.randn(3, 49152, generator=torch.Generator().manual_seed(1)) * 300).to(torch.bfloat16)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for sampling in (HOT_BIG, SamplingParams(top_k=20), SamplingParams(top_p=0.5)):
        tokens, logps, ents, _published, bad = sample_next(logits, gens, sampling)
        ref_logp, ref_h = sampling_distribution(logits, sampling)
        z = logits.double() / sampling.temperature
        exact = torch.distributions.Categorical(logits=z).entropy() if sampling == HOT_BIG else None
        assert bad == [False] * 3
        if exact is not None:
            assert torch.allclose(torch.tensor(ents, dtype=torch.float64), exact, atol=1e-4)
        assert torch.allclose(torch.tensor(ents), ref_h, atol=1e-3)
        picked = ref_logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        assert torch.isfinite(picked).all() and torch.allclose(torch.tensor(logps), picked, atol=1e-4)


def test_sample_next_reports_the_published_codes_top10_entropy_terms() -> None:
    """The published code's per-position term (issue 49 §3): −Σ p·log p over the top-10 log-probs plus the
    sampled token's when outside them, ÷ ln V; equal to the pure reference on the same distribution."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(2)) * 3
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for asked in (HOT_BIG, SamplingParams(top_k=5), SamplingParams()):
        sampling = dataclasses.replace(asked, published_entropy=True)
        tokens, _logps, _ents, published, _bad = sample_next(logits, gens, sampling)
        assert all(math.isnan(t) for t in sample_next(logits, gens, asked)[3])  # not asked for: not computed
        ref_logp, _ = sampling_distribution(logits, sampling)
        for row, (tok, term) in enumerate(zip(tokens, published, strict=True)):
            top = [v for v in ref_logp[row].topk(10).values.tolist() if math.isfinite(v)]
            expected = published_token_entropy(top, float(ref_logp[row, tok]), 3000)
            assert term == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert 0 < min(published) and max(published) < math.log(11) / math.log(3000) + 1e-6


def test_sample_next_frequencies_and_filtering() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(0)
    draws = [sample_next(probs.log(), [gen], SamplingParams())[0][0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, probs[0], atol=0.03)
    # the filtered tail (the last tokens of the vocabulary) is never drawn
    kept = {sample_next(probs.log(), [gen], SamplingParams(top_k=2))[0][0] for _ in range(500)}
    assert kept == {0, 1}


def test_greedy_is_the_argmax(tiny_engine: HFEngine) -> None:
    prompt = _prompts(tiny_engine)[0]
    greedy = SamplingParams(temperature=0.0)
    a, b = tiny_engine.generate([GenerationRequest(prompt, 6, seed=1), GenerationRequest(prompt, 6, seed=2)], greedy)
    assert a.token_ids == b.token_ids
    ids = torch.tensor([prompt + a.token_ids[:-1]])
    with torch.no_grad():
        logits = tiny_engine.model(input_ids=ids).logits[0, len(prompt) - 1:]
    assert a.token_ids == logits.argmax(-1).tolist()


def test_a_bad_row_does_not_sink_the_batch(tiny_engine: HFEngine) -> None:
    good = GenerationRequest(_prompts(tiny_engine)[1], 6, seed=9)
    results = tiny_engine.generate(
        [GenerationRequest([], 6), good, GenerationRequest([5, 10**9], 6)], HOT)
    assert [r.finish_reason for r in results] == ["error", "length", "error"]
    assert results[0].error and "empty" in results[0].error
    assert results[2].error and "vocabulary" in results[2].error
    (solo,) = tiny_engine.generate([good], HOT)
    assert results[1].token_ids == solo.token_ids


def test_engine_sees_live_weights_and_restores_train_mode(tiny_cfg: ModelConfig) -> None:
    model, tok = load_policy(tiny_cfg.model_copy(update={"init_seed": 3}))
    engine = HFEngine(model, tok)
    req = [GenerationRequest([1, 2, 3], 5, seed=0)]
    before = engine.generate(req, HOT)[0]
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # an "optimizer step": sharper distributions
    model.train()
    after = engine.generate(req, HOT)[0]
    assert model.training
    assert max(after.entropies) < min(before.entropies)


def test_sampling_distribution_closed_form() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    logp, h = sampling_distribution(logits, SamplingParams())
    assert torch.allclose(h, -(probs * probs.log()).sum(-1), atol=1e-6)
    # top-p 0.7 keeps the smallest prefix with mass ≥ 0.7: {0.5, 0.3}, renormalized
    logp, h = sampling_distribution(logits, SamplingParams(top_p=0.7))
    kept = torch.tensor([0.5, 0.3]) / 0.8
    assert torch.allclose(logp[0, :2].exp(), kept, atol=1e-6) and torch.isinf(logp[0, 2:]).all()
    assert torch.allclose(h, -(kept * kept.log()).sum(-1, keepdim=True).squeeze(-1), atol=1e-6)
    logp, h = sampling_distribution(logits, SamplingParams(top_k=1))
    assert logp[0, 0] == 0 and h.item() == 0
    # temperature 2 on the logits
    scaled = torch.softmax(logits / 2, -1)
    _, h = sampling_distribution(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(h, -(scaled * scaled.log()).sum(-1), atol=1e-6)


def test_entropy_is_stable_for_bf16_logits() -> None:
    logits = (torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 300).to(torch.bfloat16)
    logp, h = sampling_distribution(logits, SamplingParams(temperature=0.6))
    ref = torch.distributions.Categorical(logits=logits.double() / 0.6).entropy()
    assert torch.isfinite(h).all() and (h >= -1e-6).all()
    assert torch.allclose(h.double(), ref, atol=1e-3)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(4), atol=1e-4)


def test_the_output_projection_sees_only_contiguous_last_positions(tiny_engine: HFEngine) -> None:
    """The prefill asks the model for the last position's logits only, and that slice must reach the output
    projection contiguous: torch's CPU bf16 ``linear`` on a strided [rows, 1, hidden] input broadcasts the weight
    per row (measured on SmolLM2, 72 rows: +3.9 GB and 18 s for the one [72, 576] × [576, 49152] product, against
    8 MB and 0.02 s contiguous)."""
    seen: list[tuple[tuple[int, ...], bool]] = []
    head = tiny_engine.model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        prompts = _prompts(tiny_engine)
        tiny_engine.generate([GenerationRequest(p, 3, seed=i) for i, p in enumerate(prompts)], HOT)
    finally:
        hook.remove()
    assert seen and all(shape[-2] == 1 for shape, _ in seen)  # never the whole prompt's logits
    assert all(contiguous for _, contiguous in seen), seen


def test_results_carry_the_version_of_the_live_weights_loaded(tiny_cfg: ModelConfig) -> None:
    """The segments of an overlapped rollout (train.max_staleness) say which update's weights sampled them."""
    model, tok = load_policy(tiny_cfg)
    copy_model, _ = load_policy(tiny_cfg)
    engine = HFEngine(copy_model, tok)
    req = [GenerationRequest([1, 2, 3], 3, seed=0)]
    assert engine.generate(req, HOT)[0].weight_version is None
    engine.load_weights(PolicyWeights(model, 7))
    assert engine.weight_version == "7" and engine.generate(req, HOT)[0].weight_version == "7"
