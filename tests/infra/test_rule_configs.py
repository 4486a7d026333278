"""The configs ``aepo replay --losses`` updates with (:func:`infra.run.replay.rule_configs`): the run's config, then
``--set`` for every rule, then each rule's algorithm section."""

from __future__ import annotations

from pathlib import Path

import pytest

from aepo_core.config_keys import ConfigError
from infra.config_files import load_config
from infra.run.replay import rule_configs

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_the_runs_own_loss_updates_with_the_runs_own_algorithm_section():
    run = load_config(TINY, ["algorithm.dual_clip=2.0", "algorithm.loss_agg=seq-mean-token-mean"])
    configs = rule_configs(run, ["aepo", "ppo_clip", "aepo@clip_gate=high_entropy"], ["optim.mini_batch_size=1"])
    assert configs["aepo"].algorithm == run.algorithm  # not aepo's defaults (dual_clip 3, token-mean)
    assert all(cfg.optim.mini_batch_size == 1 for cfg in configs.values())
    for other in ("ppo_clip", "aepo@clip_gate=high_entropy"):  # another rule: its loss at the paper's defaults
        assert (configs[other].algorithm.dual_clip, configs[other].algorithm.loss_agg) == (3.0, "token-mean")
    with pytest.raises(ConfigError, match="update rule 'ppo'"):
        rule_configs(run, ["ppo"])
