"""Exact entropies on a remote engine (issue 26 §4): the rules read the same entropy on every engine.

A remote server returns top-k log-probs only; :class:`~infra.engines.exact_entropy.ExactEntropyEngine` replaces the
top-k estimate by the full-vocabulary entropy from a forward of the policy in this process (``HFEngine.score``),
reusing the KV of the segments before.  Against the in-process engine, which samples the same tokens with the
same seeds (the test server runs it): equal entropies, hence equal H_root, H̄_tool, m and decisions.
"""

from __future__ import annotations

import dataclasses

import pytest
from openai_compat_server import CompletionsServer

from aepo_core.config import RemoteEngineConfig, RolloutConfig
from aepo_core.interfaces import GenerationRequest, SamplingParams
from aepo_core.protocol import STOP_STRINGS
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from infra.engines.exact_entropy import ExactEntropyEngine
from infra.engines.hf import HFEngine
from infra.engines.remote import RemoteEngine


@pytest.fixture(scope="module")
def server(tiny_policy):
    model, tokenizer = tiny_policy
    with CompletionsServer(HFEngine(model, tokenizer, seed=0)) as srv:
        yield srv


def exact(server, tiny_policy, kv_mb: float = 64.0) -> ExactEntropyEngine:
    model, tokenizer = tiny_policy
    remote = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny", top_logprobs=5), tokenizer)
    return ExactEntropyEngine(remote, HFEngine(model, tokenizer, kv_reuse_mb=kv_mb))


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=50)])
def test_entropies_are_the_in_process_engines(server, tiny_policy, tiny_engine, sampling):
    engine = exact(server, tiny_policy)
    prompt = tiny_engine.apply_chat_template("What is the capital of Brotryx?")
    reqs = [GenerationRequest(prompt, n, STOP_STRINGS, seed=s) for s, n in ((1, 12), (2, 1), (3, 30))]
    got = engine.generate(reqs, sampling)
    want = tiny_engine.generate(reqs, sampling)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and not g.entropy_is_estimate
        assert g.entropies == pytest.approx(w.entropies, abs=1e-4)


def test_a_continued_segment_reuses_the_kv_of_the_one_before(server, tiny_policy, tiny_engine):
    engine = exact(server, tiny_policy)
    prompt = tiny_engine.apply_chat_template("Say something.")
    sampling = SamplingParams(1.0)
    (first,) = engine.generate([GenerationRequest(prompt, 16, (), seed=5)], sampling)
    fresh = engine.scorer.last_stats.prefill_tokens
    follow = [*prompt, *first.token_ids, *tiny_engine.encode("\n<result>\nok\n</result>\n")]
    (second,) = engine.generate([GenerationRequest(follow, 16, (), seed=6)], sampling)
    stats = engine.scorer.last_stats
    assert stats.reused_tokens == len(prompt) + len(first.token_ids) - 1  # all but the first segment's last token
    assert stats.prefill_tokens < fresh
    (want,) = tiny_engine.generate([GenerationRequest(follow, 16, (), seed=6)], sampling)
    assert second.entropies == pytest.approx(want.entropies, abs=1e-4)


class Seeds31:
    """The in-process engine with the seeds a completions request carries (``RemoteEngine`` sends seed mod 2³¹)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.encode, self.decode, self.eos_token_id = engine.encode, engine.decode, engine.eos_token_id

    def generate(self, requests, sampling):
        return self.engine.generate([dataclasses.replace(r, seed=r.seed % 2**31) for r in requests], sampling)


def test_the_rollouts_decisions_and_budget_are_the_in_process_engines(server, tiny_policy, tiny_engine):
    """The tiny random policy is near-uniform over 49 152 tokens, so the server (a batch of its own) and the local
    engine can pick neighbouring tokens where a draw falls within float rounding of a CDF boundary: with issue 49's
    question-keyed seeds, seed 3 hit one such near-tie (token 13 889 vs 13 888, one thread); seeds 4 and 5 do not."""
    cfg = RolloutConfig(mode="aepo", k=4, max_response_tokens=24, max_segment_tokens=8, entropy_window=8,
                        max_tool_calls=1)
    questions = [Question(f"q{i}", tiny_engine.apply_chat_template(f"Question {i}?")) for i in range(3)]
    remote = RolloutScheduler(exact(server, tiny_policy), {}, cfg).run(questions, seed=4)
    local = RolloutScheduler(Seeds31(tiny_engine), {}, cfg).run(questions, seed=4)
    for a, b in zip(remote.trees, local.trees, strict=True):
        assert [n.token_ids for n in a.nodes] == [n.token_ids for n in b.nodes]
        assert (a.global_budget, a.h_root, a.h_tool) == (b.global_budget, pytest.approx(b.h_root, abs=1e-4),
                                                         pytest.approx(b.h_tool, abs=1e-4))
        assert not any(n.entropy_is_estimate for n in a.nodes if n.kind == "model")
