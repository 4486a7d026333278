"""``aepo replay``: re-run one stored step's policy update from the trajectory store and the checkpoint before it,
and check the weights against the run's own checkpoint of that step."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import FormatOpt, RunsOpt, TrackingOpt, check_tracking_store, resolve_runs_dir
from flows.cli.render import OutputFormat, fail, fmt, interval, print_records

if TYPE_CHECKING:
    from flows.replay import ReplayResult, RuleComparison


def replay_cmd(
    run: Annotated[str, typer.Argument(help="MLflow run id or run name (the newest of that name).")],
    step: Annotated[list[int], typer.Option("--step", help="The RL step whose update to replay (1 is the first); "
                                            "with --losses, repeat it to pool several steps.")],
    losses: Annotated[str | None, typer.Option(
        "--losses", help="Compare update rules on the same samples instead: comma-separated <loss>[@key=value;…] "
        "(the first is the reference), e.g. aepo,ppo_clip,dapo,gppo,cispo.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="KEY=VALUE applied to every compared rule's config (with --losses).")] = None,
    runs_dir: RunsOpt = None,
    experiment: Annotated[str, typer.Option("--experiment", "-e")] = "aepo",
    tracking_uri: TrackingOpt = None,
    output: FormatOpt = OutputFormat.table,
) -> None:
    """Replay step N's update of a run: the checkpoint of step N − 1, step N's samples from the trajectory store in
    the update's order, the run's config and numerics; then compare the weights with the checkpoint of step N,
    tensor by tensor, and the update's loss, grad norm, clip fraction and entropy with what the run logged.
    Needs the checkpoints of steps N − 1 and N (checkpoint.every: 1). Exit 2 when the step cannot be replayed,
    1 when the replayed weights differ from the checkpoint.

    With --losses, each update rule starts from the same checkpoint and updates on the same samples; per token
    class (tool-call tokens, high-entropy tokens, the rest) the table shows the share of token updates whose
    gradient the rule zeroed, the class's share of the gradient weight, the sampled tokens' log-prob change, the KL
    to the start policy and the entropy after the update, with 95 % CIs over questions (redrawn within their step,
    each with all its samples) and each rule's paired difference from the first. A rule's own settings follow @,
    separated by ';' (e.g. aepo@clip_gate=high_entropy).

    \b
    Examples:
      aepo train -c configs/tiny.yaml --set checkpoint.every=1 --set train.steps=3
      aepo replay tiny --step 2
      aepo replay tiny --step 2 --format json
      aepo replay tiny --step 2 --step 3 --losses aepo,ppo_clip,dapo,gppo,cispo
    """
    runs = resolve_runs_dir(runs_dir)
    check_tracking_store(tracking_uri, runs)
    prepare_environment(runs)
    from aepo_core.config_keys import ConfigError
    from flows.replay import replay, replay_rules
    from infra.run.replay import REPLAY_ERRORS

    start_prefect_api()
    if losses is None:
        if len(step) != 1:
            fail(f"--step once without --losses (got {len(step)}: {', '.join(map(str, step))})")
        try:
            result = replay(run=run, step=step[0], runs_dir=str(runs), experiment=experiment,
                            tracking_uri=tracking_uri)
        except REPLAY_ERRORS as exc:
            fail(str(exc))
        _print_replay(result, output)
        raise typer.Exit(0 if result.weights.bit_identical else 1)
    rules = [r.strip().replace(";", ",") for r in losses.split(",") if r.strip()]
    try:
        compared = replay_rules(run=run, steps=step, rules=rules, overrides=list(overrides or []),
                                runs_dir=str(runs), experiment=experiment, tracking_uri=tracking_uri)
    except (*REPLAY_ERRORS, ConfigError) as exc:
        fail(str(exc))
    _print_rules(compared, output)


def rule_records(compared: RuleComparison) -> list[dict[str, object]]:
    """The comparison's rows as printed: value and difference with their intervals in one cell each."""
    return [{"quantity": r.quantity, "class": r.token_class, "rule": r.rule,
             "value": interval(r.value, r.ci_low, r.ci_high, 4, signed=True),
             "diff": interval(r.diff, r.diff_low, r.diff_high, 4, signed=True), "tokens": r.tokens}
            for r in compared.rows]


def _print_rules(compared: RuleComparison, output: OutputFormat) -> None:
    print_records(f"aepo replay: {compared.run_name} ({compared.run_id}) steps "
                  f"{', '.join(map(str, compared.steps))}: update rules on the same samples "
                  f"({sum(compared.samples.values())} samples of {sum(compared.questions.values())} questions; 95% CI "
                  f"over questions; diff = rule − {compared.reference})",
                  rule_records(compared) if output is OutputFormat.table else [asdict(r) for r in compared.rows],
                  output, right=("value", "diff", "tokens"))


def _print_replay(result: ReplayResult, output: OutputFormat) -> None:
    records = [
        {"quantity": "samples replayed", "logged": None, "replayed": result.samples},
        {"quantity": "numerics (compute, generation)", "logged": result.numerics, "replayed": result.numerics},
        {"quantity": "tensors bit-identical to the checkpoint", "logged": result.weights.tensors,
         "replayed": result.weights.identical},
        {"quantity": "max |Δ weight|", "logged": 0.0, "replayed": result.weights.max_abs_diff},
        *({"quantity": name, "logged": logged, "replayed": replayed}
          for name, (logged, replayed) in result.metrics.items()),
    ]
    print_records(f"aepo replay: {result.run_name} ({result.run_id}) step {result.step} — "
                  + ("bit-identical" if result.weights.bit_identical
                     else f"differs from {result.weights.first_different}"),
                  records, output, cell=lambda _c, v: fmt(v) if not isinstance(v, float) else f"{v:.6g}")
