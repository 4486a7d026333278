"""The config tree: defaults, YAML round trip, dotted overrides, clear errors."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from aepo_core.advantages import ADVANTAGE_ESTIMATORS
from aepo_core.config import AdvantageName, ExperimentConfig, LossName
from aepo_core.config_keys import RENAMED_KEYS, ConfigError, ConfigKeyDeprecationWarning
from aepo_core.losses import POLICY_LOSSES
from aepo_core.overrides import build_config, config_from_yaml, parse_override
from infra.config_files import load_config, save_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_are_the_papers():
    cfg = ExperimentConfig()
    r, a, o = cfg.rollout, cfg.algorithm, cfg.optim
    assert (r.k, r.initial_rollouts, r.beta, r.entropy_window) == (12, 6, 0.5, 20)
    assert (r.gamma, r.tau, r.branch_penalty, r.beam_size) == (0.2, 0.5, 0.05, 2)
    assert (r.max_tool_calls, r.temperature) == (6, 1.0)
    assert (a.loss, a.entropy_advantage, a.entropy_advantage_alpha) == ("aepo", True, 0.2)
    assert (a.clip_low, a.clip_high, a.kl_coef, a.loss_agg) == (0.2, 0.2, 0.0, "token-mean")
    assert (o.lr, o.weight_decay, o.grad_clip, o.ppo_epochs, o.mini_batch_size) == (1e-6, 0.01, 1.0, 1, 8)
    assert (cfg.eval.temperature, cfg.eval.top_p, cfg.eval.n_samples) == (0.6, 0.95, 5)


def test_yaml_round_trip(tmp_path):
    cfg = build_config({"rollout": {"k": 8}}, ["algorithm.loss=gspo", "eval.datasets=[gaia, xbench]"])
    path = save_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(path)
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    assert again.eval.datasets == ["gaia", "xbench"]


def test_dotted_overrides_and_types():
    cfg = build_config({}, ["rollout.k=16", "rollout.premonitor=false", "optim.lr=3e-6", "algorithm.dual_clip=3"])
    assert cfg.rollout.k == 16 and cfg.rollout.premonitor is False
    assert cfg.optim.lr == pytest.approx(3e-6) and cfg.algorithm.dual_clip == 3.0
    cfg = build_config({}, {"rollout.mode": "arpo", "seed": 7})
    assert cfg.rollout.mode == "arpo" and cfg.seed == 7
    assert parse_override("a.b=x=y") == ("a.b", "x=y")


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.kk'"):
        build_config({}, ["rollout.kk=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'algorithmm'"):
        config_from_yaml("algorithmm:\n  loss: aepo\n")


def test_bad_type_and_range_are_named():
    with pytest.raises(ConfigError, match=r"'rollout\.k'.*integer"):
        build_config({}, ["rollout.k=lots"])
    with pytest.raises(ConfigError, match=r"'rollout\.k'"):
        build_config({}, ["rollout.k=-2"])
    with pytest.raises(ConfigError, match=r"'algorithm\.loss'"):
        build_config({}, ["algorithm.loss=ppo2"])
    with pytest.raises(ConfigError, match="initial_rollouts"):
        build_config({}, ["rollout.k=2", "rollout.initial_rollouts=3"])
    with pytest.raises(ConfigError, match="pass_k"):
        build_config({}, ["eval.pass_k=9"])
    with pytest.raises(ConfigError, match="not of the form"):
        build_config({}, ["rollout.k"])
    with pytest.raises(ConfigError, match=r"'rollout\.k'"):
        build_config({}, ["rollout.k.x=1"])
    with pytest.raises(ConfigError, match=r"rollout\.k is not a section"):
        build_config({"rollout": {"k": 3}}, ["rollout.k.x=1"])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"not found.*missing\.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("rollout:\n  gama: 0.3\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml.*unknown key 'rollout\.gama'"):
        load_config(typo)


def _is_sweep(path: Path) -> bool:
    """A sweep file (configs/sweeps/, configs/recipes/): a base config and a grid of overrides, built cell by cell by
    tests/flows/test_sweep.py and test_recipes.py."""
    import yaml

    return "grid" in (yaml.safe_load(path.read_text()) or {})


EXPERIMENT_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml") if not _is_sweep(p))


@pytest.mark.parametrize("path", EXPERIMENT_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(path)


def _leaves(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", EXPERIMENT_CONFIGS, ids=lambda p: p.name)
def test_a_shipped_config_is_what_its_file_says(path):
    """Every value the file sets is the loaded config's (nothing dropped, renamed or defaulted over it), and what it
    leaves unset is the default of the loss it names (DAPO has no dual-clip; GSPO aggregates per sequence)."""
    import yaml

    raw = dict(_leaves(yaml.safe_load(path.read_text())))
    cfg = load_config(path)
    flat = cfg.flat()
    assert {k: flat.get(k, "<missing>") for k in raw} == raw
    alg = cfg.algorithm
    if "algorithm.dual_clip" not in raw:
        assert alg.dual_clip == (None if alg.loss == "dapo" else 3.0), path.name
    if "algorithm.loss_agg" not in raw:
        assert alg.loss_agg == ("seq-mean-token-mean" if alg.loss == "gspo" else "seq-mean-token-sum-norm"
                                if alg.advantage == "dr_grpo" else "token-mean"), path.name


def test_paper_config_matches_the_spec():
    cfg = load_config(CONFIGS / "paper" / "qwen3_14b_deepsearch.yaml")
    assert cfg.rollout.k == 12 and cfg.rollout.beam_size == 2 and cfg.train.batch_size == 64
    assert cfg.optim.lr == 1e-6 and cfg.rollout.max_response_tokens == 6192 and cfg.eval.pass_k == 5


def test_flat_params():
    flat = ExperimentConfig().flat()
    assert flat["rollout.k"] == 12 and flat["algorithm.loss"] == "aepo"


def fields_of(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, FieldInfo) of every field of ``model``, nested sections included."""
    for name, info in model.model_fields.items():
        yield prefix + name, info
        for section in (info.annotation, *get_args(info.annotation)):  # a section, or one inside Optional/list
            if isinstance(section, type) and issubclass(section, BaseModel):
                yield from fields_of(section, f"{prefix}{name}.")


def test_every_field_is_described():
    keys = dict(fields_of(ExperimentConfig))
    assert "data.synthetic.entities" in keys and "rollout.remote.url" in keys and "tools.search.top_k" in keys
    undescribed = [key for key, info in keys.items() if not (info.description or "").strip()]
    assert undescribed == [], f"config fields without a description: {', '.join(undescribed)}"


def test_literal_names_match_the_registries():
    assert sorted(get_args(LossName)) == sorted(POLICY_LOSSES)
    assert sorted(get_args(AdvantageName)) == sorted(ADVANTAGE_ESTIMATORS)


def test_initial_rollouts_default_follows_k():
    assert build_config({}, ["rollout.k=4"]).rollout.initial_rollouts == 2
    assert build_config({}, ["rollout.k=1"]).rollout.initial_rollouts == 1
    assert build_config({}, ["rollout.k=5"]).rollout.initial_rollouts == 2
    assert build_config({}).rollout.initial_rollouts == 6  # the paper's 6 of k = 12
    assert build_config({}, ["rollout.k=4", "rollout.initial_rollouts=4"]).rollout.initial_rollouts == 4
    with pytest.raises(ConfigError, match=r"rollout\.initial_rollouts \(5\) must not exceed rollout\.k \(4\)$"):
        build_config({}, ["rollout.k=4", "rollout.initial_rollouts=5"])


def test_renamed_keys_table_points_from_gone_keys_to_existing_ones():
    keys = dict(fields_of(ExperimentConfig))
    assert RENAMED_KEYS and all(new in keys and old not in keys for old, new in RENAMED_KEYS.items())
    assert len(set(RENAMED_KEYS.values())) == len(RENAMED_KEYS)


def test_renamed_keys_still_work_with_a_warning():
    yaml_text = "data:\n  synthetic_entities: 40\n  synthetic_families: [compute]\nrollout:\n  remote_url: http://a\n"
    with pytest.warns(ConfigKeyDeprecationWarning) as caught:
        cfg = config_from_yaml(yaml_text, ["rollout.remote_reload_url=http://a/reload"], source="old.yaml")
    messages = sorted(str(w.message) for w in caught)
    assert "data.synthetic_entities is deprecated: use data.synthetic.entities (old.yaml)" in messages
    assert "rollout.remote_reload_url is deprecated: use rollout.remote.reload_url (old.yaml)" in messages
    assert len(messages) == 4
    assert cfg == build_config({"data": {"synthetic": {"entities": 40, "families": ["compute"]}},
                                "rollout": {"remote": {"url": "http://a", "reload_url": "http://a/reload"}}})
    old_tree = {"data": {"synthetic_seed": 3}}
    with pytest.warns(ConfigKeyDeprecationWarning, match=r"use data\.synthetic\.seed"):  # e.g. a flow parameter
        assert ExperimentConfig.model_validate(old_tree).data.synthetic.seed == 3
    assert old_tree == {"data": {"synthetic_seed": 3}}  # the caller's tree is left alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keys warn about nothing
        load_config(CONFIGS / "demo.yaml", ["data.synthetic.seed=3"])


def test_renamed_keys_overrides_win_in_either_spelling():
    with pytest.warns(ConfigKeyDeprecationWarning):
        assert build_config({"data": {"synthetic_seed": 1}}, ["data.synthetic.seed=2"]).data.synthetic.seed == 2
        assert build_config({"data": {"synthetic": {"seed": 1}}}, ["data.synthetic_seed=2"]).data.synthetic.seed == 2
        assert build_config({}, ["data.synthetic_seed=2", "data.synthetic.seed=3"]).data.synthetic.seed == 3
        with pytest.raises(ConfigError, match=r"data\.synthetic_seed and data\.synthetic\.seed are both set"):
            build_config({"data": {"synthetic_seed": 1, "synthetic": {"seed": 2}}})


def test_training_needs_a_weight_reload_hook_and_synthetic_sft_data():
    """Errors at start, naming the key (issue 11): a remote engine that cannot follow the weights would sample every
    step from the initial policy; SFT transcripts exist only for the synthetic task."""
    from aepo_core.config_keys import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.remote\.reload_url"):
        build_config({}, ["rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:8000"]).check_trainable()
    build_config({}, ["rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:8000",
                      "rollout.remote.reload_url=http://127.0.0.1:8000/reload"]).check_trainable()
    build_config({}, ["rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:8000",
                      "rollout.remote.weight_sync=vllm"]).check_trainable()
    build_config({}, ["rollout.engine=vllm"]).check_trainable()  # the run's own server: always synced
    with pytest.raises(ConfigError, match=r"train\.sft\.enabled"):
        build_config({}, ["train.sft.enabled=true", "data.train=hotpotqa"]).check_trainable()
    build_config({}, ["train.sft.enabled=true", "data.train=synthetic"]).check_trainable()


def test_the_paper_config_can_train():
    from infra.config_files import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "paper" / "qwen3_14b_deepsearch.yaml")
    cfg.check_trainable()


def test_exact_entropies_refused_under_zero3_on_several_ranks():
    """Issue 49 §6: ExactEntropyEngine scores every rollout call with a forward of the training model in this
    process, a collective under ZeRO-3, while the ranks roll out different shards with different numbers of calls:
    the run would hang. Refused at start naming the keys; one rank, ZeRO-2 or exact_entropy off are fine."""
    remote = ["rollout.engine=remote", "rollout.remote.url=http://127.0.0.1:8000", "rollout.remote.weight_sync=vllm",
              "train.backend=deepspeed", "train.zero_stage=3"]
    cfg = build_config({}, remote)
    with pytest.raises(ConfigError, match=r"rollout\.exact_entropy=true.*rollout\.engine=remote.*"
                                          r"train\.zero_stage=3.*2 ranks.*rollout\.exact_entropy=false"):
        cfg.check_trainable(world_size=2)
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm"):
        build_config({}, [*remote, "rollout.engine=vllm"]).check_trainable(world_size=2)
    cfg.check_trainable(world_size=1)
    build_config({}, [*remote, "train.zero_stage=2"]).check_trainable(world_size=2)
    build_config({}, [*remote, "rollout.exact_entropy=false"]).check_trainable(world_size=2)
    with pytest.raises(ConfigError, match=r"rollout\.engine=remote"):  # the in-process engine: refused as before
        build_config({}, [*remote, "rollout.engine=hf"]).check_trainable(world_size=2)



def test_a_managed_vllm_server_per_rank_refused_under_zero3_on_several_ranks():
    """Each rank's own managed vLLM server must be handed full weights, which ZeRO-3 gathers to rank 0 alone (a
    rank > 0 would export its empty partitions): refused at start, pointing at one shared server
    (rollout.engine=remote, which rank 0 reloads for all) or ZeRO-2, where every rank holds the full weights."""
    vllm = ["rollout.engine=vllm", "rollout.exact_entropy=false", "train.backend=deepspeed", "train.zero_stage=3"]
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm.*train\.zero_stage=3.*2 ranks.*"
                                          r"rollout\.engine=remote"):
        build_config({}, vllm).check_trainable(world_size=2)
    build_config({}, vllm).check_trainable(world_size=1)
    build_config({}, [*vllm, "train.zero_stage=2"]).check_trainable(world_size=2)

def test_the_paper_config_runs_on_several_ranks_and_discards_the_probe():
    """The paper config (remote engine, ZeRO-3) trains on 8 ranks: its exact entropies are off (the server's top-k
    estimate, flagged); the published numbers come from pre-monitoring with the probe discarded."""
    cfg = load_config(CONFIGS / "paper" / "qwen3_14b_deepsearch.yaml")
    cfg.check_trainable(world_size=8)
    assert not cfg.rollout.exact_entropy and cfg.rollout.probe == "discard"
    text = (CONFIGS / "paper" / "qwen3_14b_deepsearch.yaml").read_text()
    assert "Departures from the published scripts" in text


def test_rollout_logprobs_are_not_pi_old_under_filtered_sampling():
    """Issue 49 §7a: with top-p < 1 or top-k > 0 the sampler's log-prob is of the renormalized filtered
    distribution, so every ratio would start at the kept mass (0.081 at top-k 20), not 1."""
    for filtered in ("rollout.top_p=0.9", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match=r"optim\.old_logprobs=rollout.*rollout\.top_p.*rollout\.top_k"):
            build_config({}, ["optim.old_logprobs=rollout", filtered])
        build_config({}, [filtered])  # π_old from the trainer's scoring pass: fine
    build_config({}, ["optim.old_logprobs=rollout"])


def test_bounded_staleness_refuses_what_it_cannot_keep_exact():
    """train.max_staleness > 0 samples from weights the update has moved on from: π_old must be the trainer's (the
    stale sampler's log-probs are not), the engine must hold its own copy (not DeepSpeed's partitioned model), and
    one process runs the overlap (the ranks' collectives would interleave)."""
    build_config({}, ["train.max_staleness=1"]).check_trainable()
    with pytest.raises(ConfigError, match=r"train\.max_staleness.*optim\.old_logprobs"):
        build_config({}, ["train.max_staleness=1", "optim.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match=r"train\.max_staleness.*train\.backend torch"):
        build_config({}, ["train.max_staleness=2", "train.backend=deepspeed"])
    with pytest.raises(ConfigError, match=r"train\.max_staleness > 0 runs in one process, not on 2 ranks"):
        build_config({}, ["train.max_staleness=1"]).check_trainable(world_size=2)
    with pytest.raises(ConfigError, match=r"train\.max_staleness"):
        build_config({}, ["train.max_staleness=-1"])


def test_requests_in_flight_path_by_path_need_per_path_scheduling():
    build_config({}, ["rollout.engine=vllm", "rollout.scheduling=per_path", "rollout.inflight_requests=64"])
    build_config({}, ["rollout.scheduling=per_path", "rollout.inflight_requests=8"])  # the in-process engine joins them
    with pytest.raises(ConfigError, match=r"rollout\.inflight_requests.*per_path"):
        build_config({}, ["rollout.engine=vllm", "rollout.inflight_requests=8"])  # rounds
