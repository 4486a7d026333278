"""Atomic writes: the target appears complete or not at all, never a temporary left behind, ordinary permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from infra.atomic import atomic_dir, atomic_file, leftover_temps


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_bytes_and_text_files_appear_whole_with_mode_0644(tmp_path: Path) -> None:
    with atomic_file(tmp_path / "new" / "a.bin") as fh:
        fh.write(b"\x00\x01")
        assert not (tmp_path / "new" / "a.bin").exists()  # nothing under the final name while writing
    with atomic_file(tmp_path / "b.txt", "w") as fh:
        fh.write("π ≈ 3.14\n")
    assert (tmp_path / "new" / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "π ≈ 3.14\n"
    assert mode_of(tmp_path / "new" / "a.bin") == mode_of(tmp_path / "b.txt") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "new"]


def test_an_existing_file_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")
    with atomic_file(target, "w") as fh:
        fh.write("new")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_write_leaves_no_target_and_no_temporary(tmp_path: Path, exc: type[BaseException]) -> None:
    with pytest.raises(exc), atomic_file(tmp_path / "x.parquet") as fh:
        fh.write(b"PAR1 half a file")
        raise exc("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_failure_mid_write_leaves_an_existing_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "x.txt"
    target.write_text("complete old version")
    with pytest.raises(RuntimeError), atomic_file(target, "w") as fh:
        fh.write("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "complete old version"
    assert list(tmp_path.iterdir()) == [target]


def test_only_whole_file_write_modes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"), atomic_file(tmp_path / "x", "ab"):  # type: ignore[arg-type]
        pass
    assert list(tmp_path.iterdir()) == []


def test_leftover_temps_finds_what_a_killed_writer_left(tmp_path: Path) -> None:
    target = tmp_path / "part.parquet"
    (tmp_path / ".part.parquet.k1ll3d.tmp").write_bytes(b"x")
    (tmp_path / ".other.parquet.abc.tmp").write_bytes(b"x")
    target.write_bytes(b"x")
    assert leftover_temps(target) == [tmp_path / ".part.parquet.k1ll3d.tmp"]


def test_directory_appears_whole_with_mode_0755(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "model"
    with atomic_dir(final) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"w")
        (tmp / "config.json").write_text("{}")
        assert not final.exists()
    assert (final / "sub" / "weights.bin").read_bytes() == b"w" and (final / "config.json").read_text() == "{}"
    assert mode_of(final) == 0o755
    assert os.listdir(final.parent) == ["model"]


def test_failed_directory_write_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "half.bin").write_bytes(b"h")
        raise RuntimeError("conversion failed")
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_is_kept_unless_replaced(tmp_path: Path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / "theirs").write_text("first writer")
    with atomic_dir(final) as tmp:  # another writer finished first: its directory wins, ours is dropped
        (tmp / "ours").write_text("second writer")
    assert os.listdir(final) == ["theirs"] and os.listdir(tmp_path) == ["model"]
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "ours").write_text("refreshed")
    assert os.listdir(final) == ["ours"] and os.listdir(tmp_path) == ["model"]
    with pytest.raises(RuntimeError), atomic_dir(final, replace=True) as tmp:
        raise RuntimeError("failed refresh")
    assert os.listdir(final) == ["ours"] and os.listdir(tmp_path) == ["model"]
