"""Atomic writes on local disk: a file or a directory appears under its final name complete, or not at all.

A reader (a dashboard, a resumed run, another worker loading the model cache) must never see half a Parquet
part, half a PNG, truncated JSON or a model directory without its weights, even after a crash or a power loss.
Every step of the recipe is there for a reason:

1. Write under a hidden temporary name in the target's own directory: a rename is atomic only within one
   filesystem, and readers that skip hidden names (pyarrow datasets, ``*.parquet`` globs) never pick it up.
2. Flush and fsync the contents before the rename: otherwise, after a power loss, the rename can be on disk
   while the data is not, and the final name holds an empty or truncated file.
3. chmod: ``mkstemp`` / ``mkdtemp`` create private 0600 / 0700 entries; results and caches are ordinary shared
   files (0644) and directories (0755).
4. ``os.replace`` / ``os.rename`` is the commit point: before it a reader sees the old target (or none), after
   it the new one; never a mixture.
5. fsync the parent directory: the rename is a change of the directory, durable only once the directory is.
6. On any exception (KeyboardInterrupt included) the temporary is removed and an existing target is untouched.

A writer killed hard (SIGKILL, power loss) cannot run step 6: :func:`leftover_temps` finds what it left.
Remote object stores need none of this: an S3 PUT is atomic by itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

log = logging.getLogger(__name__)

FILE_MODE = 0o644
DIR_MODE = 0o755
TEMP_SUFFIX = ".tmp"


@contextmanager
def atomic_file(path: str | os.PathLike[str], mode: Literal["wb", "w"] = "wb",
                encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """An open file (binary, or text with ``mode="w"``) whose contents become ``path`` when the block exits cleanly.

    The temporary is ``.<name>.<random>.tmp`` next to ``path``; parent directories are created.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file writes a whole new file: mode 'wb' or 'w', not {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


@contextmanager
def atomic_dir(path: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """An empty hidden directory next to ``path`` to fill; when the block exits cleanly it becomes ``path``.

    Its files are fsynced before the rename. An existing ``path`` is kept by default: a directory that appeared
    meanwhile (another process, e.g. a concurrent model conversion, finished first) wins and ours is dropped.
    With ``replace`` an existing ``path`` is removed first; between the removal and the rename there is no
    directory, never a partial one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        os.chmod(tmp, DIR_MODE)
        if replace and target.exists():
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if replace or not target.is_dir():  # not a lost race with another writer: a real error
                raise
            log.info("%s was written by another process first; keeping it", target)
            return
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename


def leftover_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Temporaries that :func:`atomic_file` writers of ``path`` left when killed hard (safe to delete only when no
    other writer of ``path`` is running)."""
    target = Path(path)
    return sorted(target.parent.glob(f".{target.name}.*{TEMP_SUFFIX}"))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable; a no-op where directories cannot be
    opened or synced (some network and Windows filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file below ``top``, then every directory (deepest first), so the rename publishes only data
    that is on disk."""
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames:
            file = Path(dirpath) / name
            if file.is_symlink():
                continue
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(dirpath)
