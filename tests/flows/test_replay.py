"""``aepo replay``: a tiny run of the tool-using policy with a checkpoint after every step; replaying step N's update
from the checkpoint of step N − 1 and the stored trajectories gives the checkpoint of step N bit for bit. The
comparison has teeth: the same samples in another order give other weights. Steps that cannot be replayed (no
checkpoint before, a missing or corrupt trajectory part, a part written before the update's order was stored) are
one clear error, exit code 2 from the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.config_files import load_config

pytestmark = pytest.mark.slow  # trains or evaluates real runs (the heavy tier; CI runs every tier)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
NAME = "tiny-replay"


@pytest.fixture(scope="module")
def run(prefect_harness: Any, tool_user: Path, model_cache: Path,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from flows.train import train

    runs = tmp_path_factory.mktemp("replay-runs")
    cfg = load_config(TINY, [f"model.name={tool_user}", f"model.cache_dir={model_cache}", "train.steps=3",
                             "checkpoint.every=1", "checkpoint.keep=3", "tracking.log_model=false",
                             "eval.max_questions=2", "data.max_questions=8", f"name={NAME}",
                             # the policy never answers right: the soft overlong penalty makes rewards (and so
                             # advantages and gradients) differ with the trajectories' lengths
                             "algorithm.overlong_buffer=64"])
    return train(config=cfg, runs_dir=str(runs)), runs


def test_replaying_a_step_gives_its_checkpoint_bit_for_bit(run: tuple[Any, Path]) -> None:
    from flows.replay import replay

    out, runs = run
    for step in (2, 3):
        result = replay(run=NAME, step=step, runs_dir=str(runs))
        assert result.run_id == out.run_id and result.samples > 0
        assert result.weights.bit_identical, (step, result.weights.first_different, result.weights.max_abs_diff)
        assert result.weights.tensors > 10 and result.weights.max_abs_diff == 0.0
        for name, (logged, replayed) in result.metrics.items():  # the update computed what the run logged
            assert logged is not None and replayed == logged, (step, name)


def test_the_same_samples_in_another_order_give_other_weights(run: tuple[Any, Path]) -> None:
    from infra.numerics import numerics_for
    from infra.run.checkpoints import checkpoint_store
    from infra.run.replay import compare_weights, replay_update, run_numerics, update_samples
    from infra.store import TrajectoryStore
    from infra.tracking.run import Tracker

    out, runs = run
    tracker = Tracker(out.tracking_uri)
    cfg = tracker.logged_config(out.run_id)
    numerics = run_numerics(tracker.client.get_run(out.run_id).data.params, numerics_for(cfg))
    samples = update_samples(TrajectoryStore(runs), out.run_id, 2)
    assert len({s.group for s in samples}) >= 2  # several groups, several mini-batches: the order matters
    # every sample carries its question (the cluster a comparison's bootstrap redraws): one per group
    assert len({(s.group, s.question_id) for s in samples}) == len({s.question_id for s in samples if s.question_id})
    assert sum(s.advantage != 0 for s in samples) >= 2  # and a gradient that depends on the samples
    before, after = (checkpoint_store(cfg, runs, NAME, out.run_id).fetch(s) for s in (1, 2))
    assert compare_weights(replay_update(cfg, numerics, before, samples, 3).weights, after).bit_identical
    other = compare_weights(replay_update(cfg, numerics, before, samples[::-1], 3).weights, after)
    assert not other.bit_identical and other.max_abs_diff > 0


def _invoke(*args: str) -> Any:
    from flows.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"}, catch_exceptions=False)


def test_the_cli_replays_and_refuses_what_it_cannot_replay(run: tuple[Any, Path]) -> None:
    out, runs = run
    ok = _invoke("replay", NAME, "--step", "3", "--runs-dir", str(runs))
    assert ok.exit_code == 0, ok.output
    assert "bit-identical" in ok.output and "train/loss" in ok.output

    first = _invoke("replay", NAME, "--step", "1", "--runs-dir", str(runs))  # no checkpoint of step 0
    assert first.exit_code == 2 and "checkpoints of steps 0 and 1" in first.output and "Traceback" not in first.output
    unknown = _invoke("replay", "no-such-run", "--step", "2", "--runs-dir", str(runs))
    assert unknown.exit_code == 2 and "no-such-run" in unknown.output

    part = runs / "trajectories" / out.run_id / "step-000002.parquet"
    saved = part.read_bytes()
    try:
        part.write_bytes(saved[: len(saved) // 2])  # a corrupt part
        corrupt = _invoke("replay", NAME, "--step", "2", "--runs-dir", str(runs))
        assert corrupt.exit_code == 2 and "step 2" in corrupt.output and "Traceback" not in corrupt.output
        part.unlink()  # a missing one
        missing = _invoke("replay", NAME, "--step", "2", "--runs-dir", str(runs))
        assert missing.exit_code == 2 and "no stored trajectories" in missing.output
    finally:
        part.write_bytes(saved)


def test_update_rules_compared_on_the_same_samples(run: tuple[Any, Path]) -> None:
    """The run's own rule twice (once spelled with its default clip_high) gives the same update to the bit, so every
    paired difference is exactly 0; CISPO, which never drops a token's gradient, zeroes none, while PPO with a clip
    range of 0 zeroes the tokens whose ratio moved the advantage's way after the first optimizer step (one question
    per mini-batch, ``--set optim.mini_batch_size=1``: the run itself took one on-policy step, where every ratio
    is 1); every rule moved the policy (KL > 0); the gradient weight shares of the classes add up to 1. Without
    overrides, the run's own rule is the run's update: its loss is the one the run logged.

    (Unclipped, AEPO, PPO-clip and CISPO have the same gradient, −r·Â·∇logπ: on this tiny run the ratios stay
    within 1 ± 0.2, so ``cispo`` alone would update exactly as ``aepo`` does; the entropy-aware advantage turned
    off is a rule that differs everywhere.)"""
    from flows.replay import replay_rules

    _, runs = run
    rules = ["aepo", "aepo@clip_high=0.2", "cispo", "ppo_clip@clip_low=0,clip_high=0", "aepo@entropy_advantage=false"]
    out = replay_rules(run=NAME, steps=[2, 3], rules=rules, overrides=["optim.mini_batch_size=1"], runs_dir=str(runs),
                       n_resamples=200)
    assert out.reference == "aepo" and set(out.samples) == {2, 3} and all(n > 0 for n in out.samples.values())
    assert set(out.questions) == {2, 3} and all(1 < out.questions[s] < out.samples[s] for s in (2, 3))
    rows = {(r.quantity, r.token_class, r.rule): r for r in out.rows}
    assert len(rows) == 6 * 3 * len(rules)
    assert rows[("kl_to_start", "rest", "aepo")].tokens > 0 and rows[("kl_to_start", "tool_call", "aepo")].tokens > 0
    for (quantity, cls, rule), r in rows.items():
        if rule == "aepo@clip_high=0.2" and r.diff is not None:
            assert (r.diff, r.diff_low, r.diff_high) == (0.0, 0.0, 0.0), (quantity, cls)
        if quantity == "zeroed_share" and rule == "cispo" and r.tokens:
            assert r.value == 0.0, cls
        if quantity == "kl_to_start" and r.tokens:
            assert r.value > 0, (cls, rule)
    for rule in rules:
        shares = [rows[("gradient_weight_share", c, rule)].value for c in ("tool_call", "high_entropy", "rest")]
        assert sum(shares) == pytest.approx(1.0)
    assert rows[("zeroed_share", "rest", "ppo_clip@clip_low=0,clip_high=0")].value > 0
    assert rows[("kl_to_start", "rest", "aepo@entropy_advantage=false")].diff != 0.0  # another rule, another update
    from infra.tracking.run import Tracker

    own = replay_rules(run=NAME, steps=[2], rules=["aepo"], runs_dir=str(runs), n_resamples=10)
    logged = dict(Tracker(_tracking_uri(runs)).metric_history(["train/loss"], run_id=out.run_id)["train/loss"])
    assert own.update_metrics[2]["aepo"]["train/loss"] == logged[2]


def _tracking_uri(runs: Path) -> str:
    from infra.tracking.client import tracking_uri_for

    return tracking_uri_for(runs)


def test_the_cli_compares_rules_and_refuses_a_bad_one(run: tuple[Any, Path]) -> None:
    import json

    _, runs = run
    ok = _invoke("replay", NAME, "--step", "2", "--losses", "aepo,ppo_clip", "--runs-dir", str(runs),
                 "--format", "json")
    assert ok.exit_code == 0, ok.output
    rows = json.loads(ok.stdout)
    assert len(rows) == 6 * 3 * 2 and {r["rule"] for r in rows} == {"aepo", "ppo_clip"}
    bad = _invoke("replay", NAME, "--step", "2", "--losses", "aepo,ppo", "--runs-dir", str(runs))
    assert bad.exit_code == 2 and "update rule 'ppo'" in bad.output and "Traceback" not in bad.output
    first = _invoke("replay", NAME, "--step", "1", "--losses", "aepo", "--runs-dir", str(runs))
    assert first.exit_code == 2 and "needs the checkpoint of step 0" in first.output
    two = _invoke("replay", NAME, "--step", "2", "--step", "3", "--runs-dir", str(runs))
    assert two.exit_code == 2 and "--step once without --losses" in two.output
