"""The GPU recipes (configs/recipes/) have never run on a GPU here; what the suite can check, it checks: every cell of
each recipe's sweep validates with the checks a 4-rank ZeRO-3 launch makes, every ``aepo`` command in the recipes'
README parses with the real command line (options, paths, overrides into a valid config), and each vLLM server
serves the model and port the run it feeds names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from flows.cli import app
from infra.config_files import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs" / "recipes"
TRAIN_RANKS = 4


def _commands() -> list[list[str]]:
    """The README's commands: each non-comment line of its bash blocks, split, leading VAR=value removed."""
    text = (RECIPES / "README.md").read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    out = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            words = shlex.split(line)
            while "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)
            out.append(words)
    return out


def _aepo_args(words: list[str]) -> tuple[list[str], int]:
    """The ``aepo`` arguments of a command, and its world size (torchrun's --nproc_per_node, else 1)."""
    program = Path(words[0]).name
    if program == "torchrun":
        at = words.index("-m")
        assert words[at + 1] == "flows.cli"
        return words[at + 2:], int(words[words.index("--nproc_per_node") + 1])
    assert program == "aepo", words
    return words[1:], 1


def _parse(args: list[str]) -> typer.Context:
    """The subcommand's parsed context, as the real command line parses ``args`` (no command runs)."""
    group = typer.main.get_command(app)
    command = group.get_command(typer.Context(group), args[0])
    assert command is not None, args[0]
    return command.make_context(f"aepo {args[0]}", args[1:])


def test_the_recipes_readme_has_the_commands_of_both_recipes() -> None:
    programs = [Path(w[0]).name for w in _commands()]
    assert programs.count("vllm") == 2 and programs.count("torchrun") == 2 and programs.count("aepo") == 2


@pytest.mark.parametrize("words", [w for w in _commands() if Path(w[0]).name != "vllm"],
                         ids=lambda w: " ".join(w[:4]))
def test_every_aepo_command_parses_into_a_config_its_launch_can_train(words: list[str]) -> None:
    args, world = _aepo_args(words)
    ctx = _parse(args)
    config = Path(ctx.params["config"])
    assert (REPO / config).is_file(), config
    if args[0] == "train":
        cfg = load_config(REPO / config, list(ctx.params["set_"] or []))
        cfg.check_trainable(world)
        assert world == TRAIN_RANKS and cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_cell_validates_for_a_four_rank_zero3_launch(path: Path) -> None:
    from infra.run.sweep_spec import load_sweep

    spec = load_sweep(path)
    assert spec.runs
    for run in spec.runs:
        run.config.check_trainable(TRAIN_RANKS)
        assert run.config.rollout.engine == "remote" and run.config.model.device == "cuda"


def test_each_vllm_server_serves_the_model_and_port_of_the_run_it_feeds() -> None:
    commands = _commands()
    for i, words in enumerate(commands):
        if Path(words[0]).name != "vllm":
            continue
        assert words[1] == "serve" and "--logprobs-mode" in words  # the sampled distribution's log-probs
        assert words[words.index("--logprobs-mode") + 1] == "processed_logprobs"
        args, _ = _aepo_args(commands[i + 1])  # the run below it
        ctx = _parse(args)
        cfg = load_config(REPO / ctx.params["config"], list(ctx.params["set_"] or []))
        assert words[2] == cfg.model.name
        assert cfg.rollout.remote.url.endswith(f":{words[words.index('--port') + 1]}")
