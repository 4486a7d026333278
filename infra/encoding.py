"""Describing text that is not UTF-8, for errors a user can act on: which byte, where in the file."""

from __future__ import annotations


def not_utf8(exc: UnicodeDecodeError, offset: int = 0) -> str:
    """Why decoding failed, with the first bad byte's offset in the file (``offset``: where the decoded bytes
    start in it), so that ``xxd -s <offset>`` or an editor's go-to-byte shows it."""
    return f"not UTF-8: byte 0x{exc.object[exc.start]:02x} at byte offset {offset + exc.start} ({exc.reason})"


def line_at(data: bytes, position: int) -> int:
    """The 1-based line (as an editor numbers them) that holds byte ``position`` of ``data``."""
    return data.count(b"\n", 0, position) + 1
