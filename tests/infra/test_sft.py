"""Cold-start SFT: the loss falls on the transcripts, and result tokens get no gradient."""

from __future__ import annotations

import torch
from test_update import VOCAB, tiny_model

from aepo_core.config import OptimConfig, SFTConfig
from infra.run.sft import sft_loss, sft_sample, train_sft
from infra.training.backends import TorchBackend


def encode(text: str) -> list[int]:
    return [1 + (ord(c) % (VOCAB - 1)) for c in text]


TRANSCRIPTS = [
    [("model", "<think>a</think><search>kavo</search>"), ("tool", "\n<result>\nPage 1: kavo 1971\n</result>\n"),
     ("model", "<answer>\\boxed{1971}</answer>")],
    [("model", "<think>b</think><python>print(2)</python>"), ("tool", "\n<result>\n2\n</result>\n"),
     ("model", "<answer>\\boxed{2}</answer>")],
]


def samples():
    return [sft_sample(encode(f"Q{i}: "), segs, encode) for i, segs in enumerate(TRANSCRIPTS)]


def test_sample_masks_tool_segments():
    s = samples()[0]
    resp = s.input_ids[s.prompt_len :]
    assert len(resp) == len(s.loss_mask)
    n_first = len(encode(TRANSCRIPTS[0][0][1]))
    n_tool = len(encode(TRANSCRIPTS[0][1][1]))
    assert s.loss_mask == [1] * n_first + [0] * n_tool + [1] * len(encode(TRANSCRIPTS[0][2][1]))


def test_sft_lowers_the_loss():
    model = tiny_model()
    cfg = SFTConfig(enabled=True, epochs=15, lr=3e-3, batch_size=2)
    backend = TorchBackend(model, OptimConfig(), total_steps=100, lr=cfg.lr)
    before = sft_loss(backend, samples(), 0, 4096)
    history = train_sft(backend, samples(), cfg, 0, 4096, seed=0)
    after = sft_loss(backend, samples(), 0, 4096)
    assert len(history) == 15
    assert after < 0.5 * before


def test_result_tokens_get_no_gradient():
    """The loss and gradient are unchanged when only the targets inside result spans change."""
    base = samples()[0]
    changed_ids = list(base.input_ids)
    for j, m in enumerate(base.loss_mask):
        if not m:
            changed_ids[base.prompt_len + j] = 5
    # Cut after the tool span so no model token is conditioned on the changed ids.
    cut = base.prompt_len + base.loss_mask.index(0) + base.loss_mask.count(0)
    a = type(base)(base.input_ids[:cut], base.prompt_len, base.loss_mask[: cut - base.prompt_len],
                   base.rollout_logprobs[: cut - base.prompt_len], 0.0, 0)
    b = type(base)(changed_ids[:cut], a.prompt_len, a.loss_mask, a.rollout_logprobs, 0.0, 0)
    grads = []
    for s in (a, b):
        model = tiny_model()
        backend = TorchBackend(model, OptimConfig(), total_steps=1)
        train_sft(backend, [s], SFTConfig(epochs=1, batch_size=1, lr=1e-3), 0, 4096, seed=0)
        grads.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])
