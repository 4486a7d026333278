"""In-process transformers engine: the CPU default behind ``aepo_core.interfaces.Engine``.

Why a hand-written loop instead of ``model.generate``: AEPO needs, for every generated token, the log-prob of
the sampled token and the entropy of the **full-vocabulary** distribution it was sampled from (AEPO.md §2), per
row stop strings whose returned ids end exactly at the token that completed the stop string, and per-row seeds.

Semantics (documented choices):

- **Distribution.** Logits are cast to float32, divided by the temperature, then top-k and top-p filtered
  (HF order). The token is sampled from that filtered distribution, and its log-prob and the full-vocabulary
  entropy ``H = −Σ p log p`` are taken from the same filtered distribution (filtered tokens have probability 0
  and contribute nothing). Without filtering this is the plain temperature-scaled softmax, the same quantity as
  ``aepo_core.entropy.token_entropy``. H is computed in the max-shifted logsumexp form
  ``log Σe − Σ e·(z − max) / Σe`` with ``e = exp(z − max)``, stable for bf16 models.
  ``temperature <= 0`` means greedy; log-probs and entropies are then those of the temperature-1 (filtered)
  distribution, since a point mass would carry no information.
- **Seeds.** One ``torch.Generator`` per row, seeded with ``request.seed`` (or, when it is None, with a seed
  drawn from the engine's own RNG, itself seeded at construction); each step the row draws one uniform from it
  and samples by inverse CDF. A row's tokens therefore do not depend on what else is in the batch: batched
  and unbatched runs of the same request agree up to kernel rounding (float32: ~1e-6 in log-prob, since
  multi-threaded CPU kernels split batch rows between threads; bfloat16: padding changes the matmul shapes),
  so a rare near-tie can flip. The same batch with the same seeds repeats bit for bit.
- **Stops.** EOS (the tokenizer's and the generation config's EOS ids, or ``stop_token_ids``) ends a row with
  ``finish_reason='eos'``; the EOS token is included in ``token_ids`` (its log-prob is trained on). A stop
  string is searched after every token in the decoded text of the last few generated tokens (enough to hold the
  longest stop string); the row stops as soon as one appears, so the ids end at the token that completed it.
  That token may carry text past the stop string (e.g. ``></`` completing ``</search>``): callers that cut
  text should cut at ``stop_string``. Otherwise ``max_tokens`` ends the row with ``finish_reason='length'``.
  Only generated text is searched: a stop string begun in the prompt (split by the caller's segment cap) is the
  caller's to find (the rollout scheduler cuts the segment at it).
- **Cost.** Rows that finish leave the batch (their KV cache rows are dropped), so each step costs what the
  active rows cost (a cache without ``batch_select_indices`` keeps them, fed padding and ignored). Per step
  the sampler makes a handful of passes over ``[B, V]`` and one host sync. ``max_batch_size`` splits very
  large request lists into sequential batches.
  **KV reuse** (``kv_reuse_mb > 0``; ``rollout.kv_reuse``): a rollout calls ``generate`` once per tool round
  and each prompt extends an earlier one (the path's previous prompt + its segment + a tool result; a branch's
  prompt is a prefix of its parent's transcript), so re-prefilling whole transcripts was about half of CPU
  rollout time. A finished row's KV (every token it fed: the prompt and all generated tokens but the last) is
  kept in a :class:`~infra.engines.prefix_cache.PrefixKVStore`; a request reuses the longest stored prefix of
  its prompt (all but its last token at most) and prefills only the rest, its rows laid out
  ``[pad | reused | pad | rest]`` under the attention mask with positions counting real tokens only.
  ``GenerationStats.prefill_tokens`` / ``reused_tokens`` count both parts. The samples are those of a full
  prefill with the same seeds: the reused KV was computed by other matmul shapes (decode steps, an earlier
  prefill), so float32 log-probs differ by ~2e-6 (measured on tiny-random), like batched vs unbatched rows;
  under bf16 autocast the difference is bf16 rounding and a sampled token can flip, after which the path
  diverges (SmolLM2, bench (d): the two arms' trees differ), as bf16 batched vs unbatched rows do.
  The store is byte-capped (LRU) and holds KV of the current weights only: it is cleared by
  :meth:`HFEngine.load_weights` and, at the start of ``generate``, whenever any parameter's storage or version
  counter changed (an optimizer step on a shared training model, ``load_state_dict``, any in-place write).
- **Continuous batching.** ``generate`` may be called from several threads at once (the per-path scheduler with
  ``rollout.inflight_requests``: one call per ready path). Every call's rows go into one shared batch
  (:class:`~infra.engines.decode_batch.DecodeBatch`): rows that arrive while it decodes are prefilled (reusing
  their stored KV) and join it before its next token, their caches left-padded to the batch's width under the mask;
  a row that finishes leaves it, and its caller returns at once, while the other rows go on. No thread of its own:
  whichever caller finds the batch without a driver runs its next step, so it advances while any caller has a row in
  it. Rows join only a batch sampled with the same ``SamplingParams`` and of a cache of full-attention layers (else
  they wait for it to drain); ``max_batch_size`` caps the rows decoded together, and queued rows join as others
  leave. A row's tokens come from its own seed, so what it samples does not depend on who joined (up to kernel
  rounding, as for any batch). A single call runs as before: prefill, then one token per row per forward.
- **Errors.** Bad requests (empty prompt, ids outside the vocabulary) get ``finish_reason='error'`` without
  running; a failure of a batched forward pass re-runs that batch's rows one by one (same seeds, so the
  healthy rows produce what they would have) and only the failing rows get ``'error'``; a row whose
  distribution becomes non-finite is ended with ``'error'`` while the others go on.
- **Live weights.** The engine holds a reference to the model it was given. When that is the training model, an
  optimizer step is seen by the next ``generate`` without a copy; when it is a separate low-precision copy
  (``model.generation_dtype``), :meth:`HFEngine.load_weights` refreshes it in place.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers import Cache, DynamicCache

from aepo_core.config import ModelConfig
from aepo_core.entropy import PUBLISHED_TOP_K
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.engines.decode_batch import DecodeBatch, GenerationStats, Row, count_pass, stop_window
from infra.engines.prefix_cache import LayerKV, PrefixKV, PrefixKVStore
from infra.engines.weights import PolicyWeights, WeightSource
from infra.kv_cache import cache_kwarg, cache_of, is_plain_dynamic
from infra.models import chat_prompt_ids, load_model_weights, load_policy

log = logging.getLogger(__name__)

SCORE_LOGIT_FLOATS = 2**26
"""Most logits :meth:`HFEngine.score` keeps at once (256 MB of float32; SmolLM2's 49k vocabulary: ~1300 tokens)."""


def filtered_logits(logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, bool]:
    """float32 logits of the distribution sampled from: temperature-scaled, then top-k, then top-p filtered
    (HF order); filtered tokens are −inf. Also says whether anything was filtered."""
    z = logits.float()
    if sampling.temperature > 0 and sampling.temperature != 1.0:
        z = z / sampling.temperature
    vocab = z.shape[-1]
    filtered = False
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
        filtered = True
    if sampling.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        remove_sorted = mass_before >= sampling.top_p  # keep the smallest prefix with mass ≥ top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
        filtered = True
    return z, filtered


def sampling_distribution(logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[..., V]`` (−inf for filtered tokens) and entropies ``[...]`` of the distribution sampled
    from: the reference form (the engine uses an equivalent fused path); float32, logsumexp form, so bf16
    logits give stable entropies."""
    z, _ = filtered_logits(logits, sampling)
    logp = torch.log_softmax(z, dim=-1)
    # −Σ p·log p, not lse − Σ p·z: the latter multiplies the normalization error by |z| (0.06 nats off for
    # bf16 logits of magnitude ~2000)
    entropy = -(logp.exp() * logp.masked_fill(~torch.isfinite(logp), 0.0)).sum(-1)
    return logp, entropy


def sample_next(logits: torch.Tensor, generators: Sequence[torch.Generator], sampling: SamplingParams
            ) -> tuple[list[int], list[float], list[float], list[float], list[bool]]:
    """Sample one token per row; return ids, log-probs, entropies, the published code's top-10 entropy terms
    (:func:`~aepo_core.entropy.published_token_entropy`, ÷ ln of the logits' width; NaN unless
    ``sampling.published_entropy``) and rows with non-finite logits.

    Few passes over ``[B, V]`` (each is a thread sync on CPU): shifted exponentials ``e = exp(z − max)``
    give the normalizer ``s``, the entropy ``log s − Σ e·(z − max) / s`` and the CDF. Each row draws one
    uniform from its own generator and takes the inverse CDF (``searchsorted(right=True)`` with the target kept
    below the CDF's last value never lands on a zero-probability token), so a row's draw does not depend on
    the rest of the batch.
    """
    z, filtered = filtered_logits(logits, sampling)
    if sampling.temperature <= 0:  # greedy: report the temperature-1 distribution's numbers
        z_max, tokens_t = z.max(dim=-1, keepdim=True)
    else:
        z_max = z.max(dim=-1, keepdim=True).values
    shifted = z - z_max
    e = shifted.exp()
    total = e.sum(-1, keepdim=True)
    dot_src = shifted.masked_fill(~torch.isfinite(shifted), 0.0) if filtered else shifted
    entropy = total.log().squeeze(-1) - (e * dot_src).sum(-1) / total.squeeze(-1)
    if sampling.temperature > 0:
        u = torch.cat([torch.rand(1, generator=g, device=z.device) for g in generators])
        cdf = e.cumsum(-1)
        last = cdf[:, -1:]
        # v < cdf[-1] strictly (u·last can round up to last), so the pick is a token with e > 0
        v = torch.minimum(u[:, None] * last, torch.nextafter(last, torch.zeros_like(last)))
        tokens_t = torch.searchsorted(cdf, v.contiguous(), right=True).clamp_(max=z.shape[-1] - 1)
    chosen = shifted.gather(-1, tokens_t).squeeze(-1) - total.log().squeeze(-1)
    published = (_published_terms(shifted, total, chosen) if sampling.published_entropy
                 else torch.full_like(chosen, math.nan))  # not asked for: NaN, reported as None
    packed = torch.stack([tokens_t.squeeze(-1).double(), chosen.double(), entropy.double(), published.double()], -1)
    tokens, chosen_l, entropy_l, published_l = (zip(*packed.tolist(), strict=True) if len(generators)
                                                 else ((), (), (), ()))
    bad = [not (math.isfinite(h) and math.isfinite(c)) for h, c in zip(entropy_l, chosen_l, strict=True)]
    return [int(t) for t in tokens], list(chosen_l), list(entropy_l), list(published_l), bad


def _published_terms(shifted: torch.Tensor, total: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row, :func:`~aepo_core.entropy.published_token_entropy` of the sampled distribution: −Σ p·log p over its
    top-10 log-probs and the sampled token's when outside them, ÷ ln V (V: the logits' width)."""
    top = shifted.topk(min(PUBLISHED_TOP_K, shifted.shape[-1]), dim=-1).values - total.log()
    head = -(top.exp() * top.masked_fill(~torch.isfinite(top), 0.0)).sum(-1)
    outside = chosen < top[:, -1]
    extra = torch.where(outside, -(chosen.exp() * chosen), torch.zeros_like(chosen))
    return (head + extra) / math.log(shifted.shape[-1])


class HFEngine:
    """Batched token-in/token-out generation with a transformers causal LM (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, *, seed: int = 0,
                 stop_token_ids: Sequence[int] | None = None, max_batch_size: int | None = None,
                 autocast_dtype: torch.dtype | None = None, kv_reuse_mb: float = 0.0,
                 refresh: Callable[[torch.nn.Module], None] | None = None, version: str | None = None) -> None:
        """``kv_reuse_mb``: byte cap (MiB) of the store of finished rows' KV that later prompts starting with the
        same tokens reuse (see the module docstring, "Cost."); 0 turns reuse off. ``refresh``: how ``model``, a
        copy of another layout than the policy (the int8 sampler's, :class:`~infra.engines.int8.Int8Copy`), takes
        the live weights; None: tensor by tensor in place (the same layout, another dtype). ``version``: the label
        of the weights it starts from (a run's engine: ``"0"``, the policy as loaded; None: unknown)."""
        self.model = model
        self._refresh = refresh
        self._version = version
        self.autocast_dtype = autocast_dtype  # mixed precision: bf16 matmuls over float32 weights
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._seed_rng = random.Random(seed)
        self._eos_ids = frozenset(stop_token_ids) if stop_token_ids is not None else _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else (min(self._eos_ids) if self._eos_ids else 0)
        self.last_stats = GenerationStats()
        self._cache_kwarg = cache_kwarg(model)
        params = inspect.signature(model.forward).parameters
        # Only the last prompt position's logits are needed: skip the [B, L, V] projection of the prefill.
        self._keep_arg = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._prefixes = PrefixKVStore(int(kv_reuse_mb * 2**20)) if kv_reuse_mb > 0 else None
        self._prefix_weights: tuple[int, ...] = ()  # the weights the stored KV was computed with
        # the shared decode batch (see "Continuous batching"): rows waiting to join it, whether a caller is running
        # its next step, and the lock that guards both and wakes the callers
        self._turn = threading.Condition()
        self._arrivals: list[Row] = []
        self._driving = False
        self._batch: DecodeBatch | None = None

    @property
    def kv_reuse(self) -> bool:
        """Whether finished rows' KV is kept for later prompts that start with the same tokens."""
        return self._prefixes is not None

    def release(self) -> None:
        """The rollout is over: its retained KV will not be asked for again (:meth:`PolicyEngine.release`)."""
        self.clear_kv()

    def close(self) -> None:
        """Nothing but the retained KV to free: the model is the caller's."""
        self.clear_kv()

    def clear_kv(self) -> None:
        """Forget every retained KV cache (done automatically when the weights change)."""
        if self._prefixes is not None:
            self._prefixes.clear()

    def _weights_fingerprint(self) -> tuple[int, ...]:
        """Storage address and version counter of every parameter: an optimizer step, ``load_state_dict`` or any
        other in-place write bumps a tensor's version, and a swapped tensor changes the address (~30 µs for
        SmolLM2's 272 tensors)."""
        return tuple(v for p in self.model.parameters() for v in (p.data_ptr(), p._version))

    @classmethod
    def from_config(cls, cfg: ModelConfig, **kwargs: Any) -> HFEngine:
        """Load the policy of ``cfg`` (infra.models.load_policy) and wrap it."""
        model, tokenizer = load_policy(cfg)
        return cls(model, tokenizer, **kwargs)

    # ---------------------------------------------------------------- Engine protocol: text <-> tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (pieces are appended to transcripts as ids)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; special tokens are kept by default so decoding is faithful."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        tid = self.tokenizer.eos_token_id
        if tid is not None:
            return int(tid)
        return min(self._eos_ids) if self._eos_ids else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a row with ``finish_reason='eos'``."""
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    def apply_chat_template(self, question: str, system_prompt: str | None = None) -> list[int]:
        """Prompt ids for one user turn, ending with the assistant header (generation prompt)."""
        return chat_prompt_ids(self.tokenizer, question, system_prompt)

    # ---------------------------------------------------------------- weights

    @property
    def weight_version(self) -> str | None:
        """The updates behind the live weights last loaded (:attr:`PolicyWeights.version`), which every result
        carries; None before any load or after an HF checkpoint directory (a version this engine cannot know)."""
        return self._version

    @torch.no_grad()
    def load_weights(self, source: WeightSource) -> None:
        """Sample from ``source`` next: the live training weights (copied into this engine's own model unless it
        is the training model itself) or an HF checkpoint directory (loaded in place)."""
        self.clear_kv()
        self._version = str(source.version) if isinstance(source, PolicyWeights) else None
        if not isinstance(source, PolicyWeights):
            if self._refresh is not None:
                raise ValueError(f"an engine on a refreshed copy (the int8 sampler) takes live weights, not {source}")
            load_model_weights(self.model, source)
            return
        if source.model is self.model:
            return
        if self._refresh is not None:
            self._refresh(source.model)
            return
        for dst, src in zip(self.model.state_dict().values(), source.model.state_dict().values(), strict=True):
            dst.copy_(src)

    # ---------------------------------------------------------------- generation

    def generate(self, requests: Sequence[GenerationRequest],
                 sampling: SamplingParams | None = None) -> list[GenerationResult]:
        """One result per request, in order; never raises for a single bad row. Safe to call from several threads
        at once: a call's rows join the batch being decoded at its next token (see the module docstring,
        "Continuous batching")."""
        sampling = sampling or SamplingParams()
        t0 = time.perf_counter()
        self.last_stats = stats = GenerationStats(rows=len(requests))
        rows: list[Row] = []
        for i, req in enumerate(requests):
            seed = req.seed % 2**63 if req.seed is not None else self._seed_rng.randrange(2**63)
            rows.append(Row(index=i, prompt=[int(t) for t in req.prompt_ids], max_tokens=int(req.max_tokens),
                             stop=tuple(s for s in req.stop if s), seed=int(seed), sampling=sampling,
                             stats=stats))
        self._join([r for r in rows if self._admit(r)])
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = sum(len(r.ids) for r in rows)
        log.debug("generated %d tokens for %d rows in %.2f s (%.1f tok/s, %d passes, %d row-steps)",
                  stats.new_tokens, stats.rows, stats.seconds, stats.tokens_per_s, stats.forward_passes,
                  stats.row_steps)
        return [r.result(sampling.published_entropy, self._version) for r in rows]

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
              sampling: SamplingParams | None = None) -> list[list[float]]:
        """Per row ``(prompt, tokens)``: the entropy of the distribution each token was sampled from (temperature
        then top-k and top-p, as :meth:`generate` samples), teacher-forced: one forward over the part of
        ``prompt + tokens[:-1]`` the prefix store does not hold.  With KV reuse each row's fed tokens are stored,
        so the next segment of the same path (its prompt starts with them) feeds only what is new.

        Memory: the logits kept are rows × tokens × V floats per batch, at most :data:`SCORE_LOGIT_FLOATS`."""
        sampling = sampling or SamplingParams()
        t0 = time.perf_counter()
        self.last_stats = stats = GenerationStats(rows=len(rows))
        self._drop_stale_kv()
        out: list[list[float]] = [[] for _ in rows]
        todo = [i for i, (prompt, tokens) in enumerate(rows) if tokens and prompt]
        with self._inference():
            while todo:
                size, longest = 1, len(rows[todo[0]][1])
                while size < len(todo) and (size + 1) * max(longest, len(rows[todo[size]][1])) * self.vocab_size \
                        <= SCORE_LOGIT_FLOATS:
                    longest = max(longest, len(rows[todo[size]][1]))
                    size += 1
                batch, todo = todo[:size], todo[size:]
                for i, entropies in zip(batch, self._score_batch([rows[i] for i in batch], sampling, stats),
                                        strict=True):
                    out[i] = entropies
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = sum(len(e) for e in out)
        return out

    @torch.inference_mode()
    def _score_batch(self, rows: list[tuple[Sequence[int], Sequence[int]]], sampling: SamplingParams,
                     stats: GenerationStats) -> list[list[float]]:
        """One forward for :meth:`score`, in :meth:`_run_batch`'s layout (reused KV right-aligned, then the rest
        of each row right-aligned), keeping the logits of each row's last ``len(tokens)`` positions only."""
        device = self.model.device
        fed = [[int(t) for t in (*prompt, *tokens[:-1])] for prompt, tokens in rows]
        needed = [len(tokens) for _, tokens in rows]
        # at most all but the prompt's last token: its logits score the first token
        reused = self._reusable_prefixes(fed, [len(f) - n for f, n in zip(fed, needed, strict=True)])
        input_ids, attention, positions, cached, width = self._layout(fed, reused, [stats] * len(fed))
        keep = max(needed)
        past = {self._cache_kwarg: self._batch_cache(reused, cached)} if cached else {}
        kept = ({"logits_to_keep": torch.arange(width - keep, width, device=device)}
                if self._keep_arg == "logits_to_keep" else {})
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         **kept, **past)
        stats.forward_passes += 1
        stats.row_steps += len(rows)
        logits = out.logits[:, -keep:, :]
        cache = cache_of(out)
        if self._prefixes is not None and is_plain_dynamic(cache):
            for i, f in enumerate(fed):
                self._store(f, cache, attention[i], i)
        return [sampling_distribution(logits[i, keep - n:], sampling)[1].tolist() for i, n in enumerate(needed)]

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode (restored after) under the engine's autocast, if any."""
        was_training = self.model.training
        self.model.eval()
        try:
            device_type = next(self.model.parameters()).device.type
            with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                yield
        finally:
            if was_training:
                self.model.train()

    def _drop_stale_kv(self) -> None:
        """Forget the retained KV when the weights changed since it was computed."""
        if self._prefixes is not None and (now := self._weights_fingerprint()) != self._prefix_weights:
            self._prefixes.clear()
            self._prefix_weights = now

    def _admit(self, row: Row) -> bool:
        """Finish rows that need no model call (nothing to generate) or cannot run (bad ids)."""
        if row.max_tokens <= 0:
            row.finish = "length"
            return False
        if not row.prompt:
            row.finish, row.error = "error", "empty prompt"
            return False
        vocab = self.vocab_size
        bad = [t for t in row.prompt if not 0 <= t < vocab]
        if bad:
            row.finish, row.error = "error", f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            return False
        return True

    def _join(self, rows: list[Row]) -> None:
        """Queue ``rows`` for the shared batch and return once every one has finished. Whichever waiting caller
        finds the batch without a driver runs its next step (:meth:`_drive`), so the batch advances while any caller
        has a row in it, and a caller whose rows are done returns at once."""
        with self._turn:
            self._arrivals.extend(rows)
            while any(row.finish is None for row in rows):
                if self._driving:
                    self._turn.wait()
                    continue
                self._driving = True
                self._turn.release()
                try:
                    self._drive()
                finally:
                    self._turn.acquire()
                    self._driving = False
                    self._turn.notify_all()

    def _take_arrivals(self) -> list[Row]:
        """The queued rows that join the batch now: those sampled like it (like the first queued row when no batch
        runs), up to ``max_batch_size`` rows in all; none while the batch's cache cannot take rows in."""
        batch = self._batch
        if not self._arrivals or (batch is not None and not batch.mergeable):
            return []
        sampling = batch.sampling if batch is not None else self._arrivals[0].sampling
        taken = [row for row in self._arrivals if row.sampling == sampling]
        if self.max_batch_size:
            taken = taken[:max(0, self.max_batch_size - (len(batch.rows) if batch is not None else 0))]
        chosen = {id(row) for row in taken}
        self._arrivals = [row for row in self._arrivals if id(row) not in chosen]
        return taken

    @torch.inference_mode()
    def _drive(self) -> None:
        """One step of the shared batch: prefill the rows that join it and merge them in, sample every row's next
        token, wake the callers whose rows finished, then feed the tokens of the rows that go on.

        If a forward fails, the unfinished rows are run again one by one (same seeds, so the healthy rows produce
        what they would have) and only a row that fails alone gets ``'error'``."""
        with self._turn:
            joining = self._take_arrivals()
        with self._inference():
            try:
                if self._batch is None and joining:
                    self._drop_stale_kv()
                    self._batch = self._prefill(joining)
                elif joining:
                    assert self._batch is not None
                    self._batch = self._batch.merged(self._prefill(joining))
                if self._batch is None:
                    return
                step = self._sample_step(self._batch)
                with self._turn:
                    self._turn.notify_all()
                if step is None:
                    self._batch = None
                else:
                    self._feed_step(self._batch, step)
            except Exception as exc:
                unfinished = [r for r in (self._batch.rows if self._batch else []) + joining if r.finish is None]
                self._batch = None
                self._rerun_one_by_one(list({id(r): r for r in unfinished}.values()), exc)

    def _rerun_one_by_one(self, rows: list[Row], exc: Exception) -> None:
        """Run each of ``rows`` again alone after a batched forward failed; a row that fails alone gets ``'error'``."""
        if len(rows) == 1:
            self._fail(rows[0], exc)
            return
        if rows:
            log.warning("batched generation of %d rows failed (%s: %s); retrying row by row",
                        len(rows), type(exc).__name__, exc)
        for row in rows:
            row.reset()
            try:
                batch = self._prefill([row])
                while (step := self._sample_step(batch)) is not None:
                    self._feed_step(batch, step)
            except Exception as row_exc:
                self._fail(row, row_exc)

    @staticmethod
    def _fail(row: Row, exc: Exception) -> None:
        log.warning("generation failed for row %d: %s: %s", row.index, type(exc).__name__, exc)
        row.finish, row.error = "error", f"{type(exc).__name__}: {exc}"
        row.stop_string = None

    def _prefill(self, rows: list[Row]) -> DecodeBatch:
        """A batch of ``rows`` ready to sample their first tokens: one forward over what the prefix store does not
        hold of their prompts.

        Layout of a row: ``[pad | reused KV | pad | rest of the prompt]``: the reused KV is right-aligned in a cache
        ``cached`` wide, the rest of the prompt right-aligned in the ``width`` new columns; the attention mask hides
        the padding and positions count only real tokens, so a row's numbers do not depend on its neighbours'
        lengths.  Without reuse, ``cached`` is 0: plain left padding."""
        device = self.model.device
        # at most all but the last prompt token, whose logits the first sample needs
        reused = self._reusable_prefixes([r.prompt for r in rows], [len(r.prompt) - 1 for r in rows])
        input_ids, attention, positions, cached, width = self._layout(
            [r.prompt for r in rows], reused, [r.stats for r in rows])
        past = {self._cache_kwarg: self._batch_cache(reused, cached)} if cached else {}
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         use_cache=True, **self._last_logits_only(width), **past)
        count_pass(rows)
        cache = cache_of(out)
        return DecodeBatch(rows=list(rows),
                           generators=[torch.Generator(device=device).manual_seed(r.seed) for r in rows],
                           windows=[stop_window(r.stop) for r in rows], cache=cache, attention=attention,
                           next_pos=positions[:, -1] + 1, logits=out.logits[:, -1, :],
                           selectable=isinstance(cache, Cache), plain=is_plain_dynamic(cache),
                           retain=self._prefixes is not None)

    def _sample_step(self, batch: DecodeBatch) -> list[int] | None:
        """Sample every unfinished row's next token and end the rows it finishes (keeping their KV when reuse is on);
        rows that finish leave the batch. The tokens to feed next, one per row of the batch; None when none goes on."""
        tokens, logps, ents, published, bad = sample_next(batch.logits, batch.generators, batch.sampling)
        keep: list[int] = []
        for j, row in enumerate(batch.rows):
            if row.finish is not None:  # a finished row kept in a cache that cannot drop rows
                continue
            if bad[j]:
                row.finish, row.error = "error", "non-finite logits (the model produced NaN/inf)"
                continue
            tok = tokens[j]
            row.ids.append(tok)
            row.logprobs.append(logps[j])
            row.entropies.append(ents[j])
            row.published_entropies.append(published[j])
            if tok in self._eos_ids:
                row.finish = "eos"
            elif row.stop and (hit := self._match_stop(row, batch.windows[j])) is not None:
                row.finish, row.stop_string = "stop", hit
            elif len(row.ids) >= row.max_tokens:
                row.finish = "length"
            else:
                keep.append(j)
            # only rows a caller may continue: EOS ends a trajectory for good (a stop string, a tool call, or the
            # length cap of a segment does not)
            if batch.retain and batch.plain and row.finish in ("stop", "length"):
                self._retain(row, batch.cache, batch.attention[j], j)
        if not keep:
            batch.rows = []
            return None
        if len(keep) < len(batch.rows) and batch.selectable:  # finished rows leave the batch: cost tracks active rows
            batch.select(keep)
            return [tokens[j] for j in keep]
        # another cache layout (some remote-code models): finished rows stay, fed padding, ignored
        kept = set(keep)
        return [tokens[j] if j in kept else self._pad_id for j in range(len(batch.rows))]

    def _feed_step(self, batch: DecodeBatch, step: list[int]) -> None:
        """One forward of one token per row: the logits the rows sample their next tokens from."""
        device = self.model.device
        batch.attention = torch.cat([batch.attention, batch.attention.new_ones((len(step), 1))], dim=-1)
        out = self.model(input_ids=torch.tensor(step, dtype=torch.long, device=device)[:, None],
                         attention_mask=batch.attention, position_ids=batch.next_pos[:, None], use_cache=True,
                         **{self._cache_kwarg: batch.cache})
        count_pass(batch.rows)
        batch.cache = cache_of(out)
        batch.logits = out.logits[:, -1, :]
        batch.next_pos = batch.next_pos + 1

    def _last_logits_only(self, width: int) -> dict[str, Any]:
        """The model argument that keeps only the last of ``width`` positions' logits.

        An index tensor, not the count 1: the model slices ``hidden[:, -1:, :]`` for a count, a strided view,
        and torch's CPU bf16 ``linear`` on a strided [rows, 1, hidden] input broadcasts the weight per row
        (measured on SmolLM2, 72 rows: +3.9 GB and 18 s for that one product, 8 MB and 0.02 s contiguous);
        indexing with a tensor gathers a contiguous copy.  ``num_logits_to_keep`` (older transformers) takes
        only a count."""
        if self._keep_arg == "logits_to_keep":
            return {"logits_to_keep": torch.tensor([width - 1], device=self.model.device)}
        return {self._keep_arg: 1} if self._keep_arg else {}

    def _reusable_prefixes(self, seqs: list[list[int]], limits: list[int]) -> list[tuple[PrefixKV | None, int]]:
        """Per sequence, the stored KV it starts with and how many of its tokens to reuse (at most its limit)."""
        if self._prefixes is None or not len(self._prefixes):
            return [(None, 0)] * len(seqs)
        return [self._prefixes.longest(np.asarray(seq, dtype=np.int64), limit)
                for seq, limit in zip(seqs, limits, strict=True)]

    def _layout(self, seqs: list[list[int]], reused: list[tuple[PrefixKV | None, int]],
                stats: Sequence[GenerationStats | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """(input ids, attention mask, positions, cached, width) of a batch in :meth:`_run_batch`'s layout: each
        sequence's reused KV right-aligned in ``cached`` columns, the rest right-aligned in ``width`` new ones."""
        cached = max(n for _, n in reused)
        width = max(len(seq) - n for seq, (_, n) in zip(seqs, reused, strict=True))
        input_ids = torch.full((len(seqs), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), cached + width), dtype=torch.long)
        for i, (seq, (_, n), cost) in enumerate(zip(seqs, reused, stats, strict=True)):
            rest = seq[n:]
            input_ids[i, width - len(rest):] = torch.tensor(rest, dtype=torch.long)
            attention[i, cached - n:cached] = 1
            attention[i, cached + width - len(rest):] = 1
            if cost is not None:
                cost.prefill_tokens += len(rest)
                cost.reused_tokens += n
        device = self.model.device
        attention = attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        return input_ids.to(device), attention, positions, cached, width

    def _batch_cache(self, reused: list[tuple[PrefixKV | None, int]], cached: int) -> DynamicCache:
        """A cache ``cached`` positions wide holding each row's reused KV right-aligned (zeros where masked)."""
        first = next(entry for entry, n in reused if entry is not None and n)
        layers: list[LayerKV] = []
        for li, (k_ref, v_ref) in enumerate(first.layers):
            keys = k_ref.new_zeros((len(reused), k_ref.shape[0], cached, k_ref.shape[2]))
            values = v_ref.new_zeros((len(reused), v_ref.shape[0], cached, v_ref.shape[2]))
            for i, (entry, n) in enumerate(reused):
                if entry is not None and n:
                    k, v = entry.layers[li]
                    keys[i, :, cached - n:] = k[:, :n]
                    values[i, :, cached - n:] = v[:, :n]
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers)

    def _retain(self, row: Row, cache: DynamicCache, attention: torch.Tensor, j: int) -> None:
        """Keep the KV of the finished row at batch index ``j``: its real positions (the mask's ones) hold the
        tokens it fed, the prompt and every generated token but the last (never fed)."""
        self._store(row.prompt + row.ids[:-1], cache, attention, j)

    def _store(self, fed: list[int], cache: DynamicCache, attention: torch.Tensor, j: int) -> None:
        """Keep the KV at batch index ``j`` of the tokens ``fed``: its real positions (the mask's ones)."""
        assert self._prefixes is not None
        real = attention.nonzero().squeeze(-1)
        if len(real) != len(fed):  # cannot happen with a plain dynamic cache; never store misaligned KV
            log.warning("not retaining the KV of batch row %d: %d cached positions for %d tokens", j, len(real),
                        len(fed))
            return
        self._prefixes.put(fed, [(layer.keys[j].index_select(1, real), layer.values[j].index_select(1, real))
                                 for layer in cache.layers])

    def _match_stop(self, row: Row, window: int) -> str | None:
        """The stop string completed by the row's latest token, if any (earliest in the text wins)."""
        text = self.tokenizer.decode(row.ids[-window:], skip_special_tokens=False)
        hits = [(text.find(s), -len(s), s) for s in row.stop if s in text]
        return min(hits)[2] if hits else None


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models often list several)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_cfg = getattr(model, "generation_config", None)
    extra = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(t) for t in extra)
    return frozenset(ids)
