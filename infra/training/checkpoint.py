"""Exact, crash-safe training checkpoints: HF-format model and tokenizer plus everything a resume needs.

Why: a resume must continue the run bit for bit (same weights, optimizer moments, LR schedule, RNG streams and
data position) or refuse loudly; a crash during a save must never leave a checkpoint that looks complete.

Layout of ``<root>/step-000012/``::

    model/         config.json  generation_config.json  model.safetensors (or shards + index)
                   tokenizer.json  tokenizer_config.json  ...    ← the policy alone, HF format: transformers / vLLM
                                                                   load it as is, ``cp -r model/`` ships it
    optimizer.pt  scheduler.pt  rng.pt                           ← torch.save, weights_only-safe

    trainer_state.json   global step, data cursor, config hash, model name, algorithm section, run id, extra
    config.yaml          the resolved ExperimentConfig
    manifest.json        size and sha256 of every other file (written last)

Commit protocol (one writer per root):

1. Everything is written into a fresh sibling ``<root>/.tmp-step-000012-XXXX/``; names starting with ``.tmp-``
   are never read as checkpoints.
2. Every file is read back once: hashed for the manifest and fsynced. ``manifest.json`` is written last and
   fsynced, then the temporary directory itself.
3. ``os.rename`` of the temporary directory to ``step-000012`` is the commit point: before it no checkpoint is
   visible, after it a complete one is. The parent directory is fsynced so the rename survives a power loss.
4. Only then are old checkpoints pruned (renamed to ``.tmp-deleting-…`` first, so a half-deleted directory is
   never visible) and stale ``.tmp-*`` directories of crashed saves removed.

A ``step-*`` directory without ``manifest.json`` is not a checkpoint. The manifest checksums also catch damage
after the commit (a truncated copy, bit rot): :func:`latest_checkpoint` skips such a checkpoint with a warning
and falls back to the previous one.

A remote root (``s3://bucket/prefix``, workers that share no disk) keeps this protocol over objects:
:mod:`infra.training.checkpoint_store` stages the checkpoint locally with :func:`save_checkpoint`, uploads
``manifest.json`` last, and reads a remote checkpoint through a local copy verified here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from aepo_core.config import AlgorithmConfig, ExperimentConfig
from aepo_core.config_keys import ConfigError, flatten, migrate_renamed_keys
from aepo_core.overrides import build_config
from infra.models import MODEL_DIR, ModelLoadError, load_model_weights
from infra.training.data_order import DataCursor

log = logging.getLogger(__name__)

FORMAT_NAME = "aepo-checkpoint"
FORMAT_VERSION = 2
"""2: the HF model and tokenizer in ``model/`` (1: at the top, next to the optimizer state; still read)."""
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked (missing part, bad request)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint is incomplete or its files do not match the manifest."""


class IncompatibleCheckpointError(CheckpointError):
    """Resuming would silently change the experiment: the model or the algorithm differs."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint says about the run, besides the tensors."""

    path: Path
    step: int
    data_cursor: DataCursor | None
    run_id: str | None
    extra: dict[str, Any]
    config_hash: str
    model_name: str
    algorithm: dict[str, Any]
    timestamp: str
    config: dict[str, Any] | None = field(default=None, repr=False)


# --------------------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (global) and torch RNG states (CUDA too when available), as tensors and plain values only,
    so that ``torch.load(weights_only=True)`` can read them back."""
    py_version, py_internal, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    if np_state["bit_generator"] != "MT19937":  # the legacy global RandomState is always MT19937
        raise CheckpointError(f"unsupported numpy global bit generator {np_state['bit_generator']}")
    state: dict[str, Any] = {
        "python": {"version": py_version, "internal": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss": py_gauss},
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` captured (CUDA only when the device count matches)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["key"].numpy().astype(np.uint32), int(npst["pos"]),
                         int(npst["has_gauss"]), float(npst["gauss"])))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("checkpoint has RNG states of %d CUDA devices, this process sees %d: CUDA RNG not restored",
                        len(cuda), torch.cuda.device_count() if torch.cuda.is_available() else 0)


# --------------------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    config: ExperimentConfig,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data_cursor: DataCursor | None = None,
    run_id: str | None = None,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``root/step-NNNNNN`` atomically (see the module docstring), then keep the last ``keep`` checkpoints
    (default ``config.checkpoint.keep``). Returns the checkpoint directory.

    Call it from one process (rank 0). Under ZeRO-3 the model's own parameters are empty partitions: pass the
    gathered full weights as ``state_dict`` (``DeepSpeedBackend.consolidated_state_dict()``). Store what
    defines the data order (``DataOrder.state_dict()``) in ``extra`` so a resume can check it with
    ``DataOrder.check_resumable``.

    Checkpoints with a larger step than ``step`` are deleted (with a warning): they belong to a timeline that
    was abandoned by resuming from an older checkpoint, and leaving them would make the next resume pick them.
    """
    if step < 0:
        raise ValueError(f"step must be ≥ 0 (got {step})")
    keep = config.checkpoint.keep if keep is None else keep
    if keep < 1:
        raise ValueError(f"keep must be ≥ 1 (got {keep})")
    extra_dict = dict(extra or {})
    try:  # fail before writing gigabytes, not after
        json.dumps(extra_dict)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint extra must be JSON-serializable: {exc}") from None
    if tokenizer is None:
        log.warning("saving checkpoint step %d without a tokenizer: transformers/vLLM cannot load it alone", step)

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is an ordinary shared directory
        _save_model(model, tmp / MODEL_DIR, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / MODEL_DIR))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        torch.save(capture_rng_state(), tmp / RNG_FILE)
        trainer_state = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "global_step": step,
            "data_cursor": data_cursor.state_dict() if data_cursor is not None else None,
            "config_hash": config.config_hash(),
            "model_name": config.model.name,
            "algorithm_loss": config.algorithm.loss,
            "algorithm": config.algorithm.model_dump(mode="json"),
            "run_id": run_id,
            "extra": extra_dict,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
        (tmp / CONFIG_FILE).write_text(config.to_yaml())
        files = {rel: {"size": size, "sha256": digest} for rel, size, digest in _hash_and_fsync_tree(tmp)}
        manifest: dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step,
                                    "files": files}
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f["size"] for f in files.values())
    log.info("saved checkpoint %s (%.1f MB, %d files) in %.2f s", final, size / 1e6, len(files) + 1,
             time.perf_counter() - t0)
    _prune(root, step, keep)
    return final


def _save_model(model: Any, out: Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """HF format with safetensors (the default of transformers ≥ 4.35 and the only format of 5.x)."""
    if state_dict is not None:
        model.save_pretrained(str(out), state_dict=dict(state_dict))
    else:
        model.save_pretrained(str(out))
    if not any(out.glob("*.safetensors")):
        raise CheckpointError(f"{type(model).__name__}.save_pretrained wrote no .safetensors file in {out}")


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (the commit point) and make the rename durable."""
    replaced: Path | None = None
    if final.exists():
        # Re-saving a step (e.g. after resuming from an older checkpoint): move the old one out of sight first;
        # for that instant the step is missing, which a reader sees as "use the previous checkpoint".
        log.warning("replacing existing checkpoint %s", final)
        replaced = _hidden_sibling(final, "replaced")
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _hidden_sibling(path: Path, tag: str) -> Path:
    """A fresh hidden sibling name that readers ignore and the next save cleans up."""
    return path.parent / f"{TMP_PREFIX}{tag}-{path.name}-{os.getpid()}-{time.time_ns()}"


def prune_plan(steps: list[int], step: int, keep: int) -> tuple[list[int], list[int]]:
    """Which committed checkpoints (``steps``, ascending) a save of ``step`` deletes: (newer ones, of a timeline
    abandoned by resuming from an older checkpoint; older ones beyond the newest ``keep``, ``step`` included)."""
    newer = [s for s in steps if s > step]
    older = [s for s in steps if s < step]
    return newer, older[: max(0, len(older) - (keep - 1))]


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints up to ``step`` (always ``step`` itself); drop the rest,
    newer abandoned ones, and leftovers of crashed saves."""
    newer, older = prune_plan([step_of(p) for p in list_checkpoints(root)], step, keep)
    for s in newer:
        log.warning("deleting checkpoint %s: newer than the one just written (step %d), from an abandoned run",
                    root / step_dir_name(s), step)
    for s in newer + older:
        _delete_dir(root / step_dir_name(s))
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX) and child.is_dir():
            log.info("removing leftover %s of an interrupted save", child)
            shutil.rmtree(child, ignore_errors=True)
        elif _STEP_RE.match(child.name) and child.is_dir() and not (child / MANIFEST).exists():
            log.warning("%s has no %s: not a checkpoint, left alone", child, MANIFEST)


def _delete_dir(path: Path) -> None:
    """Rename out of sight, then delete: a crash mid-delete leaves only an ignored ``.tmp-`` directory."""
    hidden = _hidden_sibling(path, "deleting")
    os.rename(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)
    log.info("pruned checkpoint %s", path)


# --------------------------------------------------------------------------------------------------------------
# Find and verify
# --------------------------------------------------------------------------------------------------------------


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Committed checkpoints (``step-*`` with a manifest) under ``root``, oldest first. Not verified."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_RE.match(p.name) and p.is_dir() and (p / MANIFEST).is_file()]
    return sorted(found, key=step_of)


def verify_checkpoint(path: str | os.PathLike[str], checksums: bool = True) -> None:
    """Raise :class:`CorruptCheckpointError` unless every manifest file is present with its size (and, with
    ``checksums``, its sha256). The size check alone is cheap and catches truncation."""
    path = Path(path)
    manifest = read_manifest(path)
    if _STEP_RE.match(path.name) and manifest.get("step") != step_of(path):
        raise CorruptCheckpointError(f"{path}: the manifest is for step {manifest.get('step')}")
    for rel, meta in manifest["files"].items():
        file = path / rel
        if not file.is_file():
            raise CorruptCheckpointError(f"{path}: {rel} is missing")
        size = file.stat().st_size
        if size != meta["size"]:
            raise CorruptCheckpointError(f"{path}: {rel} has {size} bytes, the manifest says {meta['size']}")
    if checksums:
        for rel, meta in manifest["files"].items():
            digest = _sha256_file(path / rel)
            if digest != meta["sha256"]:
                raise CorruptCheckpointError(f"{path}: {rel} checksum mismatch (sha256 {digest[:12]}…, "
                                             f"manifest {meta['sha256'][:12]}…)")


def latest_checkpoint(root: str | os.PathLike[str], verify: bool = True) -> Path | None:
    """The newest checkpoint that verifies (checksums when ``verify``, sizes otherwise); a newer one that does
    not is skipped with a WARNING naming it. None when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, checksums=verify)
        except CorruptCheckpointError as exc:
            log.warning("skipping corrupt checkpoint %s, falling back to the previous one: %s", path, exc)
            continue
        return path
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' mapping")
        ok = manifest.get("format") == FORMAT_NAME and manifest.get("manifest_sha256") == _manifest_digest(manifest)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path}: unreadable {MANIFEST}: {exc}") from None
    if not ok:
        raise CorruptCheckpointError(f"{path}: {MANIFEST} fails its own checksum")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: format version {manifest['format_version']} is newer than "
                                     f"this code's {FORMAT_VERSION}")
    return manifest


# --------------------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------------------


def read_checkpoint_state(path: str | os.PathLike[str]) -> CheckpointState:
    """The checkpoint's metadata without loading any tensor."""
    path = Path(path)
    try:
        raw = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read {TRAINER_STATE}: {exc}") from None
    config = _read_saved_config(path)
    try:
        cursor = raw.get("data_cursor")
        return CheckpointState(
            path=path,
            step=int(raw["global_step"]),
            data_cursor=DataCursor.from_state(cursor) if cursor is not None else None,
            run_id=raw.get("run_id"),
            extra=dict(raw.get("extra") or {}),
            config_hash=str(raw.get("config_hash", "")),
            model_name=str(raw.get("model_name", "")),
            algorithm=dict(raw.get("algorithm") or {}),
            timestamp=str(raw.get("timestamp", "")),
            config=config,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path}: bad {TRAINER_STATE}: {exc!r}") from None


def _read_saved_config(path: Path) -> dict[str, Any] | None:
    """The checkpoint's ``config.yaml`` as a tree, renamed keys moved to today's names (a checkpoint saved before
    a rename resolves like a new one); None when the file is absent or not a mapping."""
    file = path / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        tree = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read {CONFIG_FILE}: {exc}") from None
    return migrate_renamed_keys(tree, source=str(file)) if isinstance(tree, dict) else None


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    verify: bool = False,
    config: ExperimentConfig | None = None,
    force: bool = False,
) -> CheckpointState:
    """Load the checkpoint into the given objects in place and return its metadata.

    Sizes are always checked against the manifest; ``verify`` adds checksums (:func:`latest_checkpoint` has
    usually done that already). With ``config`` the compatibility check runs before anything is touched. RNG
    states are restored last so that nothing done while loading shifts the streams.
    """
    path = Path(path)
    verify_checkpoint(path, checksums=verify)
    state = read_checkpoint_state(path)
    if config is not None:
        check_compatible(state, config, force=force)
    t0 = time.perf_counter()
    if model is not None:
        try:
            load_model_weights(model, path)
        except ModelLoadError as exc:  # a checkpoint without the weights of its model is a corrupt one
            raise CorruptCheckpointError(str(exc)) from None
    if optimizer is not None:
        optimizer.load_state_dict(_torch_load(path, OPTIMIZER_FILE))
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(path, SCHEDULER_FILE))
    if restore_rng:
        restore_rng_state(_torch_load(path, RNG_FILE))
    log.info("loaded checkpoint %s (step %d) in %.2f s", path, state.step, time.perf_counter() - t0)
    return state


def _torch_load(path: Path, name: str) -> Any:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"{path} has no {name}, but its state was asked for")
    return torch.load(file, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------------------------
# Compatibility
# --------------------------------------------------------------------------------------------------------------


def check_compatible(state_or_path: CheckpointState | str | os.PathLike[str], config: ExperimentConfig,
                     force: bool = False) -> list[str]:
    """Refuse to resume when the model name or the algorithm section differs (the run would silently become
    another experiment). Returns the differing fields; with ``force`` they are logged as a WARNING instead.

    An algorithm field the checkpoint predates counts as equal when the config keeps its default.
    """
    state = state_or_path if isinstance(state_or_path, CheckpointState) else read_checkpoint_state(state_or_path)
    diffs: list[str] = []
    if state.model_name != config.model.name:
        diffs.append(f"model.name: checkpoint {state.model_name!r} vs config {config.model.name!r}")
    current = flatten(config.algorithm.model_dump(mode="json"))
    saved = flatten(state.algorithm)
    defaults = flatten(AlgorithmConfig().model_dump(mode="json"))
    missing = object()
    for key in sorted(current.keys() | saved.keys()):
        new, old = current.get(key, missing), saved.get(key, missing)
        if old is missing and new == defaults.get(key, missing):
            continue
        if old != new:
            shown_old = "<absent>" if old is missing else repr(old)
            shown_new = "<absent>" if new is missing else repr(new)
            diffs.append(f"algorithm.{key}: checkpoint {shown_old} vs config {shown_new}")
    if not diffs:
        saved_hash = _saved_config_hash(state)
        if saved_hash and saved_hash != config.config_hash():
            log.info("resuming %s with a config that differs outside model/algorithm (hash %s → %s)",
                     state.path, saved_hash, config.config_hash())
        return diffs
    fields = [d.split(":", 1)[0] for d in diffs]
    message = f"checkpoint {state.path} is incompatible with the config: " + "; ".join(diffs)
    if not force:
        raise IncompatibleCheckpointError(message + " (pass force to resume anyway)", fields)
    log.warning("%s; resuming anyway (forced)", message)
    return diffs


def _saved_config_hash(state: CheckpointState) -> str:
    """The hash of the checkpoint's config as today's code resolves it (renamed keys under their new names, fields
    added since at their defaults), so that an unchanged experiment compares equal; the recorded hash when the
    saved config is absent or no longer valid."""
    if state.config is None:
        return state.config_hash
    try:
        return build_config(state.config, source=str(state.path / CONFIG_FILE)).config_hash()
    except ConfigError:
        return state.config_hash


# --------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------


def step_of(path: str | os.PathLike[str]) -> int:
    """The step of a ``step-NNNNNN`` directory (a local path or an object-store key)."""
    match = _STEP_RE.match(str(path).rstrip("/").rsplit("/", 1)[-1])
    if match is None:
        raise ValueError(f"{path} is not a step directory")
    return int(match.group(1))


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory's name (``step-NNNNNN``)."""
    return _STEP_RE.match(name) is not None


def _sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_and_fsync_tree(top: Path) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of every file under ``top``, each fsynced; subdirectories fsynced too."""
    out: list[tuple[str, int, str]] = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            file = Path(dirpath) / name
            digest = hashlib.sha256()
            size = 0
            with open(file, "rb") as handle:
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                os.fsync(handle.fileno())
            out.append((file.relative_to(top).as_posix(), size, digest.hexdigest()))
        if Path(dirpath) != top:
            _fsync_dir(Path(dirpath))
    return out


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    """Checksum of the manifest itself (all but this field), so a damaged manifest is not trusted."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_synced(file: Path, data: bytes) -> None:
    with open(file, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return str(transformers.__version__)

