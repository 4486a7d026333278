"""RemoteEngine against a real HTTP server implementing the vLLM completions subset over the tiny model."""

from __future__ import annotations

import pytest
from openai_compat_server import CompletionsServer

from aepo_core.config import RemoteEngineConfig, RolloutConfig
from aepo_core.interfaces import GenerationRequest, SamplingParams
from aepo_core.protocol import STOP_STRINGS
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from infra.engines.hf import HFEngine
from infra.engines.remote import HTTPOptions, ReloadEndpoint, RemoteEngine, RemoteEngineError


@pytest.fixture(scope="module")
def server(tiny_policy):
    model, tokenizer = tiny_policy
    with CompletionsServer(HFEngine(model, tokenizer, seed=0)) as srv:
        yield srv


def test_tokens_match_the_local_engine_and_entropy_is_an_estimate(server, tiny_policy, tiny_engine):
    _model, tokenizer = tiny_policy
    remote = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny", top_logprobs=20), tokenizer)
    prompt = tiny_engine.apply_chat_template("What is the capital of Brotryx?")
    reqs = [GenerationRequest(prompt, 12, STOP_STRINGS, seed=s) for s in (1, 2, 3)]
    sampling = SamplingParams(temperature=1.0)
    got = remote.generate(reqs, sampling)
    want = tiny_engine.generate(reqs, sampling)
    for g, w in zip(got, want, strict=True):
        assert g.error is None
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.entropy_is_estimate and not w.entropy_is_estimate
        # The uniform-tail estimate never undershoots the true entropy (beyond float noise).
        assert all(e >= t - 1e-3 for e, t in zip(g.entropies, w.entropies, strict=True))
    assert all("token_id" not in str(r["prompt"]) for r in server.requests)  # ids went as ids


def test_transient_errors_are_retried_and_bad_rows_fail_alone(tiny_policy, tiny_engine):
    model, tokenizer = tiny_policy
    with CompletionsServer(HFEngine(model, tokenizer), fail_first=2) as srv:
        remote = RemoteEngine(RemoteEngineConfig(url=srv.url, model="tiny"), tokenizer,
                              http=HTTPOptions(retry_backoff_s=0.01, workers=1))
        (res,) = remote.generate([GenerationRequest([1, 2, 3], 4, (), seed=0)], SamplingParams())
        assert res.error is None and len(res.token_ids) == 4
        assert len(srv.requests) == 3
    dead = RemoteEngine(RemoteEngineConfig(url="http://127.0.0.1:9", model="tiny"), tokenizer,
                        http=HTTPOptions(max_retries=0))
    (res,) = dead.generate([GenerationRequest([1, 2], 4, ())], SamplingParams())
    assert res.finish_reason == "error" and "cannot reach" in (res.error or "")


def test_a_missing_log_prob_is_an_error_not_zero(tiny_policy):
    """A null log-prob (or null top log-probs) for a sampled token fails that row, naming the position; it used to
    become log-prob 0.0 (probability 1) and an entropy of log V."""
    model, tokenizer = tiny_policy
    with CompletionsServer(HFEngine(model, tokenizer), missing_logprob=True) as srv:
        remote = RemoteEngine(RemoteEngineConfig(url=srv.url, model="tiny", top_logprobs=5), tokenizer)
        (res,) = remote.generate([GenerationRequest([1, 2, 3], 4, (), seed=0)], SamplingParams())
    assert res.finish_reason == "error" and "log-prob of token 4 of 4" in (res.error or "")


def test_scheduler_runs_on_the_remote_engine(server, tiny_policy, tiny_engine):
    _, tokenizer = tiny_policy
    remote = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny"), tokenizer)
    cfg = RolloutConfig(mode="aepo", k=3, initial_rollouts=1, max_response_tokens=24, max_tool_calls=1)
    res = RolloutScheduler(remote, {}, cfg).run(
        [Question("q0", tiny_engine.apply_chat_template("Say something."))], seed=3
    )
    tree = res.trees[0]
    assert len(tree.leaves) == 3
    for leaf in tree.leaves:
        assert len(tree.response_ids(leaf)) <= 24
        assert all(n.entropy_is_estimate for n in tree.path(leaf) if n.kind == "model")


def test_weight_sync_hook_posts_the_checkpoint_path(tiny_policy):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            return

        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/reload"
        engine = RemoteEngine(RemoteEngineConfig(url="http://127.0.0.1:9", model="tiny"), tiny_policy[1],
                              receiver=ReloadEndpoint(url))
        engine.load_weights("/shared/ckpt")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert received == [{"path": "/shared/ckpt", "version": "ckpt"}]
    assert engine.weight_version == "ckpt"


def test_a_round_goes_concurrently_over_keep_alive_connections(server, tiny_policy, tiny_engine):
    """Two rounds of 8 rows with 4 request threads: at most 4 TCP connections, reused across rounds (a new
    connection per request would open 16)."""
    _, tokenizer = tiny_policy
    remote = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny"), tokenizer, http=HTTPOptions(workers=4))
    server.connections.clear()
    prompt = tiny_engine.apply_chat_template("Count to three.")
    for _ in range(2):
        got = remote.generate([GenerationRequest(prompt, 4, (), seed=s) for s in range(8)], SamplingParams())
        assert all(r.error is None and r.weight_version is None for r in got)
    assert 1 <= len(server.connections) <= 4
    remote.close()


def test_a_refused_reload_is_one_error_in_the_servers_words(tiny_policy, tmp_path):
    """A reload the server refuses (here: a checkpoint folder it cannot read) stops the run with the server's
    reason and the folder, not a bare ``HTTP Error 400: Bad Request``; the served weights are unchanged."""
    model, tokenizer = tiny_policy
    with CompletionsServer(HFEngine(model, tokenizer)) as srv:
        remote = RemoteEngine(RemoteEngineConfig(url=srv.url, model="tiny"), tokenizer,
                              receiver=ReloadEndpoint(srv.url + "/reload"), weights_dir=tmp_path)
        with pytest.raises(RemoteEngineError, match=r"refused to reload .*missing \(version missing\): HTTP 400: "
                                                    r".*no safetensors weights"):
            remote.load_weights(tmp_path / "missing")
        assert srv.reloads == [] and remote.weight_version is None
