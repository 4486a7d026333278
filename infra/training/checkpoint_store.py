"""Where a run's checkpoints live: a local directory, or an object store (``s3://bucket/prefix``) for workers that
share no disk.

A local root is :mod:`infra.training.checkpoint` as is. A remote root keeps the same commit protocol with objects
in place of directories:

Save
    :func:`~infra.training.checkpoint.save_checkpoint` writes ``step-NNNNNN`` into a fresh local staging folder
    exactly as it does for a local root (files, sizes and sha256 in ``manifest.json``, fsyncs). Every file but the
    manifest is then uploaded under ``<root>/step-NNNNNN/``, their sizes are checked against the manifest by one
    listing, and ``manifest.json`` is uploaded last: its object's existence is the commit point (an S3 PUT is
    atomic, so the manifest is whole or absent). A crash mid-upload leaves a ``step-*`` prefix without a manifest,
    which no reader takes for a checkpoint and the next save removes. Re-saving a step deletes the old one first,
    manifest first. Only after the commit are older checkpoints pruned (``checkpoint.keep``) and newer abandoned
    ones deleted (:func:`~infra.training.checkpoint.prune_plan`, as locally), each manifest before the rest of its
    checkpoint, so a half-deleted checkpoint is never seen as complete.

Read
    The committed checkpoints are the ``step-*`` prefixes holding a manifest. The newest is copied into a local
    cache ``<cache>/<scheme>/<bucket>/<prefix>/step-NNNNNN`` (only the files its manifest names, after a size check
    against a listing, so a truncated upload costs no download) and verified there like a local checkpoint
    (sizes, sha256); a corrupt one is skipped with a WARNING and the previous one tried. The verified copy is then
    loaded exactly as a local checkpoint, so a resume from S3 is as bit-identical as a local one. A cached copy
    whose manifest equals the remote one is verified and reused instead of downloaded again; the cache keeps one
    checkpoint per root (one process per cache folder).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.fs import StorageError, forget_listings, is_remote, open_fs, storage_errors
from infra.training.checkpoint import (
    MANIFEST,
    TMP_PREFIX,
    CheckpointError,
    CorruptCheckpointError,
    commit_dir,
    is_step_name,
    latest_checkpoint,
    list_checkpoints,
    prune_plan,
    read_manifest,
    save_checkpoint,
    step_dir_name,
    step_of,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]")


class CheckpointStore:
    """The checkpoints under one root: a local directory or a remote URL (``s3://bucket/prefix``).

    ``storage_options`` go to fsspec (the S3 endpoint: :func:`infra.fs.storage_options`); ``cache_dir`` holds the
    staging folder of a remote save and the verified local copies of remote checkpoints (default: a folder in the
    system's temporary directory). One writer per root, as locally.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.remote = is_remote(uri)
        self.storage_options = storage_options
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "aepo-checkpoints"
        if self.remote:
            self.fs, self.root = open_fs(uri, storage_options)
            self.uri = self.fs.unstrip_protocol(self.root)
        else:
            self.uri = str(uri)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    def step_uri(self, step: int) -> str:
        """Where the checkpoint of ``step`` is (or would be)."""
        return f"{self.uri.rstrip('/')}/{step_dir_name(step)}"

    # ---- save ----------------------------------------------------------------------------------------------

    def save(self, step: int, *, keep: int | None = None, **kwargs: Any) -> str:
        """:func:`~infra.training.checkpoint.save_checkpoint` into this root (same arguments); returns where the
        committed checkpoint is."""
        if not self.remote:
            return str(save_checkpoint(self.uri, step, keep=keep, **kwargs))
        keep = kwargs["config"].checkpoint.keep if keep is None else keep
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1 (got {keep})")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.cache_dir))
        try:
            self._upload(save_checkpoint(staging, step, keep=1, **kwargs), step)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        try:
            self._prune(step, keep)
        except StorageError as exc:  # the checkpoint is committed; the next save prunes again
            log.warning("checkpoint %s committed, but pruning failed: %s", self.step_uri(step), exc)
        return self.step_uri(step)

    def _upload(self, local: Path, step: int) -> None:
        prefix, where = self._prefix(step), self.step_uri(step)
        files = read_manifest(local)["files"]
        with storage_errors(where, "cannot write checkpoint"):
            existing = self._listing(prefix)
            if existing:  # a checkpoint of this step (a resume from an older one), or a crashed upload's leftover
                if MANIFEST in existing:
                    log.warning("replacing existing checkpoint %s", where)
                self._delete(prefix)
            for rel in sorted(files):
                self._put(local / rel, f"{prefix}/{rel}")
            sizes = self._listing(prefix)
            short = [rel for rel, meta in files.items() if sizes.get(rel) != meta["size"]]
            if short:
                raise CheckpointError(f"{where}: upload incomplete ({', '.join(short[:3])} missing or of the wrong "
                                      "size); not committed")
            self._put(local / MANIFEST, f"{prefix}/{MANIFEST}")  # the commit point
        log.info("uploaded checkpoint %s (%d files)", where, len(files) + 1)

    def _put(self, local: Path, remote: str) -> None:
        """One object (a seam the crash tests patch)."""
        self.fs.put_file(str(local), remote)

    def _prune(self, step: int, keep: int) -> None:
        with storage_errors(self.uri, "cannot prune checkpoints under"):
            newer, older = prune_plan(self.steps(), step, keep)
            for s in newer:
                log.warning("deleting checkpoint %s: newer than the one just written (step %d), from an abandoned "
                            "run", self.step_uri(s), step)
            for s in newer + older:
                self._delete(self._prefix(s))
                log.info("pruned checkpoint %s", self.step_uri(s))
            committed = set(self.steps())
            for s in self._all_steps():
                if s != step and s not in committed:
                    log.info("removing %s: the leftover of an interrupted upload or delete", self.step_uri(s))
                    self._delete(self._prefix(s))

    def _delete(self, prefix: str) -> None:
        """The manifest first (from then on it is no checkpoint), then the rest."""
        manifest = f"{prefix}/{MANIFEST}"
        if self.fs.exists(manifest):
            self.fs.rm_file(manifest)
        try:
            self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass
        forget_listings(self.fs, prefix)

    # ---- list and read -------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints (with a manifest), ascending; not verified."""
        if not self.remote:
            return [step_of(p) for p in list_checkpoints(self.uri)]
        with storage_errors(self.uri, "cannot list checkpoints under"):
            forget_listings(self.fs, self.root)
            found = self.fs.glob(f"{self.root}/step-*/{MANIFEST}")
        return sorted(step_of(p.rsplit("/", 1)[0]) for p in found if is_step_name(p.rsplit("/", 2)[-2]))

    def run_folders(self) -> list[str]:
        """Names of the subfolders holding committed checkpoints: under a run name's root, one per MLflow run id."""
        if not self.remote:
            root = Path(self.uri)
            return sorted(d.name for d in root.iterdir() if d.is_dir() and list_checkpoints(d)) if root.is_dir() else []
        with storage_errors(self.uri, "cannot list checkpoints under"):
            forget_listings(self.fs, self.root)
            found = self.fs.glob(f"{self.root}/*/step-*/{MANIFEST}")
        return sorted({p.rsplit("/", 3)[-3] for p in found if is_step_name(p.rsplit("/", 2)[-2])})

    def child(self, name: str) -> CheckpointStore:
        """The store of the subfolder ``name`` (a run id under a run name's root), same options and cache."""
        location = f"{self.uri.rstrip('/')}/{name}"
        return CheckpointStore(location, self.storage_options, self.cache_dir)

    def _all_steps(self) -> list[int]:
        """Steps of every ``step-*`` prefix, committed or not."""
        forget_listings(self.fs, self.root)
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(step_of(n) for n in names if is_step_name(n.rstrip("/").rsplit("/", 1)[-1]))

    def latest(self, verify: bool = True) -> Path | None:
        """The newest checkpoint that verifies (checksums when ``verify``, sizes otherwise), as a local directory
        (remote ones copied into the cache); a newer one that does not is skipped with a WARNING. None: none."""
        if not self.remote:
            return latest_checkpoint(self.uri, verify=verify)
        for step in reversed(self.steps()):
            try:
                return self.fetch(step, verify=verify)
            except CorruptCheckpointError as exc:
                log.warning("skipping corrupt checkpoint %s, falling back to the previous one: %s",
                            self.step_uri(step), exc)
        return None

    def fetch(self, step: int, verify: bool = True) -> Path:
        """The checkpoint of ``step`` as a verified local directory (a local root's own; a remote one's copy in the
        cache). Raises :class:`CorruptCheckpointError` when it is absent, incomplete or damaged."""
        if not self.remote:
            path = Path(self.uri) / step_dir_name(step)
            verify_checkpoint(path, checksums=verify)
            return path
        prefix, where = self._prefix(step), self.step_uri(step)
        cache = self._cache_root()
        dest = cache / step_dir_name(step)
        try:
            with storage_errors(where, "cannot read checkpoint"):
                manifest_bytes = self.fs.cat_file(f"{prefix}/{MANIFEST}")
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise CorruptCheckpointError(f"{where}: no {MANIFEST} (not a committed checkpoint)") from None
            raise
        if (dest / MANIFEST).is_file() and (dest / MANIFEST).read_bytes() == manifest_bytes:
            try:
                verify_checkpoint(dest, checksums=verify)
                log.info("checkpoint %s: using the verified copy in %s", where, dest)
                return dest
            except CorruptCheckpointError as exc:
                log.info("cached copy of %s is damaged (%s): downloading it again", where, exc)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=cache))
        try:
            self._download(prefix, where, manifest_bytes, tmp, step, verify)
            commit_dir(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for child in cache.iterdir():  # the cache keeps one checkpoint per root
            if child != dest and child.is_dir() and (is_step_name(child.name) or child.name.startswith(TMP_PREFIX)):
                shutil.rmtree(child, ignore_errors=True)
        log.info("checkpoint %s copied to %s and verified", where, dest)
        return dest

    def _download(self, prefix: str, where: str, manifest_bytes: bytes, tmp: Path, step: int, verify: bool) -> None:
        (tmp / MANIFEST).write_bytes(manifest_bytes)
        try:
            manifest = read_manifest(tmp)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(str(exc).replace(str(tmp), where)) from None
        if manifest.get("step") != step:
            raise CorruptCheckpointError(f"{where}: the manifest is for step {manifest.get('step')}")
        files: dict[str, Any] = manifest["files"]
        with storage_errors(where, "cannot read checkpoint"):
            sizes = self._listing(prefix)
            for rel, meta in files.items():
                if rel not in sizes:
                    raise CorruptCheckpointError(f"{where}: {rel} is missing")
                if sizes[rel] != meta["size"]:
                    raise CorruptCheckpointError(f"{where}: {rel} has {sizes[rel]} bytes, the manifest says "
                                                 f"{meta['size']}")
            for rel in sorted(files):
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{prefix}/{rel}", str(target))
        try:
            verify_checkpoint(tmp, checksums=verify)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(str(exc).replace(str(tmp), where)) from None

    # ---- helpers -------------------------------------------------------------------------------------------

    def _prefix(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def _listing(self, prefix: str) -> dict[str, int]:
        """Relative name → size of every object under ``prefix`` (empty when there is none)."""
        forget_listings(self.fs, prefix)
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(prefix) + 1:]: int(info["size"]) for name, info in found.items()
                if name.startswith(prefix + "/")}

    def _cache_root(self) -> Path:
        scheme = self.uri.split("://", 1)[0]
        parts = [_UNSAFE.sub("_", p) for p in self.root.split("/") if p not in ("", ".", "..")]
        path = self.cache_dir.joinpath(scheme, *parts)
        path.mkdir(parents=True, exist_ok=True)
        return path


def open_checkpoint(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
                    cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A checkpoint as a verified local directory: ``location`` is one checkpoint (``…/step-NNNNNN``), one run's
    checkpoint folder (its newest complete checkpoint), or a run name's folder holding exactly one run's (that run's
    newest), local or remote. Raises :class:`CheckpointError` (or :class:`~infra.fs.StorageError` for an unreachable
    store) naming ``location``."""
    text = str(location).rstrip("/")
    if not is_remote(text):
        p = Path(text).expanduser()
        if not p.exists():
            raise CheckpointError(f"checkpoint {p} does not exist")
        if (p / MANIFEST).is_file():
            return p
        return _newest(CheckpointStore(p, storage_options, cache_dir))
    parent, _, name = text.rpartition("/")
    if is_step_name(name) and "://" in parent:
        return CheckpointStore(parent, storage_options, cache_dir).fetch(step_of(name))
    return _newest(CheckpointStore(text, storage_options, cache_dir))


def _newest(store: CheckpointStore) -> Path:
    """The newest complete checkpoint of ``store`` or, when it is a run name's folder, of its only run's; a name that
    several runs share is ambiguous (which run is meant is not the newest file's business): name the run's folder."""
    latest = store.latest()
    if latest is not None:
        return latest
    runs = store.run_folders()
    if len(runs) > 1:
        raise CheckpointError(f"{store.uri} holds the checkpoints of {len(runs)} runs ({', '.join(runs)}): pass one "
                              f"run's folder, {store.uri.rstrip('/')}/<run id>")
    latest = store.child(runs[0]).latest() if runs else None
    if latest is None:
        raise CheckpointError(f"{store.uri} holds no complete checkpoint")
    return latest
