"""engines/files.write_whole: a file appears whole or not at all, and nothing is left aside."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.files import write_whole


def test_a_file_is_written_whole_and_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "kept.json"
    write_whole(path, b"first")
    write_whole(path, b"second")
    assert path.read_bytes() == b"second"
    assert [p.name for p in path.parent.iterdir()] == ["kept.json"]


def test_a_failed_write_leaves_nothing_aside(tmp_path: Path) -> None:
    path = tmp_path / "kept.json"
    path.mkdir()  # renaming a file over a directory fails
    with pytest.raises(OSError):
        write_whole(path, b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"] and path.is_dir()
