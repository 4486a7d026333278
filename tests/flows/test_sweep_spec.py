"""A sweep cell is exactly the single run it names: ``aepo train -c <base> --set <the cell's overrides>`` (issue 49 §1).

Fields whose unset value depends on another field (``algorithm.dual_clip`` and ``algorithm.loss_agg`` follow the
loss and the advantage) must be derived for each cell from the *unresolved* base, not inherited from the base's
resolved values: a ``dapo`` cell built from a resolved aepo base would keep dual clip 3 (DAPO has none) and a
``gspo`` cell would fail on the base's token-mean."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from aepo_core.config import AdvantageName, LossName
from infra.config_files import load_config
from infra.run.sweep_spec import load_sweep

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def _sweep_file(tmp_path: Path, cells: dict[str, str], base: Path | None = TINY, overrides: str = "") -> Path:
    body = [f"base: {base}" if base else "", "seeds: [3]", overrides, "cells:"]
    body += [f"  {name}: [{ov!r}]" for name, ov in cells.items()]
    path = tmp_path / "sweep.yaml"
    path.write_text("\n".join(line for line in body if line) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("base", [TINY, None], ids=["tiny", "defaults"])
@pytest.mark.parametrize("loss", get_args(LossName))
def test_a_loss_cell_is_the_single_run_of_that_loss(tmp_path: Path, loss: str, base: Path | None) -> None:
    spec = load_sweep(_sweep_file(tmp_path, {"cell": f"algorithm.loss={loss}"}, base))
    (run,) = spec.runs
    single = load_config(base, [f"algorithm.loss={loss}", "seed=3"])
    assert run.config.to_dict() == single.to_dict()


@pytest.mark.parametrize("advantage", get_args(AdvantageName))
def test_an_advantage_cell_is_the_single_run_of_that_advantage(tmp_path: Path, advantage: str) -> None:
    spec = load_sweep(_sweep_file(tmp_path, {"cell": f"algorithm.advantage={advantage}"}))
    single = load_config(TINY, [f"algorithm.advantage={advantage}", "seed=3"])
    assert spec.runs[0].config.to_dict() == single.to_dict()


def test_dapo_cell_has_no_dual_clip_and_gspo_cell_its_aggregation(tmp_path: Path) -> None:
    spec = load_sweep(_sweep_file(tmp_path, {"dapo": "algorithm.loss=dapo", "gspo": "algorithm.loss=gspo",
                                             "aepo": "algorithm.loss=aepo"}))
    by_cell = {r.cell: r.config.algorithm for r in spec.runs}
    assert by_cell["dapo"].dual_clip is None
    assert by_cell["gspo"].loss_agg == "seq-mean-token-mean"
    assert by_cell["aepo"].dual_clip == 3.0 and by_cell["aepo"].loss_agg == "token-mean"


def test_sweep_overrides_and_set_apply_like_the_cli_s(tmp_path: Path) -> None:
    """The sweep's own ``overrides`` and ``--set`` stack on the cell like more ``--set`` flags (``--set`` last)."""
    path = _sweep_file(tmp_path, {"cell": "algorithm.loss=dapo"},
                       overrides="overrides: ['algorithm.dual_clip=2.5', 'train.steps=1']")
    (run,) = load_sweep(path, overrides=["train.steps=2"]).runs
    single = load_config(TINY, ["algorithm.dual_clip=2.5", "train.steps=1", "algorithm.loss=dapo", "seed=3",
                                "train.steps=2"])
    assert run.config.to_dict() == single.to_dict()
    assert run.config.algorithm.dual_clip == 2.5  # an explicit value is honoured, as in a single run
