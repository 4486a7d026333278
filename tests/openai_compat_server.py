"""A small OpenAI-compatible completions server over a transformers model, for testing the remote engine.

It implements the subset of vLLM's ``/v1/completions`` that ``RemoteEngine`` uses — token-id prompts,
per-request seeds, stop strings kept in the output, top-k log-probs, ``token_id:<id>`` tokens — over real
HTTP on 127.0.0.1, with the tiny model doing the generation, and the ``rollout.remote.reload_url`` contract:
``POST /reload {"path": …, "version": …}`` loads that HF checkpoint before the next completion.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from json_server import JsonServer

from aepo_core.interfaces import GenerationRequest, SamplingParams
from infra.engines.hf import HFEngine


class CompletionsServer(JsonServer):
    def __init__(self, engine: HFEngine, fail_first: int = 0, missing_logprob: bool = False,
                 fault: Callable[[CompletionsServer], str | None] | None = None) -> None:
        """``fail_first``: the first n requests answer 503 (a server warming up); ``fault``: asked at every
        completion (``completions`` already counts it), a message makes the server answer HTTP 500 with it (every
        time: a server dead inside, e.g. out of GPU memory; every n-th: a transient fault that a retry gets past;
        once ``reloads`` holds a version: a server that dies mid-run); ``missing_logprob``: answer with the last
        token's log-prob as null (a server bug)."""
        super().__init__(self.handle)
        self.engine = engine
        self.fail_first = fail_first
        self.fault = fault
        self.received = 0  # requests of any route
        self.completions = 0  # completion requests received, failed ones included
        self.failures = 0  # of which answered with a fault
        self.missing_logprob = missing_logprob
        self.reloads: list[dict[str, Any]] = []  # every /reload body, in order
        self.lock = threading.Lock()  # one generation at a time (the model is shared)

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.received += 1
            if self.received <= self.fail_first:
                return 503, {"error": "warming up"}
        if path == "/reload":
            return self._reload(body)
        if path != "/v1/completions":
            return 404, {"error": f"no route {path}"}
        with self.lock:
            self.completions += 1
            fault = self.fault(self) if self.fault is not None else None
            if fault is not None:
                self.failures += 1
                return 500, {"error": fault}
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return 400, {"error": "prompt must be a list of token ids"}
        sampling = SamplingParams(body.get("temperature", 1.0), body.get("top_p", 1.0), body.get("top_k", 0))
        req = GenerationRequest(prompt, int(body["max_tokens"]), tuple(body.get("stop", [])), seed=body.get("seed"))
        with self.lock:
            (res,) = self.engine.generate([req], sampling)
            tops = self._top_logprobs(prompt, res.token_ids, sampling.temperature, int(body.get("logprobs") or 0))
        logprobs: list[float | None] = list(res.logprobs)
        if self.missing_logprob and logprobs:
            logprobs[-1] = None
        finish = "length" if res.finish_reason == "length" else "stop"
        choice = {
            "index": 0,
            "text": self.engine.decode(res.token_ids),
            "finish_reason": finish,
            "stop_reason": res.stop_string,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in res.token_ids],
                "token_logprobs": logprobs,
                "top_logprobs": tops,
            },
        }
        return 200, {"id": "cmpl-test", "object": "text_completion", "choices": [choice]}

    def _reload(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint directory at ``body["path"]`` (a filesystem this server shares with the trainer)."""
        with self.lock:
            try:
                self.engine.load_weights(body["path"])
            except (KeyError, OSError, ValueError, RuntimeError) as e:  # RuntimeError: ModelLoadError
                return 400, {"error": f"cannot reload {body.get('path')!r}: {e}"}
            self.reloads.append(body)
        return 200, {"loaded": body["path"], "version": body.get("version")}

    @torch.no_grad()
    def _top_logprobs(self, prompt: list[int], tokens: list[int], temperature: float, k: int) -> list[dict[str, float]]:
        if not tokens or k <= 0:
            return [{} for _ in tokens]
        ids = torch.tensor([prompt + tokens])
        logits = self.engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        top = torch.log_softmax(logits, -1).topk(k, dim=-1)
        return [
            {f"token_id:{int(i)}": float(v) for i, v in zip(idx, val, strict=True)}
            for idx, val in zip(top.indices, top.values, strict=True)
        ]
