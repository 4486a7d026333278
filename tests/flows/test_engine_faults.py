"""An engine fault never becomes data (issue 50 §1): a request the engine cannot answer after its own retries fails
the rollout or evaluation with one line naming the engine, the error and the count; nothing is scored, stored or
trained on. Transient faults that the engine's retries get past change nothing.

The server is the suite's OpenAI-compatible one over tiny-random (tests/openai_compat_server.py), told to fail.
Before the fix, ``aepo eval`` against a server answering every completion with HTTP 500 exited 0 after printing
Pass@1 0.000 and writing the evaluation's Parquet: every failed leaf was scored as a wrong answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from openai_compat_server import CompletionsServer
from test_cli import TINY, invoke, sets

pytestmark = pytest.mark.slow  # runs flows against a server

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def remote(url: str) -> list[str]:
    """The tiny config sampling from the server at ``url`` (its top-k entropy estimate, not exact entropies)."""
    return sets("rollout.engine=remote", f"rollout.remote.url={url}", f"rollout.remote.reload_url={url}/reload",
                "rollout.exact_entropy=false", "eval.max_questions=2", "eval.n_samples=2")


@pytest.fixture
def served(tiny_cfg: Any) -> Any:
    """A fresh tiny-random policy for a server (reloads change its weights in place)."""
    from infra.engines.hf import HFEngine
    from infra.models import load_policy

    model, tokenizer = load_policy(tiny_cfg)
    return HFEngine(model, tokenizer, seed=0)


def test_an_engine_failing_every_request_ends_the_evaluation_with_one_named_error(
        prefect_harness: Any, served: Any, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with CompletionsServer(served, fault=lambda _: OOM) as srv:
        result = invoke("eval", "-c", TINY, "--runs-dir", str(runs), *remote(srv.url), "--run-name", "dead")
    assert result.exit_code == 1, result.output
    line = next(s for s in result.stderr.splitlines() if s.startswith("error:"))
    assert "rollout.engine=remote" in line and srv.url in line and "HTTP 500" in line and OOM in line, line
    assert "4 of 4 requests" in line, line  # 2 questions × 2 samples, every one failed (after the engine's retries)
    assert "Traceback" not in result.stderr
    assert not list(runs.rglob("*.parquet")), "a failed evaluation stored results"
    assert "0.000" not in result.stdout  # no Pass@1 table of failures


def test_transient_engine_faults_are_retried_and_change_nothing(prefect_harness: Any, served: Any,
                                                                 tmp_path: Path) -> None:
    """Every third completion answers HTTP 500 once: the engine retries it, and the evaluation asks the server for
    exactly what it asks a clean server (the same prompts, seeds and lengths; each segment's prompt holds every token
    sampled before it, so equal requests mean equal trajectories) and stores the same per-question results."""
    import json

    import pandas as pd

    tables, asked = {}, {}
    for name, every in (("clean", 0), ("flaky", 3)):
        runs = tmp_path / name

        def fault(srv: CompletionsServer, n: int = every) -> str | None:
            return "transient fault" if n and srv.completions % n == 0 else None

        with CompletionsServer(served, fault=fault) as srv:
            result = invoke("eval", "-c", TINY, "--runs-dir", str(runs), *remote(srv.url), "--run-name", name)
            assert result.exit_code == 0, result.output
        assert (srv.failures > 0) == (every > 0), srv.failures
        asked[name] = sorted({json.dumps(r, sort_keys=True) for r in srv.requests})
        (part,) = runs.glob(f"eval/{name}/*.parquet")
        tables[name] = pd.read_parquet(part).drop(columns=["eval_run_id", "eval_run_name"])
    assert len(asked["clean"]) > 4 and asked["flaky"] == asked["clean"]
    pd.testing.assert_frame_equal(tables["clean"], tables["flaky"])


def train(runs: Path, url: str, *extra: str) -> Any:
    return invoke("train", "-c", TINY, "--runs-dir", str(runs), *remote(url), *sets("train.steps=2"), *extra)


def test_a_server_dying_mid_training_stops_the_run_and_resume_continues_exactly(
        prefect_harness: Any, tiny_cfg: Any, tmp_path: Path) -> None:
    """The server dies (every completion answers 500) once it has loaded the weights of update 1: step 2's rollout
    fails after the task's retries, the run exits 1 with the named error, nothing of step 2 is stored; ``--resume``
    on a healthy server reloads it with the step-1 checkpoint and ends on the weights of a run that never failed."""
    from safetensors.torch import load_file

    from infra.engines.hf import HFEngine
    from infra.models import load_policy

    def server(fault: Any = None) -> CompletionsServer:
        model, tokenizer = load_policy(tiny_cfg)
        return CompletionsServer(HFEngine(model, tokenizer, seed=0), fault=fault)

    with server() as srv:
        straight = train(tmp_path / "straight", srv.url)
    assert straight.exit_code == 0, straight.output
    runs = tmp_path / "faulty"
    with server(fault=lambda s: OOM if s.reloads else None) as srv:
        failed = train(runs, srv.url)
    assert failed.exit_code == 1, failed.output
    assert "rollout.engine=remote failed" in failed.stderr and OOM in failed.stderr, failed.stderr
    (folder,) = (runs / "checkpoints" / "tiny").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]
    assert [p.name for p in sorted((runs / "trajectories").rglob("*.parquet"))] == ["step-000001.parquet"]
    with server() as srv:
        resumed = train(runs, srv.url, "--resume")
        assert srv.reloads[0]["version"] == "1", srv.reloads  # the resumed weights first, then step 2's
    assert resumed.exit_code == 0, resumed.output
    weights = {name: load_file(str(next((d / "checkpoints" / "tiny").glob("*/step-000002")) / "model" /
                                    "model.safetensors")) for name, d in (("straight", tmp_path / "straight"),
                                                                          ("resumed", runs))}
    for key, tensor in weights["straight"].items():
        assert torch.equal(tensor, weights["resumed"][key]), key
