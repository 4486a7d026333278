"""The chunked vocabulary projection (update.response_logprobs_and_entropy) against the unchunked formula.

Golden test: values and gradients equal to the reference ``log_softmax`` over the full [B·R, V] logits to float
tolerance, for temperature 1 and ≠ 1, float32 and bf16 autocast, any chunk size; and the chunk bounds the
largest logits tensor the projection ever produces (counted with a forward hook).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aepo_core.config import OptimConfig
from infra.training.backends import TorchBackend
from infra.training.batching import PaddedBatch, TrainSample, collate
from infra.training.logprobs import logits_chunk_rows, response_logprobs_and_entropy

VOCAB = 211


def tiny_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).float().eval()


def batch_of(n: int = 5, seed: int = 0) -> PaddedBatch:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):  # ragged prompts and responses: padding in both
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        resp = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 11))]
        samples.append(TrainSample(prompt + resp, len(prompt), [1] * len(resp), [0.0] * len(resp), 1.0, 0))
    return collate(samples, pad_id=0)


def reference(backend: TorchBackend, batch: PaddedBatch, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked formula: [B·R, V] logits, log_softmax, entropy −Σ p log p (padded positions zeroed)."""
    module = backend.module
    hidden = backend.forward_hidden(batch.input_ids, batch.attention_mask)
    b, r = batch.targets.shape
    pos = (batch.response_start[:, None] - 1 + torch.arange(r)[None]).clamp(0, hidden.shape[1] - 1)
    h = hidden.gather(1, pos[..., None].expand(b, r, hidden.shape[-1]))
    with torch.autocast("cpu", dtype=backend.compute_dtype or torch.float32, enabled=backend.compute_dtype is not None):
        logits = module.get_output_embeddings()(h)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, batch.targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    valid = (torch.arange(r)[None] < (batch.attention_mask.sum(1) - batch.response_start)[:, None]).float()
    return logprobs * valid, entropy * valid


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("compute", [None, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_equals_unchunked_values_and_gradients(tied, temperature, compute, chunk):
    batch = batch_of()
    weight = torch.randn(batch.targets.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    results = []
    for chunked in (False, True):
        model = tiny_model(tied)
        backend = TorchBackend(model, OptimConfig(), total_steps=1, compute_dtype=compute)
        if chunked:
            lp, ent = response_logprobs_and_entropy(backend, batch, temperature, with_grad=True, chunk_rows=chunk)
            with torch.no_grad():
                lp_ng, ent_ng = response_logprobs_and_entropy(backend, batch, temperature, with_grad=False,
                                                              chunk_rows=chunk)
            torch.testing.assert_close(lp_ng, lp.detach(), rtol=0, atol=0)  # no-grad path: the same numbers
            torch.testing.assert_close(ent_ng, ent, rtol=0, atol=0)
        else:
            lp, ent = reference(backend, batch, temperature)
        (lp * weight).sum().backward()
        results.append((lp.detach(), ent, grads(model)))
    (lp_ref, ent_ref, g_ref), (lp_new, ent_new, g_new) = results
    tol = {"rtol": 1e-5, "atol": 1e-5} if compute is None else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(lp_new, lp_ref, rtol=1e-6, atol=1e-5)  # same bf16 logits, same float32 math
    torch.testing.assert_close(ent_new, ent_ref, rtol=1e-6, atol=1e-5)
    assert g_new.keys() == g_ref.keys() and g_new
    for name in g_ref:
        # bf16: the projection's gradient is summed over chunks in float32 instead of one bf16 matmul
        scale = g_ref[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(g_new[name] / scale, g_ref[name] / scale, **tol, msg=name)


def test_chunk_bounds_the_largest_logits_tensor():
    model = tiny_model(tied=True)
    backend = TorchBackend(model, OptimConfig(), total_steps=1)
    batch = batch_of(8)
    real = int(batch.loss_mask.sum())
    seen: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: seen.append(out.shape[0]))
    try:
        lp, _ = response_logprobs_and_entropy(backend, batch, 1.0, with_grad=True, chunk_rows=6)
        lp.sum().backward()  # the backward recomputes each chunk through the same head
    finally:
        handle.remove()
    # forward (log-prob and entropy in one pass) + recompute in backward, never more than 6 rows
    assert max(seen) == 6 and len(seen) == 2 * -(-real // 6)
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: seen.append(out.shape[0]))
    seen.clear()
    try:
        response_logprobs_and_entropy(backend, batch, 1.0, with_grad=False)
    finally:
        handle.remove()
    assert seen == [real]  # default chunk (≫ these rows): one projection of the real response tokens only


def test_chunk_rows_follow_the_vocabulary():
    assert logits_chunk_rows(49152) == 1365  # SmolLM2: 256 MiB of float32 logits per chunk
    assert logits_chunk_rows(151_936) == 441
    assert logits_chunk_rows(10**12) == 1


@pytest.mark.parametrize("chunk", [3, 10_000])
def test_token_divergence_against_the_unchunked_formula(chunk):
    """Both policies' log-probs and entropies are the unchunked ones; KL(start ‖ after) is Σ_v p_s (log p_s − log p_a)
    over the full [B·R, V] logits; a policy against itself has KL 0."""
    from infra.training.logprobs import token_divergence

    rng = random.Random(2)
    samples = []
    for _ in range(4):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        resp = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 11))]
        samples.append(TrainSample(prompt + resp, len(prompt), [1] * len(resp), [0.0] * len(resp), 1.0, 0))
    start = TorchBackend(tiny_model(tied=True), OptimConfig(), total_steps=1)
    after_model = tiny_model(tied=True)
    with torch.no_grad():
        for p in after_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = TorchBackend(after_model, OptimConfig(), total_steps=1)
    divergence = token_divergence(after, start, samples, pad_id=0, temperature=0.7, micro_batch_tokens=20,
                                  chunk_rows=chunk)
    for i, (sample, d) in enumerate(zip(samples, divergence, strict=True)):
        batch = collate([sample], pad_id=0)
        with torch.no_grad():
            lp_s, ent_s = reference(start, batch, 0.7)
            lp_a, ent_a = reference(after, batch, 0.7)
            module_s, module_a = start.module, after.module
            h_s = start.forward_hidden(batch.input_ids, batch.attention_mask)
            h_a = after.forward_hidden(batch.input_ids, batch.attention_mask)
            r = sample.response_len
            rows = torch.arange(r) + sample.prompt_len - 1
            logp_s = torch.log_softmax(module_s.get_output_embeddings()(h_s[0, rows]) / 0.7, -1)
            logp_a = torch.log_softmax(module_a.get_output_embeddings()(h_a[0, rows]) / 0.7, -1)
            kl = (logp_s.exp() * (logp_s - logp_a)).sum(-1)
        for got, want in ((d.logprob_start, lp_s[0]), (d.logprob_after, lp_a[0]), (d.entropy_start, ent_s[0]),
                          (d.entropy_after, ent_a[0]), (d.kl, kl)):
            torch.testing.assert_close(torch.from_numpy(got).float(), want.float(), atol=1e-5, rtol=1e-5,
                                       msg=f"sample {i}")
        assert d.kl.min() > 0
    same = token_divergence(start, start, samples, pad_id=0, temperature=0.7, micro_batch_tokens=20)
    assert all(abs(d.kl).max() < 1e-6 for d in same)

    # The start side computed once for several updated policies: the same figures, one start forward per micro-batch.
    calls = []
    hook = start.module.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    states: dict = {}
    for _ in range(2):
        cached = token_divergence(after, start, samples, pad_id=0, temperature=0.7, micro_batch_tokens=20,
                                  chunk_rows=chunk, start_states=states)
        for c, d in zip(cached, divergence, strict=True):
            assert all((x == y).all() for x, y in zip(vars(c).values(), vars(d).values(), strict=True))
    hook.remove()
    assert len(calls) == len(states) > 0
