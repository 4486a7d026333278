"""``optim.share_prefix=tree``: a micro-batch's rows run as one trie of their distinct prefixes.

The claim is an identity, so the tests compare against the unshared forward: hidden states at every real position,
log-probs, entropies and gradients, then a whole update. Each comparison also checks that the tree really ran (one
decoder call on one row of fewer tokens than the rows hold): rows that share nothing would make the packed forward
a mere concatenation, and an equality would then prove less.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_shared_prefix import DecoderCalls, sliding_window_model
from test_update import VOCAB, tiny_model

from aepo_core.config import ConfigError, OptimConfig
from aepo_core.overrides import build_config
from bench.compare_algorithms import _sft_key
from infra.training.backends import TorchBackend, last_hidden_state
from infra.training.batching import TrainSample, collate, plan_tree_micro_batches
from infra.training.logprobs import response_logprobs_and_entropy
from infra.training.token_tree import Trie, token_tree
from infra.training.update import PolicyUpdater


def branched(n_groups: int = 3, seed: int = 0) -> list[TrainSample]:
    """Rollout trees as AEPO's make them: per question, a prompt (after a shared system prompt), two first
    segments, each continued by two leaves that branch at a different depth, ragged lengths, a masked span."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    system = tokens(20)
    out = []
    for g in range(n_groups):
        prompt = system + tokens(rng.randint(3, 7))
        for _ in range(2):
            trunk = tokens(rng.randint(3, 8))
            for _ in range(2):
                response = trunk + tokens(rng.randint(2, 9))
                mask = [0 if 2 <= j < 4 else 1 for j in range(len(response))]
                out.append(TrainSample(prompt + response, len(prompt), mask,
                                       [-rng.uniform(1.0, 5.0) if m else 0.0 for m in mask],
                                       rng.uniform(-1.5, 1.5), g))
    return out


def distinct_prefixes(rows: list[list[int]]) -> int:
    return len({tuple(r[: t + 1]) for r in rows for t in range(len(r))})


def test_the_tree_holds_each_distinct_prefix_once_and_each_node_sees_its_ancestors():
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 2, 3], [4, 6]]
    ids = torch.tensor([r + [0] * (5 - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (5 - len(r)) for r in rows])
    tree = token_tree(ids, mask)
    assert tree.nodes == distinct_prefixes(rows) == 9
    for r, row in enumerate(rows):
        nodes = tree.index[r, : len(row)]
        assert tree.input_ids[0, nodes].tolist() == row  # each position's node holds its token
        assert tree.position_ids[0, nodes].tolist() == list(range(len(row)))  # at its depth
        for t in range(len(row)):  # a node attends to exactly the nodes of its row's prefix
            assert set(tree.attention_mask[0, 0, nodes[t]].nonzero().flatten().tolist()) == set(nodes[: t + 1].tolist())
    trie = Trie()
    for row in rows:
        assert trie.extension(row) == distinct_prefixes([*rows[: rows.index(row)], row]) - trie.nodes
        trie.add(row)
    assert trie.nodes == 9


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hidden_states_equal_the_unshared_forward_at_every_real_position(attn):
    batch = collate(branched(), pad_id=0)
    model = tiny_model()
    model.config._attn_implementation = attn
    calls = DecoderCalls(model)
    with torch.no_grad():
        plain = last_hidden_state(model, batch.input_ids, batch.attention_mask)
        tree = last_hidden_state(model, batch.input_ids, batch.attention_mask, share_prefix="tree")
    real = batch.attention_mask.bool()
    assert calls.rows == [len(batch.input_ids), 1]  # the tree ran: one packed row
    assert token_tree(batch.input_ids, batch.attention_mask).nodes < 0.6 * int(real.sum())  # and it shared
    assert tree.shape == plain.shape
    torch.testing.assert_close(tree[real], plain[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute", [None, torch.bfloat16])
def test_logprobs_entropies_and_gradients_equal_the_unshared_ones(compute):
    batch = collate(branched(), pad_id=0)
    weight = torch.randn(batch.targets.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    out, projected = [], []
    for share in ("off", "tree"):
        model = tiny_model()
        rows: list[int] = []
        model.lm_head.register_forward_hook(lambda _m, args, _out, rows=rows: rows.append(args[0].shape[0]))
        backend = TorchBackend(model, OptimConfig(share_prefix=share), total_steps=1, compute_dtype=compute)
        lp, ent = response_logprobs_and_entropy(backend, batch, 0.9, with_grad=True)  # checkpointing on (default)
        projected.append(rows[0])  # the forward's projection (the backward re-projects the same rows)
        (lp * weight).sum().backward()
        out.append((lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = out
    assert projected[0] == sum(s.response_len for s in branched())  # unshared: every response token
    assert projected[1] < 0.8 * projected[0]  # the leaves' shared segments were projected once
    tol = {"rtol": 1e-5, "atol": 1e-5} if compute is None else {"rtol": 3e-2, "atol": 3e-2}  # bf16: other shapes
    torch.testing.assert_close(lp1, lp0, **tol)
    torch.testing.assert_close(ent1, ent0, **tol)
    for name in g0:
        scale = g0[name].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(g1[name] / scale, g0[name] / scale, **tol, msg=name)


def test_micro_batches_keep_the_order_and_hold_at_most_the_budget_in_distinct_tokens():
    rows = [s.input_ids for s in branched(n_groups=4)]
    budget = 90
    plan = plan_tree_micro_batches(rows, budget)
    assert [i for mb in plan for i in mb] == list(range(len(rows)))
    assert all(distinct_prefixes([rows[i] for i in mb]) <= budget for mb in plan)
    # greedy: the next row would not have fitted
    assert all(distinct_prefixes([rows[i] for i in [*mb, nxt[0]]]) > budget for mb, nxt in zip(plan, plan[1:]))
    assert sum(len(r) for r in rows) > 2 * budget  # the budget binds (several micro-batches)
    assert plan_tree_micro_batches([[1] * 50], 10) == [[0]]  # a row over the budget gets its own
    assert plan_tree_micro_batches([], 10) == []


def test_an_update_on_the_tree_gives_the_unshared_weights():
    def trained(share: str) -> tuple[torch.Tensor, dict[str, float], list[int]]:
        cfg = build_config({}, ["optim.lr=1e-2", "optim.grad_clip=100", "optim.mini_batch_size=1",
                                "model.generation_dtype=same", "optim.micro_batch_tokens=120",
                                f"optim.share_prefix={share}"])
        model = tiny_model()
        calls = DecoderCalls(model)
        metrics = PolicyUpdater(TorchBackend(model, cfg.optim, total_steps=10), cfg, pad_id=0).update(branched())
        return torch.cat([p.detach().flatten() for p in model.parameters()]), metrics, calls.rows

    (w0, m0, _), (w1, m1, rows1) = trained("off"), trained("tree")
    assert set(rows1) == {1} and len(rows1) < len(branched())  # packed trees of several leaves each
    start = torch.cat([p.detach().flatten() for p in tiny_model().parameters()])
    assert (w0 - start).abs().max() > 1e-3  # the update moved the weights: the comparison below can fail
    torch.testing.assert_close(w1, w0, rtol=1e-4, atol=1e-5)  # as the common prefix's test: three Adam steps
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-5, abs=1e-7)


def test_the_config_takes_the_old_booleans_and_refuses_a_tree_it_cannot_run():
    assert OptimConfig(share_prefix=False).share_prefix == "off"
    assert OptimConfig(share_prefix=True, activation_checkpointing=False).share_prefix == "common"
    assert OptimConfig(share_prefix="tree").share_prefix == "tree"  # with activation checkpointing (the default)
    with pytest.raises((ConfigError, ValueError), match="sdpa or eager"):
        build_config({}, ["optim.share_prefix=tree", "model.attn_implementation=flash_attention_2"])
    with pytest.raises((ConfigError, ValueError), match=r"train\.backend=torch"):
        build_config({}, ["optim.share_prefix=tree", "train.backend=deepspeed"])
    common = build_config({}, ["optim.activation_checkpointing=false", "optim.share_prefix=common"])
    legacy = build_config({}, ["optim.activation_checkpointing=false", "optim.share_prefix=true"])
    assert _sft_key(common) == _sft_key(legacy)  # the SFT caches made under `true` keep their key
    off = build_config({}, ["optim.share_prefix=off"])
    assert _sft_key(build_config({}, ["optim.share_prefix=tree"])) not in (_sft_key(common), _sft_key(off))


def test_a_sliding_window_model_takes_the_unshared_forward():
    model = sliding_window_model()
    calls = DecoderCalls(model)
    batch = collate(branched(), pad_id=0)
    with torch.no_grad():
        tree = last_hidden_state(model, batch.input_ids, batch.attention_mask, share_prefix="tree")
        plain = last_hidden_state(model, batch.input_ids, batch.attention_mask)
    assert calls.rows == [12, 12]  # a window is not a prefix: no packed tree, every row ran
    torch.testing.assert_close(tree, plain, rtol=0, atol=0)
    assert not TorchBackend(model, OptimConfig(share_prefix="tree"), total_steps=1).shares_tree


def test_auto_shares_the_tree_where_it_is_the_same_computation_and_was_measured_faster():
    """``optim.share_prefix: auto`` (the default): the token tree on the torch backend on a CPU with sdpa or eager
    attention (the same log-probs and gradients up to float rounding, above; the update 1.86× faster on an AMX Xeon,
    bench/README "The token tree"), off where the tree cannot run or was never measured. The config records the mode
    it resolved to, so the run's params and the SFT cache key say what ran."""
    assert build_config({}, []).optim.share_prefix == "tree"  # transformers' default attention on CPU: sdpa
    assert build_config({}, ["model.attn_implementation=eager"]).optim.share_prefix == "tree"
    assert build_config({}, ["train.backend=deepspeed"]).optim.share_prefix == "off"
    assert build_config({}, ["model.attn_implementation=flash_attention_2"]).optim.share_prefix == "off"
    assert build_config({}, ["model.device=cuda"]).optim.share_prefix == "off"  # not measured on an accelerator
    assert build_config({}, ["optim.share_prefix=off"]).optim.share_prefix == "off"  # an explicit mode wins
    assert build_config({}, ["optim.activation_checkpointing=false",
                             "optim.share_prefix=common"]).optim.share_prefix == "common"
    assert _sft_key(build_config({}, [])) == _sft_key(build_config({}, ["optim.share_prefix=tree"]))


def test_a_backend_given_auto_resolves_it_for_the_model_it_holds():
    """A bare ``OptimConfig()`` (no experiment around it) asks ``auto`` too: the backend resolves it from its own
    model and device, the same rule (a sliding-window model then still runs every row)."""
    assert OptimConfig().share_prefix == "auto"
    assert TorchBackend(tiny_model(), OptimConfig(), total_steps=1).share_prefix == "tree"
    model = sliding_window_model()
    assert not TorchBackend(model, OptimConfig(), total_steps=1).shares_tree
