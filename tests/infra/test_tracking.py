"""MLflow tracking against a real SQLite store: params, tags, metrics, artifacts, resume, nesting, models."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from slowdown import scaled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from scripted_engine import EchoSearch, ScriptedEngine, tool_then_answer

from aepo_core.config import ExperimentConfig, RolloutConfig
from aepo_core.overrides import build_config, config_from_yaml
from aepo_core.protocol import AgentProtocol
from aepo_core.rollout.scheduler import Question, RolloutScheduler
from aepo_core.rollout.tree import RolloutTree
from aepo_core.scoring import LeafScore
from infra.models import chat_prompt_text, prepare_tokenizer
from infra.plots import curves_figure
from infra.tracking.client import (
    MAX_PARAM_VALUE,
    RunOrigin,
    TrackingError,
    artifact_location_for,
    download_artifacts,
    git_sha,
    metric_key,
    resolve_tracking,
    tracking_uri_for,
)
from infra.tracking.registry import (
    MODEL_TAG_STEP,
    PolicyProvenance,
    RegistryError,
    load_model,
    log_model,
    register_model,
    resolve_version,
)
from infra.tracking.run import DatasetRecord, Tracker


def make_trees(n_questions: int = 3) -> list[RolloutTree]:
    cfg = RolloutConfig(mode="aepo", premonitor=True, beta=0.5, k=4, initial_rollouts=2, beam_size=2, gamma=0.2,
                        tau=0.5, branch_penalty=0.7, entropy_window=20, max_tool_calls=6, max_response_tokens=2000)
    engine = ScriptedEngine(tool_then_answer(calls=2, h_first=1.0, h_after_tool=4.0))
    qs = [Question(f"q{i}", [ord(c) for c in f"Q{i}?\n"]) for i in range(n_questions)]
    return RolloutScheduler(engine, {"search": EchoSearch()}, cfg).run(qs, seed=0).trees


def make_cfg(runs_dir: Path, **overrides: object) -> ExperimentConfig:
    base = {"name": "tiny", "seed": 7, "storage": {"runs_dir": str(runs_dir)},
            "tracking": {"experiment": "tests", "system_metrics": False}}
    return build_config(base, overrides)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One runs dir (one SQLite store, migrated once) for the whole module: MLflow's first use is slow."""
    d = tmp_path_factory.mktemp("runs")
    Tracker.from_config(make_cfg(d)).experiment_id()
    return d


def test_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    uri, art = resolve_tracking(cfg)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db" == tracking_uri_for(tmp_path)
    assert art == (tmp_path.resolve() / "mlartifacts").as_uri() == artifact_location_for(tmp_path)
    server = make_cfg(tmp_path, **{"tracking.tracking_uri": "http://127.0.0.1:5000"})
    assert resolve_tracking(server) == ("http://127.0.0.1:5000", None)  # the server's artifact root applies
    own = make_cfg(tmp_path, **{"tracking.tracking_uri": "http://127.0.0.1:5000",
                                "tracking.artifact_location": str(tmp_path / "arts")})
    assert resolve_tracking(own)[1] == (tmp_path / "arts").resolve().as_uri()
    assert metric_key("eval/synthetic/pass@1") == "eval/synthetic/pass_at_1"
    assert metric_key("rollout/reward_mean") == "rollout/reward_mean"
    assert metric_key("a|b") == "a_b"


def test_git_sha_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AEPO_GIT_SHA", raising=False)
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / "sub").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert git_sha(repo / "sub") == "a" * 40
    (repo / ".git" / "refs" / "heads" / "main").write_text("b" * 40 + "\n")
    assert git_sha(repo) == "b" * 40
    (repo / ".git" / "HEAD").write_text("c" * 40 + "\n")  # detached
    assert git_sha(repo) == "c" * 40
    assert git_sha(tmp_path) is None
    monkeypatch.setenv("AEPO_GIT_SHA", "deadbeef")
    assert git_sha(tmp_path) == "deadbeef"


def test_run_params_tags_metrics_and_artifacts(runs_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may land in ./mlruns
    monkeypatch.setenv("AEPO_GIT_SHA", "0123abcd")
    long_list = [f"/data/eval/set_{i:04d}.jsonl" for i in range(400)]  # > 6000 characters as a param
    cfg = make_cfg(runs_dir, **{"eval.datasets": long_list, "algorithm.loss": "dapo", "rollout.mode": "arpo"})
    tracker = Tracker.from_config(cfg)
    origin = RunOrigin("flows/x.py:f", "a test run", "flow-123", "http://prefect/flow-runs/flow-run/flow-123")
    rid = tracker.start(cfg, run_name="run-a", tags={"purpose": "test"}, origin=origin)
    assert tracker.run_id == rid
    with pytest.raises(TrackingError, match="already has run"):
        tracker.start(cfg)

    n = tracker.log_metrics({"rollout/reward_mean": 0.5, "rollout/accuracy": float("nan"),
                             "train/loss": float("inf"), "eval/syn/pass@1": 0.25, "bad": "x"}, step=0)
    assert n == 4  # the two finite numbers, and each once more under Summary/ (headline_metrics)
    tracker.log_metrics({"rollout/reward_mean": 0.75, "rollout/accuracy": 0.5}, step=1)
    tracker.log_config(cfg)
    history = tracker.metric_history()
    tracker.log_figure(curves_figure(history), "plots/curves.png")
    local = tmp_path / "notes.txt"
    local.write_text("hello")
    tracker.log_artifact(local, "extra")
    with pytest.raises(TrackingError, match="no such file"):
        tracker.log_artifact(tmp_path / "missing.txt")
    trees = make_trees()
    scores = [[LeafScore(0.25 * j, "f1", math.nan if j == 1 else 1.0 - j, False) for j in range(len(t.leaves))]
              for t in trees]
    sample = tracker.log_trajectory_sample(trees, scores, max_rows=5, step=1, questions={"q0": "What is x?"})
    assert list(sample["question_id"]) == ["q0", "q1", "q2", "q0", "q1"]  # one per question first
    assert list(sample["reward"]) == [0.0, 0.0, 0.0, 0.25, 0.25]  # each leaf's own score
    assert list(sample["advantage"][:3]) == [1.0] * 3 and sample["advantage"][3:].isna().all()  # NaN: empty
    with pytest.raises(ValueError, match="scores for 2 trees, but 3 trees given"):
        tracker.log_trajectory_sample(trees, scores[:2], step=1)
    tracker.finish()
    tracker.finish()  # idempotent

    run = tracker.client.get_run(rid)
    flat = cfg.flat()
    assert len(flat) > 100 and set(run.data.params) == set(flat)  # more than one 100-param batch
    assert run.data.params["algorithm.loss"] == "dapo" and run.data.params["seed"] == "7"
    assert len(run.data.params["eval.datasets"]) == MAX_PARAM_VALUE
    tags = run.data.tags
    assert tags["algorithm"] == "dapo" and tags["mode"] == "arpo" and tags["seed"] == "7"
    assert tags["config_hash"] == cfg.config_hash() and tags["git_sha"] == "0123abcd"
    assert tags["prefect_flow_run_id"] == "flow-123" and tags["purpose"] == "test"
    assert tags["prefect_flow_run_url"] == "http://prefect/flow-runs/flow-run/flow-123"
    assert tags["mlflow.source.name"] == "flows/x.py:f" and tags["mlflow.note.content"] == (
        "a test run\n\nPrefect flow run: [flow-123](http://prefect/flow-runs/flow-run/flow-123)")
    assert tags["mlflow.runName"] == "run-a" and run.info.status == "FINISHED"
    assert history == {"eval/syn/pass_at_1": [(0, 0.25)], "rollout/accuracy": [(1, 0.5)],
                       "rollout/reward_mean": [(0, 0.5), (1, 0.75)],
                       "Summary/pass_at_1_syn": [(0, 0.25)], "Summary/reward": [(0, 0.5), (1, 0.75)]}
    assert "train/loss" not in run.data.metrics and "eval/syn/pass_at_1" in run.data.metrics

    # Artifacts live under <runs_dir>/mlartifacts, not ./mlruns.
    art_dir = runs_dir / "mlartifacts" / rid / "artifacts"
    assert run.info.artifact_uri == art_dir.resolve().as_uri()
    assert config_from_yaml((art_dir / "config.yaml").read_text()) == cfg
    assert (art_dir / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (art_dir / "extra" / "notes.txt").read_text() == "hello"
    table = json.loads((art_dir / "trajectories" / "step_000001.json").read_text())
    assert table["columns"][:3] == ["step", "question_id", "question"] and len(table["data"]) == 5
    assert table["data"][0][2] == "What is x?" and "<answer>" in table["data"][0][-1]
    assert not (tmp_path / "mlruns").exists()

    df = tracker.search_runs(filter_string="tags.algorithm = 'dapo'")
    assert list(df["run_id"]) == [rid] and df.loc[0, "metrics.rollout/reward_mean"] == 0.75
    assert df.loc[0, "params.rollout.mode"] == "arpo" and df.loc[0, "status"] == "FINISHED"
    assert tracker.search_runs(experiment="no-such-experiment").empty


def test_resume_continues_the_same_run(runs_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_cfg(runs_dir, **{"train.steps": 4})
    first = Tracker.from_config(cfg)
    rid = first.start(cfg, run_name="resumable")
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.log_metrics({"train/loss": 0.9}, step=1)
    first.finish("KILLED")  # the flow was killed

    more = make_cfg(runs_dir, **{"train.steps": 6})  # the resumed run asks for more steps
    second = Tracker.from_config(more)  # a new process
    assert second.start(more, resume_run_id=rid) == rid
    run = second.client.get_run(rid)
    assert run.info.status == "RUNNING" and run.data.tags["resumes"] == "1"
    assert run.data.tags["resume_changed_params"] == "train.steps" and run.data.params["train.steps"] == "4"
    # The kill came after step 1's metrics, before its checkpoint: the repeated step 1 is not logged a second time.
    assert second.log_metrics({"train/loss": 0.9, "train/grad_norm": 2.0}, step=1) == 1
    second.log_metrics({"train/loss": 0.8}, step=2)
    second.finish()
    assert second.metric_history(["train/loss"], run_id=rid) == {"train/loss": [(0, 1.0), (1, 0.9), (2, 0.8)]}
    assert second.metric_history(["train/grad_norm"], run_id=rid) == {"train/grad_norm": [(1, 2.0)]}
    assert [r.run_id for r in second.runs_named("resumable")] == [rid] and second.runs_named("nope") == []
    assert second.client.get_run(rid).info.status == "FINISHED"
    assert len(second.search_runs(filter_string="attributes.run_name = 'resumable'")) == 1

    with pytest.raises(TrackingError, match="resumed MLflow run 'nope' not found"):
        Tracker.from_config(cfg).start(cfg, resume_run_id="nope")


def test_nested_children_under_a_parent(runs_dir: Path) -> None:
    cfg = make_cfg(runs_dir)
    with Tracker.from_config(cfg) as parent:
        pid = parent.start(cfg, run_name="sweep", tags={"kind": "sweep"})
        children = []
        for loss in ("aepo", "ppo_clip"):
            cell = make_cfg(runs_dir, **{"algorithm.loss": loss})
            with Tracker.from_config(cell) as child:
                children.append(child.start(cell, run_name=f"cell-{loss}", parent_run_id=pid))
                child.log_metrics({"rollout/reward_mean": 0.1}, step=0)
        df = parent.search_runs(filter_string=f"tags.mlflow.parentRunId = '{pid}'")
        assert sorted(df["run_id"]) == sorted(children)
        assert set(df["tags.algorithm"]) == {"aepo", "ppo_clip"}
    assert parent.client.get_run(pid).info.status == "FINISHED"
    with pytest.raises(TrackingError, match="parent MLflow run"):
        Tracker.from_config(cfg).start(cfg, parent_run_id="missing")

    failing = Tracker.from_config(cfg)
    with pytest.raises(RuntimeError), failing:
        fid = failing.start(cfg)
        raise RuntimeError("task crashed")
    assert failing.client.get_run(fid).info.status == "FAILED"


def test_logging_from_worker_threads(runs_dir: Path) -> None:
    """Prefect runs tasks in threads: concurrent logging to one run through the client, no active-run stack."""
    from concurrent.futures import ThreadPoolExecutor

    cfg = make_cfg(runs_dir)
    tracker = Tracker.from_config(cfg)
    rid = tracker.start(cfg, run_name="threads")

    def work(worker: int) -> None:
        for step in range(8):
            tracker.log_metrics({f"w{worker}/value": step * 1.0, "shared/count": worker}, step=step)
        tracker.log_text(f"worker {worker}", f"threads/{worker}.txt")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    tracker.finish()
    hist = tracker.metric_history([f"w{i}/value" for i in range(4)], run_id=rid)
    assert all([s for s, _ in h] == list(range(8)) for h in hist.values())
    assert sorted(tracker.client.list_artifacts(rid, "threads"), key=lambda f: f.path)[0].path == "threads/0.txt"


def test_system_metrics_are_logged(runs_dir: Path) -> None:
    cfg = make_cfg(runs_dir, **{"tracking.system_metrics": True})
    tracker = Tracker.from_config(cfg, system_metrics_interval_s=0.2)
    rid = tracker.start(cfg)
    deadline = time.monotonic() + scaled(10)
    names: list[str] = []
    while time.monotonic() < deadline and not names:
        time.sleep(0.2)
        names = [k for k in tracker.client.get_run(rid).data.metrics if k.startswith("system/")]
    tracker.finish()
    assert any("cpu_utilization" in k for k in names), names


def test_log_model_is_loadable(runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may land in ./mlruns
    import torch
    from mlflow.entities import LoggedModelStatus
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(997)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = prepare_tokenizer(PreTrainedTokenizerFast(  # a chat template, as every policy's tokenizer has
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()

    cfg = make_cfg(runs_dir)
    tracker = Tracker.from_config(cfg)
    tracker.start(cfg, run_name="with-model")
    protocol = AgentProtocol(system_prompt="Be {brief}.")
    logged = log_model(tracker, model, tokenizer, 3, name="policy", protocol=protocol)
    uri = logged.uri
    # Two policies of the run (step 3, and step 4 after a resume with more steps), the second scoring lower: linked
    # both ways, tagged with what made them, `best` on the better one (the newest is models:/<name>/latest).
    made = PolicyProvenance("aepo", "aepo", "tiny-random", 7, cfg.config_hash(), "eval/synthetic_test/pass_at_1")
    register_model(tracker, logged, "policy-reg", {"eval/synthetic_test/pass@1": 0.5}, 3, "test", made)
    later = log_model(tracker, model, tokenizer, 4, name="policy", protocol=protocol)
    register_model(tracker, later, "policy-reg", {"eval/synthetic_test/pass@1": 0.25}, 4, "test", made)
    client = tracker.client
    v1, v2 = (client.get_model_version("policy-reg", v) for v in ("1", "2"))
    assert {k: v1.tags[k] for k in made.tags()} == made.tags() and v1.tags["seed"] == "7"
    assert v2.tags["eval/synthetic_test/pass_at_1"] == "0.25" and v2.tags["model_id"] == later.model_id
    assert resolve_version(tracker, "models:/policy-reg@best").version == v1.version
    assert resolve_version(tracker, "models:/policy-reg/latest").version == v2.version
    for bad in ("models:/policy-reg@", "models:/policy-reg/newest", "models:/policy-reg@worst"):
        with pytest.raises(RegistryError, match="policy-reg"):
            resolve_version(tracker, bad)
    assert client.get_model_version_by_alias("policy-reg", "best").version == v1.version
    versions = json.loads(client.get_logged_model(logged.model_id).tags["mlflow.modelVersions"])
    assert versions == [{"name": "policy-reg", "version": "1"}]

    # A resumed run that logs and registers its step-4 policy again (it was killed after doing so): the same
    # LoggedModel and version, nothing twice. A model an attempt left half-logged (PENDING) is replaced.
    again = log_model(tracker, model, tokenizer, 4, name="policy", protocol=protocol)
    assert again == later
    assert register_model(tracker, again, "policy-reg", {"eval/synthetic_test/pass@1": 0.25}, 4, "test",
                          made) == "models:/policy-reg/2"
    assert len(client.search_model_versions("name = 'policy-reg'")) == 2
    assert json.loads(client.get_logged_model(later.model_id).tags["mlflow.modelVersions"]) == [
        {"name": "policy-reg", "version": "2"}]
    half = client.create_logged_model(tracker.experiment_id(), name="policy", source_run_id=tracker.run_id,
                                      tags={MODEL_TAG_STEP: "5"})
    fifth = log_model(tracker, model, tokenizer, 5, name="policy", protocol=protocol)
    ready = client.search_logged_models(experiment_ids=[tracker.experiment_id()],
                                        filter_string=f"source_run_id = '{tracker.run_id}'")
    assert sorted(m.model_id for m in ready) == sorted([logged.model_id, later.model_id, fifth.model_id])
    assert half.model_id not in {m.model_id for m in ready}
    tracker.finish()

    local = download_artifacts(tracker.tracking_uri, uri, tmp_path / "dl")
    model_id = uri.removeprefix("models:/")
    assert model_id == logged.model_id
    logged = tracker.client.get_logged_model(model_id)
    assert logged.experiment_id == tracker.experiment_id() and logged.status == LoggedModelStatus.READY
    assert logged.artifact_location.startswith((runs_dir / "mlartifacts").resolve().as_uri())
    assert not (tmp_path / "mlruns").exists()
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    assert "transformers" in mlmodel["flavors"]
    assert mlmodel["metadata"]["aepo_protocol"]["system_prompt"] == "Be {brief}."  # braces survive the template
    assert mlmodel["metadata"]["prompt_template"].format(prompt="Q") == chat_prompt_text(tokenizer, "Q", "Be {brief}.")
    loaded = load_model(tracker.tracking_uri, uri)
    ids = loaded["tokenizer"]("w1 w2 w3", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [[4, 5, 6]]
    with torch.no_grad():
        want = model(ids).logits
        got = loaded["model"].float()(ids).logits
    torch.testing.assert_close(got, want)


def test_a_group_run_has_no_single_config(runs_dir: Path) -> None:
    """A sweep's parent stands for several configs: no params, no algorithm / mode / seed / config hash tags."""
    cfg = make_cfg(runs_dir)
    tracker = Tracker.from_config(cfg, system_metrics=False)
    rid = tracker.start(cfg, run_name="sweep", group=True, tags={"kind": "sweep"})
    tracker.finish()
    run = tracker.client.get_run(rid)
    assert not run.data.params and not {"algorithm", "mode", "seed", "config_hash"} & set(run.data.tags)
    assert run.data.tags["kind"] == "sweep" and run.data.tags["experiment_name"] == cfg.name


def test_a_rank_tracker_takes_every_call_and_records_nothing(tmp_path: Path) -> None:
    """RankTracker takes each RunLogger call with the protocol's bodies (nothing recorded, no store opened), and
    Tracker implements every call itself: the protocol's no-op bodies are never a Tracker's."""
    from infra.tracking.run import RankTracker, RunLogger

    calls = {name for name in vars(RunLogger) if not name.startswith("_")} - {"tracking_uri"}
    assert {"start", "finish", "log_metrics", "log_dict", "log_config", "log_rollout_traces"} <= calls
    assert calls <= set(vars(Tracker)), sorted(calls - set(vars(Tracker)))
    cfg = make_cfg(tmp_path)
    with RankTracker(1) as rank:
        assert rank.start(cfg, run_name="x") == rank.run_id == "rank1"
        assert rank.log_metrics({"a": 1.0}, 0) == 0 and rank.run_url() is None
        assert rank.log_rollout_traces(make_trees(1), None, step=1, kind="train", label="step1", questions={}) is None
    assert not list(tmp_path.iterdir())


def _open_fresh_store(runs: str, barrier: object, results: object) -> None:
    """One of the racing processes: wait for the other, then open the (fresh) store and create the experiment."""
    import traceback

    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run import Tracker

    barrier.wait()  # type: ignore[attr-defined]
    try:
        Tracker(tracking_uri_for(runs), experiment="race").experiment_id()
        results.put("ok")  # type: ignore[attr-defined]
    except BaseException:
        results.put(traceback.format_exc()[-2000:])  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_two_processes_opening_a_fresh_store_at_once_both_succeed(tmp_path: Path) -> None:
    """Two first runs in one fresh runs dir used to race on MLflow's schema migration of mlflow.db (one died)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each, as two `aepo train` would be
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_fresh_store, args=(str(tmp_path / "runs"), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=scaled(240)) for _ in procs]
    for p in procs:
        p.join(timeout=scaled(60))
    assert outcomes == ["ok", "ok"], "\n---\n".join(o for o in outcomes if o != "ok")


def test_the_run_listing_reads_sqlite_as_mlflow_does(tmp_path: Path) -> None:
    """`aepo runs` reads a local store with sqlite3 (no MLflow import: 0.4 s of CPU instead of ~4); it must give
    what MLflow's client gives: the newest active runs of the experiment, their tags and latest metrics (NaN kept),
    deleted runs and other experiments left out."""
    import math

    from mlflow.tracking import MlflowClient

    from infra.tracking.client import tracking_uri_for
    from infra.tracking.run_index import _from_client, _from_sqlite, newest_runs

    uri = tracking_uri_for(tmp_path)
    client = MlflowClient(uri)
    exp, other = client.create_experiment("aepo"), client.create_experiment("other")
    ids = []
    for i in range(5):
        run = client.create_run(exp, run_name=f"r{i}", start_time=1_700_000_000_000 + i * 1000,
                                tags={"algorithm": "aepo", "seed": str(i)})
        for step in (1, 2):
            client.log_metric(run.info.run_id, "eval/x/pass_at_1", 0.1 * i + step, step=step)
        client.log_metric(run.info.run_id, "rollout/reward_mean", math.nan if i == 3 else -i, step=1)
        ids.append(run.info.run_id)
    client.set_terminated(ids[1], "FAILED")
    client.delete_run(ids[2])
    client.create_run(other, run_name="elsewhere")
    db = tmp_path / "mlflow.db"
    fast, reference = _from_sqlite(db, "aepo", 3), _from_client(uri, "aepo", 3)
    assert [r.run_name for r in fast] == ["r4", "r3", "r1"]  # newest first, the deleted r2 left out
    assert [(r.run_id, r.run_name, r.status, r.start_time, dict(r.tags)) for r in fast] == \
        [(r.run_id, r.run_name, r.status, r.start_time, dict(r.tags)) for r in reference]
    for a, b in zip(fast, reference, strict=True):
        assert a.metrics.keys() == b.metrics.keys()
        assert all(a.metrics[k] == b.metrics[k] or (math.isnan(a.metrics[k]) and math.isnan(b.metrics[k]))
                   for k in a.metrics)
    assert fast[0].metrics["eval/x/pass_at_1"] == 0.1 * 4 + 2  # the latest step's value
    assert newest_runs(uri, "nope", 5) == []
    assert [r.run_name for r in newest_runs(uri, "other", 5)] == ["elsewhere"]


def test_a_fluent_call_leaves_the_process_tracking_uri_as_it_found_it(tmp_path: Path) -> None:
    """``fluent_uri`` (model logging, loading, artifact downloads) restores MLflow's process-wide URI: unset stays
    unset. (Restoring ``get_tracking_uri()`` pinned an unset process to ``sqlite:///<cwd>/mlflow.db``, its default:
    a later fluent call of any library in the process wrote a store into the working directory.)"""

    code = ("import mlflow\n"
            "from infra.tracking.client import fluent_uri\n"
            f"with fluent_uri({f'sqlite:///{tmp_path}/runs.db'!r}):\n"
            "    assert mlflow.is_tracking_uri_set()\n"
            "print(mlflow.is_tracking_uri_set())\n")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(120),
                          env={**env, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_runs_logging_the_same_new_dataset_at_once_all_succeed(runs_dir: Path) -> None:
    """A sweep's children on two workers log the same dataset at the same moment. MLflow looks for the (experiment,
    name, digest) row and inserts it when absent, with no lock between the two: the later insert failed its UNIQUE
    constraint (`test_fanout_sweep_…`, 2026-12-06: one child FAILED at start). Every run must get its input."""
    import threading

    cfg = make_cfg(runs_dir)
    trackers = [Tracker.from_config(cfg) for _ in range(4)]
    run_ids = [t.start(cfg, run_name=f"child-{i}") for i, t in enumerate(trackers)]
    rounds, errors = 12, []
    barrier = threading.Barrier(len(trackers))

    def log(t: Tracker) -> None:
        for r in range(rounds):
            barrier.wait()
            try:
                t.log_datasets([DatasetRecord(f"synthetic:train-{r}", f"digest{r}", "synthetic", 8, "training")])
            except Exception as exc:  # every failure reported, not the first
                errors.append(repr(exc))

    threads = [threading.Thread(target=log, args=(t,)) for t in trackers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:2]
    for rid in run_ids:
        names = {d.dataset.name for d in trackers[0].client.get_run(rid).inputs.dataset_inputs}
        assert names == {f"synthetic:train-{r}" for r in range(rounds)}
    for t in trackers:
        t.finish()


def test_pass_at_1_and_the_reward_open_the_run_page(runs_dir: Path) -> None:
    """Issue 54 §3: MLflow's UI orders a run's chart sections by name, byte by byte (cost/* came first and Pass@1
    needed a search): Pass@1 on each dataset and the training reward are logged once more under ``Summary/``, whose
    capital sorts before every lower-case section; the values and steps are the originals'."""
    from infra.tracking.client import HEADLINE_SECTION, headline_metrics

    tracker = Tracker(tracking_uri_for(runs_dir))
    tracker.start(ExperimentConfig(), run_name="headline")
    tracker.log_metrics({"eval/synthetic_test/pass@1": 0.5, "eval/synthetic_test/pass_at_2": 0.7,
                         "eval_start/synthetic_test/pass_at_1": 0.1, "rollout/reward_mean": -0.2,
                         "cost/total_cpu_s": 3.0}, 2)
    history = tracker.metric_history()
    assert history["Summary/pass_at_1_synthetic_test"] == [(2, 0.5)] and history["Summary/reward"] == [(2, -0.2)]
    assert {k for k in history if k.startswith("Summary/")} == {"Summary/pass_at_1_synthetic_test", "Summary/reward"}
    sections = sorted({k.rsplit("/", 1)[0] for k in history}, key=str.encode)
    assert sections[0] == HEADLINE_SECTION
    assert headline_metrics({"train/loss": 1.0}) == {}
    tracker.finish()


def test_the_run_description_links_its_flow_run() -> None:
    from infra.tracking.client import TAG_DESCRIPTION, RunOrigin

    tags = RunOrigin("flows/train.py:train", "AEPO training run.", "abc-123",
                     "http://127.0.0.1:4200/runs/flow-run/abc-123").tags()
    assert tags[TAG_DESCRIPTION] == ("AEPO training run.\n\nPrefect flow run: "
                                     "[abc-123](http://127.0.0.1:4200/runs/flow-run/abc-123)")
    assert RunOrigin("x", "Outside a flow.").tags()[TAG_DESCRIPTION] == "Outside a flow."


def test_the_ui_opens_the_classic_layout() -> None:
    from infra.tracking.client import landing_page

    assert landing_page("http://h:5000/", "3") == "http://h:5000/#/experiments/3?workflowType=machine_learning"
    assert landing_page("http://h:5000", None) == "http://h:5000/#/experiments?workflowType=machine_learning"
