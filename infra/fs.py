"""Local paths and remote object stores (``s3://``) behind one fsspec filesystem, for every store of a run.

The trajectory store, the checkpoints and the evaluation Parquet all take a location that is a local path or a URL
(``s3://bucket/prefix``); this module turns it into a filesystem and a root, with the S3 endpoint of
``storage.s3_endpoint_url`` (MinIO, moto) filled in, and turns a remote store's failures (no such bucket, the
endpoint unreachable, access denied) into one :class:`StorageError` that names the location.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from aepo_core.config import StorageConfig

S3_SCHEMES = ("s3://", "s3a://")


class StorageError(RuntimeError):
    """A storage location cannot be opened or used; the message names it."""


def is_remote(uri: str | os.PathLike[str]) -> bool:
    """Whether ``uri`` is a URL of a remote filesystem (anything with a scheme but ``file://``)."""
    text = str(uri)
    return "://" in text and not text.startswith("file://")


def storage_options(storage: StorageConfig, uri: str | os.PathLike[str],
                    base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for ``uri``: ``base`` plus, for S3, the endpoint of ``storage.s3_endpoint_url`` unless
    ``base`` already names one."""
    opts = dict(base or {})
    if storage.s3_endpoint_url and str(uri).startswith(S3_SCHEMES):
        client_kwargs = dict(opts.get("client_kwargs") or {})
        client_kwargs.setdefault("endpoint_url", storage.s3_endpoint_url)
        opts["client_kwargs"] = client_kwargs
    return opts


def open_fs(uri: str | os.PathLike[str], options: Mapping[str, Any] | None = None
            ) -> tuple[AbstractFileSystem, str]:
    """The filesystem of ``uri`` and the root path on it (absolute for a local path, no trailing slash)."""
    text = str(uri)
    if not text:
        raise StorageError("storage location is empty")
    try:
        fs, root = fsspec.core.url_to_fs(text, **dict(options or {}))
    except (ImportError, ValueError, TypeError) as exc:
        raise StorageError(f"cannot open {text!r}: {exc}") from exc
    local = isinstance(fs, LocalFileSystem)
    return fs, (str(Path(root).resolve()) if local else root).rstrip("/")


def forget_listings(fs: AbstractFileSystem, root: str) -> None:
    """Drop ``fs``'s cached listings of ``root``, its parents and every folder under it, so that the next listing
    asks the store. fsspec's ``invalidate_cache(root)`` drops the path and its parents only: a subfolder listed
    earlier (a step still uploading, a run folder not there yet) kept that listing, and what was committed in it
    later stayed invisible to a long-lived reader (tests/infra/test_checkpoint_store.py)."""
    fs.invalidate_cache(root)
    for key in [k for k in list(fs.dircache) if k.startswith(root.rstrip("/") + "/")]:
        fs.dircache.pop(key, None)


def remote_errors() -> tuple[type[BaseException], ...]:
    """What a remote filesystem raises when the store is unusable: OSError (s3fs's translation of S3 errors:
    no bucket, access denied) and botocore's own errors (endpoint unreachable, no credentials)."""
    errors: tuple[type[BaseException], ...] = (OSError,)
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        errors += (BotoCoreError, ClientError)
    return errors


@contextlib.contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """Re-raise a remote store's failure as :class:`StorageError` ``"<doing> <uri>: <cause>"``."""
    try:
        yield
    except remote_errors() as exc:
        raise StorageError(f"{doing} {uri}: {type(exc).__name__}: {exc}") from exc


def probe(uri: str, options: Mapping[str, Any] | None = None) -> None:
    """Fail fast (:class:`StorageError`) unless the remote location's bucket can be listed; a local path is
    always fine (it is created on first write)."""
    if not is_remote(uri):
        return
    fs, root = open_fs(uri, options)
    with storage_errors(uri, "cannot reach"):
        fs.ls(root.split("/", 1)[0], refresh=True)



def put_file(local: str | os.PathLike[str], uri: str, options: Mapping[str, Any] | None = None) -> str:
    """Copy one local file to ``uri`` (on an object store one PUT: the object appears whole or not at all);
    returns ``uri``."""
    fs, path = open_fs(uri, options)
    with storage_errors(uri, "cannot write"):
        fs.put_file(str(local), path)
    return uri
