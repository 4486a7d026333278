"""Checkpoints: exact round trip (weights, optimizer, scheduler, RNG, data cursor), HF loadability, keep-K,
corruption fallback, crash safety (exception and SIGKILL mid-save) and the compatibility check."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from aepo_core.config import ExperimentConfig
from aepo_core.config_keys import ConfigKeyDeprecationWarning
from aepo_core.overrides import build_config
from infra.training.checkpoint import (
    CheckpointError,
    IncompatibleCheckpointError,
    capture_rng_state,
    check_compatible,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_state,
    restore_rng_state,
    save_checkpoint,
)
from infra.training.data_order import DataCursor, DataOrder

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128
SEQ = 12


def make_tokenizer() -> Any:
    """A 128-token word-level tokenizer built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def make_model(seed: int, tie: bool = True) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tie, pad_token_id=0,
                         bos_token_id=2, eos_token_id=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def make_optim(model: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
    return opt, sched


def make_config(**overrides: Any) -> ExperimentConfig:
    return build_config({"model": {"name": "tiny-test", "dtype": "float32"}}, overrides)


DATA = torch.randint(4, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(0))


def train_step(model: Any, opt: torch.optim.Optimizer, sched: Any, rows: list[int]) -> None:
    """One LM step whose inputs also depend on the global RNGs (token dropout), so RNG restore matters."""
    ids = DATA[rows].clone()
    noise = torch.rand(ids.shape) < 0.2
    ids[noise] = torch.randint(4, VOCAB, (int(noise.sum()),))
    ids[:, 0] = 4 + int(np.random.randint(0, 50)) + random.randrange(10)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def same_params(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def draws() -> tuple[float, list[float], list[float]]:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def save(root: Path, step: int, model: Any, tokenizer: Any, keep: int = 3, **kwargs: Any) -> Path:
    kwargs.setdefault("config", make_config())
    return save_checkpoint(root, step, model=model, tokenizer=tokenizer, keep=keep, **kwargs)


# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip_restores_everything(tmp_path: Path, tokenizer: Any, tie: bool) -> None:
    seed_all(1)
    model = make_model(0, tie=tie)
    opt, sched = make_optim(model)
    for step in range(2):
        train_step(model, opt, sched, [step, step + 1])
    cursor = DataCursor(epoch=1, index=4, shuffle_seed=7)
    cfg = make_config()
    path = save_checkpoint(tmp_path, 2, model=model, tokenizer=tokenizer, optimizer=opt, scheduler=sched,
                           data_cursor=cursor, config=cfg, run_id="run-abc", extra={"best": 0.5}, keep=2)
    after_save = draws()
    train_step(model, opt, sched, [0, 1])  # the original continues ...

    seed_all(99)  # ... and a fresh process with other weights and RNG states resumes
    fresh = make_model(1, tie=tie)
    fresh_opt, fresh_sched = make_optim(fresh)
    assert not same_params(fresh, model)
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, verify=True,
                            config=cfg)
    assert draws() == after_save
    assert (state.step, state.data_cursor, state.run_id, state.extra) == (2, cursor, "run-abc", {"best": 0.5})
    assert state.config_hash == cfg.config_hash() and state.model_name == "tiny-test"
    assert fresh_sched.state_dict()["last_epoch"] == 2
    assert fresh_opt.state_dict()["state"][0]["step"] == 2
    train_step(fresh, fresh_opt, fresh_sched, [0, 1])
    assert same_params(fresh, model)  # bit-identical continuation
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    if tie:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_resume_equivalence_with_data_order(tmp_path: Path, tokenizer: Any) -> None:
    """4 steps straight == k steps, checkpoint, fresh objects, 4 − k steps; k = 3 is an epoch boundary."""
    order = DataOrder(6, 2, seed=3)

    def run(model: Any, opt: Any, sched: Any, cursor: DataCursor, n: int, seen: list[list[int]]) -> DataCursor:
        for _ in range(n):
            rows, cursor = order.next_batch(cursor)
            seen.append(rows)
            train_step(model, opt, sched, rows)
        return cursor

    seed_all(0)
    ref = make_model(0)
    ref_opt, ref_sched = make_optim(ref)
    ref_seen: list[list[int]] = []
    run(ref, ref_opt, ref_sched, order.start(), 4, ref_seen)
    for k in (1, 3):
        root = tmp_path / f"k{k}"
        seed_all(0)
        model = make_model(0)
        opt, sched = make_optim(model)
        seen: list[list[int]] = []
        cursor = run(model, opt, sched, order.start(), k, seen)
        save(root, k, model, tokenizer, optimizer=opt, scheduler=sched, data_cursor=cursor)
        seed_all(123)
        model = make_model(5)
        opt, sched = make_optim(model)
        state = load_checkpoint(latest_checkpoint(root), model=model, optimizer=opt, scheduler=sched)
        assert state.data_cursor is not None
        assert (state.data_cursor.index == 0) == (k == 3)
        run(model, opt, sched, state.data_cursor, 4 - k, seen)
        assert seen == ref_seen
        assert same_params(model, ref)


def test_checkpoint_model_dir_is_a_plain_hf_model_copied_alone(tmp_path: Path, tokenizer: Any) -> None:
    """``model/`` holds the policy in HF format and nothing else: copied alone, transformers loads it."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = make_model(0)
    cfg = make_config()
    path = save(tmp_path, 12, model, tokenizer, config=cfg)
    assert path == tmp_path / "step-000012"
    names = {p.name for p in path.iterdir()}
    assert names == {"model", "rng.pt", "trainer_state.json", "config.yaml", "manifest.json"}
    hf = {p.name for p in (path / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= hf
    assert not any(n.endswith((".pt", ".bin")) for n in hf)
    alone = shutil.copytree(path / "model", tmp_path / "shipped")
    loaded = AutoModelForCausalLM.from_pretrained(str(alone))
    ids = torch.tensor([[2, 10, 20, 30]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    tok = AutoTokenizer.from_pretrained(str(alone))
    assert tok("w1 w2 w3")["input_ids"] == tokenizer("w1 w2 w3")["input_ids"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert set(manifest["files"]) == ({f"model/{n}" for n in hf} | names) - {"manifest.json", "model"}
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    assert trainer_state["global_step"] == 12 and trainer_state["algorithm_loss"] == "aepo"
    assert trainer_state["config_hash"] == cfg.config_hash() and trainer_state["model_name"] == "tiny-test"
    assert read_checkpoint_state(path).config == cfg.to_dict()
    with pytest.raises(CheckpointError, match=r"no optimizer\.pt"):
        fresh = make_model(1)
        load_checkpoint(path, model=fresh, optimizer=make_optim(fresh)[0])


def test_format_1_checkpoint_with_the_model_at_its_top_still_loads(tmp_path: Path, tokenizer: Any) -> None:
    """Checkpoints written before ``model/`` (HF files next to the optimizer state) load as before."""
    from infra.training.checkpoint import _hash_and_fsync_tree, _manifest_digest

    model = make_model(0)
    opt, sched = make_optim(model)
    path = save(tmp_path, 3, model, tokenizer, optimizer=opt, scheduler=sched)
    for f in (path / "model").iterdir():  # the format-1 layout, with its manifest
        f.rename(path / f.name)
    (path / "model").rmdir()
    (path / "manifest.json").unlink()
    manifest: dict[str, Any] = {"format": "aepo-checkpoint", "format_version": 1, "step": 3, "files": {
        rel: {"size": size, "sha256": digest} for rel, size, digest in _hash_and_fsync_tree(path)}}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    fresh = make_model(1)
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path, model=fresh, optimizer=make_optim(fresh)[0], verify=True).step == 3
    assert same_params(fresh, model)


def test_keep_last_k_and_cleanup(tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(0)
    stale = tmp_path / ".tmp-step-000002-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    for step in range(1, 6):
        save(tmp_path, step, model, tokenizer, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000005"]
    assert not stale.exists() and not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    # Resuming from an older checkpoint and saving again abandons the newer ones: they must not win a resume.
    with caplog.at_level(logging.WARNING, logger="infra.training.checkpoint"):
        save(tmp_path, 3, model, tokenizer, keep=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003"]
    assert "abandoned" in caplog.text
    save(tmp_path, 3, model, tokenizer, keep=1)  # re-saving a step replaces it
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate-weights", "flip-weights", "flip-optimizer", "flip-manifest",
                                    "no-manifest", "missing-file"])
def test_corrupt_newest_falls_back_with_warning(tmp_path: Path, tokenizer: Any, damage: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    model = make_model(0)
    opt, sched = make_optim(model)
    save(tmp_path, 1, model, tokenizer, optimizer=opt, scheduler=sched)
    newest = save(tmp_path, 2, model, tokenizer, optimizer=opt, scheduler=sched)
    weights = newest / "model" / "model.safetensors"
    if damage == "truncate-weights":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "flip-weights":
        _flip_byte(weights, weights.stat().st_size - 7)  # inside a tensor: the size is unchanged
    elif damage == "flip-optimizer":
        _flip_byte(newest / "optimizer.pt", 100)
    elif damage == "flip-manifest":
        text = (newest / "manifest.json").read_text()
        (newest / "manifest.json").write_text(text.replace('"step": 2', '"step": 3'))
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "model" / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="infra.training.checkpoint"):
        found = latest_checkpoint(tmp_path)
    assert found == tmp_path / "step-000001"
    if damage != "no-manifest":  # without a manifest it is simply not a checkpoint
        assert "step-000002" in caplog.text and "corrupt" in caplog.text
    if damage == "flip-weights":
        assert latest_checkpoint(tmp_path, verify=False) == newest  # sizes alone cannot see a bit flip


def test_all_corrupt_gives_none(tmp_path: Path, tokenizer: Any) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    path = save(tmp_path, 1, model=make_model(0), tokenizer=tokenizer)
    os.truncate(path / "model" / "model.safetensors", 10)
    assert latest_checkpoint(tmp_path) is None


class FailingScheduler(torch.optim.lr_scheduler.LambdaLR):
    """Fault injection: the save dies after the model, tokenizer and optimizer files are written."""

    def state_dict(self) -> dict[str, Any]:
        raise OSError("No space left on device (injected)")


def test_exception_mid_save_leaves_previous_checkpoint(tmp_path: Path, tokenizer: Any) -> None:
    model = make_model(0)
    opt, sched = make_optim(model)
    first = save(tmp_path, 1, model, tokenizer, optimizer=opt, scheduler=sched)
    failing = FailingScheduler(opt, lambda s: 1.0)
    with pytest.raises(OSError, match="injected"):
        save(tmp_path, 2, model, tokenizer, optimizer=opt, scheduler=failing)
    assert list_checkpoints(tmp_path) == [first] and latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    with pytest.raises(CheckpointError, match="JSON"):
        save(tmp_path, 2, model, tokenizer, extra={"bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import make_config, make_model, make_optim, make_tokenizer
    from infra.training.checkpoint import save_checkpoint
    torch.set_num_threads(1)
    model, tok = make_model(0), make_tokenizer()
    opt, sched = make_optim(model)
    cfg = make_config()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        save_checkpoint({root!r}, step, model=model, tokenizer=tok, optimizer=opt, scheduler=sched, config=cfg,
                        keep=2)
        print("saved", step, flush=True)
    """
)


def test_sigkill_mid_save_never_exposes_a_partial_checkpoint(tmp_path: Path, tokenizer: Any) -> None:
    """Kill a saving process while a temporary directory is half written: the newest visible checkpoint is a
    complete, verifying one; the next save removes the leftover."""
    hits = 0
    for attempt in range(3):
        root = tmp_path / f"run{attempt}"
        script = tmp_path / "child.py"
        script.write_text(CHILD.format(tests=str(Path(__file__).parent), root=str(root)))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        errors = tmp_path / f"child{attempt}.err"
        with open(errors, "w") as err:  # a file, not a pipe: a full pipe would stall the child
            child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True,
                                     env=env, cwd=REPO)
        try:
            assert child.stdout is not None
            for line in child.stdout:  # wait until at least two checkpoints exist
                if line.strip() == "saved 2":
                    break
            else:
                pytest.fail(f"child died: {errors.read_text()[-2000:]}")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # catch it mid-save: a temp dir holding the weights already
                tmps = [p for p in root.iterdir() if p.name.startswith(".tmp-step")]
                if any((p / "model" / "model.safetensors").exists() for p in tmps):
                    break
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
        hits += bool(leftovers)
        visible = list_checkpoints(root)
        assert visible and all(p.name.startswith("step-") for p in visible)
        assert latest_checkpoint(root) == visible[-1]  # the newest visible one is complete and verifies
        assert not [p for p in root.iterdir() if p.name.startswith("step-") and p not in visible]
        nxt = save(root, 100, make_model(0), tokenizer, keep=2)
        assert latest_checkpoint(root) == nxt
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
        if hits:
            break
    assert hits, "never caught the child mid-save in 3 attempts"


def test_rng_helpers_round_trip(tmp_path: Path) -> None:
    seed_all(4)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # ... and in numpy's
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    first = (draws(), random.gauss(0, 1), np.random.standard_normal())
    seed_all(5)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # plain tensors and values only
    assert (draws(), random.gauss(0, 1), np.random.standard_normal()) == first


def test_incompatible_config_is_refused_unless_forced(tmp_path: Path, tokenizer: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = save(tmp_path, 1, make_model(0), tokenizer)
    assert check_compatible(path, make_config(**{"optim.lr": 0.5, "seed": 3})) == []  # other sections may change
    other = make_config(**{"model.name": "another-model", "algorithm.loss": "gspo", "algorithm.clip_high": 0.28})
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_compatible(path, other)
    # gspo brings its own aggregation (seq-mean-token-mean): that differs too.
    assert info.value.fields == ["model.name", "algorithm.clip_high", "algorithm.loss", "algorithm.loss_agg"]
    assert "another-model" in str(info.value) and "gspo" in str(info.value)
    model = make_model(1)
    with pytest.raises(IncompatibleCheckpointError):
        load_checkpoint(path, model=model, config=other)
    assert not same_params(model, make_model(0))  # refused before touching the model
    with caplog.at_level(logging.WARNING, logger="infra.training.checkpoint"):
        state = load_checkpoint(path, model=model, config=other, force=True)
    assert state.step == 1 and "forced" in caplog.text and same_params(model, make_model(0))


def test_checkpoint_saved_before_a_key_rename_reads_under_the_new_names(tmp_path: Path, tokenizer: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_config(**{"data.synthetic.entities": 40, "rollout.remote.url": "http://127.0.0.1:8000"})
    path = save(tmp_path, 1, make_model(0), tokenizer, config=cfg)
    old = cfg.to_dict()  # what the code before the rename saved: the same config under the flat keys
    old["data"].update({f"synthetic_{k}": v for k, v in old["data"].pop("synthetic").items()})
    before_rename = ("url", "model", "reload_url")  # rollout.remote keys of that time (later ones: defaults)
    old["rollout"].update({f"remote_{k}": v for k, v in old["rollout"].pop("remote").items() if k in before_rename})
    (path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    blob = json.dumps(old, sort_keys=True, separators=(",", ":")).encode()
    trainer_state["config_hash"] = hashlib.sha256(blob).hexdigest()[:16]  # as config_hash() computed it then
    (path / "trainer_state.json").write_text(json.dumps(trainer_state))
    expected = cfg.to_dict()
    expected["rollout"]["remote"] = {k: v for k, v in expected["rollout"]["remote"].items() if k in before_rename}
    with pytest.warns(ConfigKeyDeprecationWarning) as caught:
        assert read_checkpoint_state(path).config == expected
    assert any(str(w.message).startswith("data.synthetic_entities is deprecated: use data.synthetic.entities (")
               for w in caught)
    with pytest.warns(ConfigKeyDeprecationWarning), caplog.at_level(logging.INFO, logger="infra.training.checkpoint"):
        assert check_compatible(path, cfg) == []
        assert "differs outside" not in caplog.text  # the same experiment under new names
        assert check_compatible(path, make_config(**{"data.synthetic.entities": 41})) == []
        assert "differs outside" in caplog.text
