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
  dir knows it;
- ``5-run-overview.png`` (its description links the flow run), ``6-run-metrics.png`` (the Model metrics tab: the
  ``Summary`` section, Pass@1 and reward, first), ``7-logged-model.png`` (the model it logged: the last step's
  metrics, the run's params, its versions) and ``8-model-version.png`` (the registered version: "Source Model"
  opens the model), issue 54 §2-3.

``--check`` also reads the rendered pages (``--dump-dom``) and exits 1 naming each of issue 54 §3's checks that fails:
the page ``aepo ui`` prints opens the experiment in the classic layout; the run's first chart section is ``Summary``;
the run page links its Prefect flow run; the registry page links the logged model.

Chromium renders each page with ``--virtual-time-budget`` (timers run ahead, network waits are awaited), enough
for both React/Vue apps to fetch and draw; ``--budget-ms`` raises it on a slow machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aepo_core.rollout.tree import NOTICE_EVENTS
from infra.tracking.client import HEADLINE_SECTION, ML_WORKFLOW

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


@dataclass(frozen=True)
class RunPages:
    """What the pages of one run are about: its ids, its chart sections, its trace, flow run, model and version."""

    experiment_id: str
    run_id: str
    trace_id: str | None  # its trace with the most tool spans
    flow_run_id: str | None
    flow_run_url: str | None
    sections: set[str]  # its metric keys up to their last "/": the Model metrics tab's section titles
    model_id: str | None  # the model it logged
    version: tuple[str, str] | None  # the (registered model, version) it registered

    def page(self, mlflow: str, tab: str) -> str:
        return f"{mlflow}/#/experiments/{self.experiment_id}/runs/{self.run_id}{'/' + tab if tab else ''}?{ML_WORKFLOW}"


def pick_run(runs_dir: Path, experiment: str, run_id: str | None) -> RunPages:
    """The run ``run_id``, else the latest run with traces."""
    from mlflow.tracking import MlflowClient

    from infra.tracking.client import TAG_FLOW_RUN, TAG_FLOW_RUN_URL, TAG_REGISTERED_MODEL, tracking_uri_for

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
            tags = run.data.tags
            full = client.get_run(run.info.run_id)  # (search_runs leaves the outputs out)
            models = [m.model_id for m in (full.outputs.model_outputs if full.outputs else [])]
            registered = tags.get(TAG_REGISTERED_MODEL, "").removeprefix("models:/").split("/")
            return RunPages(exp.experiment_id, run.info.run_id, best.info.trace_id if best else None,
                            tags.get(TAG_FLOW_RUN), tags.get(TAG_FLOW_RUN_URL),
                            {k.rsplit("/", 1)[0] if "/" in k else "Model metrics" for k in run.data.metrics},
                            models[-1] if models else None,
                            (registered[0], registered[1]) if len(registered) == 2 else None)
    sys.exit(f"no run with traces in experiment {experiment!r}")


def _real_tool_calls(trace: Any) -> int:
    """Tool spans of a trace that ran a tool (not the scheduler's ``limit`` / ``invalid`` notices)."""
    return sum(s.span_type == "TOOL" and s.name not in NOTICE_EVENTS for s in trace.data.spans)


def rendered_text(chromium: str, url: str, budget_ms: int) -> tuple[str, list[str]]:
    """The page as Chromium renders it: its DOM and its text, one line per element's text."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    html = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    return html, [line.strip() for line in re.sub(r"<[^>]+>", "\n", html).splitlines() if line.strip()]


def lineage_checks(chromium: str, mlflow: str, landing: str, run: RunPages, budget_ms: int) -> list[str]:
    """Issue 54 §3's checks on the rendered pages; the failures, in words (none: all hold)."""
    failures = []
    if f"#/experiments/{run.experiment_id}?{ML_WORKFLOW}" not in landing:
        failures.append(f"aepo ui prints {landing}: not the experiment in the classic layout")
    _, lines = rendered_text(chromium, run.page(mlflow, "model-metrics"), budget_ms)
    first = next((line for line in lines if line in run.sections), None)
    if first != HEADLINE_SECTION:
        failures.append(f"the run's first chart section is {first!r}, not {HEADLINE_SECTION!r}")
    html, _ = rendered_text(chromium, run.page(mlflow, ""), budget_ms)
    if not run.flow_run_url or f'href="{run.flow_run_url}"' not in html:
        failures.append(f"the run page has no link to its Prefect flow run ({run.flow_run_url})")
    if run.version is not None:
        html, lines = rendered_text(chromium, f"{mlflow}/#/models/{run.version[0]}/versions/{run.version[1]}",
                                    budget_ms)
        if "Source Model" not in lines or run.model_id not in html:
            failures.append(f"the registry page of {run.version} does not link its model {run.model_id}")
    return failures


def screenshot(chromium: str, url: str, path: Path, size: str, budget_ms: int) -> None:
    """One headless Chromium screenshot of ``url``."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--run-all-compositor-stages-before-draw",
           f"--window-size={size}", f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    print(f"{path}  ←  {url}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, required=True, help="Runs dir of the run (mlflow.db, prefect/).")
    ap.add_argument("--run-id", help="MLflow run (default: the latest run with traces).")
    ap.add_argument("--experiment", default="aepo", help="MLflow experiment name.")
    ap.add_argument("--out", type=Path, default=OUT, help="Where the PNGs go.")
    ap.add_argument("--size", default="1600,1000", help="Browser window, width,height.")
    ap.add_argument("--budget-ms", type=int, default=20000, help="Chromium's virtual time budget per page.")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    ap.add_argument("--check", action="store_true", help="Also check the rendered pages (issue 54 §3): aepo ui "
                    "opens the experiment in the classic layout, the run's first chart section is Summary (Pass@1, "
                    "reward), its page links its Prefect flow run, the registry page links the logged model; "
                    "exit 1 naming each that fails.")
    args = ap.parse_args()
    if not args.chromium:
        sys.exit("no chromium on PATH: apt-get install -y chromium (or --chromium PATH)")
    runs = args.runs_dir.resolve()
    run = pick_run(runs, args.experiment, args.run_id)
    args.out.mkdir(parents=True, exist_ok=True)

    mport, pport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    (runs / "logs").mkdir(parents=True, exist_ok=True)
    log_path = runs / "logs" / "screenshots-ui.log"
    log = open(log_path, "wb")
    ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--runs-dir", str(runs), "--mlflow-port",
                           str(mport), "--prefect-port", str(pport)], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        mlflow, prefect = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{pport}"
        wait_http(mlflow, 180, ui)
        wait_http(f"{prefect}/api/health", 180, ui)
        while "Ctrl-C stops the servers" not in log_path.read_text(errors="replace"):
            time.sleep(0.5)
        status = 0
        landing = next((w for line in log_path.read_text().splitlines() if line.strip().startswith("open")
                        for w in line.split() if w.startswith("http")), "")
        ml = f"?{ML_WORKFLOW}"
        exp_id, run_id = run.experiment_id, run.run_id
        shots = [("1-experiment.png", landing or f"{mlflow}/#/experiments/{exp_id}{ml}"),
                 ("2-run-traces.png", f"{mlflow}/#/experiments/{exp_id}/runs/{run_id}/traces{ml}")]
        if run.trace_id:
            shots.append(("3-trace.png", f"{mlflow}/#/experiments/{exp_id}/traces{ml}&selectedEvaluationId="
                                         f"{run.trace_id}"))
        if run.flow_run_id:
            shots.append(("4-prefect-flow-run.png", f"{prefect}/runs/flow-run/{run.flow_run_id}"))
        shots += [("5-run-overview.png", run.page(mlflow, "")),
                  ("6-run-metrics.png", run.page(mlflow, "model-metrics"))]
        if run.model_id:
            shots.append(("7-logged-model.png", f"{mlflow}/#/experiments/{exp_id}/models/{run.model_id}{ml}"))
        if run.version:
            shots.append(("8-model-version.png", f"{mlflow}/#/models/{run.version[0]}/versions/{run.version[1]}"))
        for name, url in shots:
            screenshot(args.chromium, url, args.out / name, args.size, args.budget_ms)
        if args.check:
            failures = lineage_checks(args.chromium, mlflow, landing, run, args.budget_ms)
            for failure in failures:
                print(f"CHECK FAILED: {failure}")
            print("checks: " + ("all hold" if not failures else f"{len(failures)} failed"))
            status = 1 if failures else 0
    finally:
        os.killpg(ui.pid, signal.SIGINT)  # aepo ui stops both servers on Ctrl-C
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()
        log.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
