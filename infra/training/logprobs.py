"""Per-token log-probs, entropies and divergences of a policy's response tokens, through the vocabulary projection
chunk by chunk (no [tokens, V] tensor is ever materialised): what the update's gradient and scoring passes, SFT and
the update-rule comparison read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from infra.training.batching import PaddedBatch, TrainSample, collate, plan_micro_batches
from infra.training.token_tree import prefix_nodes

if TYPE_CHECKING:
    from infra.training.backend import TrainBackend

LOGITS_CHUNK_BYTES = 256 * 2**20
"""Bytes of one chunk's float32 logits: the vocabulary projection takes ``LOGITS_CHUNK_BYTES // (4 · V)`` response
tokens at a time (1365 for SmolLM2's V = 49152), so its transient memory does not grow with the micro-batch."""


def logits_chunk_rows(vocab_size: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Response tokens per vocabulary-projection chunk: ``max(1, chunk_bytes // (4 · V))``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _projected(head: torch.nn.Module, h: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """``head(h)`` under the backend's autocast (bf16 logits under bf16 compute)."""
    with torch.autocast(h.device.type, dtype=compute_dtype or torch.float32, enabled=compute_dtype is not None):
        return head(h)


class VocabProjection:
    """The vocabulary projection of one backend, applied to response rows ``h`` [N, H] in chunks of ``rows``."""

    def __init__(self, head: torch.nn.Module, compute_dtype: torch.dtype | None, temperature: float,
                 rows: int) -> None:
        self.head, self.compute_dtype, self.temperature, self.rows = head, compute_dtype, temperature, rows

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 temperature-scaled logits ``z = head(h) / T`` of one chunk (a fresh tensor: callers may work in
        place)."""
        z = _projected(self.head, h, self.compute_dtype).float()
        return z.div_(self.temperature) if self.temperature != 1.0 else z

    @torch.no_grad()
    def forward(self, h: torch.Tensor, targets: torch.Tensor, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per row: ``lse = log Σ_v e^{z_v}``, ``log p(t) = z_t − lse`` and (optionally) ``H = −Σ_v p_v log p_v``
        with ``log p = z − lse`` (the unchunked log-softmax's values), one chunk at a time."""
        n = h.shape[0]
        lse = h.new_empty(n, dtype=torch.float32)
        logp = h.new_empty(n, dtype=torch.float32)
        entropy = h.new_empty(n, dtype=torch.float32) if with_entropy else None
        for s in range(0, n, self.rows):
            e = min(n, s + self.rows)
            z = self.logits(h[s:e])
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            if entropy is not None:
                logp_all = z.sub_(lse[s:e, None])
                entropy[s:e] = -(logp_all.exp() * logp_all).sum(-1)
        return lse, logp, entropy


class ChunkedLogprob(torch.autograd.Function):
    """``log π(t_i)`` of response rows ``h_i`` through the vocabulary projection, chunk by chunk, with a backward
    that recomputes each chunk's logits instead of keeping them.

    Forward (no graph): per chunk, ``z = head(h_c) / T`` in float32, ``log p(t) = z_t − logsumexp(z)`` (and the
    detached entropy when asked); only ``lse`` [N] is saved. Backward: ``∂ log p(t_i) / ∂z_iv = 1[v = t_i] −
    softmax(z_i)_v``, so the logits' gradient is ``dz_i = g_i (onehot(t_i) − e^{z_i − lse_i}) / T``, built in place
    on the recomputed chunk and pushed through a re-run of ``head(h_c)``: that backward accumulates the
    projection's parameter gradients (tied embeddings included) into ``.grad``, as a reentrant checkpoint does,
    and gives ``∂L/∂h_c``. So the loss must be differentiated with ``backward()`` (not ``autograd.grad``), and a
    backend whose gradient hooks allow one accumulation per parameter (DeepSpeed ZeRO) opts out
    (``TrainBackend.chunked_projection``).

    Peak: two [rows, V] tensors of one chunk (bf16 logits, float32 ``dz``) instead of the micro-batch's
    [N, V] bf16 logits, their float32 copy, the log-softmax saved for backward and its gradients (SmolLM2,
    2048 response tokens: ~1.6 GB → ~0.4 GB). Cost: one more projection matmul per response token.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, targets: torch.Tensor, proj: VocabProjection, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        lse, logp, entropy = proj.forward(h, targets, with_entropy)
        ctx.save_for_backward(h, targets, lse)
        ctx.proj = proj
        entropy = entropy if entropy is not None else logp.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        h, targets, lse = ctx.saved_tensors
        proj: VocabProjection = ctx.proj
        grad_h = torch.empty_like(h)
        for s in range(0, h.shape[0], proj.rows):
            e = min(h.shape[0], s + proj.rows)
            with torch.enable_grad():
                hc = h[s:e].detach().requires_grad_()
                out = _projected(proj.head, hc, proj.compute_dtype)
                with torch.no_grad():
                    dz = out.float()
                    if proj.temperature != 1.0:
                        dz.div_(proj.temperature)
                    dz.sub_(lse[s:e, None]).exp_()  # softmax(z)
                    dz.scatter_add_(1, targets[s:e, None], dz.new_full((e - s, 1), -1.0))  # softmax − onehot
                    dz.mul_((grad[s:e] / -proj.temperature)[:, None])  # g (onehot − softmax) / T
                torch.autograd.backward(out, dz.to(out.dtype))
            grad_h[s:e] = hc.grad
        return grad_h, None, None, None


def response_logprobs_and_entropy(
    backend: TrainBackend, batch: PaddedBatch, temperature: float, with_grad: bool, with_entropy: bool = True,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per response token: log π(token) and (optionally) the full-vocabulary entropy, from temperature-scaled logits.

    Only the real response positions (no prompt, no padding) go through the vocabulary projection, ``chunk_rows``
    at a time (default :func:`logits_chunk_rows`): see :class:`ChunkedLogprob`, whose backward recomputes a
    chunk's logits, so no [B·R, V] tensor is ever materialised. The entropy, always detached, is computed only
    when asked, since the gradient pass gets it from the scoring pass or the rollout. Padded positions are 0.
    """
    head = _head(backend)
    with torch.set_grad_enabled(with_grad):
        hidden, rows, cols, h, targets = _response_hidden(backend, batch)
        b, r = batch.targets.shape
        inverse = None
        if backend.shares_tree and targets.numel():  # one projection per distinct (prefix, next token)
            h, targets, inverse = _distinct_pairs(batch, rows, cols, h, targets)
        proj = VocabProjection(head, backend.compute_dtype, temperature,
                               chunk_rows or logits_chunk_rows(head.out_features))
        flat_ent: torch.Tensor | None
        if with_grad and torch.is_grad_enabled() and backend.chunked_projection:
            flat_lp, flat_ent = ChunkedLogprob.apply(h, targets, proj, with_entropy)
            flat_ent = flat_ent if with_entropy else None
        elif with_grad and torch.is_grad_enabled():  # one [N, V] graph: autograd sums each parameter's gradient once
            z = proj.logits(h)
            flat_lp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=-1)
            flat_ent = proj.forward(h.detach(), targets, with_entropy=True)[2] if with_entropy else None
        else:
            _, flat_lp, flat_ent = proj.forward(h, targets, with_entropy)
        if inverse is not None:  # back to every response token (the gather's backward sums a pair's gradients)
            flat_lp = flat_lp[inverse]
            flat_ent = flat_ent[inverse] if flat_ent is not None else None
        index = rows * r + cols
        logprobs = hidden.new_zeros(b * r, dtype=torch.float32).index_put((index,), flat_lp).view(b, r)
        entropy = None
        if flat_ent is not None:
            entropy = hidden.new_zeros(b * r, dtype=torch.float32).index_put((index,), flat_ent).view(b, r)
    return logprobs, entropy




def _distinct_pairs(batch: PaddedBatch, rows: torch.Tensor, cols: torch.Tensor, h: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, targets, inverse) of the distinct (prefix node, target) pairs among the response tokens (``h[inverse]``
    is the input ``h``): under the token tree, a question's leaves share their prompt's last state and their
    parent's segments, and project each once. A node's state is one tensor row whichever row reads it, so any
    occurrence stands for all."""
    # The trie is built again here (the forward's is behind TrainBackend.forward_hidden): 11 ms for 16 leaves of
    # 5 349 tokens on a 2-core Xeon; a demo step of ~4 such micro-batches updates in 21 s (bench/README).
    nodes = prefix_nodes(batch.input_ids, batch.attention_mask)[rows, batch.response_start[rows] - 1 + cols]
    key = nodes * (int(targets.max()) + 1) + targets
    _, inverse = torch.unique(key, return_inverse=True)
    first = torch.empty(int(inverse.max()) + 1, dtype=torch.long, device=h.device)
    first.scatter_(0, inverse, torch.arange(inverse.numel(), device=h.device))
    return h[first], targets[first], inverse


def _head(backend: TrainBackend) -> torch.nn.Linear:
    head = backend.module.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the vocabulary projection must be a torch.nn.Linear, got {type(head).__name__}")
    return head


def _response_hidden(backend: TrainBackend, batch: PaddedBatch
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [B, L, H], rows, cols, h [N, H], targets [N]): the last layer's states, and for each real response
    token (row-major; no prompt, no padding) its (row, column) of ``batch.targets``, the state of the position
    before it and its id."""
    hidden = backend.forward_hidden(batch.input_ids, batch.attention_mask)  # [B, L, H]
    r = batch.targets.shape[1]
    resp_len = batch.attention_mask.sum(1) - batch.response_start  # [B]
    offsets = torch.arange(r, device=hidden.device)
    rows, cols = (offsets[None] < resp_len[:, None]).nonzero(as_tuple=True)
    h = hidden[rows, batch.response_start[rows] - 1 + cols]
    return hidden, rows, cols, h, batch.targets[rows, cols]


@dataclass(frozen=True)
class TokenDivergence:
    """Per response token of one sample, a policy against a start policy (float64 arrays of the response length)."""

    logprob_start: np.ndarray
    logprob_after: np.ndarray
    entropy_start: np.ndarray
    entropy_after: np.ndarray
    kl: np.ndarray
    """KL(π_start ‖ π_after) over the whole vocabulary at the token's position."""


@torch.no_grad()
def token_divergence(after: TrainBackend, start: TrainBackend, samples: Sequence[TrainSample], pad_id: int,
                     temperature: float, micro_batch_tokens: int, chunk_rows: int | None = None,
                     start_states: dict[tuple[int, ...], torch.Tensor] | None = None) -> list[TokenDivergence]:
    """For every response token of ``samples`` (tool results too: callers mask): both policies' log-prob of the
    sampled token and entropy, and KL(π_start ‖ π_after) = Σ_v p_start(v)·(log p_start(v) − log p_after(v)), from
    temperature-scaled logits, micro-batch by micro-batch and ``chunk_rows`` tokens at a time.

    ``start_states``: the start policy's response states per micro-batch, filled on first use and read after, so
    that several updated policies compared with one start run its forward once (the same samples and budget)."""
    out: list[TokenDivergence | None] = [None] * len(samples)
    for mb in plan_micro_batches([len(s.input_ids) for s in samples], micro_batch_tokens):
        batch = collate([samples[i] for i in mb], pad_id, after.device)
        _, rows, _, h_after, targets = _response_hidden(after, batch)
        key = tuple(mb)
        if start_states is None or key not in start_states:
            h_start = _response_hidden(start, batch)[3]
            if start_states is not None:
                start_states[key] = h_start
        h_start = start_states[key] if start_states is not None else h_start
        step = chunk_rows or logits_chunk_rows(_head(after).out_features)
        proj_after = VocabProjection(_head(after), after.compute_dtype, temperature, step)
        proj_start = VocabProjection(_head(start), start.compute_dtype, temperature, step)
        columns = np.zeros((5, targets.shape[0]))
        for s in range(0, targets.shape[0], step):
            e = min(targets.shape[0], s + step)
            logp_a = torch.log_softmax(proj_after.logits(h_after[s:e]), dim=-1)
            logp_s = torch.log_softmax(proj_start.logits(h_start[s:e]), dim=-1)
            p_s = logp_s.exp()
            t = targets[s:e, None]
            columns[:, s:e] = torch.stack([
                logp_s.gather(1, t).squeeze(1), logp_a.gather(1, t).squeeze(1),
                -(p_s * logp_s).sum(-1), -(logp_a.exp() * logp_a).sum(-1), (p_s * (logp_s - logp_a)).sum(-1),
            ]).double().cpu().numpy()
        rows_np = rows.cpu().numpy()
        for row, i in enumerate(mb):
            picked = columns[:, rows_np == row]  # row-major: the row's tokens in response order
            out[i] = TokenDivergence(*picked)
    return [d for d in out if d is not None]
