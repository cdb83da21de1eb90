"""engines/files.write_whole: a file appears whole or not at all, and nothing is left aside."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.files import sweep_aside, write_whole


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


def test_files_left_aside_by_a_killed_writer_are_swept_once_old(tmp_path: Path) -> None:
    """A writer killed between writing aside and renaming leaves its file; a sweep removes such files once
    they are older than a write could take, and leaves a younger one (a write under way) and the rest."""
    import os
    import time

    write_whole(tmp_path / "kept.json", b"data")
    old, young = tmp_path / ".kept.json.abc123.tmp", tmp_path / ".kept.json.def456.tmp"
    old.write_bytes(b"half")
    young.write_bytes(b"half")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert sweep_aside(tmp_path, older_than_s=600) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [young.name, "kept.json"]
    assert sweep_aside(tmp_path / "missing", older_than_s=600) == 0
