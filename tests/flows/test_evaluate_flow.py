"""The evaluate flow on a checkpoint: per-question Parquet, MLflow run, table artifact, paired comparison, and an
LLM judge reached over real HTTP (a fake OpenAI-compatible chat server on 127.0.0.1)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from json_server import JsonServer
from slowdown import scaled

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
FAST = ["eval.max_questions=2", "eval.n_samples=2", "eval.pass_k=2", "eval.top_p=1.0",
        "rollout.max_response_tokens=48", "rollout.max_segment_tokens=16", "rollout.entropy_window=16",
        "tracking.system_metrics=false"]
DS = "synthetic:test"
KEY = "synthetic_test"  # the dataset's name in results, metrics, files and tables
# The checkpoint's evaluations: the session's tool user (conftest.tool_user) on the train questions it memorized,
# where it answers some right and some not (a policy that never answers makes Pass@1 0 for any code).
TRAIN_DS, TRAIN_KEY = "synthetic:train", "synthetic_train"
ON_TRAIN = [f"eval.datasets=[{TRAIN_DS}]", "eval.max_questions=5", "eval.n_samples=2", "eval.pass_k=2",
            "rollout.max_response_tokens=200", "tracking.system_metrics=false"]


def fake_judge(fail_first: int = 0) -> Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]:
    """An OpenAI-compatible chat endpoint that grades like a careful judge: CORRECT iff the predicted answer is
    one of the gold answers (case-insensitive); the first ``fail_first`` calls get a 503."""
    calls = {"n": 0}

    def handle(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] <= fail_first:
            return 503, {"error": "warming up"}
        if path != "/v1/chat/completions":
            return 404, {"error": path}
        user = body["messages"][-1]["content"]
        golds = re.search(r"Gold answer\(s\): (.*)", user).group(1).split(" | ")
        answer = re.search(r"Predicted answer: (.*)", user).group(1)
        word = "CORRECT" if answer.strip().lower() in {g.strip().lower() for g in golds} else "INCORRECT"
        return 200, {"id": "chat-1", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": word}}]}

    return handle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tool_user: Path, model_cache: Path,
               prefect_harness: Any) -> Path:
    """A committed checkpoint of the session's tool user (saved as a run would; evaluation only reads it)."""
    from aepo_core.config import ModelConfig
    from infra.config_files import load_config
    from infra.models import load_policy
    from infra.training.checkpoint import save_checkpoint

    model, tokenizer = load_policy(ModelConfig(name=str(tool_user), dtype="float32", cache_dir=str(model_cache)))
    root = tmp_path_factory.mktemp("ckpt") / "tiny"
    return save_checkpoint(root, 3, model=model, tokenizer=tokenizer, config=load_config(TINY))


@pytest.fixture(scope="module")
def first_eval(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    from flows.evaluate import evaluate

    runs = tmp_path_factory.mktemp("eval-runs")
    state = evaluate(config=str(TINY), checkpoint=str(checkpoint.parent), overrides=ON_TRAIN, runs_dir=str(runs),
                     return_state=True)
    assert state.is_completed(), state.message
    return state.result(), runs


def test_eval_writes_per_question_parquet_mlflow_run_and_table(first_eval: tuple[dict[str, Any], Path],
                                                               checkpoint: Path) -> None:
    from infra.run.evaluation import QUESTION_SCHEMA
    from infra.tracking.run import Tracker

    result, runs = first_eval
    assert result.checkpoint == str(checkpoint) and result.checkpoint_step == 3
    path = Path(result.files[TRAIN_KEY])
    assert path == runs / "eval" / result.run_name / "synthetic_train.parquet"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    table = pq.read_table(path)
    assert table.schema.equals(QUESTION_SCHEMA, check_metadata=False)
    rows = table.to_pylist()
    assert len(rows) == 5 and {r["dataset"] for r in rows} == {TRAIN_DS}
    for r in rows:
        assert r["n"] == 2 and len(r["answers"]) == 2 and r["golds"] and r["question"]
        # correct counts the samples whose answer is a gold (the synthetic golds are exact names and numbers)
        golds = {g.strip().lower() for g in r["golds"]}
        assert r["correct"] == sum(a is not None and a.strip().lower() in golds for a in r["answers"]), r
        assert r["pass_at_1"] == r["correct"] / r["n"]
        assert r["judge_verdicts"] is None  # no judge configured
    correct = [r["correct"] for r in rows]
    assert 0 < sum(correct) < 10, f"the tool user should answer some of its train questions right, not all: {correct}"
    summary = result.summary[TRAIN_KEY]
    assert summary["questions"] == 5 and summary["pass@1"] == pytest.approx(sum(correct) / 10)
    assert summary["answered_rate"] == pytest.approx(sum(a is not None for r in rows for a in r["answers"]) / 10)
    # the interval is over questions, and they differ: it has width and holds the estimate
    assert 0.0 <= summary["pass@1_ci_low"] < summary["pass@1"] < summary["pass@1_ci_high"] <= 1.0

    tracker = Tracker(result.tracking_uri)
    run = tracker.client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kind"] == "eval"
    assert run.data.tags["checkpoint_step"] == "3"
    assert run.data.metrics["eval/synthetic_train/pass_at_1"] == pytest.approx(summary["pass@1"])
    artifacts = {f.path for f in tracker.client.list_artifacts(result.run_id, "eval")}
    assert "eval/summary.json" in artifacts


def test_eval_table_artifact(checkpoint: Path, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.evaluate import evaluate

    state = evaluate(config=str(TINY), checkpoint=str(checkpoint), overrides=[*ON_TRAIN, "eval.max_questions=1"],
                     runs_dir=str(tmp_path), return_state=True)
    assert state.is_completed()
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    tables = [a for a in arts if a.type == "table"]
    assert len(tables) == 1
    data = json.loads(tables[0].data) if isinstance(tables[0].data, str) else tables[0].data
    assert {r["family"] for r in data} >= {"all"} and all(r["dataset"] == TRAIN_KEY for r in data)


def test_paired_comparison_with_itself_is_zero(first_eval: tuple[dict[str, Any], Path], checkpoint: Path) -> None:
    from flows.evaluate import evaluate
    from infra.tracking.run import Tracker

    first, runs = first_eval
    again = evaluate(config=str(TINY), checkpoint=str(checkpoint), overrides=ON_TRAIN, runs_dir=str(runs),
                     compare_to=first.results_dir)
    # the same weights and seeds sample the same answers (the policy answers some right: 0 is not the only value)
    before, after = (pq.read_table(r.files[TRAIN_KEY]).to_pylist() for r in (first, again))
    assert [(r["question_id"], r["answers"], r["correct"]) for r in after] == [
        (r["question_id"], r["answers"], r["correct"]) for r in before]
    cmp = again.compare[TRAIN_KEY]
    assert cmp["diff"] == 0.0 and cmp["ci_low"] <= 0.0 <= cmp["ci_high"] and cmp["questions"] == 5
    metrics = Tracker(again.tracking_uri).client.get_run(again.run_id).data.metrics
    assert metrics["compare/synthetic_train/pass_at_1_diff"] == 0.0


def test_paired_comparison_pairs_by_question_and_keeps_the_sign(first_eval: tuple[dict[str, Any], Path],
                                                                checkpoint: Path, tmp_path: Path) -> None:
    """Against a doctored earlier evaluation with a known shift: only the questions both have are paired, by id, and
    the difference is this run's minus the earlier one's (a self-comparison gives 0 for almost any bug)."""
    from flows.evaluate import evaluate
    from infra.run.evaluation import read_question_results

    first, runs = first_eval
    rows = pq.read_table(first.files[TRAIN_KEY]).to_pylist()
    kept, dropped = rows[0], rows[1]
    doctored = [{**kept, "pass_at_1": kept["pass_at_1"] + 0.75},  # the earlier run did better on this one
                {**kept, "question_id": "not-in-this-run", "pass_at_1": 0.0}]  # a question this run lacks
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    pq.write_table(pa.Table.from_pylist(doctored, schema=pq.read_schema(first.files[TRAIN_KEY])),
                   earlier / "synthetic_train.parquet")
    again = evaluate(config=str(TINY), checkpoint=str(checkpoint), overrides=ON_TRAIN, runs_dir=str(runs),
                     compare_to=str(earlier))
    now = read_question_results(again.files[TRAIN_KEY])[TRAIN_DS]
    cmp = again.compare[TRAIN_KEY]
    assert cmp["questions"] == 1 and dropped["question_id"] in now  # the unshared questions are left out
    assert cmp["diff"] == pytest.approx(now[kept["question_id"]] - (kept["pass_at_1"] + 0.75))


def test_compare_to_a_missing_file_fails_before_evaluating(checkpoint: Path, tmp_path: Path) -> None:
    from flows.evaluate import evaluate

    state = evaluate(config=str(TINY), checkpoint=str(checkpoint), overrides=FAST, runs_dir=str(tmp_path / "r"),
                     compare_to=str(tmp_path / "nope.parquet"), return_state=True)
    assert state.is_failed() and "nope.parquet" in state.message
    assert not (tmp_path / "r").exists()


@pytest.fixture()
def scripted_policy_server(tiny_policy: tuple[Any, Any]) -> Iterator[tuple[JsonServer, dict[str, str]]]:
    """An OpenAI-compatible *completions* server standing in for the policy: it answers the first synthetic test
    question correctly and the others wrongly, in the project's tag protocol, as token ids."""
    from infra.config_files import load_config
    from infra.data.loaders import load_dataset_rows
    from infra.data.synthetic import SyntheticTask

    _, tokenizer = tiny_policy
    cfg = load_config(TINY)
    rows = load_dataset_rows(DS, "fail", synthetic=SyntheticTask.from_config(cfg.data))[:2]
    answers = {rows[0].question: rows[0].golds[0], rows[1].question: "nobody knows"}

    def handle(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = tokenizer.decode(body["prompt"])
        answer = next(a for q, a in answers.items() if q in prompt)
        ids = tokenizer.encode(f"<think>I know this.</think>\n<answer>The answer is \\boxed{{{answer}}}.</answer>",
                               add_special_tokens=False)
        ids.append(tokenizer.eos_token_id)
        choice = {"index": 0, "text": tokenizer.decode(ids), "finish_reason": "stop", "stop_reason": None,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids),
                               "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids]}}
        return 200, {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}

    with JsonServer(handle) as server:
        yield server, answers


def test_judge_verdicts_are_recorded(scripted_policy_server: tuple[JsonServer, dict[str, str]], tmp_path: Path,
                                     prefect_harness: Any) -> None:
    from flows.evaluate import evaluate

    policy, answers = scripted_policy_server
    with JsonServer(fake_judge(fail_first=1)) as judge:
        result = evaluate(config=str(TINY), runs_dir=str(tmp_path),
                          overrides=[*FAST, "rollout.engine=remote", f"rollout.remote.url={policy.url}",
                                     f"eval.judge_url={judge.url}/v1", "eval.judge_model=fake-judge"])
    assert len(policy.requests) == 4  # 2 questions × 2 samples
    assert len(judge.requests) == 1 + 4  # one 503, retried
    assert {r["model"] for r in judge.requests} == {"fake-judge"}
    rows = {r["question"]: r for r in pq.read_table(result.files[KEY]).to_pylist()}
    good, bad = list(answers)
    assert rows[good]["answers"] == [answers[good]] * 2 and rows[good]["judge_verdicts"] == ["correct"] * 2
    assert rows[good]["judge_raw"] == ["CORRECT"] * 2 and rows[good]["judge_pass_at_1"] == 1.0
    assert rows[bad]["judge_verdicts"] == ["incorrect"] * 2 and rows[bad]["judge_correct"] == 0
    assert result.judge[KEY] == 0.5
    # the reward's own grading agrees: an answered but wrong sample is not correct (both questions are answered)
    assert (rows[good]["correct"], rows[bad]["correct"]) == (2, 0) and result.summary[KEY]["pass@1"] == 0.5
    assert result.summary[KEY]["answered_rate"] == 1.0


def test_judge_client_verdicts_over_http() -> None:
    from infra.judge import JUDGE_USER_TEMPLATE, LLMJudge, chat_url, parse_verdict

    assert parse_verdict("Incorrect.") == "incorrect" and parse_verdict("**CORRECT**") == "correct"
    assert parse_verdict("I am not sure") == "unparsed"
    assert chat_url("http://h:1") == chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert "{question}" in JUDGE_USER_TEMPLATE and "{answer}" in JUDGE_USER_TEMPLATE
    with JsonServer(fake_judge(fail_first=2)) as server:
        judge = LLMJudge(server.url, "m", backoff_s=0.01)
        verdicts = judge.judge_many([("Q?", ["Paris"], "paris"), ("Q?", ["Paris"], "Rome"), ("Q?", ["x"], None)])
        assert [v.verdict for v in verdicts] == ["correct", "incorrect", "no_answer"]
        assert len(server.requests) == 2 + 2  # two 503s retried; no request for the missing answer
        url = server.url
    down = LLMJudge(url, retries=0, timeout_s=2).judge("Q?", ["a"], "a")  # server closed
    assert down.verdict == "error" and not down.correct


# `aepo eval` builds the policy runtime only: no training data read, no trainer, no training backend. Run in a
# fresh process so that `sys.modules` shows what the command really imported.
EVAL_ONLY = """
import sys
from flows.cli import app

try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("DEEPSPEED_IMPORTED=" + str(any(m.split(".")[0] == "deepspeed" for m in sys.modules)))
"""


def test_aepo_eval_needs_no_training_data_and_never_imports_deepspeed(checkpoint: Path, tmp_path: Path,
                                                                      model_cache: Path, prefect_api_url: str
                                                                      ) -> None:
    import os
    import subprocess
    import sys

    from infra.config_files import load_config

    cfg = load_config(TINY, [*FAST, "eval.max_questions=1", f"model.cache_dir={model_cache}",
                             f"data.train={tmp_path / 'missing.parquet'}", "train.backend=deepspeed",
                             f"eval.datasets=[{DS}]"])
    config = tmp_path / "eval.yaml"
    config.write_text(cfg.to_yaml())
    runs = tmp_path / "runs"
    # The session's Prefect API (the CLI tests test a temporary server of its own; that costs ~17 s per process)
    env = {**os.environ, "AEPO_MODEL_CACHE": str(model_cache), "PYTHONPATH": str(REPO),
           "PREFECT_API_URL": prefect_api_url}
    env.pop("PREFECT_HOME", None)  # the CLI sets its own under the runs dir
    proc = subprocess.run([sys.executable, "-c", EVAL_ONLY, "eval", "--checkpoint", str(checkpoint), "-c", str(config),
                           "--runs-dir", str(runs), "--run-name", "eval-only"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DEEPSPEED_IMPORTED=False" in proc.stdout, proc.stdout[-3000:]
    assert (runs / "eval" / "eval-only" / f"{KEY}.parquet").is_file()
