"""``aepo replay``: re-run one stored step's policy update from the trajectory store and the checkpoint before it,
and check the weights against the run's own checkpoint of that step."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.environment import prepare_environment, start_prefect_api
from flows.cli.inputs import FormatOpt, RunsOpt, TrackingOpt, check_tracking_server, resolve_runs_dir
from flows.cli.render import OutputFormat, fail, fmt, print_records


def replay_cmd(
    run: Annotated[str, typer.Argument(help="MLflow run id or run name (the newest of that name).")],
    step: Annotated[int, typer.Option("--step", help="The RL step whose update to replay (1 is the first).")],
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

    \b
    Examples:
      aepo train -c configs/tiny.yaml --set checkpoint.every=1 --set train.steps=3
      aepo replay tiny --step 2
      aepo replay tiny --step 2 --format json
    """
    runs = resolve_runs_dir(runs_dir)
    check_tracking_server(tracking_uri)
    prepare_environment(runs)
    from flows.replay import replay
    from infra.run.checkpoints import CheckpointError
    from infra.run.replay import ReplayError

    start_prefect_api()
    try:
        result = replay(run=run, step=step, runs_dir=str(runs), experiment=experiment, tracking_uri=tracking_uri)
    except (ReplayError, CheckpointError) as exc:
        fail(str(exc))
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
    if not result.weights.bit_identical:
        raise typer.Exit(1)
