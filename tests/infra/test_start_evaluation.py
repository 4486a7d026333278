"""One evaluation of a shared start (issue 52, item 2): stored under the weights' digest and the settings that change
the result, read back by another run with the same start, never used when damaged, computed once under concurrency."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from infra.config_files import load_config
from infra.run.evaluation import EvalReport, EvalSource, evaluate_dataset
from infra.run.runtime import PolicyRuntime, build_runtime
from infra.run.start_evaluation import MANIFEST, QUESTIONS, SharedStart, StartEvalStore, start_eval_key

REPO = Path(__file__).resolve().parents[2]
DATASET = "synthetic:test"


def _runtime(model_cache: Path, runs: Path, *sets: str) -> PolicyRuntime:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"model.cache_dir={model_cache}", "eval.max_questions=2",
                                                        *sets])
    return build_runtime(cfg, runs)


class Counted:
    """An evaluation that counts how often it sampled."""

    def __init__(self, runtime: PolicyRuntime) -> None:
        self.runtime, self.calls = runtime, 0

    def __call__(self) -> EvalReport:
        self.calls += 1
        cfg = self.runtime.cfg
        return evaluate_dataset(self.runtime, DATASET, self.runtime.load_rows(DATASET), cfg.eval, cfg.seed, 2)


def _evaluate(runtime: PolicyRuntime, runs: Path, run_id: str) -> tuple[Counted, EvalReport, str | None, str]:
    compute = Counted(runtime)
    source = EvalSource(run_id, f"name-{run_id}", None, 0, "start")
    out = SharedStart.of(runtime, runs).evaluate(DATASET, source, "start",
                                                 compute)
    return compute, out.report, out.reused_from.run_id if out.reused_from else None, out.key


@pytest.fixture(scope="module")
def first(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PolicyRuntime, EvalReport, str]:
    runs = tmp_path_factory.mktemp("runs")
    runtime = _runtime(model_cache, runs)
    compute, report, reused, key = _evaluate(runtime, runs, "run-a")
    assert compute.calls == 1 and reused is None
    return runs, runtime, report, key


def test_the_same_start_is_read_back_not_sampled(first, model_cache: Path) -> None:
    runs, _, report, key = first
    # Another run (its own runtime, another rollout mode and branching: the arms of a sweep) from the same weights.
    other = _runtime(model_cache, runs, "rollout.mode=independent", "rollout.branch_penalty=0", "algorithm.loss=dapo")
    compute, again, reused, key2 = _evaluate(other, runs, "run-b")
    assert compute.calls == 0 and reused == "run-a" and key2 == key
    assert again.metrics() == report.metrics() and again.per_question_pass1 == report.per_question_pass1
    assert again.answers == report.answers and again.outcomes == report.outcomes
    assert again.by_family == report.by_family and again.key == report.key and again.traced is None


@pytest.mark.parametrize("change", ["eval.n_samples=1", "eval.temperature=0.9", "seed=1", "eval.max_questions=1",
                                    "model.init_seed=1", "rollout.max_response_tokens=64", "reward.kind=em",
                                    "tools.search.top_k=2"])
def test_a_changed_setting_or_weights_evaluate_themselves(first, model_cache: Path, change: str) -> None:
    runs, _, _, key = first
    if change.startswith("eval.n_samples"):
        change = f"{change} eval.pass_k=1"
    runtime = _runtime(model_cache, runs, *change.split())
    compute = Counted(runtime)
    rows = runtime.load_rows(DATASET)[: runtime.cfg.eval.max_questions]
    shared = SharedStart.of(runtime, runs)
    assert start_eval_key(runtime, DATASET, rows, shared.weights, shared.prompt).name != key, change
    if change in ("seed=1", "model.init_seed=1"):  # two of them evaluated end to end (each samples)
        out = shared.evaluate(DATASET, EvalSource("run-c", "c", None, 0, "start"), "start", compute)
        assert compute.calls == 1 and out.reused_from is None


def test_a_damaged_entry_is_evaluated_again_with_a_warning(model_cache: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    runtime = _runtime(model_cache, tmp_path, "eval.max_questions=1")
    _, report, _, key = _evaluate(runtime, tmp_path, "run-a")
    entry = StartEvalStore(tmp_path).root / key
    for damage in ("flip", "no manifest"):
        if damage == "flip":
            data = bytearray((entry / QUESTIONS).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (entry / QUESTIONS).write_bytes(bytes(data))
        else:
            (entry / MANIFEST).unlink()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infra.run.start_evaluation"):
            compute, again, reused, _ = _evaluate(runtime, tmp_path, "run-b")
        assert compute.calls == 1 and reused is None, damage
        assert any("damaged" in r.getMessage() for r in caplog.records), damage
        assert again.per_question_pass1 == report.per_question_pass1  # the same start sampled again
        assert StartEvalStore(tmp_path).load(start_eval_key(  # and stored whole again, as run-b's
            runtime, DATASET, runtime.load_rows(DATASET)[:1], SharedStart.of(runtime, tmp_path).weights,
            SharedStart.of(runtime, tmp_path).prompt)).origin.run_id == "run-b"


def test_concurrent_runs_sample_once(model_cache: Path, tmp_path: Path) -> None:
    runtime = _runtime(model_cache, tmp_path, "eval.max_questions=1")
    started = threading.Event()
    calls: list[str] = []
    result: dict[str, str | None] = {}

    def slow() -> EvalReport:
        calls.append("a")
        started.set()
        time.sleep(0.5)  # the second run asks for the entry meanwhile
        return Counted(runtime)()

    def run(run_id: str, compute) -> None:
        source = EvalSource(run_id, run_id, None, 0, "start")
        out = SharedStart.of(runtime, tmp_path).evaluate(DATASET, source, "start",
                                                        compute)
        result[run_id] = out.reused_from.run_id if out.reused_from else None

    a = threading.Thread(target=run, args=("a", slow))
    a.start()
    started.wait(30)
    run("b", lambda: calls.append("b"))  # type: ignore[arg-type,return-value]
    a.join(30)
    assert calls == ["a"] and result == {"a": None, "b": "a"}


def _key(model_cache: Path, runs: Path, *sets: str) -> str:
    runtime = _runtime(model_cache, runs, *sets)
    rows = runtime.load_rows(DATASET)[: runtime.cfg.eval.max_questions]
    shared = SharedStart.of(runtime, runs)
    return start_eval_key(runtime, DATASET, rows, shared.weights, shared.prompt).name


def test_the_rollouts_sampler_enters_the_key_only_when_evaluation_samples_from_it(first, model_cache: Path) -> None:
    """An int8 rollout sampler (or a rollout correction) is the training arms' business, not the evaluation's; with
    eval.sampler=rollout it samples the evaluation, and the key changes."""
    runs, _, _, key = first
    assert _key(model_cache, runs, "model.sampler_dtype=int8", "algorithm.rollout_correction=mask") == key
    assert _key(model_cache, runs, "model.sampler_dtype=int8", "eval.sampler=rollout") != key
