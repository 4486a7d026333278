"""The inputs the commands share: their common options, the runs dir, and the checks that run before anything is
created (:mod:`infra.run.preflight`: a bad config or dataset exits 2 with one line; an MLflow server that does not
answer exits 1)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import typer

from aepo_core.config import RUNS_DIR_ENV, ExperimentConfig
from aepo_core.overrides import did_you_mean
from flows.cli.render import OutputFormat, fail
from infra.run import preflight
from infra.run.preflight import DEFAULT_RUNS_DIR, InputError, with_runs_dir

__all__ = [
    "DEFAULT_RUNS_DIR",
    "check_datasets",
    "check_experiment",
    "check_not_running",
    "check_storage",
    "check_tracking_store",
    "choice",
    "choices",
    "exits",
    "healthy",
    "load_checked_config",
    "reading_tracking_uri",
    "resolve_runs_dir",
    "with_runs_dir",
]

RUNS_ENV = RUNS_DIR_ENV

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Experiment config YAML.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                  help="Dotted override key=value (repeatable).")]
RunsOpt = Annotated[str | None, typer.Option("--runs-dir", envvar=RUNS_ENV, show_envvar=True, metavar="DIR",
                                             help="Where all state goes (default: the config's storage.runs_dir, "
                                                  "./runs).")]
E = TypeVar("E", bound=enum.Enum)


def choice(enum_type: type[E]) -> Callable[[str | E], E]:
    """The ``parser`` of an option whose values are ``enum_type``'s: the member, or a ValueError that lists the
    values and offers the closest to a near miss (``--format jsn``: did you mean 'json'?)."""
    values = [str(member.value) for member in enum_type]

    def parse(text: str | E) -> E:
        if isinstance(text, enum_type):
            return text
        try:
            return enum_type(text)
        except ValueError:
            raise ValueError(f"{text!r} is not one of {', '.join(map(repr, values))}"
                             f"{did_you_mean(str(text), values, 0.6)}") from None

    return parse


def choices(enum_type: type[enum.Enum]) -> str:
    """An enum option's metavar: its values."""
    return "[" + "|".join(str(member.value) for member in enum_type) + "]"


FormatOpt = Annotated[OutputFormat, typer.Option("--format", parser=choice(OutputFormat), metavar=choices(OutputFormat),
                                                help="table (for a person), csv or json (every value unrounded, "
                                                     "for a program).")]
TrackingOpt = Annotated[str | None, typer.Option("--tracking-uri", help="MLflow tracking URI, e.g. an `mlflow "
                                                 "server` (http://host:5000, `aepo ui`); default: the runs dir's "
                                                 "SQLite store.")]


def resolve_runs_dir(option: str | None, cfg: ExperimentConfig | None = None) -> Path:
    """--runs-dir / $AEPO_RUNS_DIR (typer fills ``option`` from both), else the config's, else ./runs; absolute
    (the cwd of a later command does not matter)."""
    return preflight.resolve_runs_dir(option, cfg.storage.runs_dir if cfg is not None else None).resolve()


P = ParamSpec("P")
R = TypeVar("R")


def exits(check: Callable[P, R]) -> Callable[P, R]:
    """``check`` as a command calls it: its :class:`~infra.run.preflight.InputError` becomes the one line and the
    exit code it names (:func:`~flows.cli.render.fail`)."""

    @functools.wraps(check)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return check(*args, **kwargs)
        except InputError as exc:
            fail(str(exc), code=exc.code)

    return checked


def check_experiment(uri: str, experiment: str) -> None:
    """Exit 2 naming the store's experiments (and the closest one) when ``experiment`` is not among them."""
    from infra.run.reading import experiment_names

    known = experiment_names(uri)
    if experiment not in known:
        fail(f"no experiment {experiment!r} at {uri}{did_you_mean(experiment, known, 0.6)} (experiments: "
             f"{', '.join(known) or 'none'}; --experiment/-e)")


def load_checked_config(path: Path | None, sets: Sequence[str] | None, training: bool = True) -> ExperimentConfig:
    """The config with overrides, its datasets checked; exits 2 with the problem named."""
    return exits(preflight.load_checked_config)(path, list(sets or []), training)


check_storage = exits(preflight.check_storage)
check_not_running = exits(preflight.check_not_running)
check_tracking_store = exits(preflight.check_tracking_store)
reading_tracking_uri = exits(preflight.reading_tracking_uri)
healthy = preflight.healthy
check_datasets = preflight.check_datasets
