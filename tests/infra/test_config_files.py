"""Config files as a user writes them: a file that is not UTF-8 is one clear error naming the file, line and byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from aepo_core.config_keys import ConfigError
from infra.config_files import load_config


def test_non_utf8_config_names_file_line_and_byte_offset(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    head = b"name: tiny\nseed: 0\n"
    path.write_bytes(head + b"# caf\xe9\ntrain:\n  steps: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "line 3" in message and f"byte offset {len(head) + 5}" in message
    assert "UTF-8" in message
