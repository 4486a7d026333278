"""End-to-end rollouts with a real (tiny) transformers model, the real tokenizer, real BM25 search and the real
Python sandbox.  The random model is first taught one oracle transcript by SFT so that it actually calls tools."""

from __future__ import annotations

import pytest

from aepo_core.config import OptimConfig, RolloutConfig, SFTConfig
from aepo_core.interfaces import GenerationRequest, SamplingParams
from aepo_core.protocol import SYSTEM_PROMPT
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.tool_config import ToolsConfig
from infra.data.synthetic import SyntheticTask, oracle_transcript
from infra.engines.hf import HFEngine
from infra.models import load_policy
from infra.run.sft import sft_loss, sft_sample, train_sft
from infra.tools.registry import build_tools
from infra.training.backends import TorchBackend

pytestmark = pytest.mark.slow  # the heavy tier: its policy is taught by SFT first


@pytest.fixture(scope="module")
def taught(tiny_cfg, tmp_path_factory):
    runs = tmp_path_factory.mktemp("e2e")
    task = SyntheticTask(seed=3, n_companies=12)
    tools = build_tools(ToolsConfig(timeout_s=10.0), runs, documents=task.documents())
    row = next(r for r in task.questions("train") if r.family == "compute")
    segments = oracle_transcript(row, lambda q: tools["search"](q).text, lambda c: tools["python"](c).text)
    model, tokenizer = load_policy(tiny_cfg)  # a private copy: the weights change here
    engine = HFEngine(model, tokenizer, seed=0)
    prompt = engine.apply_chat_template(row.question, SYSTEM_PROMPT)
    sample = sft_sample(prompt, segments, engine.encode)
    backend = TorchBackend(model, OptimConfig(), total_steps=300, lr=3e-3)
    train_sft(backend, [sample], SFTConfig(epochs=150, batch_size=1, lr=3e-3), 0, 8192, seed=0)
    assert sft_loss(backend, [sample], 0, 8192) < 0.05
    return engine, tools, row, prompt, segments


def rollout(taught, seed: int, mode: str = "aepo", **rule: float):
    engine, tools, row, prompt, _ = taught
    cfg = RolloutConfig(mode=mode, k=3, initial_rollouts=1, max_response_tokens=700, max_tool_calls=4,
                        temperature=0.3, **rule)
    return RolloutScheduler(engine, tools, cfg, tool_timeout_s=10.0).run(
        [Question(row.id, prompt)], seed=seed, sampling=SamplingParams(temperature=0.3)
    )


def test_real_tools_are_called_and_tokens_line_up(taught):
    engine, _, row, _, segments = taught
    res = rollout(taught, seed=1)
    tree = res.trees[0]
    assert len(tree.leaves) == 3
    called = {e.name for leaf in tree.leaves for e in tree.tool_events(leaf)}
    assert called == {"search", "python"}
    for leaf in tree.leaves:
        ids, mask = tree.response_ids(leaf), tree.loss_mask(leaf)
        assert len(ids) == len(mask) == len(tree.logprobs(leaf)) == len(tree.entropies(leaf))
        for node in tree.path(leaf)[1:]:
            assert mask[node.token_start : node.token_end] == [int(node.kind == "model")] * len(node.token_ids)
            if node.kind == "tool":
                assert engine.decode(node.token_ids).startswith("\n<result>\n")
        # Token ids in, token ids out: decoding the leaf gives the transcript segment by segment.
        assert engine.decode(ids) == "".join(engine.decode(n.token_ids) for n in tree.path(leaf)[1:])
    answered = [leaf for leaf in tree.leaves if leaf.status == "answered"]
    assert answered and any(f"\\boxed{{{row.golds[0]}}}" in tree.text(leaf) for leaf in answered)
    # The real tools produced the results the oracle saw.
    python_results = [n.text for n in tree.nodes if n.tool is not None and n.tool.name == "python"]
    assert any(row.golds[0] in text for text in python_results)
    assert segments  # the transcript the model was taught


def test_same_seed_same_tree(taught):
    def signature(seed):
        tree = rollout(taught, seed).trees[0]
        return [(n.parent_id, n.kind, n.branch_reason, tuple(n.token_ids)) for n in tree.nodes]

    assert signature(7) == signature(7)


@pytest.mark.parametrize("mode", ["aepo", "arpo", "independent"])
def test_kv_reuse_gives_the_same_rollout_tree(taught, mode):
    """Every mode samples the identical tree with and without KV reuse (same seeds), while reuse prefills a
    fraction of the prompt tokens: continuations and branches start from retained KV."""
    engine, tools, row, prompt, _ = taught
    reuse = HFEngine(engine.model, engine.tokenizer, seed=0, kv_reuse_mb=64)
    trees, counts = [], []
    # τ = 0, γ = 0: every tool step with budget left branches (score u ≥ 0), so a branch is certain, not a seed's luck
    for eng in (engine, reuse):
        counting = _CountingEngine(eng)
        res = rollout((counting, tools, row, prompt, None), seed=3, mode=mode, tau=0.0, gamma=0.0)
        trees.append(res.trees[0])
        counts.append((counting.prefill, counting.reused))
    plain, reused = trees
    assert [(n.parent_id, n.kind, n.branch_reason, n.token_ids) for n in plain.nodes] == \
        [(n.parent_id, n.kind, n.branch_reason, n.token_ids) for n in reused.nodes]
    assert [(leaf.node_ids, leaf.sample_kind, leaf.status) for leaf in plain.leaves] == \
        [(leaf.node_ids, leaf.sample_kind, leaf.status) for leaf in reused.leaves]
    for a, b in zip(plain.nodes, reused.nodes, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert any(n.tool is not None for n in plain.nodes)  # tool rounds happened
    if mode != "independent":
        assert any(leaf.sample_kind == "branch" for leaf in plain.leaves)
    (p_off, r_off), (p_on, r_on) = counts
    assert r_off == 0 and p_on + r_on == p_off and p_on <= 0.6 * p_off


class _CountingEngine:
    """An HFEngine seen through the Engine protocol, adding up its prefill and reuse counts."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.prefill, self.reused = engine, 0, 0
        self.encode, self.decode = engine.encode, engine.decode
        self.eos_token_id = engine.eos_token_id

    def generate(self, requests, sampling):
        out = self.engine.generate(requests, sampling)
        self.prefill += self.engine.last_stats.prefill_tokens
        self.reused += self.engine.last_stats.reused_tokens
        return out


def test_the_official_entropy_scale_asks_the_in_process_engine_for_the_published_terms(taught):
    """The in-process engine computes the published code's top-10 terms only when the sampler asks
    (``SamplingParams.published_entropy``, set by the scheduler under ``entropy_scale: official``); the official
    budget rule then reads them: H_root is a sum of at most W terms, each below ln 11 / ln V."""
    import math

    engine = taught[0]
    (tree,) = rollout(taught, 0, budget_rule="official", entropy_scale="official").trees
    assert 0 < tree.h_root < RolloutConfig().entropy_window * math.log(11) / math.log(len(engine.tokenizer))
    (plain,) = engine.generate([GenerationRequest(taught[3], 4, ())], SamplingParams())
    assert plain.published_entropies is None  # not asked for, not paid for


@pytest.mark.parametrize(("scheduling", "inflight"), [("per_question", 0), ("per_path", 0), ("per_path", 8)])
def test_overlapped_schedulings_sample_the_round_loop_s_tree_with_real_tools(taught, scheduling, inflight):
    """The real engine (float32) and the real tools, two questions: the overlapped schedulings give the round loop's
    trees (tests/core/test_overlap.py proves the ordering with a scripted engine; this, that nothing in the real
    engine or tools depends on which paths share a generate call). With ``inflight_requests`` each ready path's
    segment is a generate call of its own thread, joining the engine's running batch (continuous batching)."""
    from aepo_core.rollout.overlap import scheduler_class

    engine, tools, row, prompt, _ = taught
    questions = [Question(row.id, prompt), Question(f"{row.id}-again", prompt)]
    trees = {}
    for name in ("rounds", scheduling):
        cfg = RolloutConfig(mode="aepo", k=3, initial_rollouts=1, max_response_tokens=700, max_tool_calls=4,
                            temperature=0.3, scheduling=name, inflight_requests=inflight if name == "per_path" else 0)
        res = scheduler_class(name)(engine, tools, cfg, tool_timeout_s=10.0).run(
            questions, seed=4, sampling=SamplingParams(temperature=0.3))
        trees[name] = [[(n.parent_id, n.kind, tuple(n.token_ids), n.branched) for n in t.nodes] for t in res.trees]
    assert any(kind == "tool" for tree in trees["rounds"] for _, kind, _, _ in tree)
    assert trees[scheduling] == trees["rounds"]


def test_requests_in_flight_path_by_path_on_a_real_server_give_the_round_loop_s_tree(taught):
    """rollout.inflight_requests: the taught policy behind the suite's completions server (real HTTP), each ready
    path's segment sent as its own request the moment its tool result is back. The round loop on the same server
    (one generate call per round) samples the same trees (tests/core/test_overlap.py checks that the requests were
    in flight together and came back in shuffled orders)."""
    from openai_compat_server import CompletionsServer

    from aepo_core.config import RemoteEngineConfig
    from aepo_core.rollout.overlap import PerPathScheduler
    from infra.engines.remote import RemoteEngine

    engine, tools, row, prompt, _ = taught
    questions = [Question(row.id, prompt), Question(f"{row.id}-again", prompt)]
    with CompletionsServer(HFEngine(engine.model, engine.tokenizer, seed=0)) as server:
        remote = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny"), engine.tokenizer)
        trees = {}
        for name, inflight in (("rounds", 0), ("per_path", 8)):
            cfg = RolloutConfig(mode="aepo", k=3, initial_rollouts=1, max_response_tokens=700, max_tool_calls=4,
                                temperature=0.3, scheduling=name, inflight_requests=inflight)
            scheduler = (PerPathScheduler if inflight else RolloutScheduler)(remote, tools, cfg, tool_timeout_s=10.0)
            res = scheduler.run(questions, seed=4, sampling=SamplingParams(temperature=0.3))
            trees[name] = [[(n.parent_id, n.kind, tuple(n.token_ids), n.branched) for n in t.nodes]
                           for t in res.trees]
    assert any(kind == "tool" for tree in trees["rounds"] for _, kind, _, _ in tree)
    assert trees["per_path"] == trees["rounds"]
