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
    they are older than a write could take, and leaves a younger one (a write under way), other files
    aside and the rest."""
    import os
    import time

    write_whole(tmp_path / "kept.aot", b"data")
    old, young = tmp_path / ".kept.aot.abc123.tmp", tmp_path / ".kept.aot.def456.tmp"
    other = tmp_path / ".notes.txt.ghi789.tmp"
    hour_ago = time.time() - 3600
    for aside in (old, young, other):
        aside.write_bytes(b"half")
    for aside in (old, other):
        os.utime(aside, (hour_ago, hour_ago))
    assert sweep_aside(tmp_path, ".aot", older_than_s=600) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, other.name, "kept.aot"])
    assert sweep_aside(tmp_path / "missing", ".aot", older_than_s=600) == 0


def test_a_folder_that_cannot_be_changed_is_left_as_it_is(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeping is housekeeping: on a read-only volume it removes nothing and raises nothing."""
    import errno
    import os
    import time

    aside = tmp_path / ".kept.aot.abc123.tmp"
    aside.write_bytes(b"half")
    hour_ago = time.time() - 3600
    os.utime(aside, (hour_ago, hour_ago))

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    assert sweep_aside(tmp_path, ".aot", older_than_s=600) == 0
    assert aside.exists()
