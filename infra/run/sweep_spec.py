"""A sweep file, parsed and validated without Prefect or MLflow (``aepo sweep --dry-run`` lists its runs from here
before anything starts): cells × seeds, each with its fully resolved config. The sweep flow is :mod:`flows.sweep`.

Sweep file (YAML; relative paths are relative to the sweep file)::

    name: algorithms              # parent MLflow run name; output directory <runs_dir>/sweeps/<name>/
    base: ../tiny.yaml            # the experiment config every cell starts from (default: built-in defaults)
    overrides:                    # dotted overrides applied to every cell (a mapping or a list of "k=v")
      train.steps: 4
    seeds: [0, 1, 2]              # every cell runs once per seed (sets `seed`); default: the base config's seed
    grid:                         # axes → levels → overrides; the cells are the cross product of the levels,
      algorithm:                  # named by joining the level names with "-" (one axis: the level name)
        aepo: {rollout.mode: aepo, algorithm.loss: aepo}
        grpo: {rollout.mode: independent, algorithm.loss: ppo_clip, algorithm.entropy_advantage: false}
    cells:                        # extra cells after the grid: name → overrides (e.g. ablations)
      aepo-no-premonitor: {rollout.mode: aepo, algorithm.loss: aepo, rollout.premonitor: false}
    runs_dir: runs                # optional; the flow's runs_dir parameter (or the CLI's --runs-dir) wins
    sequential:                   # optional: the group-sequential design `aepo sweep --sequential` runs
      waves: [2, 2, 2, 2, 2]      # seeds per wave, in the order of `seeds` (they must add up to its length)
      comparisons: [[aepo, arpo], [aepo, grpo], [arpo, grpo]]   # cells compared (a − b), paired by seed
      alpha: 0.05                 # family-wise, two-sided (Bonferroni over the comparisons)
      margin: 0.15                # equivalence margin on Pass@1 (optional)
      variance: paired            # or pooled (t), or pilot (z with the stated sigma; aepo_core/sequential.py)
      futility: none              # or obf / pocock: non-binding β-spending futility stop for delta at power
      delta: 0.121                # the planned effect (needed by pilot and futility)
      sigma: 0.0963               # the pilot's SD of one seed's paired difference (needed by pilot and futility)
      power: 0.8                  # per comparison at delta
      datasets: [synthetic_test]  # eval datasets (keys) whose final per-question Pass@1 is compared (default all)

A child run is named ``<name>-<cell>-s<seed>`` and tagged ``sweep_name``, ``sweep_cell`` (its MLflow params hold
the whole resolved config).  Every cell's config is validated before the first one runs, so a typo in the last
ablation fails the sweep at once with the cell and key in the message.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigError
from aepo_core.config_section import Section
from aepo_core.overrides import config_from_yaml, parse_override
from aepo_core.sequential import Design
from infra.config_files import read_config_text

SPEC_KEYS = frozenset({"name", "base", "overrides", "seeds", "grid", "cells", "runs_dir", "description",
                       "sequential"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SweepRun:
    """One child training run: a cell of the grid at one seed, with its fully resolved config."""

    cell: str
    seed: int
    run_name: str
    overrides: dict[str, Any]
    config: ExperimentConfig = field(repr=False)


class SequentialSpec(Section):
    """A sweep's ``sequential:`` section: the group-sequential design of :mod:`aepo_core.sequential`."""

    waves: list[int] = Field(description="Seeds per wave, in the order of the sweep's seeds (they add up to its "
                                         "number of seeds); a look follows every wave.")
    comparisons: list[tuple[str, str]] = Field(description="The planned comparisons [a, b] (a − b) of cells, "
                                                           "paired by seed.")
    alpha: float = Field(0.05, description="Family-wise two-sided type I error, split over the comparisons "
                                           "(Bonferroni).")
    margin: float | None = Field(None, description="Equivalence margin on Pass@1: a comparison whose repeated CI "
                                                   "lies within ±margin stops as equivalent; None: no such stop.")
    variance: Literal["paired", "pooled", "pilot"] = Field("paired", description="The variance of a seed-matched "
                                                           "difference: over its own seeds (paired, t), the seed × "
                                                           "arm residual of the arms still running (pooled, t), or "
                                                           "sigma stated from a pilot (pilot, z: waves must reach "
                                                           "the power at delta).")
    futility: Literal["none", "obf", "pocock"] = Field("none", description="Non-binding β-spending futility stop "
                                                       "for the effect delta at power (O'Brien–Fleming- or "
                                                       "Pocock-type); none: no futility stop.")
    delta: float | None = Field(None, description="The planned effect on Pass@1 (the design's alternative); "
                                                  "needed by variance: pilot and by a futility rule.")
    sigma: float | None = Field(None, description="The pilot's SD of one seed's paired difference of Pass@1 "
                                                  "(bench/results/power_claims_powered.json: 0.0963); needed by "
                                                  "variance: pilot and by a futility rule.")
    power: float = Field(0.8, description="The power at delta per comparison (futility boundaries, pilot seeds).")
    datasets: list[str] | None = Field(None, description="Eval dataset keys whose final per-question Pass@1 is "
                                                         "compared (all questions pooled); None: every one.")

    def design(self) -> Design:
        return Design(tuple(self.waves), tuple(self.comparisons), self.alpha, self.margin, self.variance,
                      self.futility, self.delta, self.sigma, self.power)


def _sequential(raw: Any, label: str, cells: Mapping[str, Any], seeds: Sequence[int]) -> SequentialSpec | None:
    """The validated ``sequential:`` section (None when absent); :class:`ConfigError` names the field."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{label}: sequential must be a mapping (waves, comparisons, …); got {raw!r}")
    try:
        seq = SequentialSpec.model_validate(dict(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{label}: sequential.{where}: {first['msg']}") from None
    unknown = sorted({c for pair in seq.comparisons for c in pair} - set(cells))
    if unknown:
        raise ConfigError(f"{label}: sequential.comparisons: no cell(s) {unknown}; the cells are {', '.join(cells)}")
    if sum(seq.waves) != len(seeds):
        raise ConfigError(f"{label}: sequential.waves: {seq.waves} add up to {sum(seq.waves)} seeds, but seeds "
                          f"lists {len(seeds)}")
    try:
        seq.design()
    except ValueError as exc:
        raise ConfigError(f"{label}: sequential: {exc}") from None
    return seq


@dataclass(frozen=True)
class SweepSpec:
    """A parsed, validated sweep file (see the module docstring)."""

    name: str
    base: ExperimentConfig = field(repr=False)
    base_source: str
    overrides: dict[str, Any]
    seeds: list[int]
    cells: dict[str, dict[str, Any]]
    runs_dir: str | None = None
    runs: list[SweepRun] = field(default_factory=list, repr=False)
    forced: dict[str, Any] = field(default_factory=dict)
    """Overrides given with the sweep (``aepo sweep --set``): applied to every cell, after the cell's own."""
    sequential: SequentialSpec | None = None
    """The file's group-sequential design (``aepo sweep --sequential`` runs it)."""

    def as_dict(self) -> dict[str, Any]:
        """The sweep as plain data (logged to the parent run)."""
        return {"name": self.name, "base": self.base_source, "overrides": self.overrides, "seeds": self.seeds,
                "cells": self.cells, "set": self.forced, "runs": [r.run_name for r in self.runs],
                **({"sequential": self.sequential.model_dump()} if self.sequential else {})}


def _override_map(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return dict(parse_override(v) for v in value)
    raise ConfigError(f"sweep {where}: expected a mapping of dotted keys or a list of 'key=value'; got {value!r}")


def _check_name(name: str, what: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"sweep {what} {name!r}: use letters, digits, '.', '_' or '-' (it names runs and files)")
    return name


def _grid_cells(grid: Any) -> dict[str, dict[str, Any]]:
    if grid is None:
        return {}
    if not isinstance(grid, Mapping) or not grid:
        raise ConfigError(f"sweep grid: expected a mapping axis → {{level: overrides}}; got {grid!r}")
    axes = []
    for axis, levels in grid.items():
        if not isinstance(levels, Mapping) or not levels:
            raise ConfigError(f"sweep grid.{axis}: expected a non-empty mapping level → overrides; got {levels!r}")
        axes.append([(_check_name(str(lv), f"grid.{axis} level"), _override_map(ov, f"grid.{axis}.{lv}"))
                     for lv, ov in levels.items()])
    cells: dict[str, dict[str, Any]] = {}
    for combo in itertools.product(*axes):
        merged: dict[str, Any] = {}
        for _, ov in combo:
            merged.update(ov)
        cells["-".join(lv for lv, _ in combo)] = merged
    return cells


def load_sweep(source: str | Path | Mapping[str, Any], overrides: Sequence[str] = (),
               only_cells: Sequence[str] | None = None) -> SweepSpec:
    """Parse and validate a sweep (a YAML path or the same data as a dict); every cell × seed config is built,
    so any bad key fails here with the cell named (:class:`ConfigError`).

    ``overrides`` (``"key=value"``, ``aepo sweep --set``) apply to every cell after its own overrides (and to the
    parent's config); ``only_cells`` keeps those cells (``aepo sweep --cells``), in the file's order."""
    raw, here, label = _read_sweep(source)
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise ConfigError(f"{label}: unknown sweep key(s) {unknown}; known: {sorted(SPEC_KEYS)}")
    name = _check_name(str(raw.get("name") or "sweep"), "name")
    # Every config is built from the base file's text, never from a resolved config: fields whose unset value
    # follows another (algorithm.dual_clip and loss_agg follow the loss) are then derived for each cell exactly as
    # `aepo train -c <base> --set <the cell's overrides>` derives them.
    base_ref = raw.get("base")
    if base_ref is None:
        base_text, base_source = "{}", "defaults"
    else:
        base_path = Path(str(base_ref)).expanduser()
        base_path = base_path if base_path.is_absolute() else here / base_path
        base_text, base_source = read_config_text(base_path, "config file"), str(base_path.resolve())
    forced = _override_map(list(overrides), "--set")
    common = {**_override_map(raw.get("overrides"), "overrides"), **forced}
    # the parent run's config: it logs where the children do (e.g. tracking.tracking_uri of a server)
    base = config_from_yaml(base_text, common, source=f"{label}, base {base_source}")
    seeds_raw = raw.get("seeds")
    seeds = [base.seed] if seeds_raw is None else seeds_raw
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                             for s in seeds):
        raise ConfigError(f"{label}: seeds must be a non-empty list of integers; got {seeds_raw!r}")
    cells = _only(_cells(raw, label), only_cells, label)
    sequential = _sequential(raw.get("sequential"), label, cells, seeds)
    runs = []
    for cell, ov in cells.items():
        for seed in seeds:
            cfg = config_from_yaml(base_text, {**common, **ov, "seed": seed, **forced},
                                   source=f"{label}, cell {cell}")
            if (cfg.tracking.tracking_uri, cfg.tracking.experiment) != (base.tracking.tracking_uri,
                                                                        base.tracking.experiment):
                raise ConfigError(f"{label}, cell {cell}: tracking.* must match the base config (the children are "
                                  "nested under one parent run in one MLflow experiment)")
            runs.append(SweepRun(cell, seed, f"{name}-{cell}-s{seed}", {**common, **ov, "seed": seed, **forced},
                                 cfg))
    runs_dir = raw.get("runs_dir")
    if runs_dir is not None and not Path(str(runs_dir)).expanduser().is_absolute():
        runs_dir = str(here / str(runs_dir)) if not isinstance(source, Mapping) else str(runs_dir)
    return SweepSpec(name, base, base_source, common, list(seeds), cells, runs_dir, runs, forced, sequential)


def _read_sweep(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], Path, str]:
    """The sweep's raw mapping, the directory its relative paths start from, and how messages name it."""
    if isinstance(source, Mapping):
        return dict(source), Path.cwd(), "sweep parameters"
    path = Path(source).expanduser()
    text = read_config_text(path, "sweep file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {path}: expected a mapping at the top level")
    return raw, path.resolve().parent, str(path)


def _cells(raw: Mapping[str, Any], label: str) -> dict[str, dict[str, Any]]:
    """The grid's cells, then the extra ``cells`` (one cell ``base`` when there are none)."""
    cells = _grid_cells(raw.get("grid"))
    extra = raw.get("cells") or {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{label}: cells must be a mapping name → overrides; got {extra!r}")
    for cell, ov in extra.items():
        cell = _check_name(str(cell), "cell")
        if cell in cells:
            raise ConfigError(f"{label}: cell {cell!r} is defined twice (grid and cells)")
        cells[cell] = _override_map(ov, f"cells.{cell}")
    return cells or {"base": {}}


def _only(cells: dict[str, dict[str, Any]], only_cells: Sequence[str] | None, label: str
          ) -> dict[str, dict[str, Any]]:
    """``only_cells`` of ``cells`` (None: all), in the file's order; an unknown cell fails naming the known ones."""
    if only_cells is None:
        return cells
    unknown_cells = [c for c in only_cells if c not in cells]
    if unknown_cells or not only_cells:
        raise ConfigError(f"{label}: no cell(s) {unknown_cells or list(only_cells)}; the cells are "
                          f"{', '.join(cells)}")
    return {c: ov for c, ov in cells.items() if c in only_cells}


_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse_shard(shard: str) -> tuple[int, int]:
    """``"i/N"`` → (i, N), 1 ≤ i ≤ N."""
    m = _SHARD_RE.match(shard)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ConfigError(f"shard must be 'i/N' with 1 <= i <= N (e.g. '1/2'); got {shard!r}")
    return int(m.group(1)), int(m.group(2))


def shard_runs(runs: Sequence[SweepRun], shard: str | None) -> list[SweepRun]:
    """The runs of shard ``"i/N"``: every N-th run from the i-th, so that cells and seeds spread evenly."""
    if shard is None:
        return list(runs)
    i, n = parse_shard(shard)
    return list(runs)[i - 1::n]


def sweep_spec(sweep_config: str | Mapping[str, Any], shard: str | None, overrides: Sequence[str] | None = None,
               cells: Sequence[str] | None = None) -> SweepSpec:
    """The sweep a flow run runs: the file's (or mapping's) with ``overrides`` on every cell, only ``cells`` (None:
    all), cut to one shard ``"i/N"`` (named ``…-shardIofN``)."""
    spec = load_sweep(sweep_config, overrides or (), cells)
    if shard is None:
        return spec
    i, n = parse_shard(shard)
    return replace(spec, name=f"{spec.name}-shard{i}of{n}", runs=shard_runs(spec.runs, shard))


def configured_runs_dir(path: Path) -> Path | None:
    """The sweep file's ``runs_dir`` (relative to the file), resolved; None when it names none. Raises
    :class:`ConfigError` for a file that cannot be read or parsed."""
    try:
        raw = yaml.safe_load(read_config_text(path, "sweep file")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read sweep file {path}: {exc}") from None
    value = raw.get("runs_dir") if isinstance(raw, dict) else None
    if not value:
        return None
    p = Path(str(value)).expanduser()
    return (p if p.is_absolute() else path.resolve().parent / p).resolve()
