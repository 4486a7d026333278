"""Checkpoints on S3 (a moto server): the local commit protocol over objects — manifest uploaded last, pruned
manifest first — and reads through a verified local copy, falling back past incomplete or damaged checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import make_config, make_model, make_optim, make_tokenizer, same_params, train_step

from infra.fs import StorageError
from infra.training.checkpoint import CheckpointError, load_checkpoint
from infra.training.checkpoint_store import CheckpointStore, open_checkpoint

LOGGER = "infra.training.checkpoint_store"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def opts(endpoint: str) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}


def store(uri: str, endpoint: str, cache: Path) -> CheckpointStore:
    return CheckpointStore(uri, opts(endpoint), cache_dir=cache)


def save(st: CheckpointStore, step: int, model: Any, tokenizer: Any, keep: int = 2, **kwargs: Any) -> str:
    return st.save(step, model=model, tokenizer=tokenizer, config=make_config(), keep=keep, **kwargs)


def keys(st: CheckpointStore, step: int) -> list[str]:
    return sorted(st.fs.find(f"{st.root}/step-{step:06d}"))


def test_save_list_load_round_trip_manifest_last(s3_bucket: str, moto_s3: str, tmp_path: Path, tokenizer: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    writer = store(f"{s3_bucket}/ckpt/run", moto_s3, tmp_path / "writer-cache")
    model = make_model(0)
    opt, sched = make_optim(model)
    puts: list[str] = []
    real_put = CheckpointStore._put
    monkeypatch.setattr(CheckpointStore, "_put", lambda self, local, remote: (puts.append(remote),
                                                                                real_put(self, local, remote))[1])
    for step in (1, 2, 3):
        train_step(model, opt, sched, [0, 1])
        where = save(writer, step, model, tokenizer, optimizer=opt, scheduler=sched)
        assert where == f"s3://aepo/ckpt/run/step-{step:06d}"
        step_puts = [p for p in puts if f"/step-{step:06d}/" in p]
        assert step_puts[-1].endswith("/manifest.json") and sum(p.endswith("manifest.json") for p in step_puts) == 1
        assert "model/model.safetensors" in {p.split(f"/step-{step:06d}/", 1)[1] for p in step_puts}
    assert writer.steps() == [2, 3]  # keep=2: step 1 pruned after step 3 was committed
    assert not writer.fs.exists(f"{writer.root}/step-000001")
    assert not any(p.name.startswith(".staging-") for p in (tmp_path / "writer-cache").iterdir())

    # Another machine: its own empty cache, nothing shared but the bucket.
    reader = store(f"{s3_bucket}/ckpt/run", moto_s3, tmp_path / "reader-cache")
    local = reader.latest()
    assert local is not None and local.name == "step-000003" and (tmp_path / "reader-cache") in local.parents
    fresh = make_model(1)
    fresh_opt, fresh_sched = make_optim(fresh)
    state = load_checkpoint(local, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, restore_rng=False)
    assert state.step == 3 and same_params(model, fresh)
    assert fresh_sched.state_dict() == sched.state_dict()
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # A second read reuses the verified copy; open_checkpoint takes the root or one step, and keeps one per root.
    assert reader.latest() == local
    older = open_checkpoint("s3://aepo/ckpt/run/step-000002", opts(moto_s3), tmp_path / "reader-cache")
    assert older.name == "step-000002" and not local.exists()
    assert open_checkpoint("s3://aepo/ckpt/run/", opts(moto_s3), tmp_path / "reader-cache").name == "step-000003"


def test_interrupted_upload_is_no_checkpoint_and_is_cleaned_up(s3_bucket: str, moto_s3: str, tmp_path: Path,
                                                              tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    st = store(f"{s3_bucket}/ckpt/run", moto_s3, tmp_path / "cache")
    model = make_model(0)
    save(st, 1, model, tokenizer)
    real_put = CheckpointStore._put

    def dies_before_the_manifest(self: CheckpointStore, local: Path, remote: str) -> None:
        if remote.endswith("/manifest.json"):
            raise KeyboardInterrupt("killed mid-upload (injected)")
        real_put(self, local, remote)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(CheckpointStore, "_put", dies_before_the_manifest)
        save(st, 2, make_model(1), tokenizer)
    assert "aepo/ckpt/run/step-000002/model/model.safetensors" in keys(st, 2)  # the files are there, the manifest not
    assert not any(k.endswith("manifest.json") for k in keys(st, 2))
    reader = store(f"{s3_bucket}/ckpt/run", moto_s3, tmp_path / "reader")
    assert reader.steps() == [1]
    assert reader.latest() == tmp_path / "reader" / "s3" / "aepo" / "ckpt" / "run" / "step-000001"
    with pytest.raises(CheckpointError, match=r"step-000002: no manifest\.json"):
        open_checkpoint("s3://aepo/ckpt/run/step-000002", opts(moto_s3), tmp_path / "reader")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        save(st, 3, model, tokenizer, keep=5)
    assert keys(st, 2) == [] and st.steps() == [1, 3]
    assert "leftover of an interrupted upload" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_falls_back_with_warning(s3_bucket: str, moto_s3: str, tmp_path: Path, tokenizer: Any,
                                                damage: str, caplog: pytest.LogCaptureFixture) -> None:
    st = store(f"{s3_bucket}/c", moto_s3, tmp_path / "cache")
    save(st, 1, make_model(0), tokenizer)
    save(st, 2, make_model(1), tokenizer)
    weights = f"{st.root}/step-000002/model/model.safetensors"
    data = bytearray(st.fs.cat_file(weights))
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-7] ^= 0x01  # inside a tensor: only the checksum can tell
    st.fs.pipe(weights, bytes(data))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = store(f"{s3_bucket}/c", moto_s3, tmp_path / "reader").latest()
    assert found is not None and found.name == "step-000001"
    assert "s3://aepo/c/step-000002" in caplog.text and "corrupt" in caplog.text
    assert ("has " if damage == "truncate" else "checksum mismatch") in caplog.text
    assert not (tmp_path / "reader" / "s3" / "aepo" / "c" / "step-000002").exists()


def test_resave_and_abandoned_newer_and_half_deleted(s3_bucket: str, moto_s3: str, tmp_path: Path, tokenizer: Any,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    st = store(f"{s3_bucket}/c", moto_s3, tmp_path / "cache")
    model = make_model(0)
    for step in (1, 2, 3):
        save(st, step, model, tokenizer, keep=5)
    # Resuming from step 2 and saving it again abandons step 3: it must not win the next resume.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        save(st, 2, make_model(1), tokenizer, keep=5)
    assert st.steps() == [1, 2] and "abandoned" in caplog.text and "replacing existing checkpoint" in caplog.text
    loaded = make_model(2)
    load_checkpoint(st.latest(), model=loaded, restore_rng=False)  # type: ignore[arg-type]
    assert same_params(loaded, make_model(1))
    # A prune that dies after deleting a manifest leaves a prefix nobody reads as a checkpoint.
    real_rm = st.fs.rm

    def dies(path: Any, *args: Any, **kwargs: Any) -> Any:
        if "step-000001" in str(path):
            raise KeyboardInterrupt("killed mid-delete (injected)")
        return real_rm(path, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(st.fs, "rm", dies)
        save(st, 3, model, tokenizer, keep=1)
    assert st.steps() == [2, 3] and keys(st, 1)  # step 1 half deleted: its files remain, it is no checkpoint
    save(st, 4, model, tokenizer, keep=1)
    assert st.steps() == [4] and keys(st, 1) == []


def test_a_reader_sees_what_was_committed_after_it_listed(s3_bucket: str, moto_s3: str, tmp_path: Path,
                                                          tokenizer: Any) -> None:
    """A store that keeps watching a run name's folder (a worker waiting for a checkpoint, a resume search started
    early) lists what is there now. fsspec caches every folder listing and ``invalidate_cache`` drops a path and its
    parents only: a folder listed while empty, or a step listed while it was uploading, stayed so for ever."""
    reader = store(f"{s3_bucket}/ckpt/name", moto_s3, tmp_path / "reader")
    assert reader.run_folders() == []
    writer = store(f"{s3_bucket}/ckpt/name/run1", moto_s3, tmp_path / "writer")
    writer.fs.pipe(f"{writer.root}/step-000001/model/model.safetensors", b"uploading")  # step 1, half uploaded
    assert reader.run_folders() == []  # no manifest yet: no checkpoint
    model = make_model(0)
    save(writer, 1, model, tokenizer)
    assert reader.run_folders() == ["run1"]
    one_run = reader.child("run1")
    assert one_run.steps() == [1]
    save(writer, 2, model, tokenizer)
    assert one_run.steps() == [1, 2] and reader.run_folders() == ["run1"]


def test_bad_locations_name_the_uri(moto_s3: str, s3_bucket: str, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="s3://no-such-bucket/ckpt"):
        store("s3://no-such-bucket/ckpt", moto_s3, tmp_path).steps()
    with pytest.raises(CheckpointError, match="s3://aepo/empty holds no complete checkpoint"):
        open_checkpoint("s3://aepo/empty", opts(moto_s3), tmp_path)
    assert store(f"{s3_bucket}/empty", moto_s3, tmp_path).latest() is None


def test_open_checkpoint_of_a_run_name_folder_takes_its_one_run(tmp_path: Path, tokenizer: Any) -> None:
    """Checkpoints live under ``<run name>/<run id>/``: the name's folder opens as its one run's newest checkpoint;
    a name that several runs share names them instead of guessing."""
    model = make_model(0)
    name = tmp_path / "tiny"
    save(CheckpointStore(name / "run-a"), 1, model, tokenizer)
    save(CheckpointStore(name / "run-a"), 2, model, tokenizer)
    assert CheckpointStore(name).run_folders() == ["run-a"] and CheckpointStore(name).steps() == []
    assert open_checkpoint(name) == name / "run-a" / "step-000002"
    assert open_checkpoint(name / "run-a" / "step-000001") == name / "run-a" / "step-000001"
    save(CheckpointStore(name / "run-b"), 1, model, tokenizer)
    with pytest.raises(CheckpointError, match=r"holds the checkpoints of 2 runs \(run-a, run-b\)"):
        open_checkpoint(name)
    assert open_checkpoint(name / "run-b") == name / "run-b" / "step-000001"
