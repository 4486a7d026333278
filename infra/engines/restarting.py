"""The run's own vLLM server brought back when its process dies (issue 50 §1).

A managed server can die mid-run — a crash, the OOM killer, a GPU fault. Its requests then fail (the remote
engine's HTTP retries cannot reach it), and before this the rollout failed with :class:`~aepo_core.rollout.
scheduler.EngineFailure`: a Prefect task retry against a server that was gone, then the whole run, to be resumed
by hand from its last checkpoint. :class:`RestartingEngine` restarts the server (on the same port, with the weights
it served last, labelled with their version) and sends the failed requests again with their own seeds; the
``rollout.vllm.max_restarts`` budget bounds it, past which the failure goes up as before. A server that is alive
keeps its errors: they are the requests' own, and the scheduler fails the rollout on them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.engines.remote import RemoteEngine
from infra.engines.vllm_server import VLLMServer, VLLMServerError
from infra.engines.weights import WeightSource

log = logging.getLogger(__name__)


class RestartingEngine:
    """``remote`` over the run's ``server``, which is restarted at most ``max_restarts`` times when it has died."""

    def __init__(self, remote: RemoteEngine, server: VLLMServer, max_restarts: int) -> None:
        self.remote = remote
        self.server = server
        self.max_restarts = max_restarts
        self.restarts = 0
        self._restarting = threading.Lock()  # generate calls may run concurrently (rollout.inflight_requests)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        seen = self.restarts
        results = self._attempt(requests, sampling)
        failed = [i for i, r in enumerate(results) if r.finish_reason == "error"]
        while failed and self._restarted_if_dead(f"{len(failed)} of {len(requests)} requests failed", seen):
            seen = self.restarts
            again = self._attempt([requests[i] for i in failed], sampling)
            for i, result in zip(failed, again, strict=True):
                results[i] = result
            failed = [i for i in failed if results[i].finish_reason == "error"]
        return results

    def _attempt(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        """The remote engine's results; a dead server's control endpoints (the weight version asked before and
        after the requests) make every request failed, not an exception."""
        try:
            return self.remote.generate(requests, sampling)
        except VLLMServerError as exc:
            if self.server.running:
                raise
            return [GenerationResult([], [], [], "error", error=f"VLLMServerError: {exc}") for _ in requests]

    def _restarted_if_dead(self, why: str, seen: int | None = None) -> bool:
        """Restart the server if its process has died and the budget allows; whether it was restarted, by this call
        or, for a caller whose requests were sent when ``seen`` restarts had been made, by a concurrent one (its
        failed requests then go again to the new server: a death restarts the server once, however many calls
        were in flight)."""
        with self._restarting:
            if seen is not None and self.restarts > seen:
                return True
            return self._restart_if_dead(why)

    def _restart_if_dead(self, why: str) -> bool:
        if self.server.running:
            return False
        if self.restarts >= self.max_restarts:
            log.error("the vLLM server died again (%s) and rollout.vllm.max_restarts=%d restarts are spent",
                      why, self.max_restarts)
            return False
        served, version = self.remote.serving, self.remote.weight_version
        if served is None or not served.is_dir():
            raise VLLMServerError(f"the vLLM server died ({why}) and the weights it served are gone ({served})")
        self.restarts += 1
        log.warning("the vLLM server died (%s; its last lines:\n%s)\nrestarting it (%d of %d) with %s, weight "
                    "version %s", why, self.server.last_log_lines(), self.restarts, self.max_restarts, served, version)
        self.server.restart(served)
        if version is not None:
            self.server.control.label(version)
        return True

    # ------------------------------------------------------------------ the rest of the engine protocol
    def encode(self, text: str) -> list[int]:
        return self.remote.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.remote.decode(token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.remote.eos_token_id

    def load_weights(self, source: WeightSource) -> None:
        self._restarted_if_dead("before a weight sync")  # (a dead server cannot reload: bring it back first)
        self.remote.load_weights(source)

    @property
    def weight_version(self) -> str | None:
        return self.remote.weight_version

    def release(self) -> None:
        self.remote.release()

    def close(self) -> None:
        self.remote.close()
