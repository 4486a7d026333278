"""Client of an OpenAI-compatible completions server (vLLM ``vllm serve``, SGLang): token ids in and out.

vLLM cannot share a virtualenv with Prefect (FastAPI pins clash) and needs a GPU, so rollouts at scale run
on separate server processes reached over HTTP.  The prompt is sent as token ids (never re-tokenized text),
one request per row (the server batches concurrent requests itself), asking for

- ``logprobs = top_k``: the sampled token's log-prob and the top-k alternatives per position, from which the
  entropy is *estimated* (top-k plus the tail mass spread uniformly; flagged ``entropy_is_estimate``);
- ``return_tokens_as_token_ids``: tokens come back as ``token_id:<id>`` so no detokenize/retokenize drift;
- ``include_stop_str_in_output``: the transcript keeps the closing tool tag the protocol needs.

The server matches stop strings in the text it generates, not in the prompt; a stop string split across two
segments by the rollout's segment cap is found and cut by the rollout scheduler.

For AEPO start vLLM with ``--logprobs-mode processed_logprobs`` so log-probs and entropies are those of the
temperature-scaled distribution that was sampled (the default reports the raw model distribution).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aepo_core.entropy import topk_entropy_estimate
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.engines.weights import PolicyWeights, WeightSource

log = logging.getLogger(__name__)

TOKEN_ID_PREFIX = "token_id:"
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


class RemoteEngineError(RuntimeError):
    pass


class RemoteEngine:
    """Engine protocol over HTTP; ``tokenizer`` is the policy's tokenizer (for encode/decode of results)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        top_logprobs: int = 20,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        workers: int = 64,
        api_key: str | None = None,
        reload_url: str | None = None,
        weights_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.reload_url = reload_url
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.workers = workers
        self.api_key = api_key
        self.vocab_size = len(tokenizer)

    # ------------------------------------------------------------------ Engine protocol
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.workers, len(requests))) as pool:
            return list(pool.map(lambda r: self._one(r, sampling), requests))

    def load_weights(self, source: WeightSource) -> None:
        """The weight-update hook: live weights are saved as an HF checkpoint under ``weights_dir/step-NNNNNN``
        (a filesystem the server shares), then the server is asked to load it (POST ``{"path": …}`` to
        ``reload_url``); a checkpoint directory is sent as it is."""
        if not self.reload_url:
            log.warning("rollout.remote.reload_url is not set: the server keeps sampling from its old weights")
            return
        path = Path(source) if not isinstance(source, PolicyWeights) else self._save(source)
        request = urllib.request.Request(self.reload_url, data=json.dumps({"path": str(path)}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
            resp.read()

    def _save(self, weights: PolicyWeights) -> Path:
        if self.weights_dir is None:
            raise RemoteEngineError("a remote engine that follows training weights needs a weights_dir to save them")
        path = self.weights_dir / f"step-{weights.version:06d}"
        weights.model.save_pretrained(path, state_dict=weights.full_state_dict())
        self.tokenizer.save_pretrained(path)
        return path

    # ------------------------------------------------------------------ internals
    def _payload(self, req: GenerationRequest, sampling: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(req.prompt_ids),
            "max_tokens": req.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": self.top_logprobs,
            "stop": list(req.stop),
            "include_stop_str_in_output": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if req.seed is not None:
            body["seed"] = req.seed % (2**31)
        return body

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        delay = self.retry_backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode())
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                if exc.code not in TRANSIENT_HTTP or attempt == self.max_retries:
                    raise RemoteEngineError(f"HTTP {exc.code} from {self.url}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == self.max_retries:
                    raise RemoteEngineError(f"cannot reach {self.url}: {exc}") from None
            log.warning("transient error from %s (attempt %d); retrying in %.1f s", self.url, attempt + 1, delay)
            time.sleep(delay)
            delay *= 2
        raise RemoteEngineError("unreachable")  # pragma: no cover

    def _one(self, req: GenerationRequest, sampling: SamplingParams) -> GenerationResult:
        try:
            choice = self._post(self._payload(req, sampling))["choices"][0]
            return self._parse(choice, req)
        except Exception as exc:  # one row's failure is that row's result
            return GenerationResult([], [], [], "error", error=f"{type(exc).__name__}: {exc}")

    def _token_id(self, token: str) -> int:
        if token.startswith(TOKEN_ID_PREFIX):
            return int(token[len(TOKEN_ID_PREFIX) :])
        ids = self.encode(token)
        if len(ids) != 1:
            raise RemoteEngineError(f"server returned token text {token!r}; enable return_tokens_as_token_ids")
        return ids[0]

    def _parse(self, choice: dict[str, Any], req: GenerationRequest) -> GenerationResult:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        token_ids = [self._token_id(t) for t in tokens]
        logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
        tops = lp.get("top_logprobs") or [{}] * len(tokens)
        entropies = [topk_entropy_estimate(list(top.values()), self.vocab_size) for top in tops]
        finish = choice.get("finish_reason") or "length"
        stop_reason = choice.get("stop_reason")
        eos = self.eos_token_id
        if finish == "stop" and token_ids and eos is not None and token_ids[-1] == eos:
            return GenerationResult(token_ids, logprobs, entropies, "eos", None, True)
        if finish == "stop":
            matched = stop_reason if isinstance(stop_reason, str) else next(
                (s for s in req.stop if self.decode(token_ids).endswith(s)), None)
            return GenerationResult(token_ids, logprobs, entropies, "stop" if matched else "eos", matched, True)
        return GenerationResult(token_ids, logprobs, entropies, "length", None, True)
