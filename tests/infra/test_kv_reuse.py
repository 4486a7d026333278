"""KV reuse in HFEngine (tiny random model, float32): counts, identical samples, branches, stale weights, the store."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aepo_core.config import ExperimentConfig, ModelConfig
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.engines.hf import HFEngine
from infra.engines.prefix_cache import PrefixKVStore
from infra.engines.weights import PolicyWeights
from infra.models import load_policy

HOT = SamplingParams(temperature=0.7)
TOOL_RESULT = "\n<result>\nParis is the capital.\n</result>\n"


def _rounds(engine: HFEngine, rounds: int = 3) -> tuple[list[list[GenerationResult]], list[tuple[int, int]]]:
    """A scheduler-like sequence of calls: two paths continue with their segment and a tool result; from the
    third call on, a branch forks path 0 at the tool result its last segment followed, with another seed.
    Returns the results and (prefill, reused) counts per call."""
    prompts = [engine.apply_chat_template("What is the capital of France?"), engine.encode("Once upon a time")]
    requests = [GenerationRequest(p, 8 + 4 * i, seed=i) for i, p in enumerate(prompts)]
    results, counts = [], []
    for r in range(rounds):
        out = engine.generate(requests, HOT)
        results.append(out)
        counts.append((engine.last_stats.prefill_tokens, engine.last_stats.reused_tokens))
        fork = requests[0].prompt_ids
        requests = [GenerationRequest([*req.prompt_ids, *res.token_ids, *engine.encode(TOOL_RESULT)], 10,
                                      seed=req.seed + 10) for req, res in zip(requests[:2], out, strict=False)]
        if r:  # as the scheduler forks: at the tool result that row 0's last segment followed
            requests.append(GenerationRequest(fork, 6, seed=100 + r))
    return results, counts


def _same(a: list[GenerationResult], b: list[GenerationResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-5) and np.allclose(x.entropies, y.entropies, atol=1e-5)


def test_without_reuse_every_prompt_token_is_prefilled(tiny_policy: tuple[Any, Any]) -> None:
    model, tok = tiny_policy
    engine = HFEngine(model, tok)
    _, counts = _rounds(engine)
    assert not engine.kv_reuse
    assert all(reused == 0 for _, reused in counts)
    # call 2 holds 3 rows whose prompts are whole transcripts: all prefilled again
    assert counts[2][0] > 3 * counts[0][0]


def test_reuse_gives_the_same_samples_and_prefills_only_new_tokens(tiny_policy: tuple[Any, Any]) -> None:
    model, tok = tiny_policy
    off, on = HFEngine(model, tok), HFEngine(model, tok, kv_reuse_mb=16)
    results_off, counts_off = _rounds(off)
    results_on, counts_on = _rounds(on)
    for a, b in zip(results_off, results_on, strict=True):
        _same(a, b)
    assert counts_on[0] == counts_off[0]  # nothing stored yet
    for (p_off, _), (p_on, reused) in zip(counts_off[1:], counts_on[1:], strict=True):
        assert p_on + reused == p_off  # every prompt token is either prefilled or reused
        assert p_on < 0.4 * p_off
    # a continuation prefills its last generated token and the tool result; the branch only its last token
    tool = len(tok(TOOL_RESULT, add_special_tokens=False)["input_ids"])
    assert counts_on[1][0] == 2 * (1 + tool)
    assert counts_on[2][0] == 2 * (1 + tool) + 1


def test_a_branch_starts_like_a_fresh_prefill(tiny_policy: tuple[Any, Any]) -> None:
    """A branch forked inside a stored transcript reuses its parent's KV up to the fork point and samples what a
    fresh prefill of the same prompt and seed samples."""
    model, tok = tiny_policy
    on, off = HFEngine(model, tok, kv_reuse_mb=16), HFEngine(model, tok)
    prompt = on.apply_chat_template("Search for the tallest building.", system_prompt="Use tools.")
    (parent,) = on.generate([GenerationRequest(prompt, 20, seed=1)], HOT)
    fork = [*prompt, *parent.token_ids[:7]]
    request = [GenerationRequest(fork, 12, seed=42)]
    (branch,) = on.generate(request, HOT)
    assert on.last_stats.reused_tokens == len(fork) - 1 and on.last_stats.prefill_tokens == 1
    (fresh,) = off.generate(request, HOT)
    _same([branch], [fresh])
    # the same fork from a batch holding rows without a stored prefix (mixed layouts in one batch)
    other = off.encode("Once upon a time")
    both = on.generate([GenerationRequest(other, 9, seed=3), *request], HOT)
    _same(both, off.generate([GenerationRequest(other, 9, seed=3), *request], HOT))


def test_changed_weights_are_never_served_stale_kv(tiny_cfg: ModelConfig) -> None:
    """An in-place update of a shared model (an optimizer step) and load_weights both clear the store."""
    model, tok = load_policy(tiny_cfg.model_copy(update={"init_seed": 5}))
    engine = HFEngine(model, tok, kv_reuse_mb=16)
    prompt = engine.encode("Once upon a time there was")
    (first,) = engine.generate([GenerationRequest(prompt, 8, seed=0)], HOT)
    follow = [GenerationRequest([*prompt, *first.token_ids], 8, seed=1)]
    engine.generate(follow, HOT)
    assert engine.last_stats.reused_tokens > 0  # control: unchanged weights reuse
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # an "optimizer step" on the model the engine shares
    (after,) = engine.generate(follow, HOT)
    assert engine.last_stats.reused_tokens == 0
    (fresh,) = HFEngine(model, tok).generate(follow, HOT)
    _same([after], [fresh])

    # a separate generation copy refreshed through load_weights (the runtime's weights_changed)
    copy, _ = load_policy(tiny_cfg.model_copy(update={"init_seed": 6}))
    engine.generate(follow, HOT)
    engine.load_weights(PolicyWeights(copy, version=1))
    engine.generate(follow, HOT)
    assert engine.last_stats.reused_tokens == 0


def test_the_store_supersedes_prefixes_and_stays_under_its_cap() -> None:
    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.zeros(1, n, 4), torch.zeros(1, n, 4))]  # 32 bytes per token

    store = PrefixKVStore(max_bytes=32 * 10)
    store.put([1, 2, 3], kv(3))
    store.put([1, 2, 3, 4, 5], kv(5))  # extends the first: replaces it
    assert len(store) == 1 and store.nbytes == 32 * 5
    store.put([1, 2], kv(2))  # already held by a longer entry
    assert len(store) == 1
    entry, n = store.longest(np.array([1, 2, 3, 9]), limit=3)
    assert entry is not None and n == 3
    assert store.longest(np.array([1, 2, 3, 4, 5, 6]), limit=5)[1] == 5
    assert store.longest(np.array([7, 8]), limit=1) == (None, 0)
    store.put([1, 7, 7, 7], kv(4))  # fits (9 tokens)
    store.put([2, 7, 7], kv(3))  # 12 tokens > cap: the least recently used ([1..5]) goes
    assert len(store) == 2 and store.nbytes == 32 * 7
    assert store.longest(np.array([1, 2, 3]), limit=2)[1] == 1
    store.put(list(range(11)), kv(11))  # larger than the whole cap: not kept
    assert len(store) == 2
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.parametrize("reuse", [True, False])
def test_the_config_turns_reuse_on_and_off(reuse: bool, tiny_policy: tuple[Any, Any], tmp_path: Any) -> None:
    from infra.engines.registry import build_engine
    from infra.numerics import numerics_for

    cfg = ExperimentConfig.model_validate({"model": {"name": "tiny-random", "generation_dtype": "same"},
                                           "rollout": {"kv_reuse": reuse}})
    model, tok = tiny_policy
    engine = build_engine(cfg, numerics_for(cfg), model, tok, tmp_path).engine
    assert isinstance(engine, HFEngine) and engine.kv_reuse is reuse


def test_only_continuable_rows_are_kept_and_a_rollout_frees_them(tiny_policy: tuple[Any, Any], model_cache,
                                                                  tmp_path) -> None:
    """A row that ended with EOS is never continued (its KV would only hold memory); a stop string or the length
    cap may be.  When a rollout ends, the runtime releases what the engine retained for it."""
    from pathlib import Path

    from infra.config_files import load_config
    from infra.run.runtime import build_runtime

    model, tok = tiny_policy
    engine = HFEngine(model, tok, kv_reuse_mb=16)
    prompt = engine.apply_chat_template("Say something.")
    eos = engine.eos_token_ids
    (res,) = engine.generate([GenerationRequest(prompt, 6, seed=1)], HOT)
    assert res.finish_reason == "length" and len(engine._prefixes or []) == 1  # type: ignore[arg-type]
    engine.clear_kv()
    ended = HFEngine(model, tok, kv_reuse_mb=16, stop_token_ids=tuple(range(model.config.vocab_size)))
    (res,) = ended.generate([GenerationRequest(prompt, 6, seed=1)], HOT)  # every token is an "EOS"
    assert res.finish_reason == "eos" and len(ended._prefixes or []) == 0  # type: ignore[arg-type]
    assert eos  # the tokenizer's EOS ids exist (what normally ends a trajectory)

    repo = Path(__file__).resolve().parents[2]
    runtime = build_runtime(load_config(repo / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}"]), tmp_path)
    rows = runtime.load_rows("synthetic:train")[:1]
    runtime.sample(rows, runtime.cfg.rollout, seed=0)
    assert runtime.engine.kv_reuse and len(runtime.engine._prefixes) == 0  # type: ignore[attr-defined]
