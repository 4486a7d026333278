"""Client of an OpenAI-compatible completions server (vLLM ``vllm serve``, SGLang): token ids in and out.

vLLM cannot share a virtualenv with our packages (it pins its own transformers), so it runs as a separate server
process reached over HTTP: one the run manages itself (``rollout.engine: vllm``,
:mod:`infra.engines.vllm_server`) or one someone else runs (``rollout.engine: remote``).  The prompt is sent as
token ids (never re-tokenized text), one request per row, all rows of a round at once from a thread pool over one
keep-alive connection pool (the server batches concurrent requests itself; a connection per request cost a TCP
handshake and a server-side accept each), asking for

- ``logprobs = top_k``: the sampled token's log-prob and the top-k alternatives per position, from which the
  entropy is *estimated* (top-k plus the tail mass spread uniformly; flagged ``entropy_is_estimate``);
- ``return_tokens_as_token_ids``: tokens come back as ``token_id:<id>`` so no detokenize/retokenize drift;
- ``include_stop_str_in_output``: the transcript keeps the closing tool tag the protocol needs.

The server matches stop strings in the text it generates, not in the prompt; a stop string split across two
segments by the rollout's segment cap is found and cut by the rollout scheduler.

For AEPO start vLLM with ``--logprobs-mode processed_logprobs`` so log-probs and entropies are those of the
temperature-scaled distribution that was sampled (the default reports the raw model distribution).

**Weights.** After every update the trainer's weights are saved as an HF checkpoint under
``weights_dir/step-NNNNNN`` (written under a temporary name and renamed; the previous export is removed once the
server has loaded the new one) and handed to a :class:`WeightReceiver`: the managed vLLM server (reload in place,
label the version, verify it) or a plain reload URL.  Where the receiver reports versions, every ``generate``
reads the served version before and after its requests and stamps each result with it
(:attr:`~aepo_core.interfaces.GenerationResult.weight_version`): a result whose version is not the last one
loaded was sampled by stale weights, and the runtime counts it (and fails the rollout in strict mode).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from safetensors.torch import save_file

from aepo_core.config import RemoteEngineConfig
from aepo_core.entropy import published_token_entropy, topk_entropy_estimate
from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.atomic import atomic_dir
from infra.engines.weights import PolicyWeights, WeightSource
from infra.ranks import Ranks

log = logging.getLogger(__name__)

TOKEN_ID_PREFIX = "token_id:"
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


class RemoteEngineError(RuntimeError):
    pass


def export_hf_checkpoint(model: Any, tokenizer: Any, path: Path,
                         state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """``model`` (or the gathered ``state_dict``) as an HF checkpoint directory at ``path``, atomically.

    Tied weights are written under both names: vLLM 0.32's in-place reload materialises the layers anew, which
    unties ``lm_head`` from ``embed_tokens``, and a checkpoint that names only the embedding (what
    ``save_pretrained`` writes for a tied model) leaves ``lm_head`` at its old values; measured on SmolLM2 after
    scaling the embedding by 1.2, the server's log-probs were off by 1.6 nats.  With both names, the loader
    either skips the alias (tie intact) or fills ``lm_head`` with the same values.
    """
    full = model.state_dict() if state_dict is None else state_dict
    if not full:
        raise RemoteEngineError(f"{path}: no weights to export (under ZeRO-3 a rank other than 0 holds only "
                                "partitions)")
    state = {k: v.detach().to("cpu").contiguous() for k, v in full.items()}
    if model.config.tie_word_embeddings:
        embed = model.get_input_embeddings()  # found by module, not storage: ZeRO-3 partitions share empty ones
        name = next(n for n, m in model.named_modules() if m is embed) + ".weight"
        state["lm_head.weight"] = state[name]
    seen: dict[int, str] = {}
    for key, tensor in list(state.items()):  # safetensors refuses shared storage: clone the aliases
        if tensor.data_ptr() in seen:
            state[key] = tensor.clone()
        seen[tensor.data_ptr()] = key
    with atomic_dir(path, replace=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return path


class WeightReceiver(Protocol):
    """What a server offers for weight sync: load a checkpoint directory, and (optionally) say what it serves."""

    def reload(self, weights_dir: Path, version: str) -> None:
        """Serve the HF checkpoint at ``weights_dir`` from the next request on, labelled ``version``."""
        ...

    def weight_version(self) -> str | None:
        """The label of the weights being served; None when the server does not track versions."""
        ...


class ReloadEndpoint:
    """A server someone else runs (``rollout.remote.reload_url``): the checkpoint path is POSTed as
    ``{"path": …, "version": …}``; it reports no versions."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def reload(self, weights_dir: Path, version: str) -> None:
        request = urllib.request.Request(self.url, data=json.dumps({"path": str(weights_dir), "version": version}
                                                                    ).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as e:  # the server's own words name the cause: keep them
            raise RemoteEngineError(f"{self.url} refused to reload {weights_dir} (version {version}): HTTP {e.code}: "
                                    f"{e.read().decode(errors='replace')[:500]}") from None
        except OSError as e:
            raise RemoteEngineError(f"cannot reach {self.url} to reload {weights_dir}: {e}") from None

    def weight_version(self) -> str | None:
        return None


@dataclass(frozen=True)
class HTTPOptions:
    """How a :class:`RemoteEngine` talks to its server (not part of the experiment's config)."""

    timeout_s: float = 600.0
    max_retries: int = 3
    """Retries of a transient failure (an HTTP 408/429/5xx, a transport error), with a doubling back-off."""
    retry_backoff_s: float = 1.0
    workers: int = 64
    """Concurrent requests (one thread and one keep-alive connection each)."""
    api_key: str | None = None


class RemoteEngine:
    """Engine protocol over HTTP to the server of ``section`` (its ``url``, ``model`` and ``top_logprobs``; the
    caller resolves ``model`` and builds the ``receiver`` from the rest, see :mod:`infra.engines.registry`);
    ``tokenizer`` is the policy's tokenizer (for encode/decode of results)."""

    def __init__(
        self,
        section: RemoteEngineConfig,
        tokenizer: Any,
        *,
        receiver: WeightReceiver | None = None,
        weights_dir: str | os.PathLike[str] | None = None,
        loaded_version: str | None = None,
        served_export: str | os.PathLike[str] | None = None,
        http: HTTPOptions | None = None,
        shared_by: Ranks | None = None,
    ) -> None:
        """``shared_by``: the data-parallel ranks that sample from this one server (``rollout.engine=remote`` under a
        launcher): rank 0 alone exports the weights and has the server reload them, every rank waits until it
        has (a barrier). None: the server is this process's alone (a managed vLLM server, one per rank)."""
        if not section.url or not section.model:
            raise RemoteEngineError(f"a remote engine needs a server URL and a model name (got {section.url!r}, "
                                    f"{section.model!r})")
        self.receiver = receiver
        self.shared_by = shared_by or Ranks()
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.url = section.url.rstrip("/") + "/v1/completions"
        self.model = section.model
        self.tokenizer = tokenizer
        self.top_logprobs = section.top_logprobs
        self.options = http = http or HTTPOptions()
        self.vocab_size = len(tokenizer)
        headers = {"Authorization": f"Bearer {http.api_key}"} if http.api_key else {}
        # One pool of keep-alive connections shared by the request threads (httpx.Client is thread-safe).
        self._http = httpx.Client(headers=headers, timeout=http.timeout_s,
                                  limits=httpx.Limits(max_connections=http.workers,
                                                      max_keepalive_connections=http.workers))
        self._loaded_version = loaded_version  # the version the server serves now, when known
        # The export of ours the server serves now (``served_export``: the caller's initial one): removed once the
        # server loads another, and on close (an export of SmolLM2 is ~650 MB; the checkpoints hold the policy).
        self._exported: Path | None = Path(served_export) if served_export is not None else None
        self.serving: Path | None = self._exported
        """The weights directory the server serves now (an export of ours or a checkpoint sent as it is), when this
        engine gave it: what a restarted server must load."""

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
        before = self._served_version()
        with ThreadPoolExecutor(max_workers=min(self.options.workers, len(requests))) as pool:
            results = list(pool.map(lambda r: self._one(r, sampling), requests))
        after = self._served_version()
        if before is None and after is None:
            return results
        # A version change during the requests means some rows may have been sampled by the old weights: stamp
        # them all with the older label (``before``) so nothing stale passes as current.
        version = before if before is not None else after
        if before != after:
            log.warning("the server's weight version changed from %s to %s during a generate call", before, after)
        return [dataclasses.replace(r, weight_version=version) for r in results]

    def load_weights(self, source: WeightSource) -> None:
        """The weight-update hook: live weights are exported as an HF checkpoint under ``weights_dir/step-NNNNNN``
        (a filesystem the server shares), then handed to the receiver; a checkpoint directory is sent as it is.

        A server shared by several ranks is handed the weights once, by rank 0, which holds them whole (under
        ZeRO-3 the gather is a collective every rank takes part in, and only rank 0 receives the full tensors; a
        rank > 0 exporting its own would send the server empty partitions); every rank then waits at a barrier
        so that none samples from the server before it serves the new weights."""
        if self.receiver is None:
            log.warning("this remote engine has no weight receiver (rollout.remote.reload_url is not set): the "
                        "server keeps sampling from its old weights")
            return
        if isinstance(source, PolicyWeights):
            state = source.full_state_dict()  # under ZeRO-3 a collective: every rank calls it
            version = str(source.version)
            path = self._export(source, state) if self.shared_by.is_main else None
        else:
            path, version = Path(source), Path(source).name
        if self.shared_by.is_main:
            assert path is not None
            self.receiver.reload(path, version)
            if self._exported is not None and self._exported != path:
                shutil.rmtree(self._exported, ignore_errors=True)  # the server no longer reads it
            self._exported = path if isinstance(source, PolicyWeights) else None
            self.serving = path
        self.shared_by.barrier()
        self._loaded_version = version

    @property
    def weight_version(self) -> str | None:
        return self._loaded_version

    def release(self) -> None:
        return None  # the server's prefix cache is its own (and is reset at every weight sync)

    def close(self) -> None:
        self._http.close()
        if self._exported is not None:
            shutil.rmtree(self._exported, ignore_errors=True)
            self._exported = None
        self.serving = None

    def _export(self, weights: PolicyWeights, state: Mapping[str, torch.Tensor] | None) -> Path:
        if self.weights_dir is None:
            raise RemoteEngineError("a remote engine that follows training weights needs a weights_dir to save them")
        path = self.weights_dir / f"step-{weights.version:06d}"
        export_hf_checkpoint(weights.model, self.tokenizer, path, state)
        return path

    def _served_version(self) -> str | None:
        return self.receiver.weight_version() if self.receiver is not None else None

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
        delay = self.options.retry_backoff_s
        for attempt in range(self.options.max_retries + 1):
            try:
                resp = self._http.post(self.url, json=body)
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code not in TRANSIENT_HTTP or attempt == self.options.max_retries:
                    raise RemoteEngineError(f"HTTP {resp.status_code} from {self.url}: {resp.text[:500]}")
            except httpx.TransportError as exc:
                if attempt == self.options.max_retries:
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
        logprobs = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or ([{}] * len(tokens) if not self.top_logprobs else [])
        for name, values in (("log-prob", logprobs), ("top log-probs", tops)):
            if len(values) != len(tokens) or None in values:
                at = values.index(None) if None in values else min(len(values), len(tokens))
                raise RemoteEngineError(f"the server sent no {name} of token {at + 1} of {len(tokens)}: a sampled "
                                        "token's probability is never assumed")
        logprobs = [float(x) for x in logprobs]
        entropies = [topk_entropy_estimate(list(top.values()), self.vocab_size) for top in tops]
        # the published code's terms: its top-10 of the server's top log-probs (ask for at least 10) and the sampled
        published = [published_token_entropy(list(top.values()), lp_t, self.vocab_size)
                     for top, lp_t in zip(tops, logprobs, strict=True)]
        finish = choice.get("finish_reason") or "length"
        stop_reason = choice.get("stop_reason")
        eos = self.eos_token_id
        if finish == "stop" and token_ids and eos is not None and token_ids[-1] == eos:
            finish, matched = "eos", None
        elif finish == "stop":
            matched = stop_reason if isinstance(stop_reason, str) else next(
                (s for s in req.stop if self.decode(token_ids).endswith(s)), None)
            finish = "stop" if matched else "eos"
        else:
            finish, matched = "length", None
        return GenerationResult(token_ids, logprobs, entropies, finish, matched, True, published_entropies=published)
