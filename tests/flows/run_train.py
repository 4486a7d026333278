"""Run the train flow in its own process (own ephemeral Prefect API), for kill-and-resume tests.

``AEPO_TEST_DIE_AT=module:attribute:n`` (the tests' fault injection, never the product's): the process SIGKILLs
itself when the ``n``-th call of that function or method begins — a kill at a chosen point of a chosen phase,
where a timer could land anywhere. The attribute is patched where the code looks it up (``flows.train:write_eval_
results`` is the name the flow calls, ``infra.run.trainer:Trainer.update`` a method, ``flows.collect:rollout.fn`` a
Prefect task's function). Points joined by `` > `` arm each other: ``flows.collect:rollout.fn:1 >
infra.training.backends:TorchBackend.step:1`` counts optimizer steps only once the first rollout has begun."""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def die_at(spec: str) -> None:
    """Patch each ``module:attribute:n`` of ``spec`` (joined by `` > ``) so that, once the points before it have
    been reached, its ``n``-th call arms the next one; the last one SIGKILLs this process before it runs."""
    points = [point.strip().rsplit(":", 2) for point in spec.split(">")]
    reached = 0  # how many points have been reached

    def patch(index: int, module: str, attribute: str, n: str) -> None:
        *path, name = attribute.split(".")
        owner: Any = functools.reduce(getattr, path, importlib.import_module(module))
        real: Callable[..., Any] = getattr(owner, name)
        calls = 0

        @functools.wraps(real)
        def dying(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls, reached
            if reached == index:
                calls += 1
                if calls == int(n):
                    reached += 1
                    if reached == len(points):
                        os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(owner, name, dying)

    for index, (module, attribute, n) in enumerate(points):
        patch(index, module, attribute, n)


def main() -> None:
    config, runs_dir, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    overrides = sys.argv[4:]
    os.environ["PREFECT_HOME"] = str(Path(runs_dir) / "prefect")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from flows.train import train
    from infra.config_files import load_config

    if os.environ.get("AEPO_TEST_DIE_AT"):
        die_at(os.environ["AEPO_TEST_DIE_AT"])
    out = train(config=load_config(config, overrides), runs_dir=runs_dir, resume=resume)
    Path(runs_dir, "result.json").write_text(json.dumps({"run_id": out.run_id, "steps": out.steps}))


if __name__ == "__main__":
    main()
