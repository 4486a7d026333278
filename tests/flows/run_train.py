"""Run the train flow in its own process (own ephemeral Prefect API), for kill-and-resume tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    config, runs_dir, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    overrides = sys.argv[4:]
    os.environ["PREFECT_HOME"] = str(Path(runs_dir) / "prefect")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from flows.train import train
    from infra.config_files import load_config

    out = train(config=load_config(config, overrides), runs_dir=runs_dir, resume=resume)
    Path(runs_dir, "result.json").write_text(json.dumps({"run_id": out.run_id, "steps": out.steps}))


if __name__ == "__main__":
    main()
