"""Screenshots of a run in the MLflow UI (landing page, the run's traces, one trace) and in the Prefect UI (its
flow run), taken with headless Chromium. Not a test: a way to see what a run looks like in the UIs, and to
check by eye that the traces show (issue 14).

    apt-get install -y chromium                                   # Debian's package; or --chromium PATH
    .venv/bin/python -m bench.screenshots --runs-dir runs         # latest run with traces in runs/mlflow.db

It starts ``aepo ui`` on the runs dir (MLflow and Prefect servers on free ports; stopped at the end), picks the
latest run that has traces (or ``--run-id``), and writes PNGs to ``bench/results/screenshots/``:

- ``1-experiment.png``: the experiment on its training runs. MLflow 3.17's UI decides GenAI vs "Model training"
  with a global switch (URL ``?workflowType=``, else the browser's last choice, else GenAI), not with the
  experiment's ``mlflow.experimentKind`` tag, so the links carry ``workflowType=machine_learning``;
- ``2-run-traces.png``: the run's Traces tab (one row per traced question and step);
- ``3-trace.png``: the trace with the most tool calls (span tree: leaves, model segments, tool calls; the root
  span's inputs and outputs);
- ``4-prefect-flow-run.png``: the run's Prefect flow run (its task runs), when the Prefect database under the runs
  dir knows it.

Chromium renders each page with ``--virtual-time-budget`` (timers run ahead, network waits are awaited), enough
for both React/Vue apps to fetch and draw; ``--budget-ms`` raises it on a slow machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from aepo_core.rollout.tree import NOTICE_EVENTS
from infra.tracking.client import ML_WORKFLOW

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "screenshots"


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Return once ``url`` answers; raise SystemExit if the servers died or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"aepo ui exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    sys.exit(f"{url} did not answer within {timeout_s:.0f} s")


def pick_run(runs_dir: Path, experiment: str, run_id: str | None) -> tuple[str, str, str | None, str | None]:
    """(experiment id, run id, the id of its trace with the most tool spans, its Prefect flow run id)."""
    from mlflow.tracking import MlflowClient

    from infra.tracking.client import TAG_FLOW_RUN, tracking_uri_for

    client = MlflowClient(tracking_uri_for(runs_dir))
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        sys.exit(f"no experiment {experiment!r} in {runs_dir / 'mlflow.db'}")
    runs = ([client.get_run(run_id)] if run_id else
            client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=50))
    for run in runs:
        traces = client.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, max_results=50)
        if traces or run_id:
            best = max(traces, key=_real_tool_calls, default=None)
            return (exp.experiment_id, run.info.run_id, best.info.trace_id if best else None,
                    run.data.tags.get(TAG_FLOW_RUN))
    sys.exit(f"no run with traces in experiment {experiment!r}")


def _real_tool_calls(trace: Any) -> int:
    """Tool spans of a trace that ran a tool (not the scheduler's ``limit`` / ``invalid`` notices)."""
    return sum(s.span_type == "TOOL" and s.name not in NOTICE_EVENTS for s in trace.data.spans)


def screenshot(chromium: str, url: str, path: Path, size: str, budget_ms: int) -> None:
    """One headless Chromium screenshot of ``url``."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--run-all-compositor-stages-before-draw",
           f"--window-size={size}", f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    print(f"{path}  ←  {url}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, required=True, help="Runs dir of the run (mlflow.db, prefect/).")
    ap.add_argument("--run-id", help="MLflow run (default: the latest run with traces).")
    ap.add_argument("--experiment", default="aepo", help="MLflow experiment name.")
    ap.add_argument("--out", type=Path, default=OUT, help="Where the PNGs go.")
    ap.add_argument("--size", default="1600,1000", help="Browser window, width,height.")
    ap.add_argument("--budget-ms", type=int, default=20000, help="Chromium's virtual time budget per page.")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no chromium on PATH: apt-get install -y chromium (or --chromium PATH)")
    runs = args.runs_dir.resolve()
    exp_id, run_id, trace_id, flow_run = pick_run(runs, args.experiment, args.run_id)
    args.out.mkdir(parents=True, exist_ok=True)

    mport, pport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (runs / "logs").mkdir(parents=True, exist_ok=True)
    log = open(runs / "logs" / "screenshots-ui.log", "wb")
    ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--runs-dir", str(runs), "--mlflow-port",
                           str(mport), "--prefect-port", str(pport)], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        mlflow, prefect = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{pport}"
        wait_http(mlflow, 180, ui)
        wait_http(f"{prefect}/api/health", 180, ui)
        ml = f"?{ML_WORKFLOW}"
        shots = [("1-experiment.png", f"{mlflow}/#/experiments/{exp_id}{ml}"),
                 ("2-run-traces.png", f"{mlflow}/#/experiments/{exp_id}/runs/{run_id}/traces{ml}")]
        if trace_id:
            shots.append(("3-trace.png", f"{mlflow}/#/experiments/{exp_id}/traces{ml}&selectedEvaluationId={trace_id}"))
        if flow_run:
            shots.append(("4-prefect-flow-run.png", f"{prefect}/runs/flow-run/{flow_run}"))
        for name, url in shots:
            screenshot(args.chromium, url, args.out / name, args.size, args.budget_ms)
    finally:
        os.killpg(ui.pid, signal.SIGINT)  # aepo ui stops both servers on Ctrl-C
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()
        log.close()


if __name__ == "__main__":
    main()
